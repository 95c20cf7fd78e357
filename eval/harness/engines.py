"""Engines and how they are timed: built from ``specd serve`` flags or one per speculation mode,
sharing loaded weights; their time read from the engine's public statistics, never by wrapping
its methods.

- :func:`load_pair` / :func:`load_variant`: the models, loaded once and shared by every engine.
- :func:`engine_from_flags` (exactly as ``specd serve FLAGS``) and :func:`make_engine` (one per ``Mode``).
- :class:`StepTimer` reads ``engine.timings`` (wall and engine-thread CPU seconds per stage) and the
  drafter's forward counters; :class:`StepLog` records every step (its time, the draft depth the
  policy chose, the draft tokens granted, each verified request's (depth, accepted) pair from the
  requests' own ``SpecStats``).
- :class:`PagedPrefix`: a one-sequence paged KV cache for timing a model's forward outside the engine.
"""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass

from eval.harness.stats import stats_difference


# models -----------------------------------------------------------------------------------------
def load_variant(path, quantization: str, *args, **kw):
    """``load_model`` for a benchmark's weight variant: ``Q`` (``--quantization Q``) or ``Q+a8``
    (the same weights with the CPU kernel's int8 activations, ``--act-quant int8``)."""
    from specd.model.loader import load_model
    from specd.model.quant import set_act_int8

    q, _, act = quantization.partition("+")
    if act not in ("", "a8"):
        raise SystemExit(f"unknown weight variant {quantization!r}: Q or Q+a8")
    lm = load_model(path, *args, quantization=q, **kw)
    if act == "a8" and set_act_int8(lm.model, True) == 0:
        raise SystemExit(f"{quantization}: int8 activations need quantized weights")
    return lm


def load_pair(target, draft, device: str = "cpu", dtype: str = "float32", quantization: str = "none") -> tuple:
    """``(target, draft)`` loaded once for every engine of a run: the target in ``quantization``
    (:func:`load_variant`), the draft (float weights) in the target's dtype, as ``specd serve``
    loads them (a reduced-vocabulary draft uses the target's embeddings and head rows)."""
    from specd.model.loader import load_model

    t = load_variant(target, quantization, device, dtype, progress=False)
    return t, load_model(draft, device, str(t.dtype).removeprefix("torch."), progress=False, target=t)


def kv_bytes_per_token(model) -> int:
    """KV cache bytes one token takes in a loaded model (``LoadedModel``): 2 (K, V) x layers x KV heads x head dim."""
    import torch

    c = model.config
    return 2 * c.num_layers * c.num_kv_heads * c.head_dim * torch.empty((), dtype=model.dtype).element_size()


# engines ----------------------------------------------------------------------------------------
def engine_from_flags(flags: list, target=None, draft=None, warm: bool = False):
    """An ``Engine`` configured exactly as ``specd serve FLAGS`` would configure it; ``target`` and
    ``draft`` (``LoadedModel``) share weights already loaded; ``warm``: run the server's warm-up
    (first-call costs paid, speculation totals reset afterwards)."""
    from specd.engine.engine import Engine
    from specd.options import engine_config, fill_default_models, serve_parser

    a = serve_parser().parse_args(list(flags))
    if target is None:
        fill_default_models(a)  # no --target: the built-in model (and its head), as `specd serve` does
    engine = Engine(engine_config(a), target=target, draft=draft)
    if warm:
        from specd.engine.warmup import warm_up

        warm_up(engine)
    return engine


