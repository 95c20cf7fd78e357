"""A step captured as graphs at bucketed widths: static buffers, padding, eager fallback, a memory bound.

On a GPU a small model's step is launch overhead (docs/benchmarks.md, "First runs on a GPU": a
12.3 ms plain step against a 0.063 ms bandwidth floor). A CUDA graph replays a step's hundreds of
launches as one. A graph replays fixed addresses and shapes, so :class:`GraphRunner` keeps one set
of static input buffers per *bucket* (batch rows x tokens, causal or tree-masked), copies a step's
inputs into the smallest bucket that holds them, pads the rest, replays, and hands back the real
rows of the static output. Steps wider than every bucket run eagerly.

Interface (the engine calls it; nothing here knows the engine)::

    def step(inp: StepInputs) -> torch.Tensor:        # rows per token: [T, ...] (or a tuple of them)
        meta = inp.to_metadata(block_size)             # fresh each call (backends cache per step in it)
        return model.forward(inp.input_ids, inp.positions, kv, meta, backend)

    runner = GraphRunner(step, GraphConfig(buckets=default_buckets(32, 512), max_blocks=...,
                         block_size=16, max_region=33, pool_bytes=2 << 30), device)
    runner.capture()                                   # at start-up; the log line: runner.describe()
    hidden = runner.run(StepInputs(...))               # [T, d]: valid until a graph of the pool replays
    runner.stats()                                     # counters for /metrics

Contracts:

* **Padding.** Padded tokens sit past ``query_start_loc[B]`` (padded requests have no tokens,
  context 0, a zero block-table row), with token id 0, position 0 and slot ``pad_slot`` (-1: the
  Triton KV write skips it; a backend that cannot skip needs a reserved slot). The closure must
  keep rows independent and tolerate rows past the last request: the Triton tree attention leaves
  them unwritten and ``specd_kernels.batch_invariant.attention`` writes zeros; the torch reference
  backend does not take them (it runs eagerly: CPU engines need no graphs). Padded tree-mask rows
  and columns are False; padded block-table columns 0.
* **Host values.** A graph bakes in every host value the closure reads at capture. At capture the
  inputs' ``max_query_len`` is the bucket's token count and ``max_seq_len`` is ``max_blocks *
  block_size``, so launch grids cover any step the bucket takes; anything else the closure
  computes on the host is frozen (use device tensors).
* **Outputs** are views of the graph's static output: read or copy them before any graph of the
  same memory pool replays (a runner's next :meth:`GraphRunner.run`, or another runner's: the
  engine's runners share one pool, and a replay may reuse another graph's output memory).
* **Memory.** Buckets are captured smallest first; a bucket whose static buffers and graph would
  take the total past ``pool_bytes`` is refused (with every larger bucket): those widths run
  eagerly, and ``stats()`` counts them.

The engine (``specd.engine.step_graphs``) uses it through :class:`GraphedModel` (the target: one
runner per forward variant behind the model's own call signature) and ``Drafter.graphs`` (the draft
model, or the feature head whose hidden inputs travel as ``StepInputs.rows``, padded with zeros).

On CUDA the graph is ``torch.cuda.CUDAGraph`` (two warm-up runs on a side stream compile the
Triton kernels first). Elsewhere :class:`RecordedGraph` stands in: it records the closure at
capture and replays the same closure on the same static buffers, copying into the same output
tensors, so bucketing, padding and buffer reuse are tested on a CPU; only the capture itself needs
a device.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from dataclasses import dataclass, fields

import torch

from specd.model import invariant
from specd.model.attention import AttentionMetadata

BucketKey = tuple  # (batch rows, tokens, masked)


def default_buckets(max_batch: int, max_tokens: int) -> tuple:
    """(batch, tokens) pairs: batch 1, 2, 4, ... up to ``max_batch``; for each, tokens from the
    batch (a decode step) doubling up to ``max_tokens`` (verification trees, chunks)."""
    out = []
    b = 1
    while b <= max_batch:
        t = b
        while t <= max_tokens:
            out.append((b, t))
            t *= 2
        b *= 2
    return tuple(out)


@dataclass(frozen=True)
class GraphConfig:
    """What to capture: ``buckets`` (batch rows, tokens) pairs; block tables ``max_blocks`` columns
    wide (of ``block_size`` slots); tree masks ``max_region`` columns (0: causal graphs only);
    ``masked``: the mask variants to capture; ``pool_bytes``: the bound on static buffers + graphs;
    ``pad_slot``: the KV slot padded tokens write (-1: none); ``row_width`` / ``row_dtype``: the
    per-token float input of a step that takes one (``StepInputs.rows``; 0: none)."""

    buckets: tuple
    max_blocks: int
    block_size: int
    max_region: int = 0
    pool_bytes: int = 1 << 30
    pad_slot: int = -1
    masked: tuple = (False, True)
    row_width: int = 0
    row_dtype: torch.dtype = torch.float32

    def __post_init__(self):
        for b, t in self.buckets:
            if not (isinstance(b, int) and isinstance(t, int) and 1 <= b <= t):
                raise ValueError(f"a bucket is (batch, tokens) with 1 <= batch <= tokens, got {(b, t)}")
        if self.max_blocks < 1 or self.block_size < 1 or min(self.max_region, self.pool_bytes, self.row_width) < 0:
            raise ValueError("max_blocks and block_size must be >= 1, max_region, pool_bytes and row_width >= 0")
        if not set(self.masked) <= {False, True}:
            raise ValueError(f"masked holds False (causal) and/or True (tree masks), got {self.masked}")

    def keys(self) -> list:
        """Every bucket to capture, smallest first (tokens, then batch; causal before masked). No
        masked bucket of one token per request (a tree has several: such steps pad to the next one)."""
        variants = [m for m in (False, True) if m in self.masked and (not m or self.max_region > 0)]
        keys = [(b, t, m) for b, t in self.buckets for m in variants if not (m and t == b)]
        return sorted(keys, key=lambda k: (k[1], k[0], k[2]))


@dataclass(frozen=True)
class StepInputs:
    """One step's inputs in the model's terms (``specd.model.attention.AttentionMetadata``'s tensors
    plus the tokens); ``max_query_len`` / ``max_seq_len`` are host ints that size launch grids."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64
    query_start_loc: torch.Tensor  # [B + 1] int32
    context_lens: torch.Tensor  # [B] int32
    seq_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, W] int32
    tree_mask: torch.Tensor | None  # [T, R] bool, None = causal
    max_query_len: int
    max_seq_len: int
    rows: torch.Tensor | None = None  # [T, d] per-token float input (a feature head's hidden input), or None

    @classmethod
    def of(cls, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, rows=None) -> StepInputs:
        """A model call's inputs (tokens, positions, its attention metadata and any per-token rows)."""
        return cls(input_ids, positions, meta.slot_mapping, meta.query_start_loc, meta.context_lens, meta.seq_lens,
                   meta.block_tables, meta.tree_mask, meta.max_query_len, meta.max_seq_len, rows)  # fmt: skip

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_seqs(self) -> int:
        return self.context_lens.shape[0]

    def to_metadata(self, block_size: int, host: bool = False) -> AttentionMetadata:
        """The attention metadata over these tensors (no copies). ``host``: also the per-sequence host
        lists the torch reference backend plans with (a device sync; eager steps only)."""
        lists = {}
        if host:
            qsl = self.query_start_loc.tolist()
            lists = dict(
                query_lens_host=[b - a for a, b in zip(qsl, qsl[1:])],
                context_lens_host=self.context_lens.tolist(),
                seq_lens_host=self.seq_lens.tolist(),
            )
        return AttentionMetadata(self.query_start_loc, self.context_lens, self.seq_lens, self.block_tables,
                                 self.slot_mapping, self.tree_mask, self.max_query_len, self.max_seq_len,
                                 block_size, **lists)  # fmt: skip

    def tensors(self) -> list:
        return [getattr(self, f.name) for f in fields(self) if isinstance(getattr(self, f.name), torch.Tensor)]


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    return sum(_nbytes(t) for t in x) if isinstance(x, (tuple, list)) else 0


