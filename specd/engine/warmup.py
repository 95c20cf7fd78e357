"""Pay first-call costs before a server reports ready, and measure what verification rows cost.

``seed_costs``: where a step is memory-bound (a 1-8B model on a CPU reads every weight once per step),
verifying 8 rows costs ~1.4x one row, so speculating deep pays from the first request; the engine's
cost model would only learn it by exploring widths by doubling. The warm-up times the target's forward
(with its logits) over 1, 2, 4, ... 32 rows after a short context, in the engine's policy clock,
within a time budget, and seeds ``SpecPolicy.costs`` with them (``CostModel.seed``), each priced as
the engine's measured plain step plus what the extra rows added to the forward. Only costs change:
how much is drafted, never what is accepted.

``specd serve`` does not wait for the row timings (3 s of a 1.7B model's start): ``warm_up(engine,
defer=True, cache=...)`` pays the first-call costs and measures the plain step, then either seeds at
once from the costs a previous start measured for the same model on the same CPU (``CostCache``), or
returns a ``Seeding`` that the engine loop runs in pieces of one forward while the engine is idle
(``EngineLoop(idle=...)``), after the server reports ready: until it finishes, ``auto`` prices
drafts from what it measures itself, as an unseeded engine does.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import statistics
import time
from collections.abc import Generator
from pathlib import Path

import torch

log = logging.getLogger("specd.warmup")

ROW_WIDTHS = (1, 2, 4, 8, 16, 32)  # verification rows timed at start-up
SEED_BUDGET_S = 3.0  # seconds the row timings may take (widths left are not seeded)
CONTEXT_CHUNK = 8  # rows per forward writing the timings' context (a piece of idle work is one forward)
CACHE_VERSION = 1  # part of every cost cache key: bump when what is timed changes


def warm_up(engine, seed: bool = True, defer: bool = False, cache: CostCache | None = None) -> Seeding | None:
    """A short greedy and a sampled generation: first-call costs (allocations, kernel compilation)
    are paid before the server reports ready; then (``seed``, an adaptive policy on one process)
    the row costs are measured and seeded (``seed_costs``). Speculation totals are reset afterwards.

    ``cache``: seed from the costs it holds for this engine when it has them (nothing timed), and
    keep measured ones there. ``defer``: return the row timings still to run as a ``Seeding`` (None
    when there are none) instead of running them now."""
    from specd.engine.sequence import SpecStats
    from specd.sampling.params import SamplingParams

    tok = engine.tokenizer
    ids = list(tok("Hello")["input_ids"]) if tok is not None else [0]
    ids = ids or [0]
    engine.generate(
        [ids, ids],
        [
            SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
            SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True, seed=0),
        ],
    )
    seeding = None
    if seed and engine.policy.spec.adaptive and engine.tp is None:
        seeding = start_seeding(engine, ids, cache=cache)
    engine.stats = SpecStats()
    engine.num_steps = 0
    if seeding is not None and not defer:
        seeding.run()
        return None
    return seeding


def seed_costs(engine, ids: list, widths=ROW_WIDTHS, budget_s: float = SEED_BUDGET_S) -> dict:
    """Measure a batch-1 plain step through the engine and the target's forward over ``widths``
    rows (``row_costs``), and seed the engine's cost model: W rows cost the plain step plus
    ``forward(W) - forward(1)``. Returns the seeded {rows: seconds} (empty when fewer than three
    widths fit in ``budget_s``)."""
    seeding = start_seeding(engine, ids, widths, budget_s)
    return seeding.run() if seeding is not None else {}


def start_seeding(
    engine, ids: list, widths=ROW_WIDTHS, budget_s: float = SEED_BUDGET_S, cache: CostCache | None = None
) -> Seeding | None:
    """Measure the batch-1 plain step through the engine (a short generation without drafts), then
    seed at once from ``cache`` where it has this engine's row costs (None returned), else return
    the ``Seeding`` that times the rows (None also when no plain step was measured)."""
    from specd.sampling.params import SamplingParams
    from specd.speculation.request import SpecParams

    engine.generate([ids], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), SpecParams(mode="off"))
    costs = engine.policy.costs
    costs.at_context(0)
    plain = costs.plain_cost(1)
    if plain is None:
        return None
    seeding = Seeding(engine, plain, widths, budget_s, cache)
    if cache is not None:
        fwd = cache.get()
        if fwd is not None:
            seeding.finish(fwd, cached=True)
            return None
    return seeding


class Seeding:
    """The row timings of ``seed_costs`` still to run, one forward per ``step()`` (the engine loop
    calls it while the engine is idle, so a request that arrives waits for one forward at most),
    then the engine's cost model seeded (``finish``) and the timings kept in the ``CostCache``.
    Only the target's forward over a scratch KV cache runs: the engine's caches, requests and
    statistics are not touched."""

    def __init__(self, engine, plain: float, widths, budget_s: float, cache: CostCache | None = None):
        self.engine, self.plain, self.cache = engine, plain, cache
        self.widths, self.budget_s = tuple(widths), budget_s
        self.seeded: dict | None = None  # {rows: seconds} once finished ({} when too few widths fit)
        self._timings: Generator[None, None, dict] | None = None  # (started by the first step)

    def step(self) -> bool:
        """Run the next forward; False once every timing has run and the costs are seeded."""
        if self._timings is None:
            e = self.engine
            model, kv_dtype = e.target.model, e.cache.kv.dtype
            self._timings = row_timings(model, kv_dtype, e.backend, self.widths, budget_s=self.budget_s)
        try:
            next(self._timings)
            return True
        except StopIteration as done:
            self.finish(done.value)
            return False

    def run(self) -> dict:
        """Every timing left, now; the seeded costs."""
        while self.step():
            pass
        assert self.seeded is not None
        return self.seeded

    def finish(self, fwd: dict, cached: bool = False) -> dict:
        """Seed the engine's cost model from row timings ``fwd`` ({rows: seconds}): W rows cost the
        plain step plus ``fwd[W] - fwd[1]``; timings measured here go into the cache."""
        self.seeded = {}
        if len(fwd) < 3 or 1 not in fwd:
            return self.seeded
        self.seeded = {w: self.plain + max(0.0, s - fwd[1]) for w, s in fwd.items()}
        self.engine.policy.costs.seed(1, self.seeded)
        if self.cache is not None and not cached:
            self.cache.put(fwd)
        widths = {str(w): round(s * 1e3, 3) for w, s in fwd.items()}
        log.info("row costs seeded", extra={"fields": {"cached": cached, "plain_ms": round(self.plain * 1e3, 3),
                                                        "forward_ms": widths}})  # fmt: skip
        return self.seeded


def row_costs(
    model, kv_dtype, backend, widths=ROW_WIDTHS, context: int = 32, reps: int = 3, budget_s: float | None = None,
    clock=None,
) -> dict:  # fmt: skip
    """{W: seconds} of one forward of ``model`` (a ``LlamaModel``) with its logits over W rows after
    ``context`` tokens (random ids; the median of ``reps`` after one untimed call) in a scratch KV
    cache of ``kv_dtype``; ``clock``: default the engine's on this device (this thread's CPU time
    on a CPU, wall time with a synchronize on a GPU). Widths are timed in order while ``budget_s``
    allows (in ``clock`` seconds): a width whose timing would overrun it (priced from the last one, in
    proportion to the rows) is not started, so the warm-up stays within its budget (it took 5.1 s
    of a 3 s one at 1.7B)."""
    timings = row_timings(model, kv_dtype, backend, widths, context, reps, budget_s, clock)
    while True:
        try:
            next(timings)
        except StopIteration as done:
            return done.value


def row_timings(
    model, kv_dtype, backend, widths=ROW_WIDTHS, context: int = 32, reps: int = 3, budget_s: float | None = None,
    clock=None,
) -> Generator[None, None, dict]:  # fmt: skip
    """``row_costs`` as a generator that yields after each forward and returns the timings (the
    context written ``CONTEXT_CHUNK`` rows per forward); the budget counts the forwards' own time in
    ``clock`` (a CPU's: this thread's CPU time, so neither the pauses between pieces nor other
    processes on the core count)."""
    from specd.engine.kv_cache import KVCache
    from specd.model.attention import build_metadata

    c, dev = model.cfg, next(iter(model.buffers())).device
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    clock = clock or (time.thread_time if dev.type == "cpu" else time.perf_counter)
    bs, n = 16, context + max(widths)
    cache = KVCache(c.num_layers, c.num_kv_heads, c.head_dim, -(-n // bs) + 1, bs, kv_dtype, dev)
    seq = cache.new_seq()
    seq.reserve(n)
    gen = torch.Generator().manual_seed(0)

    def forward(w: int, start: int) -> None:
        with torch.inference_mode():
            ids = torch.randint(0, c.vocab_size, (w,), generator=gen).to(dev)
            meta = build_metadata([w], [start], [seq.blocks], seq.slots(start, start + w), bs, dev)
            model.compute_logits(model(ids, torch.arange(start, start + w, device=dev), cache.kv, meta, backend))
            sync()

    for start in range(0, context, CONTEXT_CHUNK):  # (in chunks: each is one short piece)
        forward(min(CONTEXT_CHUNK, context - start), start)
        yield
    out, spent, budget = {}, 0.0, budget_s if budget_s is not None else float("inf")
    last = None  # (rows, clock seconds) of the last width's timing
    for w in widths:
        if last is not None and spent + last[1] * w / last[0] > budget:
            break  # (timing w would overrun the budget: a forward costs at most in proportion to its rows)
        times = []
        for _ in range(reps + 1):
            t = clock()
            forward(w, context)
            times.append(clock() - t)
            yield
        spent += sum(times)
        out[w] = statistics.median(times[1:])
        last = (w, sum(times))
    return out


class CostCache:
    """Row timings kept per model and machine in ``$SPECD_CACHE_DIR/row-costs/`` (one JSON file per
    checkpoint path, ``cost_cache_file``), so that a server's later starts seed its cost model at
    once. An entry's key holds what the timings depend on: the checkpoint's files (size and mtime:
    a changed file is measured again), the CPU (model and flags), the threads, the CPU kernel's
    build (its source hash), torch's version, the model's and KV cache's dtypes,
    activation quantization, the device, the widths, budget and ``CACHE_VERSION``. A cached
    timing only prices drafts: a stale one costs speed until the engine's own measurements
    replace it, never a different token."""

    def __init__(self, path: Path, key: str):
        self.path, self.key = path, key

    @classmethod
    def for_engine(cls, engine, target, widths=ROW_WIDTHS, budget_s: float = SEED_BUDGET_S) -> CostCache | None:
        """The cache of ``engine``'s row timings; None for a tensor-parallel engine (``warm_up`` seeds
        none: its target is the ranks' ``ShardedTarget``, no module to key)."""
        if engine.tp is not None:
            return None
        return cls(cost_cache_file(target), engine_key(engine, target, widths, budget_s))

    def _entries(self) -> dict:
        try:
            got = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return got if isinstance(got, dict) else {}

    def get(self) -> dict | None:
        """{rows: seconds} kept for this key, else None (also for a damaged entry)."""
        entry = self._entries().get(self.key)
        try:
            fwd = {int(w): float(s) for w, s in entry.items()}  # type: ignore[union-attr]
        except (AttributeError, TypeError, ValueError):
            return None
        return fwd if fwd and all(s > 0 for s in fwd.values()) else None

    def put(self, fwd: dict) -> None:
        """Keep ``fwd`` under this key (beside other machines' and settings' entries; written to a
        temporary file renamed into place, so a reader never sees half a file)."""
        entries = self._entries()
        entries[self.key] = {str(w): s for w, s in sorted(fwd.items())}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}")
            tmp.write_text(json.dumps(entries, indent=1) + "\n")
            tmp.replace(self.path)
        except OSError as e:
            log.warning("could not keep the row costs in %s (%s)", self.path, e.strerror or e)