def make_engine(
    mode,
    target,
    draft,
    device: str = "cpu",
    prefix_cache: bool = True,
    memory_bytes: int = 256 << 20,
    max_num_seqs: int = 4,
    head: str | None = None,
):
    """One Engine per speculation mode (``harness.Mode``), sharing the loaded models (``off`` gets no
    draft at all). ``prefix_cache=False``: every prompt is prefilled in full, like a peer engine
    without one. ``head``: a feature head folder as the model proposer instead of ``draft``."""
    from specd.config import CacheConfig, EngineConfig, SchedulerConfig
    from specd.engine.engine import Engine

    drafts = mode.kind not in ("off", "ngram")  # the mode uses a model proposer
    use_draft = draft if drafts and head is None else None
    cfg = EngineConfig(
        target=str(target.path),
        head=head if drafts else None,
        draft=str(draft.path) if use_draft is not None else None,
        device=device,
        spec=mode.spec_config(),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, enable_prefix_cache=prefix_cache),
        cache=CacheConfig(memory_bytes=memory_bytes),
    )
    return Engine(cfg, target=target, draft=use_draft)


class PagedPrefix:
    """A one-sequence paged KV cache of ``layers`` layers holding ``n`` rows, with room for ``extra``
    more; ``meta(w)``: attention metadata for W rows after them (``start``: after another length)."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, n: int, extra: int, dtype, dev):
        from specd.engine.kv_cache import KVCache

        self.cache = KVCache(layers, kv_heads, head_dim, (n + extra) // 16 + 2, 16, dtype, dev)
        self.seq, self.n, self.dev = self.cache.new_seq(), n, dev
        self.seq.reserve(n + extra)

    def meta(self, w: int, start: int | None = None):
        from specd.model.attention import build_metadata

        s = self.n if start is None else start
        return build_metadata([w], [s], [self.seq.blocks], self.seq.slots(s, s + w), 16, self.dev)


# timings ----------------------------------------------------------------------------------------
class StepTimer:
    """Per-stage time of one engine since ``reset()``, read from its public statistics
    (``engine.timings``: wall and engine-thread CPU seconds per stage; the drafter's forward
    count and seconds).

    ``as_dict()``: ``steps`` (engine steps that ran a batch), ``draft_forwards`` and
    ``draft_forwards_per_step``, then per clock (wall: no prefix; engine-thread CPU: ``cpu_``) the
    seconds of the whole step (``step_s``), of its stages (``schedule_s``; ``draft_s`` = proposing,
    draft forwards included; ``target_forward_s``; ``verify_s``; ``commit_s``), of the draft model's
    forwards alone (``draft_forward_s``, part of ``draft_s``), and per-step means in ms. The stages
    never add up to more than the step (the policy's bookkeeping after the stages is the rest)."""

    def __init__(self, engine):
        self.engine = engine
        self.reset()

    def _draft_totals(self) -> tuple:
        d = self.engine.drafter
        return (d.forwards, d.forward_wall, d.forward_cpu) if d is not None else (0, 0.0, 0.0)

    def reset(self) -> None:
        self.engine.timings.reset()
        self._d0 = self._draft_totals()

    def as_dict(self) -> dict:
        tm = self.engine.timings
        n_steps = max(1, tm.steps)
        nd, dwall, dcpu = (b - a for a, b in zip(self._d0, self._draft_totals()))
        d = {"steps": tm.steps, "draft_forwards": nd, "draft_forwards_per_step": nd / n_steps}
        for clock, src, dsec in (("", tm.wall, dwall), ("cpu_", tm.cpu, dcpu)):
            d[f"{clock}step_s"] = src["step"]
            d[f"{clock}schedule_s"] = src["schedule"]
            d[f"{clock}draft_s"] = src["draft"]
            d[f"{clock}target_forward_s"] = src["forward"]
            d[f"{clock}verify_s"] = src["verify"]
            d[f"{clock}commit_s"] = src["commit"]
            d[f"{clock}draft_forward_s"] = dsec
            d[f"{clock}step_ms_mean"] = 1e3 * src["step"] / n_steps
            d[f"{clock}draft_ms_per_step"] = 1e3 * src["draft"] / n_steps
            d[f"{clock}target_forward_ms_per_step"] = 1e3 * src["forward"] / n_steps
            d[f"{clock}draft_forward_ms_mean"] = 1e3 * dsec / nd if nd else 0.0
        return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in d.items()}