def static_inputs(key: BucketKey, cfg: GraphConfig, device) -> StepInputs:
    """The static buffers of bucket ``key``, holding an all-padding step."""
    B, T, masked = key
    i64, i32 = dict(dtype=torch.int64, device=device), dict(dtype=torch.int32, device=device)
    return StepInputs(
        input_ids=torch.zeros(T, **i64),
        positions=torch.zeros(T, **i64),
        slot_mapping=torch.full((T,), cfg.pad_slot, **i64),
        query_start_loc=torch.zeros(B + 1, **i32),
        context_lens=torch.zeros(B, **i32),
        seq_lens=torch.zeros(B, **i32),
        block_tables=torch.zeros(B, cfg.max_blocks, **i32),
        tree_mask=torch.zeros(T, cfg.max_region, dtype=torch.bool, device=device) if masked else None,
        max_query_len=T,
        max_seq_len=cfg.max_blocks * cfg.block_size,
        rows=torch.zeros(T, cfg.row_width, dtype=cfg.row_dtype, device=device) if cfg.row_width else None,
    )


def fill(static: StepInputs, inp: StepInputs, pad_slot: int) -> None:
    """Copy ``inp`` into the front of ``static`` and reset the rest to padding (see the module doc)."""
    T, B = inp.num_tokens, inp.num_seqs
    W = inp.block_tables.shape[1]
    for name, pad in (("input_ids", 0), ("positions", 0), ("slot_mapping", pad_slot)):
        dst = getattr(static, name)
        dst[:T].copy_(getattr(inp, name), non_blocking=True)
        dst[T:].fill_(pad)
    static.query_start_loc[: B + 1].copy_(inp.query_start_loc, non_blocking=True)
    static.query_start_loc[B + 1 :].fill_(T)  # padded requests: no tokens
    for name in ("context_lens", "seq_lens"):
        getattr(static, name)[:B].copy_(getattr(inp, name), non_blocking=True)
        getattr(static, name)[B:].zero_()
    static.block_tables[:B, :W].copy_(inp.block_tables, non_blocking=True)
    static.block_tables[:B, W:].zero_()
    static.block_tables[B:].zero_()
    if static.tree_mask is not None:
        static.tree_mask.zero_()
        if inp.tree_mask is not None:
            static.tree_mask[:T, : inp.tree_mask.shape[1]].copy_(inp.tree_mask, non_blocking=True)
    if static.rows is not None and inp.rows is not None:
        static.rows[:T].copy_(inp.rows, non_blocking=True)
        static.rows[T:].zero_()