def cost_cache_file(target) -> Path:
    """Where ``CostCache`` keeps a checkpoint's row timings: ``row-costs/<name>-<path hash>.json`` in
    the model cache."""
    from specd.model.errors import cache_dir

    path = Path(target).resolve()
    where = hashlib.sha256(str(path).encode()).hexdigest()[:10]
    return cache_dir() / "row-costs" / f"{path.stem if path.is_file() else path.name}-{where}.json"


def _files_state(target) -> list:
    """(name, size, mtime) of the checkpoint's files: the GGUF file, or a folder's config.json and
    weights."""
    path = Path(target).resolve()
    files = [path] if path.is_file() else sorted([path / "config.json", *path.glob("*.safetensors")])
    out = []
    for f in files:
        try:
            st = f.stat()
        except OSError:
            continue
        out.append((f.name, st.st_size, st.st_mtime_ns))
    return out


def _kernel_build(engine) -> str | None:
    """The CPU kernel's library file (named by its source hash) where the target runs on a CPU."""
    from specd.model.qkernel import kernel

    lib = kernel() if engine.target.device.type == "cpu" else None
    return Path(lib._name).name if lib is not None else None


def engine_key(engine, target, widths=ROW_WIDTHS, budget_s: float = SEED_BUDGET_S) -> str:
    """The ``CostCache`` key of ``engine``'s row timings on this machine (see ``CostCache``)."""
    from specd.model.cpu import cpu_info

    model = engine.target.model
    info = cpu_info()
    parts = {
        "version": CACHE_VERSION,
        "files": _files_state(target),
        "cpu": info["model"],
        "flags": hashlib.sha256(" ".join(sorted(info["flags"])).encode()).hexdigest()[:12],
        "threads": torch.get_num_threads(),
        "kernel": _kernel_build(engine),
        "torch": torch.__version__,
        "device": str(engine.target.device),
        "dtype": str(engine.target.dtype),
        "kv": str(engine.cache.kv.dtype),
        "act_int8": any(getattr(m, "act_int8", False) for m in model.modules()),
        "quantized": bool(model.quantized()),
        "widths": list(widths),
        "budget": budget_s,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]
