"""The engine: ``step()`` = schedule -> draft -> one target forward -> verify -> commit -> emit.

Every decode step is a tree verification: the root is the request's pending token; without
speculation the tree is just the root, so greedy/sampled plain decoding and speculative decoding
share one path. A prefill chunk that reaches the pending token is followed, in the same forward, by
the request's tree, so the first token(s) come out of the step that finishes the prompt.

Thread safety: ``add_request`` and ``abort`` may be called from any thread; they queue work that
``step()`` (one thread) picks up at its start.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from specd.config import EngineConfig
from specd.engine.detokenizer import IncrementalDetokenizer
from specd.engine.health import EngineHealth, RateLimitedLog
from specd.engine.kv_cache import KVCache, PrefixCache
from specd.engine.sampling import SamplingParams, logits_to_probs, make_generator
from specd.engine.scheduler import Scheduler
from specd.engine.sequence import Checkpoint, Sequence, SpecParams, SpecStats, Status
from specd.model.attention import build_metadata, get_backend
from specd.model.loader import LoadedModel, LoadError, load_model
from specd.speculation.drafter import Drafter
from specd.speculation.tree import DraftTree
from specd.speculation.verify import AcceptResult, greedy_verify, verify_batch

log = logging.getLogger("specd.engine")


FAIL_ALL_AFTER = 3  # scheduling failures in a row after which every active request is failed


class RequestError(ValueError):
    """A request the engine refuses; ``code`` is the protocol error code."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


@dataclass
class RequestOutput:
    request_id: str
    token_ids: list  # tokens emitted this step
    text: str  # text completed this step
    finished: bool
    finish_reason: str | None
    seq: Sequence
    error: str | None = None  # finish_reason "error": what failed (stage and exception)