class RecordedGraph:
    """The CPU stand-in of ``torch.cuda.CUDAGraph``: capture runs and records the closure; replay runs
    the same closure again on the same static buffers and copies its result into the captured output
    tensors (a CUDA graph writes the same addresses)."""

    kind = "recorded"

    def __init__(self):
        self._fn = self._out = None
        self.nbytes = 0

    def capture(self, fn):
        self._fn = fn
        self._out = fn()
        self.nbytes = _nbytes(self._out)
        return self._out

    def replay(self) -> None:
        new = self._fn()
        outs = (self._out,) if isinstance(self._out, torch.Tensor) else self._out
        news = (new,) if isinstance(new, torch.Tensor) else new
        for dst, src in zip(outs, news, strict=True):
            with torch.inference_mode(dst.is_inference()):  # (a forward under inference_mode made it)
                dst.copy_(src)


class CudaGraph:
    """``torch.cuda.CUDAGraph`` in a shared memory pool; ``nbytes``: the memory its capture reserved."""

    kind = "cuda"

    def __init__(self, device, pool, warmup: int = 2):
        self.device, self.pool, self.warmup = torch.device(device), pool, warmup
        self.graph = None
        self.nbytes = 0

    def capture(self, fn):
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):  # compiles Triton kernels and sets up cuBLAS outside the capture
            for _ in range(self.warmup):
                fn()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        before = torch.cuda.memory_reserved(self.device)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=self.pool):
            out = fn()
        self.nbytes = torch.cuda.memory_reserved(self.device) - before
        return out

    def replay(self) -> None:
        self.graph.replay()


def graph_factory(device):
    """A zero-argument constructor of the device's graphs: CUDA graphs in one shared pool, else the
    stand-in."""
    device = torch.device(device)
    if device.type == "cuda":
        pool = torch.cuda.graph_pool_handle()
        return lambda: CudaGraph(device, pool)
    return RecordedGraph


