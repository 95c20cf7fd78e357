"""The engine: ``step()`` = schedule -> draft -> target pass -> verify -> accept -> commit -> emit.

Every decode step is a tree verification: the root is the request's pending token; without
speculation the tree is just the root, so greedy/sampled plain decoding and speculative decoding
share one path. A prefill chunk that reaches the pending token is followed, in the same forward, by
the request's tree, so the first token(s) come out of the step that finishes the prompt.

Who owns what: the scheduler picks the batch, the ``SpecPolicy`` how each request speculates, the
``KVLedger`` every change to a request's KV state (``accept(seq, n)`` is the one rollback),
``stages`` the target pass and verification, ``output`` stop conditions and text. The engine runs
them in order, isolates a failing request (``_run_isolating``) and records statistics.

Thread safety: ``add_request`` and ``abort`` may be called from any thread; they queue work that
``step()`` (one thread) picks up at its start.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable

from specd.config import MODEL_MODES, EngineConfig
from specd.engine.builder import build
from specd.engine.constraints import Constraints
from specd.engine.detokenizer import IncrementalDetokenizer
from specd.engine.health import EngineHealth, RateLimitedLog
from specd.engine.ledger import Checkpoint
from specd.engine.output import RequestOutput, emit, token_logprobs
from specd.engine.requests import RequestError, normalize_params, validate_request
from specd.engine.scheduler import SchedulerOutput
from specd.engine.sequence import Sequence, Status
from specd.engine.stages import TargetPass, WorkItem, kept_hidden, target_pass, verify
from specd.engine.timings import StageTimings
from specd.model.loader import LoadedModel
from specd.sampling.params import SamplingParams
from specd.sampling.probs import make_generator
from specd.speculation.policy import LOOKUP_ONLY
from specd.speculation.request import SpecParams, SpecStats

__all__ = ["Engine", "RequestError", "RequestOutput", "validate_request"]

log = logging.getLogger("specd.engine")

FAIL_ALL_AFTER = 3  # scheduling failures in a row after which every active request is failed


class Engine:
    def __init__(
        self,
        cfg: EngineConfig,
        target: LoadedModel | None = None,
        draft: LoadedModel | None = None,
        clock=time.monotonic,
    ):
        self.cfg = cfg
        self.clock = clock
        p = build(cfg, target, draft, clock)
        self.target, self.draft = p.target, p.draft
        self.device = p.target.device
        self.tokenizer = p.target.tokenizer
        self.max_model_len = p.max_model_len
        self.backend = p.backend
        self.cache, self.draft_cache = p.cache, p.draft_cache
        self.prefix_cache, self.draft_prefix_cache = p.prefix_cache, p.draft_prefix_cache
        self.ledger, self.policy, self.scheduler = p.ledger, p.policy, p.scheduler
        self.speculator = p.speculator  # the proposers (specd.speculation.speculator)
        self.drafter = p.speculator.model  # the model proposer (draft model or feature head), or None
        self.tp = p.tp  # the target's tensor-parallel ranks, or None
        self.capture = getattr(self.drafter, "capture", None)  # a feature head's target layers
        self._policy_clock = p.policy_clock
        self.eos_ids = set(p.target.config.eos_token_ids)
        self.vocab_size = p.target.config.vocab_size
        overlap = cfg.mask_overlap == "on"
        self.constraints = Constraints(self.tokenizer, self.vocab_size, self.eos_ids, overlap=overlap)  # (lazy)
        self.seqs: dict[str, Sequence] = {}
        self._inbox: list = []
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self.stats = SpecStats()  # engine-wide totals
        self.timings = StageTimings()  # where the time goes, by stage (benchmarks read it)
        self.num_steps = 0
        self.step_hook = None  # tests: called at the start of every step (e.g. to simulate a hang)
        # tests (fault injection): fault_hook(stage, seqs) runs as each stage starts, with its requests
        self.fault_hook: Callable[[str, list], None] | None = None
        self.health = EngineHealth()
        self._errlog = RateLimitedLog(log)
        self._stage = "schedule"

    # requests ------------------------------------------------------------------------------------
    def validate(self, prompt_ids: list, params: SamplingParams) -> None:
        validate_request(
            prompt_ids, params, self.max_model_len, self.cache.block_size, self.cache.pool.num_blocks, self.vocab_size
        )

    def add_request(
        self,
        prompt_ids: list,
        params: SamplingParams,
        spec: SpecParams = SpecParams(),
        priority: str = "interactive",
        request_id: str | None = None,
        tenant: str | None = None,
        grammar=None,
    ) -> Sequence:
        """Queue a request (any thread). Raises RequestError for an invalid one. ``tenant`` (e.g. a
        digest of the API key): model-free drafting reads only earlier requests of the same tenant.
        ``grammar`` (a ``specd.structured.GrammarSpec``): the reply is constrained to it; the request
        is scheduled once its grammar compiled (off the engine thread), and ends with an ``error``
        naming the problem if it does not."""
        self.validate(prompt_ids, params)
        params = normalize_params(params, self.vocab_size)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        seq = Sequence(rid, prompt_ids, params, spec, priority, arrival=self.clock())
        seq.generator = make_generator(params.seed)
        seq.tenant = tenant
        seq.grammar = grammar
        seq.detok = IncrementalDetokenizer(self.tokenizer, prompt_ids) if self.tokenizer is not None else None
        with self._lock:
            if rid in self.seqs:
                raise RequestError("duplicate_id", f"request id {rid!r} is already running")
            self.seqs[rid] = seq
            self._inbox.append(("add", seq))
        return seq

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._inbox.append(("abort", request_id))

    def has_work(self) -> bool:
        """Requests to run, or a dead tensor-parallel rank (the next ``step`` raises ``RankFailure``)."""
        if self.tp is not None and self.tp.failed:
            return True
        with self._lock:
            return bool(self._inbox) or self.scheduler.has_work() or bool(self.constraints.waiting)

    def has_new_requests(self) -> bool:
        """Requests added (or aborts asked for) since the last step began."""
        return bool(self._inbox)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def _drain_inbox(self) -> list:
        with self._lock:
            inbox, self._inbox = self._inbox, []
        outs = []
        for op, x in inbox:
            if op == "add":
                if x.finished:
                    continue
                if x.grammar is not None:
                    self.constraints.submit(x, x.grammar)
                else:
                    self.scheduler.add(x)
            else:
                seq = self.seqs.get(x)
                if seq is not None and not seq.finished:
                    self._finish(seq, "cancelled")
                    outs.append(RequestOutput(seq.request_id, [], "", True, "cancelled", seq))
        return outs + self._compiled()

    def _compiled(self) -> list:
        """Constrained requests whose grammar is ready join the scheduler; a refused grammar ends
        its request with an ``error`` output (``code: message``; not an engine failure)."""
        if not self.constraints.waiting:
            return []
        if not self.scheduler.has_work():  # nothing else to run: wait for a compile, briefly (no spin)
            self.constraints.wait(0.005)
        ready, failed = self.constraints.ready()
        for seq in ready:
            self.scheduler.add(seq)
        outs = []
        for seq, err in failed:
            seq.error = f"{getattr(err, 'code', 'invalid_grammar')}: {getattr(err, 'message', err)}"
            self._finish(seq, "error")
            outs.append(RequestOutput(seq.request_id, [], "", True, "error", seq, seq.error))
        return outs

    # the step ------------------------------------------------------------------------------------
    def step(self) -> list:
        """One engine step; returns its ``RequestOutput``s. Never raises for a failing stage: see
        ``_run_isolating`` (a failed request ends alone with ``finish_reason: "error"``)."""
        if self.step_hook is not None:
            self.step_hook(self)
        if self.tp is not None:
            self.tp.check()  # a dead rank ends the engine (RankFailure escapes every step isolation)
        outputs = self._drain_inbox()
        start = self.timings.now()
        try:
            sched = self.scheduler.schedule()
        except Exception as e:  # noqa: BLE001 - no culprit to isolate: retry, then fail everyone
            return outputs + self._schedule_failed(e)
        if not sched.scheduled:
            self.health.step_ended(progressed=True, failed=False)
            return outputs
        self.timings.add("schedule", start)
        outputs += self._run_step(sched)
        self.timings.steps += 1
        self.timings.add("step", start)
        return outputs

    def _run_step(self, sched: SchedulerOutput) -> list:
        """The scheduled batch through every stage, failures isolated; health and the policy's
        cost model updated. The policy's clock: on CPU the engine thread's CPU time (immune to
        waits for the GIL and to other load), on a GPU wall time (the thread may sleep on kernels)."""
        clock = self._policy_clock
        t0 = clock()
        cps = {id(sc.seq): self.ledger.checkpoint(sc.seq) for sc in sched.scheduled}
        failed_before = self.health.stage_failures
        timing: dict = {}
        outs = self._run_isolating(sched.scheduled, cps, timing)
        failed = self.health.stage_failures > failed_before
        errors = sum(1 for o in outs if o.finish_reason == "error")
        self.health.step_ended(progressed=errors < len(sched.scheduled), failed=failed)
        if not failed:
            self._observe(sched, timing, t0, clock())
        self.num_steps += 1
        return outs

    def _enter(self, stage: str, seqs: list) -> None:
        """``stage`` starts (named in a failure's report); the test seam ``fault_hook`` runs."""
        self._stage = stage
        if self.fault_hook is not None:
            self.fault_hook(stage, seqs)

    def _run_batch(self, scheduled: list, cps: dict, timing: dict) -> list:
        """draft -> target pass -> verify -> accept/commit/emit for ``scheduled``. Per-request
        commit failures are handled inside; a batched stage's failure propagates."""
        seqs = [sc.seq for sc in scheduled]
        mark = self.timings.now()
        self._enter("draft", seqs)
        proposals = self.speculator.draft(scheduled)
        mark = self.timings.add("draft", mark)
        masks = self.constraints.constrain(scheduled, proposals)  # (prunes what the grammar forbids)
        mark = self.timings.add("mask", mark)
        self._enter("forward", seqs)
        tp = target_pass(
            scheduled, proposals, self.target.model, self.cache.kv, self.cache.block_size, self.backend, self.capture,
            self.cfg.batch_invariant, any(sc.seq.params.greedy for sc in scheduled),
        )  # fmt: skip
        mark = self.timings.add("forward", mark)
        self._enter("verify", seqs)
        self.constraints.apply(tp, masks)
        mark = self.timings.add("mask", mark)
        results = verify(tp)
        mark = self.timings.add("verify", mark)
        self._stage = "commit"
        outs = self._commit(tp, results, cps)
        self.timings.add("commit", mark)
        timing["proposals"], timing["logits"] = proposals, tp.logits is not None
        timing["accepted"] = sum(len(r.accepted) for r in results if r is not None)
        return outs

    def _run_isolating(self, scheduled: list, cps: dict, timing: dict) -> list:
        """``_run_batch``, and when one of its batched stages raises: every request of the batch is
        rolled back to its checkpoint (as if the step never ran for it), then the two halves of the
        batch run again separately, down to single requests. A request that fails alone is the
        culprit: it ends with ``finish_reason: "error"`` (its blocks freed); every other request
        completes its step exactly as it would have (its own tokens, KV and random draws)."""
        try:
            return self._run_batch(scheduled, cps, timing)
        except Exception as e:  # noqa: BLE001 - isolate the culprit, never fail the engine
            stage = self._stage
            self.health.stage_failed(stage)
            self.constraints.settle()  # (mask fills still running hold matchers the restore rolls back)
            for sc in scheduled:
                self.ledger.restore(sc.seq, cps[id(sc.seq)])
            if len(scheduled) == 1:
                return [self._fail_request(scheduled[0].seq, stage, e, cps[id(scheduled[0].seq)])]
            mid = len(scheduled) // 2
            return self._run_isolating(scheduled[:mid], cps, timing) + self._run_isolating(scheduled[mid:], cps, timing)

    # accept, commit, emit ------------------------------------------------------------------------
    def _commit(self, tp: TargetPass, results: list, cps: dict) -> list:
        """Compact accepted KV entries (one batched copy), then each request's bookkeeping on its
        own: a request whose commit or emit raises is rolled back and fails alone."""
        self.ledger.compact([(w.sc.seq, r.accepted) for w, r in zip(tp.work, results) if r is not None])
        outs = []
        now = self.clock()
        for w, res in zip(tp.work, results):
            try:
                out = self._commit_one(w, res, now, tp.logits)
            except Exception as e:  # noqa: BLE001 - this request's own data: it fails alone
                self.health.stage_failed(self._stage)
                outs.append(self._fail_request(w.sc.seq, self._stage, e, cps[id(w.sc.seq)]))
                continue
            if out is not None:
                outs.append(out)
        return outs

    def _commit_one(self, w: WorkItem, res, now: float, logits) -> RequestOutput | None:
        """One request's bookkeeping after verification. What can fail (emit: stop conditions,
        detokenization) runs before the counters, the policy's acceptance and the prefix cache
        are touched, so a failure leaves those as if the step never ran."""
        seq = w.sc.seq
        self._enter("commit", [seq])
        hidden = kept_hidden(w, res) if self.capture and self.policy.mode_of(seq) in MODEL_MODES else None
        if res is None:  # prefill chunk only
            self.ledger.advance(seq, w.sc.num_tokens, hidden)
            return None
        accepted = len(res.accepted)
        self.ledger.accept(seq, accepted, hidden, res.tokens)
        if seq.first_token_time is None:
            seq.first_token_time = now
        self._enter("emit", [seq])
        new, reason, text = emit(seq, res.tokens, self.eos_ids, self.max_model_len)
        lps = None
        if seq.params.logprobs is not None:  # token i comes from the row of path node i (root first)
            rows = [w.row0 + node for node in [0, *res.accepted][: len(new)]]
            lps = token_logprobs(logits, rows, new, seq.params.logprobs)
            if seq.logprobs is not None:
                seq.logprobs.extend(lps)
        drafted = w.tree.num_nodes - 1 if w.tree is not None else 0
        self.speculator.record(seq, w.proposal, drafted, res.accepted, len(new), self.stats)
        if reason is not None:
            self._finish(seq, reason)
            self.speculator.forget(seq)
        else:
            self.ledger.register(seq)
        return RequestOutput(seq.request_id, new, text, reason is not None, reason, seq, logprobs=lps)

    def _observe(self, sched: SchedulerOutput, timing: dict, t0: float, t2: float) -> None:
        """Feed the adaptive policy the costs of a clean pure-decode step (prefill would skew the fit)."""
        if not timing.get("logits") or not all(sc.final and sc.num_tokens == 1 for sc in sched.scheduled):
            return
        proposals = timing["proposals"]
        try:
            if proposals:
                # per-level draft cost (draft model only): the forwards after the first (which also
                # catches the draft cache up by however much it lags, e.g. after a skipped prefill)
                level = None
                if self.drafter is not None and any(not p.deterministic for p in proposals.values()):
                    levels = self.drafter.levels - 1
                    level = self.drafter.level_time / levels if levels > 0 else None
                # the step's cost but the model proposer's forwards (priced per level): prompt
                # lookup's matching and the per-request work of speculating count, as they do in
                # a plain step's cost (t2 - t0)
                # keyed by the tokens the target verified, not the budget the scheduler reserved (a
                # lookup that found no match reserves its tokens and verifies none: priced by the
                # reservation, 16 requests' rows looked ~5x cheaper than they are)
                verified = len(sched.scheduled) + sum(p.tree.num_nodes - 1 for p in proposals.values())
                self.policy.costs.observe(
                    t2 - t0 - self.speculator.model_draft_s, level, verified, len(sched.scheduled)
                )
                if all(sc.spec_depth == LOOKUP_ONLY for sc in sched.scheduled if sc.seq.request_id in proposals):
                    n = len(sched.scheduled)
                    self.policy.costs.note_lookup_step(n, n + timing.get("accepted", 0), t2 - t0)
            else:
                self.policy.costs.observe_plain(len(sched.scheduled), t2 - t0)
        except Exception as e:  # noqa: BLE001 - the policy's inputs are the policy's problem
            self.health.stage_failed("policy")
            name = type(e).__name__
            self._errlog.error(f"policy:{name}", "speculation policy update failed: %s: %s", name, e, exc_info=True)

    # failures ------------------------------------------------------------------------------------
    def _fail_request(
        self, seq: Sequence, stage: str, exc: BaseException, cp: Checkpoint | None = None
    ) -> RequestOutput:
        """End ``seq`` with ``finish_reason: "error"``: restored to ``cp`` first (so that only KV
        computed before the step is kept or offered to the prefix cache), then its blocks freed."""
        msg = f"{stage} failed: {type(exc).__name__}: {exc}"
        self._errlog.error(
            f"{stage}:{type(exc).__name__}", "request %s failed in %s: %s", seq.request_id, stage, msg, exc_info=exc
        )
        self.health.request_failed(stage)
        try:
            if cp is not None:
                self.ledger.restore(seq, cp)
            seq.error = msg
            self._finish(seq, "error")
        except Exception:  # noqa: BLE001 - its state is beyond repair: drop it without its prefix
            log.exception("could not release request %s cleanly", seq.request_id)
            self._drop(seq)
        return RequestOutput(seq.request_id, [], "", True, "error", seq, msg)

    def _drop(self, seq: Sequence) -> None:
        """Last resort for a request whose state cannot be restored: out of every queue, its blocks
        released without registering any prefix."""
        seq.status = Status.FINISHED
        seq.finish_reason = "error"
        seq.finish_time = self.clock()
        for q in (self.scheduler.waiting, self.scheduler.running):
            if seq in q:
                q.remove(seq)
        self.ledger.drop(seq)
        with self._lock:
            self.seqs.pop(seq.request_id, None)

    def _schedule_failed(self, exc: Exception) -> list:
        """Scheduling raised: no batch, so no culprit. Retry on the next steps (the engine loop backs
        off); after ``FAIL_ALL_AFTER`` such steps in a row, fail every active request."""
        self.health.stage_failed("schedule")
        self.health.step_ended(progressed=False, failed=True)
        self._errlog.error(
            f"schedule:{type(exc).__name__}", "scheduling failed: %s: %s", type(exc).__name__, exc, exc_info=exc
        )
        if self.health.consecutive_failed < FAIL_ALL_AFTER:
            return []
        return self.fail_all(exc, "schedule")

    def fail_all(self, exc: BaseException, stage: str = "step") -> list:
        """End every active request with ``finish_reason: "error"`` (engine thread only). Never raises:
        a request that cannot be released cleanly is dropped (``_fail_request``)."""
        with self._lock:
            seqs = [s for s in self.seqs.values() if not s.finished]
        return [self._fail_request(seq, stage, exc) for seq in seqs]

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        seq.finish_time = self.clock()
        self.scheduler.finish(seq)
        with self._lock:
            self.seqs.pop(seq.request_id, None)

    def close(self) -> None:
        """Release what outlives the object: the tensor-parallel worker processes and the grammar
        masks' worker thread (idempotent)."""
        self.constraints.close()
        if self.tp is not None:
            self.tp.close()

    # convenience ---------------------------------------------------------------------------------
    def output_text(self, seq: Sequence) -> str:
        if seq.stop_text is not None:
            return seq.stop_text
        return seq.detok.text if seq.detok is not None else ""

    def generate(
        self, prompts: list, params, spec: SpecParams = SpecParams(), priority="interactive", grammar=None
    ) -> list:
        """Run prompts (token id lists) to completion; returns their Sequences in order (``grammar``:
        one GrammarSpec for all, or a list, one per prompt)."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        grammars = grammar if isinstance(grammar, list) else [grammar] * len(prompts)
        seqs = [self.add_request(p, sp, spec, priority, grammar=g) for p, sp, g in zip(prompts, params, grammars)]
        while any(not s.finished for s in seqs):
            self.step()
        return seqs

    def prefix_cache_stats(self) -> dict:
        pc = self.prefix_cache
        return {
            "query_tokens": pc.queried_tokens,
            "hit_tokens": pc.hit_tokens,
            "hit_rate": pc.hit_rate,
            "evictions": self.cache.pool.evictions,
        }

    def health_snapshot(self) -> dict:
        """``EngineHealth.snapshot()``: failed steps / requests by stage, failed steps in a row."""
        return self.health.snapshot()

    def kv_blocks_used(self) -> tuple:
        t = self.cache.pool.num_allocated
        d = self.draft_cache.pool.num_allocated if self.draft_cache is not None else 0
        return t, d
