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
- Speculation budget (adaptive, requests in ``auto`` mode): each step picks the draft depth D
  (0..max) that maximises the expected tokens per second of the whole step,
  ``sum_i E(a_i, D) / T(D)`` with ``E(a, D) = (1 - a^(D+1)) / (1 - a)`` (Leviathan et al. 2023)
  and a_i each request's per-position acceptance (EMA of accepted / drafted depth; new requests
  start from the engine-wide EMA). Costs are measured in the engine thread's CPU time on a CPU
  (waits for the GIL or other load do not distort them; wall time on a GPU): T(0) = the measured
  cost of a draft-free decode step at this batch size (a batch size not yet seen gets one plain
  step first); T(D>0) = ``max(t_fixed + t_per_token * B * (1 + nodes(D)), T(0) + t_per_token * B *
  nodes(D)) + D * t_draft``, t_fixed and t_per_token fitted on speculative decode steps (a
  verification never costs less than a plain step plus its extra tokens), t_draft = the draft
  levels after the first (which also catches the draft cache up). D = 0
  turns speculation off - at high batch the target step grows and D shrinks; when the batch drains
  it grows back. While D = 0, a probe step drafts one token for one request (the least recently
  probed) so acceptance estimates stay current; the probe interval doubles (16 -> 256 steps)
  while D stays 0 (every 4096 steps when not even perfect acceptance would make drafting pay at
  this batch size: probing acceptance cannot change that answer; the rare probe refreshes the
  costs), and the draft model skips prompt prefill (a request catches up lazily, in one
  draft forward, when it next drafts). Decisions are reused for up to 8 steps while the batch's
  acceptance estimates are unchanged. Chains use k = D; trees keep min(tree_budget, D * tree_topk)
  nodes up to depth D. Requests that name a mode (chain/tree) get that fixed size (capped by their
  max_draft_tokens); the step's draft tokens are also capped at ``max_verify_tokens - batch``.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from dataclasses import dataclass

from specd.config import SchedulerConfig, SpecConfig
from specd.engine.sequence import Sequence, Status


@dataclass
class Scheduled:
    seq: Sequence
    num_tokens: int  # committed tokens processed this step (prefill chunk; 1 = the pending token)
    final: bool  # the chunk reaches the pending token: logits are computed and tokens emitted
    spec_budget: int  # draft tokens allowed (0 = no speculation this step)
    spec_depth: int = 0  # tree depth allowed (0 = the configured depth)


@dataclass
class SchedulerOutput:
    scheduled: list
    preempted: list

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens + s.spec_budget for s in self.scheduled)