@dataclass
class _Captured:
    static: StepInputs
    graph: object
    out: object  # the static output: a tensor [T, ...] or a tuple of them
    nbytes: int


class GraphRunner:
    """``step`` captured per bucket of ``cfg`` on ``device`` (see the module doc)."""

    def __init__(self, step, cfg: GraphConfig, device, make_graph=None):
        self.step, self.cfg, self.device = step, cfg, torch.device(device)
        self.make_graph = make_graph or graph_factory(self.device)
        self.graphs: dict = {}  # BucketKey -> _Captured
        self.refused: list = []
        self.used_bytes = 0
        self.capture_s = 0.0
        self.replays: Counter = Counter()
        self.eager_steps = 0
        self.padded_tokens = 0

    def capture(self) -> None:
        """Capture every bucket, smallest first, until the memory bound refuses one (then the rest)."""
        t0 = time.perf_counter()
        keys = self.cfg.keys()
        for i, key in enumerate(keys):
            static = static_inputs(key, self.cfg, self.device)
            buf = sum(_nbytes(t) for t in static.tensors())
            if self.used_bytes + buf > self.cfg.pool_bytes:
                self.refused = keys[i:]
                break
            graph = self.make_graph()
            out = graph.capture(lambda s=static: self.step(s))
            if self.used_bytes + buf + graph.nbytes > self.cfg.pool_bytes:
                del graph, out
                self.refused = keys[i:]
                break
            self.graphs[key] = _Captured(static, graph, out, buf + graph.nbytes)
            self.used_bytes += buf + graph.nbytes
        if self.device.type == "cuda" and self.refused:
            torch.cuda.empty_cache()
        self.capture_s = time.perf_counter() - t0

    def bucket_for(self, inp: StepInputs) -> BucketKey | None:
        """The smallest captured bucket that holds ``inp`` (its rows, tokens, block-table and mask
        widths), or None."""
        masked = inp.tree_mask is not None
        if inp.block_tables.shape[1] > self.cfg.max_blocks:
            return None
        if (inp.rows.shape[1] if inp.rows is not None else 0) != self.cfg.row_width:
            return None
        if masked and inp.tree_mask.shape[1] > self.cfg.max_region:
            return None
        for key in self.graphs:  # in capture order: smallest first
            if key[2] == masked and key[0] >= inp.num_seqs and key[1] >= inp.num_tokens:
                return key
        return None

    def run(self, inp: StepInputs):
        """The step's output rows [T, ...] (or a tuple): a graph replay when a bucket holds the step,
        else the closure run eagerly on ``inp``."""
        key = self.bucket_for(inp)
        if key is None:
            self.eager_steps += 1
            return self.step(inp)
        cap = self.graphs[key]
        fill(cap.static, inp, self.cfg.pad_slot)
        cap.graph.replay()
        self.replays[key] += 1
        T = inp.num_tokens
        self.padded_tokens += key[1] - T
        return cap.out[:T] if isinstance(cap.out, torch.Tensor) else tuple(o[:T] for o in cap.out)

    def static_output(self, key: BucketKey):
        """The static output tensors of a captured bucket (what :meth:`run` returns views of)."""
        return self.graphs[key].out

    def stats(self) -> dict:
        """Counters for the log and /metrics (flat numbers) plus replays per bucket."""
        return {
            "graphs": len(self.graphs),
            "refused": len(self.refused),
            "memory_bytes": self.used_bytes,
            "pool_bytes": self.cfg.pool_bytes,
            "capture_s": round(self.capture_s, 3),
            "replays": sum(self.replays.values()),
            "eager_steps": self.eager_steps,
            "padded_tokens": self.padded_tokens,
            "by_bucket": {_name(k): n for k, n in self.replays.items()},
        }

    def describe(self) -> str:
        """One log line: what was captured, in how long, in how much memory, what was refused."""
        keys = list(self.graphs)
        span = "" if not keys else f" ({_name(keys[0])}{f' .. {_name(keys[-1])}' if len(keys) > 1 else ''})"
        kind = next(iter(self.graphs.values())).graph.kind if keys else "none"
        refused = f"; {len(self.refused)} refused by the memory bound (eager)" if self.refused else ""
        return (
            f"graphs ({kind}): {len(keys)} captured{span} in {self.capture_s:.2f} s, "
            f"{self.used_bytes / 2**20:.1f} of {self.cfg.pool_bytes / 2**20:.0f} MiB{refused}"
        )


