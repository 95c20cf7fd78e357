"""The engine's CUDA graphs (``--cuda-graphs``, ``EngineConfig.cuda_graphs``): which forwards are
captured, at which buckets, in how much memory; called by the builder once the KV caches exist.

- **Target**: the model is wrapped in a ``specd.model.graphs.GraphedModel`` (the engine's
  ``target.model``), with one ``GraphRunner`` per forward variant the engine's target pass can ask
  for: the ops of ``stages.step_ops_kwargs`` (``--batch-invariant auto`` on CUDA: the invariant
  kernels for steps with a greedy row, cuBLAS for the others: both captured) and the feature head's
  capture layers. Buckets: (batch, tokens) from ``default_buckets(16, 256)`` (bounded by the
  scheduler's limits), causal and tree-masked, block tables of contexts up to ``GRAPH_MAX_CONTEXT``.
- **Draft model / feature head**: ``Drafter.graphs``, a runner over ``Drafter.graph_step`` (catch-up
  rows and tree levels: up to ``DRAFT_MAX_TOKENS`` rows; the head's hidden inputs as
  ``StepInputs.rows``).
- **Memory**: all graphs share one pool; the runners are captured one after the other within one
  budget (``GRAPH_POOL_BYTES``, at most half the device memory left after the KV caches), each
  refusing the buckets that would not fit (those widths run eagerly).

``auto``: on where they can run (CUDA, the ``triton`` attention backend, one process, a Llama-family
forward whose attention never falls back to the torch reference); ``on`` refuses to start elsewhere
(``LoadError``); ``off``: eager. A CPU engine never takes graphs; tests set ``STAND_IN`` to the CPU
stand-in (``specd.model.graphs.RecordedGraph``), which lets a CPU engine on the interpreted Triton
backend capture and replay through the same code.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from specd.engine.stages import step_ops_kwargs
from specd.model.graphs import GraphConfig, GraphedModel, GraphRunner, default_buckets, graph_factory, merged_stats
from specd.model.llama import LlamaModel
from specd.model.loader import LoadError

log = logging.getLogger("specd.engine")

GRAPH_MAX_BATCH = 16  # requests per captured step
GRAPH_MAX_TOKENS = 256  # tokens per captured target step (trees, short chunks)
DRAFT_MAX_TOKENS = 64  # rows per captured draft forward (catch-up rows, tree levels)
GRAPH_MAX_CONTEXT = 8192  # block tables captured for contexts up to this many tokens (longer: eager)
GRAPH_POOL_BYTES = 2 << 30  # static buffers + graphs, all runners together
GRAPH_POOL_SHARE = 0.5  # at most this share of the device memory free after the KV caches
STAND_IN = None  # tests: a graph class that lets a CPU engine capture (specd.model.graphs.RecordedGraph)


@dataclass
class StepGraphs:
    """The engine's captured forwards: the target's (a ``GraphedModel``) and the proposer's runner."""

    target: GraphedModel | None
    draft: GraphRunner | None

    def describe(self) -> list:
        """One log line per runner."""
        lines = []
        if self.target is not None:
            for (ops, layers), r in self.target.runners.items():
                what = f"target ({'invariant' if ops.enabled else 'default'} ops{', features' if layers else ''})"
                lines.append(f"{what} {r.describe()}")
        if self.draft is not None:
            lines.append(f"draft {self.draft.describe()}")
        return lines


def graph_stats(engine) -> dict:
    """``{"target": ..., "draft": ...}`` counters (``specd.model.graphs.merged_stats``) of an engine's
    captured forwards; {} without graphs (what ``/metrics`` reads through the engine snapshot)."""
    out = {}
    target_model, drafter = getattr(getattr(engine, "target", None), "model", None), getattr(engine, "drafter", None)
    if isinstance(target_model, GraphedModel) and target_model.runners:
        out["target"] = merged_stats(target_model.runners.values())
    runner = getattr(drafter, "graphs", None)
    if runner is not None:
        out["draft"] = merged_stats([runner])
    return out


def device_refusal(device: torch.device, backend) -> str | None:
    """Why no forward can be captured on ``device`` with ``backend``, or None."""
    if device.type != "cuda" and STAND_IN is None:
        return f"they need a CUDA device (this engine runs on {device.type})"
    if getattr(backend, "name", None) != "triton":
        return f"they need the triton attention backend (not {getattr(backend, 'name', backend)})"
    return None


def refusal(model, device: torch.device, backend, tp) -> str | None:
    """Why ``model``'s forward cannot be captured here, or None."""
    why = device_refusal(device, backend)
    if why is not None:
        return why
    if tp is not None:
        return "tensor-parallel ranks run eagerly"
    if not isinstance(model, LlamaModel):
        return f"{type(model).__name__} has no captured forward"
    cfg = model.cfg
    if any(w is not None for w in model.windows) or cfg.attn_softcap is not None:
        return "sliding windows and soft-capped attention run the torch reference attention (host-planned)"
    if getattr(cfg, "num_experts", 0):
        return "mixture-of-experts layers route on the host"
    return None