class Scheduler:
    def __init__(
        self,
        cfg: SchedulerConfig,
        spec: SpecConfig,
        target_cache,
        draft_cache=None,
        clock: Callable[[], float] = time.monotonic,
        max_verify_tokens: int = 256,
        has_draft: bool = True,
        prefix_cache=None,
        draft_prefix_cache=None,
    ):
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
        self.last_spec_budget = 0
        self.last_depth = 0
        self.t_target: float | None = None  # EMA seconds of a target step (forward + verify + commit)
        self.t_per_token = 0.0  # marginal seconds per target token (least squares over recent steps)
        self._obs: collections.deque = collections.deque()  # recent (tokens, seconds) of target steps
        self._sums = [0, 0.0, 0, 0.0]  # sum x, sum y, sum x^2, sum x*y over _obs
        self._nobs = 0
        self.t_draft: float | None = None  # EMA seconds of one draft forward (one tree level)
        self.probe_every = 16  # current probe interval (steps) while speculation is off
        self.probe_min, self.probe_max = 16, 256
        self.probe_hopeless = 4096  # probe interval while even perfect acceptance would not pay
        self.probing = False
        self._depth_cache = None  # (alphas, step, config, depth, hopeless) of the last cost-model decision
        self._hopeless_at = None  # (batch size, step, mode) of the last decision that drafting is hopeless
        self.t_plain: dict = {}  # batch size -> EMA seconds of a decode step without drafts
        self.accept_ema: float | None = None  # engine-wide per-position acceptance (prior for new requests)
        self._steps = 0
        self.prefix_cache = prefix_cache if cfg.enable_prefix_cache else None
        self.draft_prefix_cache = draft_prefix_cache if cfg.enable_prefix_cache else None

    # queue ---------------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        if self.accept_ema is not None and seq.stats.steps == 0:
            seq.recent_accept = self.accept_ema
        seq.status = Status.WAITING
        seq.wait_since = self.clock()
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        for q in (self.waiting, self.running):
            if seq in q:
                q.remove(seq)
        self.free_blocks(seq)

    def free_blocks(self, seq: Sequence) -> None:
        self.register_prefix(seq)  # finished/preempted requests leave their full blocks reusable
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
        waiting = seq.status is Status.WAITING
        if prio > 0 and waiting and now - seq.wait_since >= self.cfg.batch_starvation_s:
            prio = 0  # starvation guard: only time spent WAITING counts, never time spent running
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
        return base

    def observe(self, t_target: float, t_draft_level: float | None, tokens: int = 0) -> None:
        """Feed measured costs of a speculative decode step (the engine calls this after each one).

        Its target cost (forward + verify + commit) is modelled as ``t_fixed + t_per_token * tokens``
        (least squares over the last 64 such steps); ``t_target`` keeps the fixed part (or the EMA
        when token counts never varied). Steps without drafts go to ``observe_plain``.
        """
        a = 0.2
        if t_draft_level is not None:
            self.t_draft = t_draft_level if self.t_draft is None else (1 - a) * self.t_draft + a * t_draft_level
        # least squares over a sliding window, from running sums (O(1) per step; re-summed exactly
        # every window so float drift never accumulates)
        obs = self._obs
        obs.append((tokens, t_target))
        self._sums = [s + d for s, d in zip(self._sums, (tokens, t_target, tokens * tokens, tokens * t_target))]
        if len(obs) > 64:
            x0, y0 = obs.popleft()
            self._sums = [s - d for s, d in zip(self._sums, (x0, y0, x0 * x0, x0 * y0))]
        self._nobs += 1
        if self._nobs % 64 == 0:
            self._sums = [
                sum(x for x, _ in obs),
                sum(y for _, y in obs),
                sum(x * x for x, _ in obs),
                sum(x * y for x, y in obs),
            ]
        n = len(obs)
        sx, sy, sxx, sxy = self._sums
        nvx = n * sxx - sx * sx  # n * variance of x: exact for integer token counts
        if n >= 8 and nvx > 0:
            b = max(0.0, (n * sxy - sx * sy) / nvx)
            self.t_per_token = b
            self.t_target = max(sy / n - b * sx / n, 1e-6)
            return
        self.t_target = t_target if self.t_target is None else (1 - a) * self.t_target + a * t_target

    def nodes_for_depth(self, d: int) -> int:
        return d if self.spec.mode == "chain" else min(self.spec.tree_budget, d * self.spec.tree_topk)

    def choose_depth(self, alphas: list) -> int:
        """Draft depth maximising expected tokens/s of the step (0 = no speculation).

        While the answer is 0, every ``probe_every`` steps it returns 1 and sets ``probing``: that
        step drafts one token for ONE request (the least recently probed), so acceptance estimates
        stay current at a cost that does not grow with the batch.
        """
        dmax = max(self.spec.tree_depth, self.spec.num_draft_tokens)
        self.probing = False
        if not alphas:
            return 0
        if self.t_target is None or self.t_draft is None:
            return min(dmax, 4)  # no measurements yet: start speculating, measure
        c = self._depth_cache  # same estimates as a recent step: same answer (costs drift slowly)
        if c is not None and c[0] == alphas and self._steps - c[1] < 8 and c[2] == (self.spec.mode, dmax):
            best_d, hopeless = c[3], c[4]
        else:
            best_d = self._best_depth(alphas, dmax)
            # hopeless: not even perfect acceptance would make drafting pay at this batch size, so
            # probing for acceptance cannot change the answer (only the costs might, rarely)
            hopeless = best_d == 0 and self._best_depth([0.999] * len(alphas), dmax) == 0
            if len(alphas) in self.t_plain:  # (an unmeasured batch size is re-asked next step)
                self._depth_cache = (list(alphas), self._steps, (self.spec.mode, dmax), best_d, hopeless)
                self._hopeless_at = (len(alphas), self._steps, self.spec.mode) if hopeless else None
        if best_d == 0:
            every = self.probe_hopeless if hopeless else self.probe_every
            if self._steps % every == 0:
                self.probing = True  # one draft token keeps the estimates fresh...
                if not hopeless:
                    self.probe_every = min(self.probe_max, self.probe_every * 2)  # ...ever more rarely
                return 1
            return 0
        self.probe_every = self.probe_min
        return best_d

    def _hopeless_now(self, batch: int) -> bool:
        """Depth 0 without looking at acceptance: a recent decision found drafting hopeless at this
        batch size (no acceptance could make it pay) and this is not a probe step. Saves building
        the batch's acceptance list every step in the common loaded case."""
        h = self._hopeless_at
        if (
            h is None
            or h[0] != batch
            or self._steps - h[1] >= 64
            or h[2] != self.spec.mode
            or self._steps % self.probe_hopeless == 0
            or self.t_target is None
        ):
            return False
        self.probing = False
        return True

    def observe_plain(self, batch: int, seconds: float) -> None:
        """A decode step with no drafts at all, ``batch`` requests, took ``seconds`` (engine thread
        CPU time): the cost of depth 0 at this batch size, measured rather than extrapolated from
        speculative steps (plain decoding takes a cheaper attention path)."""
        old = self.t_plain.get(batch)
        self.t_plain[batch] = seconds if old is None else 0.8 * old + 0.2 * seconds

    def _best_depth(self, alphas: list, dmax: int) -> int:
        B = len(alphas)
        # sum_i E(a_i, d) over requests, grouped by acceptance rounded to 0.01 (a batch shares a few
        # distinct estimates), so the cost is O(distinct * dmax), not O(B * dmax) per step
        groups = collections.Counter(round(min(max(a, 0.0), 0.999), 2) for a in alphas)
        t0, tpt, td = self.t_target, self.t_per_token, self.t_draft
        t_plain = self.t_plain.get(B)
        if t_plain is None:
            return 0  # first time at this batch size: one plain step measures the cost of depth 0
        best, best_d = B / t_plain, 0
        tot = [float(B)] * (dmax + 1)  # tot[d] = sum_i E(a_i, d)
        for a, n in groups.items():
            p, acc = 1.0, 1.0
            for d in range(1, dmax + 1):
                p *= a
                acc += p
                tot[d] += n * (acc - 1.0)
        for d in range(1, dmax + 1):
            nodes = self.nodes_for_depth(d)
            # a verification step costs at least a plain step plus its extra tokens: the fit alone
            # can underestimate it (a fixed part fitted near 0 from a few probe steps)
            t_verify = max(t0 + tpt * B * (1 + nodes), t_plain + tpt * B * nodes)
            rate = tot[d] / (t_verify + d * td)
            if rate > best * 1.02:  # a clear win only
                best, best_d = rate, d
        return best_d

    def note_accept(self, rate: float) -> None:
        """Per-position acceptance of a speculating step (engine); new requests start from its EMA."""
        self.accept_ema = rate if self.accept_ema is None else 0.9 * self.accept_ema + 0.1 * rate

    def step_spec_cap(self, batch: int) -> int:
        """Per-sequence cap on draft tokens so the step's verification tokens stay bounded."""
        if batch <= 0:
            return 0
        return max(0, (self.max_verify_tokens - batch) // batch)

    # the step -----------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        now = self.clock()
        budget = self.cfg.max_num_batched_tokens
        rank = {id(q): self._rank(q, now) for q in self.running}  # computed once per step
        rank.update((id(q), self._rank(q, now)) for q in self.waiting)
        cands = sorted(self.running + self.waiting, key=lambda q: rank[id(q)])
        est_batch = min(len(cands), self.cfg.max_num_seqs)
        cap = self.step_spec_cap(est_batch) if self.spec.adaptive else 1 << 30
        self._steps += 1
        auto_depth = None
        probe = None  # the one request a probe step drafts for
        if self.spec.adaptive and self.has_draft:
            autos = (
                [s for s in cands[: self.cfg.max_num_seqs] if s.spec.mode == "auto"] if self.spec.mode != "off" else []
            )  # (mode_of(auto request) == spec.mode here)
            if autos and self._hopeless_now(len(autos)):
                auto_depth = 0
            else:
                auto_depth = self.choose_depth([s.recent_accept for s in autos])
            self.last_depth = auto_depth
            if self.probing and autos:
                probe = min(autos, key=lambda s: s.last_probe)
                probe.last_probe = self._steps
        scheduled: list[Scheduled] = []
        preempted: list[Sequence] = []
        # while interactive requests are active, batch work runs in small rotating groups so the
        # interactive steps stay short (batch requests fill what is left)
        limit = self.cfg.batch_seqs_with_interactive
        batch_slots = None
        if limit and any(rank[id(q)][0] == 0 for q in cands):
            batch_slots = limit
            head = [q for q in cands if rank[id(q)][0] == 0]
            tail = sorted(
                (q for q in cands if rank[id(q)][0] > 0), key=lambda q: (q.last_step, rank[id(q)])
            )  # least recently served first
            cands = head + tail
        for seq in cands:
            if seq in preempted:
                continue
            if budget <= 0 or len(scheduled) >= self.cfg.max_num_seqs:
                break
            if batch_slots is not None and rank[id(seq)][0] > 0:
                if batch_slots <= 0:
                    continue
                batch_slots -= 1
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
            depth = 0
            if final:
                if auto_depth == 0 and not self.probing and seq.spec.mode == "auto":
                    want = 0  # speculation off for adaptive requests this step (the common case at load)
                else:
                    want = self.desired_budget(seq)
                if auto_depth is not None and seq.spec.mode == "auto" and want > 0:
                    depth = auto_depth
                    mode = self.mode_of(seq)
                    want = depth if mode == "chain" else min(self.spec.tree_budget, depth * self.spec.tree_topk)
                    if self.probing:
                        want = 1 if seq is probe else 0  # a probe drafts a single token for one request
                    if seq.spec.max_draft_tokens is not None:
                        want = min(want, seq.spec.max_draft_tokens)
                spec = min(want, cap, max(0, budget - chunk))
            total = seq.num_computed + chunk + spec
            while not seq.blocks.reserve(total):
                victim = self._pick_victim(scheduled, seq, now)
                if victim is None:
                    break
                self._preempt(victim, scheduled)
                preempted.append(victim)
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
            scheduled.append(Scheduled(seq, chunk, final, spec, depth))
            seq.last_step = self._steps
            budget -= chunk + spec
        self.last_spec_budget = sum(s.spec_budget for s in scheduled)
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
        return self.prefix_cache.chain_key(tokens, n)

    def register_prefix(self, seq: Sequence) -> None:
        # cheap checks first: most steps complete no new full block
        pc, dpc = self.prefix_cache, self.draft_prefix_cache
        if pc is not None and seq.blocks is not None and seq.num_computed // pc.block_size > seq.pc_state[0]:
            pc.register(seq.blocks, seq.tokens, seq.num_computed, seq.pc_state)
        if (
            dpc is not None
            and seq.draft_blocks is not None
            and seq.draft_computed // dpc.block_size > seq.pc_draft_state[0]
        ):
            dpc.register(seq.draft_blocks, seq.tokens, seq.draft_computed, seq.pc_draft_state)

    def _pick_victim(self, scheduled: list, requester: Sequence, now: float) -> Sequence | None:
        """Lowest-ranked running sequence ranked below the requester (batch first, latest first)."""
        rq = self._rank(requester, now)
        victims = [
            s
            for s in self.running
            if s is not requester and self._rank(s, now) > rq and (s.blocks is not None and s.blocks.blocks)
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
        self.free_blocks(seq)
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
        self.free_blocks(seq)