@dataclass(frozen=True)
class StepRow:
    """One logged engine step."""

    seconds: float  # wall time of the step
    cpu_clock: float  # the logging thread's CPU clock (thread_time) after the step: deltas = CPU per step
    depth: int  # draft depth the adaptive policy chose for the step (policy.last_depth)
    spec_budget: int  # draft tokens the scheduler granted in the step
    outputs: int  # requests that got output
    verified: tuple  # (drafted depth, accepted drafts) of each request the step verified


class StepLog:
    """Every step of one engine, from public state only: usable as an ``AsyncEngine`` listener
    (``f(outputs, seconds)``, engine thread) or to drive an engine directly (:meth:`step`,
    :meth:`generate`). A request's (depth, accepted) pair for a step is the change of its own
    ``SpecStats`` since its previous output, so the per-position acceptance is exact even when the
    tree depth varies from step to step. It also snapshots the engine-wide totals
    (``engine.stats``) when created: :meth:`engine_stats` is what the engine counted since."""

    def __init__(self, engine):
        self.engine = engine
        self.rows: list[StepRow] = []
        self._seen: dict = {}  # request id -> (steps, accepted, drafted per depth) at its last output
        self._taken = 0
        self._stats0 = copy.deepcopy(engine.stats)
        self._inner_step = None  # the engine's own step while ``follow``-ing it

    def __call__(self, outs: list, seconds: float) -> None:
        eng = self.engine
        verified = tuple(v for v in map(self._verified, outs) if v is not None)
        self.rows.append(
            StepRow(
                seconds, time.thread_time(), eng.policy.last_depth, eng.scheduler.last_spec_budget, len(outs), verified
            )
        )

    def _verified(self, out) -> tuple | None:
        seq = out.seq
        if seq is None:
            return None
        st, rid = seq.stats, seq.request_id
        steps0, acc0, drafted0 = self._seen.get(rid, (0, 0, ()))
        if seq.finished:
            self._seen.pop(rid, None)
        else:
            self._seen[rid] = (st.steps, st.accepted_tokens, tuple(st.drafted_per_depth))
        if st.steps == steps0:
            return None
        depth = sum(1 for i, n in enumerate(st.drafted_per_depth) if n > (drafted0[i] if i < len(drafted0) else 0))
        return depth, st.accepted_tokens - acc0

    def step(self) -> list:
        """One ``engine.step()``, logged; its outputs."""
        if self._inner_step is not None:  # (``follow``: the engine's step logs itself)
            return self.engine.step()
        return self._logged_step(self.engine.step)

    def _logged_step(self, step) -> list:
        t0 = time.perf_counter()
        outs = step()
        if outs:
            try:
                self(outs, time.perf_counter() - t0)
            except Exception:  # noqa: BLE001 - a log that fails never fails the step's requests
                logging.getLogger("eval").exception("StepLog failed")
        return outs

    def follow(self) -> StepLog:
        """Log every ``engine.step()`` whoever calls it, on the thread that steps (an in-process
        server's engine thread). A listener on the server's event loop would read each request's
        live statistics after later steps changed them (a hand-off can carry several steps), and the
        event loop's CPU clock instead of the engine's."""
        if self._inner_step is None:
            inner = self._inner_step = self.engine.step
            self.engine.step = lambda: self._logged_step(inner)
        return self

    def generate(self, prompt_ids: list, params, spec):
        """``Engine.generate`` for one request, every step logged; the finished ``Sequence``."""
        seq = self.engine.add_request(prompt_ids, params, spec)
        while not seq.finished:
            self.step()
        return seq

    def mark(self) -> int:
        return len(self.rows)

    def since(self, k: int) -> list[StepRow]:
        return self.rows[k:]

    def take(self) -> list:
        """The (depth, accepted) pairs verified since the previous ``take()``."""
        n = len(self.rows)  # (once: a followed engine's thread may append meanwhile)
        rows, self._taken = self.rows[self._taken : n], n
        return [v for r in rows for v in r.verified]

    def engine_stats(self):
        """``engine.stats`` minus its value when this log was created (a ``SpecStats``)."""
        return stats_difference(self.engine.stats, self._stats0)
