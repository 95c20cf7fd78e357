"""Latency-priority scheduler: who runs this step, with how many tokens, and how much speculation.

Policy (knobs in ``SchedulerConfig`` / ``SpecConfig``):

- Order: interactive before batch; running before waiting within a class; then arrival order. A
  batch request that has been WAITING ``batch_starvation_s`` is ranked as interactive (starvation
  guard; time spent running does not count). While any interactive request is active, at most
  ``batch_seqs_with_interactive`` batch requests run per step, rotated least-recently-served first,
  so interactive steps stay short; with no interactive work, batch requests use the whole step.
- Token budget per step (``max_num_batched_tokens``) counts every token the target processes:
  prefill chunks AND verification trees (1 root + draft tokens). Decoding sequences are served
  first in rank order, so a long prompt never stalls running decodes: it is split into chunks of at
  most ``prefill_chunk`` tokens that take only what is left of the budget.
- KV exhaustion: the lowest-ranked running sequence (batch before interactive, latest arrival
  first) is preempted - its blocks freed, its tokens kept - and recomputed later (prefix-cache hits
  make that cheap). A sequence that cannot get blocks even then waits.
- Speculation: how many draft tokens each request gets is the ``SpecPolicy``'s decision
  (``specd.speculation.policy``); the scheduler counts them in the token budget and the KV
  reservation. Block tables, reservations, prefix reuse and release go through the ``KVLedger``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from specd.config import SchedulerConfig
from specd.engine.ledger import KVLedger
from specd.engine.sequence import Sequence, Status
from specd.speculation.policy import SpecPolicy, StepPlan


@dataclass
class Scheduled:
    seq: Sequence
    num_tokens: int  # committed tokens processed this step (prefill chunk; 1 = the pending token)
    final: bool  # the chunk reaches the pending token: logits are computed and tokens emitted
    spec_budget: int  # draft tokens allowed (0 = no speculation this step)
    spec_depth: int = 0  # tree depth allowed (0 = the configured depth; LOOKUP_ONLY: prompt lookup only)


@dataclass
class SchedulerOutput:
    scheduled: list
    preempted: list

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens + s.spec_budget for s in self.scheduled)


class Scheduler:
    """Who runs each step and with how many tokens. ``policy`` decides how requests speculate;
    ``ledger`` owns their KV state."""

    def __init__(
        self,
        cfg: SchedulerConfig,
        policy: SpecPolicy,
        ledger: KVLedger,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.cfg = cfg
        self.policy = policy
        self.ledger = ledger
        self.clock = clock
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.last_spec_budget = 0
        self.steps = 0

    @property
    def last_depth(self) -> int:
        """The adaptive draft depth of the last step (metrics)."""
        return self.policy.last_depth

    # queue ---------------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.policy.start(seq)
        seq.status = Status.WAITING
        seq.wait_since = self.clock()
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        for q in (self.waiting, self.running):
            if seq in q:
                q.remove(seq)
        self.ledger.free(seq)  # finished/preempted requests leave their full blocks reusable

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
        waiting = seq.status is Status.WAITING
        if prio > 0 and waiting and now - seq.wait_since >= self.cfg.batch_starvation_s:
            prio = 0  # starvation guard: only time spent WAITING counts, never time spent running
        return (prio, seq.status is Status.WAITING, seq.arrival)

    # the step -----------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        now = self.clock()
        cands, rank = self._ordered(now)
        plan = self.policy.plan(cands[: self.cfg.max_num_seqs], min(len(cands), self.cfg.max_num_seqs))
        self.steps += 1
        out = SchedulerOutput([], [])
        budget = self.cfg.max_num_batched_tokens
        # while interactive requests are active, batch work runs in small rotating groups so the
        # interactive steps stay short (batch requests fill what is left)
        limit = self.cfg.batch_seqs_with_interactive
        batch_slots = limit if limit and any(rank[id(q)][0] == 0 for q in cands) else None
        for seq in cands:
            if seq in out.preempted:
                continue
            if budget <= 0 or len(out.scheduled) >= self.cfg.max_num_seqs:
                break
            if batch_slots is not None and rank[id(seq)][0] > 0:
                if batch_slots <= 0:
                    continue
                batch_slots -= 1
            sc = self._place(seq, budget, plan, out, now)
            if sc is not None:
                out.scheduled.append(sc)
                budget -= sc.num_tokens + sc.spec_budget
        self.last_spec_budget = sum(s.spec_budget for s in out.scheduled)
        return out

    def _ordered(self, now: float) -> tuple[list, dict]:
        """Candidates in rank order (with batch requests least recently served first while
        interactive work is active) and each one's rank."""
        rank = {id(q): self._rank(q, now) for q in self.running}  # computed once per step
        rank.update((id(q), self._rank(q, now)) for q in self.waiting)
        cands = sorted(self.running + self.waiting, key=lambda q: rank[id(q)])
        if self.cfg.batch_seqs_with_interactive and any(rank[id(q)][0] == 0 for q in cands):
            head = [q for q in cands if rank[id(q)][0] == 0]
            tail = sorted((q for q in cands if rank[id(q)][0] > 0), key=lambda q: (q.last_step, rank[id(q)]))
            cands = head + tail
        return cands, rank

    def _place(self, seq: Sequence, budget: int, plan: StepPlan, out: SchedulerOutput, now: float):
        """This step's work for ``seq`` within ``budget`` tokens, its KV reserved (preempting
        lower-ranked requests if needed); None when it cannot run this step."""
        waiting = seq.status is Status.WAITING
        self.ledger.attach(seq, admitting=waiting)
        need = len(seq.tokens) - seq.num_computed
        chunk = min(need, self.cfg.prefill_chunk, budget) if need > 1 else 1
        final = chunk == need
        spec, depth = 0, 0
        if final:
            want, depth = self.policy.budget(seq, plan)
            spec = min(want, plan.cap, max(0, budget - chunk))
        granted = self._reserve(seq, seq.num_computed + chunk, spec, out, now)
        if granted is None:
            return None
        if waiting:
            self.waiting.remove(seq)
            self.running.append(seq)
            seq.status = Status.RUNNING
            if seq.scheduled_time is None:
                seq.scheduled_time = now
        seq.last_step = self.steps
        return Scheduled(seq, chunk, final, granted, depth)

    def _reserve(self, seq: Sequence, upto: int, spec: int, out: SchedulerOutput, now: float) -> int | None:
        """Reserve KV for positions [0, upto + spec), preempting lower-ranked requests as needed;
        without the draft tokens if only that fits. The draft tokens granted, or None (a running
        request that cannot fit is preempted itself)."""
        ledger = self.ledger
        while not ledger.reserve(seq, upto + spec):
            victim = self._pick_victim(seq, now)
            if victim is None:
                break
            self._preempt(victim, out.scheduled)
            out.preempted.append(victim)
        if ledger.capacity(seq) >= upto + spec:
            return spec
        if spec and ledger.reserve(seq, upto):  # not even a smaller tree fits: no speculation
            return 0
        if seq.status is not Status.WAITING:
            self._preempt(seq, out.scheduled)
            out.preempted.append(seq)
        return None

    def _pick_victim(self, requester: Sequence, now: float) -> Sequence | None:
        """Lowest-ranked running sequence ranked below the requester (batch first, latest first)."""
        rq = self._rank(requester, now)
        victims = [
            s for s in self.running if s is not requester and self._rank(s, now) > rq and self.ledger.holds_blocks(s)
        ]
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
        self.ledger.free(seq)
        seq.status = Status.WAITING
        seq.wait_since = self.clock()
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.append(seq)

    def finish(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        self.ledger.free(seq)
