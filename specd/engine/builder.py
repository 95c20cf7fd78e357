"""Building an engine's parts from its config: load the models (unless given), check the draft
against the target, size the KV caches, and wire the ledger, speculation policy, scheduler and
drafter. ``Engine.__init__`` only takes the result."""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch

from specd.config import EngineConfig
from specd.engine import step_graphs
from specd.engine.kv_cache import KVCache, PrefixCache
from specd.engine.ledger import KVLedger
from specd.engine.scheduler import Scheduler
from specd.engine.step_graphs import StepGraphs
from specd.engine.tensor_parallel import ShardedTarget, per_rank_threads
from specd.model.attention import get_backend
from specd.model.cpu import usable_cpus
from specd.model.loader import LoadedModel, LoadError, load_model
from specd.model.qkernel import kernel
from specd.model.quant import set_act_int8
from specd.model.tp_shard import check_shardable
from specd.speculation.drafter import Drafter
from specd.speculation.head import HeadDrafter
from specd.speculation.policy import SpecPolicy
from specd.speculation.registry import ProposerContext, build_free
from specd.speculation.speculator import Speculator

log = logging.getLogger("specd.engine")

CPU_KV_BUDGET = 2 << 30  # bytes of KV cache on a CPU when no budget is given
GPU_KV_SHARE = 0.85  # share of free device memory for the KV caches on a GPU
TREE_ROOM = 300  # tokens per sequence beyond its context, for draft trees


@dataclass
class EngineParts:
    target: LoadedModel
    draft: LoadedModel | None
    max_model_len: int
    backend: object
    cache: KVCache
    draft_cache: KVCache | None
    prefix_cache: PrefixCache
    draft_prefix_cache: PrefixCache | None
    ledger: KVLedger
    policy: SpecPolicy
    scheduler: Scheduler
    speculator: Speculator  # the proposers (model and model-free) and the policy that prices them
    policy_clock: Callable[[], float]  # seconds: the engine thread's CPU time on a CPU, wall time on a GPU
    tp: ShardedTarget | None = None  # the target's ranks (--tensor-parallel-size > 1); target.model is it
    graphs: StepGraphs | None = None  # the captured forwards (--cuda-graphs); target.model is its GraphedModel


def load_models(cfg: EngineConfig, target: LoadedModel | None, draft: LoadedModel | None) -> tuple:
    """(target, draft) from the config unless given; the draft computes in the target's dtype and
    ``dtype auto`` on a CPU weighs the widths a step will have. ``quantization`` applies to each
    (``auto``: a GGUF file keeps its blocks, a folder stays unquantized)."""
    if target is None:
        width = 1 + (max(cfg.spec.tree_budget, cfg.spec.num_draft_tokens) if cfg.draft or cfg.head else 0)
        # tensor parallelism splits unquantized weights: ``auto`` then loads a GGUF file dequantized
        quant = "none" if cfg.tensor_parallel_size > 1 and cfg.quantization == "auto" else cfg.quantization
        target = load_model(cfg.target, cfg.device, cfg.dtype, widths=(1, max(width, 8)), quantization=quant)
    if draft is None and cfg.draft:
        dtype = str(target.dtype).removeprefix("torch.")
        draft = load_model(
            cfg.draft, cfg.device, dtype, with_tokenizer=True, target=target, quantization=cfg.quantization
        )
    if draft is not None:
        check_draft(target, draft)
    _act_quant(cfg.act_quant, target, draft)
    return target, draft


def _act_quant(mode: str, target: LoadedModel, draft: LoadedModel | None) -> None:
    """``int8``: the CPU kernel's int8 activations for both models (models passed in included);
    ``auto``: the same where the target's weights are quantized and the CPU kernel runs (the fastest
    choice there, as llama.cpp's), else nothing; ``none`` leaves them as loaded (fp32 activations,
    unless a caller set them)."""
    if (
        mode == "none"
        or mode == "auto"
        and (target.device.type != "cpu" or kernel() is None or not target.model.quantized())
    ):
        return
    n = sum(set_act_int8(m.model, True) for m in (target, draft) if m is not None)
    if mode == "auto":
        log.info("activations: int8 in %d quantized layers (--act-quant auto; none for fp32)", n)
    elif n == 0 or target.device.type != "cpu":
        raise LoadError("--act-quant int8 needs quantized weights (--quantization) on a CPU device")


