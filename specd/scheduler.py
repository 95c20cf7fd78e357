"""Latency-priority scheduler: who runs this step, with how many tokens, and how much speculation.

Policy (knobs in ``SchedulerConfig`` / ``SpecConfig``):

- Order: interactive before batch; running before waiting within a class; then arrival order. A
  batch request that has waited ``batch_starvation_s`` is ranked as interactive (starvation guard).
- Token budget per step (``max_num_batched_tokens``) counts every token the target processes:
  prefill chunks AND verification trees (1 root + draft tokens). Decoding sequences are served
  first in rank order, so a long prompt never stalls running decodes: it is split into chunks of at
  most ``prefill_chunk`` tokens that take only what is left of the budget.
- KV exhaustion: the lowest-ranked running sequence (batch before interactive, latest arrival
  first) is preempted - its blocks freed, its tokens kept - and recomputed later (prefix-cache hits
  make that cheap). A sequence that cannot get blocks even then waits.
- Speculation budget (adaptive): a request's tree size follows the EMA of its acceptance rate
  (>= 0.6 full size, halves below, down to a single-token probe below 0.15), capped by the request;
  and the step's total draft tokens are capped at ``max(0, max_verify_tokens - batch)`` split evenly,
  so at high batch speculation shrinks to nothing rather than costing throughput, and grows back
  when the batch drains.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional

from specd.config import SchedulerConfig, SpecConfig
from specd.sequence import Sequence, Status


@dataclass
class Scheduled:
    seq: Sequence
    num_tokens: int  # committed tokens processed this step (prefill chunk; 1 = the pending token)
    final: bool  # the chunk reaches the pending token: logits are computed and tokens emitted
    spec_budget: int  # draft tokens allowed (0 = no speculation this step)


@dataclass
class SchedulerOutput:
    scheduled: list
    preempted: list

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens + s.spec_budget for s in self.scheduled)


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, spec: SpecConfig, target_cache, draft_cache=None,
                 clock: Callable[[], float] = time.monotonic, max_verify_tokens: int = 256,
                 on_free: Optional[Callable[[Sequence], None]] = None, has_draft: bool = True,
                 prefix_cache=None, draft_prefix_cache=None):
        self.cfg = cfg
        self.spec = spec
        self.cache = target_cache
        self.draft_cache = draft_cache
        self.clock = clock
        self.max_verify_tokens = max_verify_tokens
        self.has_draft = has_draft
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.on_free = on_free  # hook (prefix cache) called before a sequence's blocks are freed
        self.last_spec_budget = 0
        self.prefix_cache = prefix_cache if cfg.enable_prefix_cache else None
        self.draft_prefix_cache = draft_prefix_cache if cfg.enable_prefix_cache else None

    # queue ---------------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        for q in (self.waiting, self.running):
            if seq in q:
                q.remove(seq)
        self.free_blocks(seq)

    def free_blocks(self, seq: Sequence) -> None:
        self.register_prefix(seq)  # finished/preempted requests leave their full blocks reusable
        if self.on_free is not None:
            self.on_free(seq)
        if seq.blocks is not None:
            seq.blocks.free()
        if seq.draft_blocks is not None:
            seq.draft_blocks.free()
        seq.num_computed = 0
        seq.draft_computed = 0
        seq.pc_state = [0, 0]
        seq.pc_draft_state = [0, 0]

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def queue_lengths(self) -> dict:
        out = {"interactive": 0, "batch": 0}
        for s in self.waiting:
            out[s.priority] += 1
        return out

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ranking ------------------------------------------------------------------------------------
    def _rank(self, seq: Sequence, now: float):
        prio = seq.prio
        if prio > 0 and now - seq.arrival >= self.cfg.batch_starvation_s:
            prio = 0  # starvation guard
        return (prio, seq.status is Status.WAITING, seq.arrival)

    # speculation policy -------------------------------------------------------------------------
    def mode_of(self, seq: Sequence) -> str:
        if not self.has_draft:
            return "off"
        m = seq.spec.mode
        if m == "auto":
            m = self.spec.mode
        return m

    def desired_budget(self, seq: Sequence) -> int:
        mode = self.mode_of(seq)
        if mode == "off":
            return 0
        base = self.spec.num_draft_tokens if mode == "chain" else self.spec.tree_budget
        if seq.spec.max_draft_tokens is not None:
            base = min(base, seq.spec.max_draft_tokens)
        if base <= 0:
            return 0
        if self.spec.adaptive and seq.spec.mode == "auto":
            a = seq.recent_accept
            if a < 0.15:
                base = 1
            elif a < 0.3:
                base = max(1, base // 4)
            elif a < 0.6:
                base = max(1, base // 2)
        return base

    def step_spec_cap(self, batch: int) -> int:
        """Per-sequence cap on draft tokens so the step's verification tokens stay bounded."""
        if batch <= 0:
            return 0
        return max(0, (self.max_verify_tokens - batch) // batch)

    # the step -----------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        now = self.clock()
        budget = self.cfg.max_num_batched_tokens
        cands = sorted(self.running + self.waiting, key=lambda s: self._rank(s, now))
        est_batch = min(len(cands), self.cfg.max_num_seqs)
        cap = self.step_spec_cap(est_batch) if self.spec.adaptive else 1 << 30
        scheduled: list[Scheduled] = []
        preempted: list[Sequence] = []
        bs = self.cache.block_size
        for seq in cands:
            if seq in preempted:
                continue
            if budget <= 0 or len(scheduled) >= self.cfg.max_num_seqs:
                break
            waiting = seq.status is Status.WAITING
            if seq.blocks is None:
                seq.blocks = self.cache.new_seq()
                if self.draft_cache is not None:
                    seq.draft_blocks = self.draft_cache.new_seq()
            if waiting and seq.num_computed == 0 and not seq.blocks.blocks:
                self._match_prefix(seq)
            need = len(seq.tokens) - seq.num_computed
            chunk = min(need, self.cfg.prefill_chunk, budget) if need > 1 else 1
            final = chunk == need
            spec = 0
            if final:
                spec = min(self.desired_budget(seq), cap, max(0, budget - chunk))
            total = seq.num_computed + chunk + spec
            while not seq.blocks.reserve(total):
                victim = self._pick_victim(scheduled, seq, now)
                if victim is None:
                    break
                self._preempt(victim, scheduled)
                preempted.append(victim)
            else:
                pass
            if seq.blocks.capacity < total:
                # not even a smaller tree fits: try without speculation, else wait
                if spec and seq.blocks.reserve(seq.num_computed + chunk):
                    spec = 0
                else:
                    if not waiting:
                        self._preempt(seq, scheduled)
                        preempted.append(seq)
                    continue
            if waiting:
                self.waiting.remove(seq)
                self.running.append(seq)
                seq.status = Status.RUNNING
                if seq.scheduled_time is None:
                    seq.scheduled_time = now
            scheduled.append(Scheduled(seq, chunk, final, spec))
            budget -= chunk + spec
        self.last_spec_budget = sum(s.spec_budget for s in scheduled)
        _ = bs
        return SchedulerOutput(scheduled, preempted)

    def _match_prefix(self, seq: Sequence) -> None:
        """Reuse cached full blocks of the committed tokens (the pending token is always recomputed)."""
        limit = len(seq.tokens) - 1
        if self.prefix_cache is not None:
            hit = self.prefix_cache.match(seq.tokens, limit)
            seq.blocks.blocks.extend(hit)
            seq.num_computed = len(hit) * self.cache.block_size
            seq.pc_state = [len(hit), 0]
            if hit:
                seq.pc_state[1] = self._chain_key(seq.tokens, len(hit))
            seq.cached_prefix_tokens = max(seq.cached_prefix_tokens, seq.num_computed)
        if self.draft_prefix_cache is not None and seq.draft_blocks is not None:
            hit = self.draft_prefix_cache.match(seq.tokens, limit)
            seq.draft_blocks.blocks.extend(hit)
            seq.draft_computed = len(hit) * self.cache.block_size
            seq.pc_draft_state = [len(hit), self._chain_key(seq.tokens, len(hit)) if hit else 0]

    def _chain_key(self, tokens, n: int) -> int:
        key = 0
        for _, key in self.prefix_cache._keys(tokens, n):
            pass
        return key

    def register_prefix(self, seq: Sequence) -> None:
        if self.prefix_cache is not None and seq.blocks is not None:
            self.prefix_cache.register(seq.blocks, seq.tokens, seq.num_computed, seq.pc_state)
        if self.draft_prefix_cache is not None and seq.draft_blocks is not None:
            self.draft_prefix_cache.register(seq.draft_blocks, seq.tokens, seq.draft_computed, seq.pc_draft_state)

    def _pick_victim(self, scheduled: list, requester: Sequence, now: float) -> Optional[Sequence]:
        """Lowest-ranked running sequence ranked below the requester (batch first, latest first)."""
        rq = self._rank(requester, now)
        victims = [s for s in self.running if s is not requester and self._rank(s, now) > rq
                   and (s.blocks is not None and s.blocks.blocks)]
        if not victims:
            return None
        return max(victims, key=lambda s: self._rank(s, now))

    def _preempt(self, seq: Sequence, scheduled: list) -> None:
        for i, sc in enumerate(scheduled):
            if sc.seq is seq:
                scheduled.pop(i)
                break
        if seq in self.running:
            self.running.remove(seq)
        self.free_blocks(seq)
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.append(seq)

    def finish(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        self.free_blocks(seq)