def _name(key: BucketKey) -> str:
    return f"{key[0]}x{key[1]}{'+mask' if key[2] else ''}"


def invariant_tiles(ops):
    """The context a forward with ``ops`` runs in: the quantized GEMMs' fixed tiles
    (``specd_kernels.woq.fixed_tiles``) when ``ops`` are enabled (batch-invariant), else nothing."""
    if ops is None or not ops.enabled:
        return contextlib.nullcontext()
    from specd_kernels.woq import fixed_tiles

    return fixed_tiles(True)


class GraphedModel:
    """A target model whose forward goes through :class:`GraphRunner` s: one runner per forward variant
    (the ops it runs, ``specd.model.invariant``, and the layers whose inputs it captures), each bound
    to the engine's KV cache and attention backend. A call that matches a captured variant replays
    (or falls back eagerly outside its buckets); any other call (another cache, backend or variant)
    runs the model eagerly. Everything else (``compute_logits``, ``cfg``, ...) is the model's.

    The returned rows, and captured features, are views of a graph's static output: valid until any
    graph of the pool replays (the target pass indexes or copies them at once)."""

    def __init__(self, model, kv: torch.Tensor, backend, block_size: int):
        self.model, self.kv, self.backend, self.block_size = model, kv, backend, block_size
        self.runners: dict = {}  # (InvariantOps, capture layers) -> GraphRunner

    def closure(self, ops, layers: tuple):
        """The step a graph captures: the forward over the static inputs with ``ops``, returning the
        hidden rows [T, d] (then the features entering each of ``layers``, when there are any)."""

        def step(inp: StepInputs):
            caps = dict.fromkeys(layers) if layers else None
            meta = inp.to_metadata(self.block_size)
            with invariant_tiles(ops):  # (a graph bakes in the tiles its capture launched)
                h = self.model(inp.input_ids, inp.positions, self.kv, meta, self.backend, capture=caps, ops=ops)
            return (h, *(caps[i] for i in layers)) if caps is not None else h

        return step

    def add(self, ops, layers: tuple, cfg: GraphConfig, make_graph=None) -> GraphRunner:
        """Capture the variant (``ops``, ``layers``) at ``cfg``'s buckets; returns its runner."""
        runner = GraphRunner(self.closure(ops, tuple(layers)), cfg, self.kv.device, make_graph)
        runner.capture()
        self.runners[(ops, tuple(layers))] = runner
        return runner

    def __call__(self, input_ids, positions, kv, meta, backend=None, capture: dict | None = None, ops=None):
        kw = {} if ops is None else {"ops": ops}
        layers = tuple(capture) if capture else ()
        runner = self.runners.get((ops if ops is not None else invariant.OFF, layers))
        if runner is None or kv is not self.kv or (backend is not None and backend is not self.backend):
            return self.model(input_ids, positions, kv, meta, backend, capture=capture, **kw)
        out = runner.run(StepInputs.of(input_ids, positions, meta))
        if not layers:
            return out
        for i, f in zip(layers, out[1:]):
            capture[i] = f
        return out[0]

    def compute_logits(self, hidden: torch.Tensor, **kw) -> torch.Tensor:
        return self.model.compute_logits(hidden, **kw)

    def __getattr__(self, name: str):
        if name == "model":  # (not set yet: unpickling, or __init__ not run)
            raise AttributeError(name)
        return getattr(self.model, name)


def merged_stats(runners) -> dict:
    """The flat counters of several runners summed (``by_bucket`` merged), for the log and /metrics."""
    out: dict = {"graphs": 0, "refused": 0, "memory_bytes": 0, "capture_s": 0.0, "replays": 0, "eager_steps": 0,
                 "padded_tokens": 0, "by_bucket": {}}  # fmt: skip
    for r in runners:
        s = r.stats()
        for k in out:
            if k == "by_bucket":
                for b, n in s[k].items():
                    out[k][b] = out[k].get(b, 0) + n
            else:
                out[k] += s[k]
    out["capture_s"] = round(out["capture_s"], 3)
    return out