def validate_request(
    prompt_ids: list, params: SamplingParams, max_model_len: int, block_size: int, num_blocks: int, vocab_size: int
) -> None:
    """Refuse (RequestError) a request that can never run: empty, too long for the context or the KV
    cache, token ids outside the vocabulary. Before any compute (also used by the server process)."""
    n = len(prompt_ids)
    if n == 0:
        raise RequestError("invalid_request", "prompt is empty")
    if n + params.max_tokens > max_model_len:
        raise RequestError("too_long", f"prompt ({n}) + max_tokens ({params.max_tokens}) > context {max_model_len}")
    if -(-(n + params.max_tokens + 1) // block_size) > num_blocks:
        raise RequestError(
            "too_long",
            f"prompt ({n}) + max_tokens ({params.max_tokens}) exceeds the KV cache ({num_blocks * block_size} tokens)",
        )
    bad = next((t for t in prompt_ids if not (0 <= t < vocab_size)), None)
    if bad is not None:
        raise RequestError("invalid_request", f"token id {bad} outside the vocabulary (0..{vocab_size - 1})")
    bad = next((t for t in params.stop_token_ids if not (0 <= t < vocab_size)), None)
    if bad is not None:
        raise RequestError("invalid_request", f"stop_token_ids: {bad} is outside the vocabulary (0..{vocab_size - 1})")


def normalize_params(params: SamplingParams, vocab_size: int) -> SamplingParams:
    """``top_k`` at or above the vocabulary keeps every token: the same as off (0)."""
    if params.top_k >= vocab_size:
        return dataclasses.replace(params, top_k=0)
    return params


def _cache_blocks(cfg: EngineConfig, target: LoadedModel, draft: LoadedModel | None, max_len: int):
    bs = cfg.cache.block_size
    tc = target.config
    per_t = KVCache.bytes_per_block(tc.num_layers, tc.num_kv_heads, tc.head_dim, bs, target.dtype)
    per_d = 0
    if draft is not None:
        dc = draft.config
        per_d = KVCache.bytes_per_block(dc.num_layers, dc.num_kv_heads, dc.head_dim, bs, draft.dtype)
    if cfg.cache.num_blocks is not None:
        return cfg.cache.num_blocks, cfg.cache.num_blocks
    # enough for every sequence at full length (+ tree room) unless the budget says less
    want = cfg.scheduler.max_num_seqs * (-(-(max_len + 300) // bs)) + 8
    budget = cfg.cache.memory_bytes
    if budget is None:
        if target.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(target.device)
            budget = int(free * 0.85)
        else:
            budget = 2 << 30
    n = max(16, min(want, budget // (per_t + per_d)))
    return n, n


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
        if target is None:  # (dtype auto on a CPU weighs the widths a step will have)
            width = 1 + (max(cfg.spec.tree_budget, cfg.spec.num_draft_tokens) if cfg.draft else 0)
            target = load_model(cfg.target, cfg.device, cfg.dtype, widths=(1, max(width, 8)))
        if draft is None and cfg.draft:
            dtype = str(target.dtype).removeprefix("torch.")  # the draft computes in the target's dtype
            draft = load_model(cfg.draft, cfg.device, dtype, with_tokenizer=True, target=target)
        self.target, self.draft = target, draft
        self.device = target.device
        self.tokenizer = target.tokenizer
        tc = target.config
        self.max_model_len = tc.max_position_embeddings
        if tc.sliding_window:
            self.max_model_len = min(self.max_model_len, int(tc.sliding_window))
        if draft is not None:
            self._check_draft(target, draft)
            self.max_model_len = min(self.max_model_len, draft.config.max_position_embeddings)
        self.backend = get_backend(cfg.attention_backend, self.device)
        self._policy_clock = time.thread_time if self.device.type == "cpu" else time.perf_counter
        nt, nd = _cache_blocks(cfg, target, draft, self.max_model_len)
        bs = cfg.cache.block_size
        self.cache = KVCache(tc.num_layers, tc.num_kv_heads, tc.head_dim, nt, bs, target.dtype, self.device)
        self.draft_cache = None
        self.drafter = None
        if draft is not None:
            dc = draft.config
            self.draft_cache = KVCache(dc.num_layers, dc.num_kv_heads, dc.head_dim, nd, bs, draft.dtype, self.device)
            self.drafter = Drafter(draft.model, self.draft_cache, cfg.spec, self.device, dc.vocab_size, self.backend)
            self.drafter.clock = self._policy_clock
        self.prefix_cache = PrefixCache(self.cache.pool, bs)
        self.draft_prefix_cache = PrefixCache(self.draft_cache.pool, bs) if self.draft_cache is not None else None
        self.scheduler = Scheduler(
            cfg.scheduler,
            cfg.spec,
            self.cache,
            self.draft_cache,
            clock=clock,
            has_draft=draft is not None,
            prefix_cache=self.prefix_cache,
            draft_prefix_cache=self.draft_prefix_cache,
        )
        self.eos_ids = set(tc.eos_token_ids)
        self.vocab_size = tc.vocab_size
        self.seqs: dict[str, Sequence] = {}
        self._inbox: list = []
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self.stats = SpecStats()  # engine-wide totals
        self.num_steps = 0
        self.step_hook = None  # tests: called at the start of every step (e.g. to simulate a hang)
        # tests (fault injection): fault_hook(stage, seqs) runs as each stage starts, with its requests
        self.fault_hook: Callable[[str, list], None] | None = None
        self.health = EngineHealth()
        self._errlog = RateLimitedLog(log)
        self._stage = "schedule"

    @staticmethod
    def _check_draft(target: LoadedModel, draft: LoadedModel) -> None:
        tv, dv = target.config.vocab_size, draft.config.vocab_size
        if tv != dv:
            raise LoadError(
                f"draft vocabulary ({dv} tokens, {draft.path}) does not match the target's "
                f"({tv} tokens, {target.path}): the draft must share the target's tokenizer"
            )
        if target.tokenizer is not None and draft.tokenizer is not None:
            if target.tokenizer.get_vocab() != draft.tokenizer.get_vocab():
                raise LoadError(
                    f"draft tokenizer ({draft.path}) differs from the target's ({target.path}): "
                    f"the draft must share the target's tokenizer"
                )

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
    ) -> Sequence:
        """Queue a request (any thread). Raises RequestError for an invalid one."""
        self.validate(prompt_ids, params)
        params = normalize_params(params, self.vocab_size)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        seq = Sequence(rid, prompt_ids, params, spec, priority, arrival=self.clock())
        seq.generator = make_generator(params.seed)
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
        with self._lock:
            return bool(self._inbox) or self.scheduler.has_work()

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
                if not x.finished:
                    self.scheduler.add(x)
            else:
                seq = self.seqs.get(x)
                if seq is not None and not seq.finished:
                    self._finish(seq, "cancelled")
                    outs.append(RequestOutput(seq.request_id, [], "", True, "cancelled", seq))
        return outs

    # the step ------------------------------------------------------------------------------------
    def step(self) -> list:
        """One engine step; returns its ``RequestOutput``s. Never raises for a failing stage: see
        ``_run_isolating`` (a failed request ends alone with ``finish_reason: "error"``)."""
        if self.step_hook is not None:
            self.step_hook(self)
        outputs = self._drain_inbox()
        try:
            sched = self.scheduler.schedule()
        except Exception as e:  # noqa: BLE001 - no culprit to isolate: retry, then fail everyone
            return outputs + self._schedule_failed(e)
        if not sched.scheduled:
            self.health.step_ended(progressed=True, failed=False)
            return outputs
        # the policy's costs: on CPU the engine thread's CPU time (immune to waits for the GIL and to
        # other load on the machine); on a GPU wall time (the thread may sleep while kernels run)
        clock = self._policy_clock
        t0 = clock()
        cps = {id(sc.seq): sc.seq.checkpoint() for sc in sched.scheduled}
        failed_before = self.health.stage_failures
        timing: dict = {}
        outs = self._run_isolating(sched.scheduled, cps, timing)
        failed = self.health.stage_failures > failed_before
        errors = sum(1 for o in outs if o.finish_reason == "error")
        self.health.step_ended(progressed=errors < len(sched.scheduled), failed=failed)
        if not failed:
            self._observe(sched, timing, t0, clock())
        self.num_steps += 1
        return outputs + outs

    def _observe(self, sched, timing: dict, t0: float, t2: float) -> None:
        """Feed the adaptive policy the costs of a clean pure-decode step (prefill would skew the fit)."""
        if not timing.get("logits") or not all(sc.final and sc.num_tokens == 1 for sc in sched.scheduled):
            return
        sch = self.scheduler
        proposals, t1 = timing["proposals"], timing["t1"]
        try:
            levels = self.drafter.levels - 1 if (self.drafter is not None and proposals) else 0
            if proposals:  # per-level draft cost: the forwards after the first (which also catches
                # the draft cache up by however much it lags, e.g. after a skipped prompt prefill)
                sch.observe(t2 - t1, self.drafter.level_time / levels if levels > 0 else None, sched.num_tokens)
            else:
                sch.observe_plain(len(sched.scheduled), t2 - t0)
        except Exception as e:  # noqa: BLE001 - the policy's inputs are the policy's problem
            self.health.stage_failed("policy")
            self._errlog.error(
                f"policy:{type(e).__name__}",
                "speculation policy update failed: %s: %s",
                type(e).__name__,
                e,
                exc_info=True,
            )

    def _run_batch(self, scheduled: list, cps: dict, timing: dict) -> list:
        """draft -> target forward -> verify -> commit for ``scheduled``; ``self._stage`` names the
        stage running (for a failure's report). Per-request commit failures are handled inside."""
        hook = self.fault_hook
        self._stage = "draft"
        if hook is not None:
            hook("draft", [sc.seq for sc in scheduled])
        proposals = self._draft(scheduled)
        timing["t1"] = self._policy_clock()
        self._stage = "forward"
        if hook is not None:
            hook("forward", [sc.seq for sc in scheduled])
        work, logits = self._target_forward(scheduled, proposals)
        self._stage = "verify"
        if hook is not None:
            hook("verify", [sc.seq for sc in scheduled])
        results = self._verify(work, logits)
        self._stage = "commit"
        outs = self._commit(work, results, cps)
        timing["proposals"], timing["logits"] = proposals, logits is not None
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
            for sc in scheduled:
                sc.seq.restore(cps[id(sc.seq)])
            if len(scheduled) == 1:
                return [self._fail_request(scheduled[0].seq, stage, e, cps[id(scheduled[0].seq)])]
            mid = len(scheduled) // 2
            return self._run_isolating(scheduled[:mid], cps, timing) + self._run_isolating(scheduled[mid:], cps, timing)

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
                seq.restore(cp)
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
        for blocks in (seq.blocks, seq.draft_blocks):
            while blocks is not None and blocks.blocks:
                try:
                    blocks.pool.decref(blocks.blocks.pop())
                except Exception:  # noqa: BLE001 - a double free is already counted as freed
                    pass
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

    def _spec_budget(self, seq: Sequence, budget: int) -> int:
        room = self.max_model_len - len(seq.tokens) - 1
        remaining = seq.params.max_tokens - seq.num_output - 1
        return max(0, min(budget, room, remaining))

    def _draft(self, scheduled) -> dict:
        if self.drafter is None:
            return {}
        catch, spec = [], []
        sch = self.scheduler
        # adaptive speculation switched off: prompts skip the draft prefill (a request catches up in
        # one draft forward when it next drafts)
        lazy_auto = sch.spec.adaptive and sch.last_depth == 0
        for sc in scheduled:
            seq = sc.seq
            if sc.final:
                b = self._spec_budget(seq, sc.spec_budget) if sc.spec_budget > 0 else 0
                shape = self.drafter.shape_for(sch.mode_of(seq), b, sc.spec_depth) if b > 0 else None
                if shape is not None:
                    spec.append((seq, shape))
            elif sch.mode_of(seq) != "off" and not (lazy_auto and seq.spec.mode == "auto"):
                catch.append((seq, seq.num_computed + sc.num_tokens))
        if catch:
            self.drafter.catch_up(catch)
        return self.drafter.propose(spec) if spec else {}

    def _target_forward(self, scheduled, proposals):
        ids, pos, slots, qlens, ctxs, tables, masks = [], [], [], [], [], [], []
        work, logit_rows = [], []
        n = 0
        for sc in scheduled:
            seq = sc.seq
            c0 = seq.num_computed
            if not sc.final:
                c1 = c0 + sc.num_tokens
                ids += seq.tokens[c0:c1]
                pos += range(c0, c1)
                slots += seq.blocks.slots(c0, c1)
                qlens.append(c1 - c0)
                masks.append(None)
                work.append((sc, None, None, 0))
            elif c0 == len(seq.tokens) - 1 and seq.request_id not in proposals:  # plain decode: the root alone
                L = c0 + 1
                if not seq.blocks.reserve(L):
                    raise RuntimeError("KV reservation lost")
                tok = seq.tokens[c0]
                ids.append(tok)
                pos.append(c0)
                slots.append(seq.blocks.slot(c0))
                qlens.append(1)
                masks.append(None)
                work.append((sc, DraftTree([tok], [-1], validate=False), None, len(logit_rows)))
                logit_rows.append(n)
            else:
                L = len(seq.tokens)
                prop = proposals.get(seq.request_id)
                tree = prop.tree if prop is not None else DraftTree([seq.tokens[-1]], [-1], validate=False)
                m = L - 1 - c0  # committed tokens before the root
                nt = tree.num_nodes
                if not seq.blocks.reserve(L - 1 + nt):  # the scheduler reserved the budget; trees may be smaller
                    raise RuntimeError("KV reservation lost")
                ids += seq.tokens[c0 : L - 1]
                ids += tree.token_list
                pos += range(c0, L - 1)
                pos += [L - 1 + d for d in tree.depth_list]
                slots += seq.blocks.slots(c0, L - 1 + nt)
                qlens.append(m + nt)
                if nt > 1 and tree.max_depth < nt - 1:  # a chain is plain causal: no mask needed
                    mk = torch.zeros((m + nt, m + nt), dtype=torch.bool)
                    mk[:m, :m] = torch.ones((m, m), dtype=torch.bool).tril_()
                    mk[m:, :m] = True
                    mk[m:, m:] = tree.ancestor_mask()
                    masks.append(mk)
                else:
                    masks.append(None)
                work.append((sc, tree, prop, len(logit_rows)))
                logit_rows += range(n + m, n + m + nt)
            ctxs.append(c0)
            tables.append(seq.blocks.blocks)
            n += qlens[-1]
        meta = build_metadata(
            qlens,
            ctxs,
            tables,
            slots,
            self.cache.block_size,
            self.device,
            tree_masks=masks if any(x is not None for x in masks) else None,
        )
        dev = self.device
        model = self.target.model
        hidden = model(torch.tensor(ids, device=dev), torch.tensor(pos, device=dev), self.cache.kv, meta, self.backend)
        if not logit_rows:
            return work, None
        if len(logit_rows) < n:  # prefill rows carry no logits
            hidden = hidden[torch.tensor(logit_rows, device=dev)]
        logits = model.compute_logits(hidden)
        return work, logits

    def _verify(self, work, logits) -> list:
        results = [None] * len(work)
        if logits is None:
            return results
        greedy_idx = [k for k, (sc, tree, _, _) in enumerate(work) if tree is not None and sc.seq.params.greedy]
        samp_idx = [k for k, (sc, tree, _, _) in enumerate(work) if tree is not None and not sc.seq.params.greedy]
        if greedy_idx:
            argmax = logits.argmax(dim=-1).tolist()  # one host transfer for the whole batch
            for k in greedy_idx:
                sc, tree, _, r0 = work[k]
                if tree.num_nodes == 1:  # root only: the target's token is the bonus token
                    t = argmax[r0]
                    results[k] = AcceptResult([], [t], t, True)
                else:
                    results[k] = greedy_verify(tree, argmax[r0 : r0 + tree.num_nodes])
        if samp_idx:
            rows, temp, topk, topp = [], [], [], []
            for k in samp_idx:
                sc, tree, _, r0 = work[k]
                p = sc.seq.params
                rows += range(r0, r0 + tree.num_nodes)
                temp += [p.temperature] * tree.num_nodes
                topk += [p.top_k] * tree.num_nodes
                topp += [p.top_p] * tree.num_nodes
            dev = logits.device
            # params stay on the host: logits_to_probs picks its fast path without a device sync
            probs = logits_to_probs(
                logits[torch.tensor(rows, device=dev)], torch.tensor(temp), torch.tensor(topk), torch.tensor(topp)
            )
            trees, dps = [], []
            for k in samp_idx:
                sc, tree, prop, _ = work[k]
                trees.append(tree)
                dp = prop.draft_probs if prop is not None else None
                dps.append(
                    dp
                    if dp is not None
                    else torch.zeros((tree.num_nodes, probs.shape[1]), dtype=probs.dtype, device=dev)
                )
            # the whole batch in one vectorised pass (two host transfers), each request drawing only
            # from its own generator
            batch = verify_batch(
                trees,
                probs,
                greedy=False,
                draft_probs=torch.cat(dps),
                generators=[work[k][0].seq.generator for k in samp_idx],
                draft_mode="sampled",
            )
            for k, res in zip(samp_idx, batch):
                results[k] = res
        return results

    # commit: the one place that does cache bookkeeping after verification ------------------------
    def _commit(self, work, results, cps: dict) -> list:
        """Compact accepted KV entries (one batched copy), then each request's bookkeeping on its
        own: a request whose commit or emit raises is rolled back and fails alone."""
        src, dst = [], []
        for (sc, _, _, _), res in zip(work, results):
            if res is None:
                continue
            seq = sc.seq
            base = len(seq.tokens) - 1  # the root's position
            for k, node in enumerate(res.accepted, 1):
                if node != k:
                    src.append(seq.blocks.slot(base + node))
                    dst.append(seq.blocks.slot(base + k))
        if src:  # (positions past the committed prefix only: a rollback needs no undo)
            self.backend.copy_slots(
                self.cache.kv, torch.tensor(src, device=self.device), torch.tensor(dst, device=self.device)
            )
        outs = []
        now = self.clock()
        for (sc, tree, prop, _), res in zip(work, results):
            try:
                out = self._commit_one(sc, tree, prop, res, now)
            except Exception as e:  # noqa: BLE001 - this request's own data: it fails alone
                self.health.stage_failed(self._stage)
                cp = cps[id(sc.seq)]
                outs.append(self._fail_request(sc.seq, self._stage, e, cp))
                continue
            if out is not None:
                outs.append(out)
        return outs

    def _commit_one(self, sc, tree, prop, res, now: float) -> RequestOutput | None:
        """One request's bookkeeping after verification. What can fail (emit: stop conditions,
        detokenization) runs before the counters, the policy's acceptance and the prefix cache
        are touched, so a failure leaves those as if the step never ran."""
        seq = sc.seq
        self._stage = "commit"
        if self.fault_hook is not None:
            self.fault_hook("commit", [seq])
        if res is None:  # prefill chunk only
            seq.num_computed += sc.num_tokens
            self.scheduler.register_prefix(seq)
            return None
        L = len(seq.tokens)
        a = len(res.accepted)
        seq.num_computed = L + a
        seq.blocks.truncate(L + a)
        if seq.draft_blocks is not None:
            seq.draft_blocks.truncate(seq.draft_computed)
        if seq.first_token_time is None:
            seq.first_token_time = now
        self._stage = "emit"
        if self.fault_hook is not None:
            self.fault_hook("emit", [seq])
        new, reason, text = self._emit(seq, res.tokens)
        depth = prop.depth if prop is not None else 0
        seq.stats.record(tree.num_nodes - 1, depth, a)
        self.stats.record(tree.num_nodes - 1, depth, a)
        seq.stats.emitted_tokens += len(new)
        self.stats.emitted_tokens += len(new)
        if depth:
            seq.recent_accept = 0.7 * seq.recent_accept + 0.3 * (a / depth)
            self.scheduler.note_accept(a / depth)
        if reason is not None:
            self._finish(seq, reason)
        else:
            self.scheduler.register_prefix(seq)
        return RequestOutput(seq.request_id, new, text, reason is not None, reason, seq)

    def _emit(self, seq: Sequence, tokens: list) -> tuple:
        """Append the step's tokens up to a stop condition: (new tokens, finish reason or None, text)."""
        p = seq.params
        new, reason = [], None
        for t in tokens:
            new.append(t)
            seq.tokens.append(t)
            if (t in self.eos_ids and not p.ignore_eos) or t in p.stop_token_ids:
                reason = "stop"
                break
            if seq.num_output >= p.max_tokens or len(seq.tokens) >= self.max_model_len:
                reason = "length"
                break
        text = ""
        if seq.detok is not None:
            text = self._text(seq, new, reason is not None)
            if seq.finish_reason == "stop" and reason is None:
                reason = "stop"  # a stop string matched
        return new, reason, text

    def _text(self, seq: Sequence, new: list, final: bool) -> str:
        """Text delta, honouring stop strings; holds back a suffix that may start a stop string."""
        d = seq.detok
        d.add(new)
        if final:
            d.flush()
        full = d.text
        sent = seq.sent_chars
        stops = seq.params.stop
        if stops:
            lo = max(0, sent - max(len(s) for s in stops))
            hits = [i for i in (full.find(s, lo) for s in stops) if i >= 0]
            if hits:
                cut = min(hits)
                seq.finish_reason = "stop"
                delta = full[sent:cut] if cut > sent else ""
                seq.sent_chars = max(sent, cut)
                seq.stop_text = full[:cut]
                return delta
            if not final:
                hold = 0
                for s in stops:
                    for k in range(min(len(s) - 1, len(full)), 0, -1):
                        if full.endswith(s[:k]):
                            hold = max(hold, k)
                            break
                upto = len(full) - hold
                delta = full[sent:upto] if upto > sent else ""
                seq.sent_chars = max(sent, upto)
                return delta
        seq.sent_chars = len(full)
        return full[sent:]

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        seq.finish_time = self.clock()
        self.scheduler.finish(seq)
        with self._lock:
            self.seqs.pop(seq.request_id, None)

    # convenience ---------------------------------------------------------------------------------
    def output_text(self, seq: Sequence) -> str:
        if seq.stop_text is not None:
            return seq.stop_text
        return seq.detok.text if seq.detok is not None else ""

    def generate(self, prompts: list, params, spec: SpecParams = SpecParams(), priority="interactive") -> list:
        """Run prompts (token id lists) to completion; returns their Sequences in order."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        seqs = [self.add_request(p, sp, spec, priority) for p, sp in zip(prompts, params)]
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