def check_draft(target: LoadedModel, draft: LoadedModel) -> None:
    """The draft must share the target's vocabulary and tokenizer (LoadError otherwise)."""
    tv, dv = target.config.vocab_size, draft.config.vocab_size
    if tv != dv:
        raise LoadError(
            f"draft vocabulary ({dv} tokens, {draft.path}) does not match the target's "
            f"({tv} tokens, {target.path}): the draft must share the target's tokenizer"
        )
    tt, dt = cast(Any, target.tokenizer), cast(Any, draft.tokenizer)
    if tt is not None and dt is not None and tt.get_vocab() != dt.get_vocab():
        raise LoadError(
            f"draft tokenizer ({draft.path}) differs from the target's ({target.path}): "
            f"the draft must share the target's tokenizer"
        )


def max_model_len(target: LoadedModel, draft: LoadedModel | None) -> int:
    tc = target.config
    n = tc.max_position_embeddings  # (a sliding window masks keys in attention; it does not bound the context)
    if draft is not None:
        n = min(n, draft.config.max_position_embeddings)
    return n


def cache_blocks(
    cfg: EngineConfig, target: LoadedModel, draft: LoadedModel | None, max_len: int, head=None, kv_dt=None
) -> int:
    """KV blocks per cache: the configured number, else enough for every sequence at full length
    (plus tree room) within the memory budget (both caches together)."""
    if cfg.cache.num_blocks is not None:
        return cfg.cache.num_blocks
    bs = cfg.cache.block_size
    tc = target.config
    per = KVCache.bytes_per_block(tc.num_layers, tc.num_kv_heads, tc.head_dim, bs, kv_dt or target.dtype)
    if draft is not None or head is not None:
        dc = draft.config if draft is not None else head.cfg
        per += KVCache.bytes_per_block(dc.num_layers, dc.num_kv_heads, dc.head_dim, bs, target.dtype)
    want = cfg.scheduler.max_num_seqs * (-(-(max_len + TREE_ROOM) // bs)) + 8
    budget = cfg.cache.memory_bytes
    if budget is None:
        if target.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(target.device)
            budget = int(free * GPU_KV_SHARE)
        else:
            budget = CPU_KV_BUDGET
    return max(16, min(want, budget // per))


def kv_dtype(cfg: EngineConfig, target: LoadedModel, backend) -> torch.dtype:
    """The target KV cache's element type (``--kv-dtype``). ``auto``: fp16 where a quantized fp32
    target runs on the CPU kernel (its fused layers read fp16 keys and values widened exactly to fp32:
    half the bytes of the attention's memory-bound read at long contexts; within a quantized model's
    own noise), else the model's dtype. An explicit choice is the model's dtype, or fp16 under an fp32
    model on the CPU kernel's attention; anything else is a one-line ``LoadError``."""
    model_dt, name = target.dtype, cfg.cache.dtype
    cpu_kernel = target.device.type == "cpu" and getattr(backend, "name", None) == "cpu" and model_dt == torch.float32
    if name == "auto":
        tp = cfg.tensor_parallel_size > 1
        return torch.float16 if cpu_kernel and not tp and target.model.quantized() else model_dt
    want = getattr(torch, name)
    if want == model_dt or (want == torch.float16 and cpu_kernel and cfg.tensor_parallel_size == 1):
        return want
    raise LoadError(
        f"--kv-dtype {name}: a {str(model_dt).removeprefix('torch.')} model on {target.device.type} keeps its KV "
        "cache in its own dtype (float16 under float32 needs the CPU kernel's attention, one process)"
    )


def load_head_for(cfg: EngineConfig, target: LoadedModel, draft: LoadedModel | None):
    """The feature head named by ``cfg.head`` (None without one), bound to ``target``."""
    if cfg.head and cfg.tensor_parallel_size > 1:
        raise LoadError(
            "a feature head reads the target's hidden states, which tensor-parallel ranks do not gather "
            "yet: use --draft or --spec-mode ngram with --tensor-parallel-size"
        )
    if not cfg.head:
        return None
    if draft is not None:
        raise LoadError("a draft model and a feature head were both given: one model proposer at a time")
    from specd.model.head_files import load_head

    head = load_head(cfg.head, target)
    tm = target.model
    # a quantized target on a CPU: the head drafts through the same kernel (SPECD_HEAD_KERNEL=0: fp32)
    on_kernel = target.device.type == "cpu" and tm.quantized() and kernel() is not None
    if on_kernel and os.environ.get("SPECD_HEAD_KERNEL", "1") != "0":
        head.use_kernel(any(getattr(m, "act_int8", False) for m in tm.modules()))
    return head


def build(cfg: EngineConfig, target: LoadedModel | None, draft: LoadedModel | None, clock) -> EngineParts:
    target, draft = load_models(cfg, target, draft)
    head = load_head_for(cfg, target, draft)
    device = target.device
    max_len = max_model_len(target, draft)
    backend = get_backend(cfg.attention_backend, device)
    kv_dt = kv_dtype(cfg, target, backend)
    if kv_dt != target.dtype:
        log.info("KV cache in %s (--kv-dtype %s)", str(kv_dt).removeprefix("torch."), cfg.cache.dtype)
    n = cache_blocks(cfg, target, draft, max_len, head, kv_dt)
    bs = cfg.cache.block_size
    tc = target.config
    tp = None
    if cfg.tensor_parallel_size > 1:
        target, tp = start_tensor_parallel(cfg, target, n, backend)
    kv_heads = tp.kv_heads if tp is not None else tc.num_kv_heads
    cache = KVCache(tc.num_layers, kv_heads, tc.head_dim, n, bs, kv_dt, device)
    draft_cache = None
    if draft is not None or head is not None:
        dc = draft.config if draft is not None else head.cfg
        ddt = draft.dtype if draft is not None else target.dtype
        draft_cache = KVCache(dc.num_layers, dc.num_kv_heads, dc.head_dim, n, bs, ddt, device)
    prefix_cache = PrefixCache(cache.pool, bs)
    # (a head's rows depend on the token after their block: never shared through a prefix cache)
    draft_prefix_cache = PrefixCache(draft_cache.pool, bs) if draft_cache is not None and draft is not None else None
    on = cfg.scheduler.enable_prefix_cache
    ledger = KVLedger(
        cache, draft_cache, prefix_cache if on else None, draft_prefix_cache if on else None, backend=tp or backend
    )
    policy = SpecPolicy(cfg.spec, has_draft=draft is not None or head is not None, has_head=head is not None)
    scheduler = Scheduler(cfg.scheduler, policy, ledger, clock=clock)
    policy_clock = time.thread_time if device.type == "cpu" else time.perf_counter
    drafter = None
    if draft is not None:
        assert draft_cache is not None
        drafter = Drafter(draft.model, draft_cache, cfg.spec, device, draft.config.vocab_size, backend, ledger)
    elif head is not None:
        assert draft_cache is not None
        drafter = HeadDrafter(head, draft_cache, cfg.spec, device, tc.vocab_size, backend, ledger)
    if drafter is not None:
        drafter.clock = policy_clock
    free = build_free(ProposerContext(cfg.spec, tc.vocab_size, target.tokenizer))
    speculator = Speculator(policy, drafter, free, policy_clock, max_len)
    graphs = step_graphs.setup(cfg, target, cache, backend, drafter, tp, max_len)  # (CUDA graphs: captured now)
    return EngineParts(
        step_graphs.replace_target(target, graphs), draft, max_len, backend, cache, draft_cache, prefix_cache,
        draft_prefix_cache, ledger, policy, scheduler, speculator, policy_clock, tp, graphs,
    )  # fmt: skip


def start_tensor_parallel(cfg: EngineConfig, target: LoadedModel, num_blocks: int, backend) -> tuple:
    """Start the target's ranks: ``(target with its model replaced by the ShardedTarget, it)``.
    Rank 0 (this process) computes with ``per_rank_threads`` threads, as each worker does.
    One-line ``LoadError`` when the target cannot be split (quantized weights, too few KV heads)."""
    world = cfg.tensor_parallel_size
    if target.model.quantized():
        raise LoadError(
            "tensor parallelism needs unquantized target weights (--quantization none): quantized "
            "blocks are not split across ranks yet"
        )
    try:
        check_shardable(target.config, world)
    except ValueError as e:
        raise LoadError(str(e)) from None
    threads = per_rank_threads(cfg.threads, world, usable_cpus())
    torch.set_num_threads(threads)
    tp = ShardedTarget(
        target.model, world, num_blocks, cfg.cache.block_size, backend, threads, lm_head=cfg.tensor_parallel_lm_head
    )
    return dataclasses.replace(target, model=cast(Any, tp)), tp