def setup(cfg, target, cache, backend, drafter, tp, max_len: int) -> StepGraphs | None:
    """Capture the engine's forwards as ``cfg.cuda_graphs`` says (see the module doc); None: eager.
    Logs one line per runner."""
    if cfg.cuda_graphs == "off":
        return None
    why = refusal(target.model, target.device, backend, tp)
    if why is not None:
        if cfg.cuda_graphs == "on":
            raise LoadError(f"--cuda-graphs on: {why} (use --cuda-graphs auto or off)")
        return None
    device = target.device
    make_graph = STAND_IN or graph_factory(device)  # (one pool for every runner)
    budget = pool_budget(device)
    graphed = GraphedModel(target.model, cache.kv, backend, cache.block_size)
    layers = tuple(getattr(drafter, "capture", None) or ())
    for ops in op_variants(target.model, device, cfg.batch_invariant):
        budget -= graphed.add(ops, layers, target_config(cfg, cache.block_size, max_len, budget), make_graph).used_bytes
    draft_runner = None
    if drafter is not None and _draft_capturable(drafter, device, backend):
        draft_runner = GraphRunner(drafter.graph_step, draft_config(cfg, drafter, max_len, budget), device, make_graph)
        draft_runner.capture()
        drafter.graphs = draft_runner
    graphs = StepGraphs(graphed, draft_runner)
    for line in graphs.describe():
        log.info("CUDA graphs: %s", line)
    return graphs


def op_variants(model, device: torch.device, batch_invariant: str) -> list:
    """The ops the target pass can run ``model`` with on ``device`` (``stages.step_ops_kwargs``, for
    steps with and without a greedy row), each once."""
    from specd.model import invariant

    out: list = []
    for greedy in (True, False):
        ops = step_ops_kwargs(model, device, batch_invariant, greedy).get("ops", invariant.OFF)
        if ops not in out:
            out.append(ops)
    return out


def pool_budget(device: torch.device) -> int:
    """Bytes for every runner's static buffers and graphs: ``GRAPH_POOL_BYTES``, at most
    ``GRAPH_POOL_SHARE`` of the free device memory (the KV caches are allocated by now)."""
    if device.type != "cuda":
        return GRAPH_POOL_BYTES
    free, _ = torch.cuda.mem_get_info(device)
    return int(min(GRAPH_POOL_BYTES, free * GRAPH_POOL_SHARE))


def _max_blocks(block_size: int, max_len: int) -> int:
    return -(-min(max_len, GRAPH_MAX_CONTEXT) // block_size) + 1


def target_config(cfg, block_size: int, max_len: int, pool_bytes: int) -> GraphConfig:
    sc = cfg.scheduler
    tokens = max(1, min(GRAPH_MAX_TOKENS, sc.max_num_batched_tokens))
    batch = max(1, min(GRAPH_MAX_BATCH, sc.max_num_seqs, tokens))
    return GraphConfig(buckets=default_buckets(batch, tokens), max_blocks=_max_blocks(block_size, max_len),
                       block_size=block_size, max_region=tokens, pool_bytes=max(0, pool_bytes))  # fmt: skip


def draft_config(cfg, drafter, max_len: int, pool_bytes: int) -> GraphConfig:
    """The proposer's buckets: up to ``DRAFT_MAX_TOKENS`` rows; tree masks as wide as its largest tree."""
    sc, spec = cfg.scheduler, cfg.spec
    tokens = max(1, min(DRAFT_MAX_TOKENS, sc.max_num_batched_tokens))
    batch = max(1, min(GRAPH_MAX_BATCH, sc.max_num_seqs, tokens))
    k = max(1, spec.tree_topk)
    region = max(spec.tree_budget, spec.num_draft_tokens, k + (max(spec.tree_depth, 1) - 1) * k * k)
    row = {}
    head = getattr(drafter, "capture", None) is not None
    if head:  # the feature head's hidden input per row
        row = dict(row_width=drafter.model.cfg.hidden_size, row_dtype=drafter.model.fc.weight.dtype)
    bs = drafter.cache.block_size
    return GraphConfig(buckets=default_buckets(batch, tokens), max_blocks=_max_blocks(bs, max_len), block_size=bs,
                       max_region=min(region, GRAPH_MAX_TOKENS), pool_bytes=max(0, pool_bytes), **row)  # fmt: skip


def _draft_capturable(drafter, device: torch.device, backend) -> bool:
    """A draft model like a target (``refusal``); a feature head off the CPU kernel."""
    if getattr(drafter, "capture", None) is not None:
        return getattr(drafter.model, "fused", None) is None and device_refusal(device, backend) is None
    why = refusal(drafter.model, device, backend, None)
    if why is not None:
        log.info("CUDA graphs: the draft model runs eagerly: %s", why)
    return why is None


def replace_target(target, graphs: StepGraphs | None):
    """``target`` whose model is the captured one (the engine's target pass then replays it)."""
    if graphs is None or graphs.target is None:
        return target
    return dataclasses.replace(target, model=graphs.target)
