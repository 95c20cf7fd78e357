"""One rank's shard of a Llama-family target for tensor parallelism, and its forward.

Megatron-style split over ``world`` ranks (``r`` = this rank):

- attention: rank r owns a contiguous range of KV heads and the query heads that read them
  (``G = H / KVH`` query heads per KV head). q/k/v are column-parallel (its rows of the fused qkv
  projection), the output projection row-parallel (its input columns): one all-reduce per layer;
- MLP: gate/up column-parallel (rows ``[i0, i1)`` of each), down row-parallel (the same columns):
  one all-reduce per layer;
- KV cache: each rank holds only its own KV heads, ``[L, 2, NB, BS, kvh_r, D]``, same block ids;
- LM head: split by vocabulary (rows ``[v0, v1)``, the last shard zero-padded so every shard has
  ``ceil(V / world)`` rows) and gathered once on rank 0, or computed on rank 0 with the whole head;
- embedding, RMSNorm weights and RoPE tables are replicated (the residual stream is).

Heads need not divide evenly: with 3 KV heads over 2 ranks (SmolLM2-135M) rank 0 owns 1 KV head
(3 query heads) and rank 1 owns 2 (6 query heads); every rank needs at least one KV head.

Worked example (stories260K: H=8, KVH=4, D=8, I=172, world=2): rank 1 owns KV heads 2..3, query
heads 4..7 (qkv rows 32..63 of q, 16..31 of k and of v: 64 rows), o columns 32..63, gate/up rows
86..171, down columns 86..171, head rows 256..511.

The residual add rides in the row-parallel matmul of rank 0 only (``addmm(x, o, W_o^T)``; other
ranks ``mm``), so the all-reduced sum is the new residual stream, as in the one-rank forward.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from specd.config import ModelConfig
from specd.model.attention import AttentionMetadata
from specd.model.llama import LlamaModel, Rotary
from specd.model.quant import linear


def split(n: int, world: int) -> list:
    """``[(start, end)]`` of ``n`` units over ``world`` ranks, as even as possible; the higher
    ranks take the remainder (rank 0 also runs the scheduler and the draft)."""
    base, extra = divmod(n, world)
    out, start = [], 0
    for r in range(world):
        size = base + (1 if r >= world - extra else 0)
        out.append((start, start + size))
        start += size
    return out


@dataclasses.dataclass(frozen=True)
class ShardPlan:
    """What rank ``rank`` of ``world`` owns: KV heads, query heads, MLP columns, vocabulary rows."""

    rank: int
    world: int
    kv_heads: tuple  # (k0, k1)
    q_heads: tuple  # (q0, q1)
    inter: tuple  # (i0, i1)
    vocab: tuple  # (v0, v1) real rows; the shard is padded to vocab_rows
    vocab_rows: int


def check_shardable(cfg: ModelConfig, world: int) -> None:
    """ValueError when ``cfg`` cannot be split over ``world`` ranks (one line, what to do)."""
    if world < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {world}")
    if cfg.num_kv_heads < world:
        raise ValueError(
            f"tensor parallelism over {world} ranks needs at least {world} KV heads; the target has "
            f"{cfg.num_kv_heads} (the KV cache is sharded by KV head): use --tensor-parallel-size <= {cfg.num_kv_heads}"
        )
    if cfg.intermediate_size < world:
        raise ValueError(f"intermediate_size {cfg.intermediate_size} < tensor_parallel_size {world}")
    if world > 1 and cfg.beyond_llama():
        raise ValueError(
            f"tensor parallelism runs Llama layers only; this {cfg.architecture} has "
            f"{', '.join(cfg.beyond_llama())}: use --tensor-parallel-size 1"
        )


def plan(cfg: ModelConfig, rank: int, world: int) -> ShardPlan:
    check_shardable(cfg, world)
    g = cfg.num_heads // cfg.num_kv_heads
    k0, k1 = split(cfg.num_kv_heads, world)[rank]
    rows = -(-cfg.vocab_size // world)
    v0 = min(rank * rows, cfg.vocab_size)
    return ShardPlan(
        rank, world, (k0, k1), (k0 * g, k1 * g), split(cfg.intermediate_size, world)[rank],
        (v0, min(v0 + rows, cfg.vocab_size)), rows,
    )  # fmt: skip


def shard_config(cfg: ModelConfig, p: ShardPlan) -> ModelConfig:
    """The rank's own view: its heads and MLP columns (hidden size, vocabulary, layers unchanged)."""
    return dataclasses.replace(
        cfg,
        num_heads=p.q_heads[1] - p.q_heads[0],
        num_kv_heads=p.kv_heads[1] - p.kv_heads[0],
        intermediate_size=p.inter[1] - p.inter[0],
    )


def _rows(w: torch.Tensor, p: ShardPlan, cfg: ModelConfig) -> torch.Tensor:
    """The rank's rows of a fused q/k/v weight [(H + 2 KVH) D, ...] (or bias [(H + 2 KVH) D])."""
    D, H, KVH = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    (q0, q1), (k0, k1) = p.q_heads, p.kv_heads
    q = w[q0 * D : q1 * D]
    k = w[(H + k0) * D : (H + k1) * D]
    v = w[(H + KVH + k0) * D : (H + KVH + k1) * D]
    return torch.cat([q, k, v]).contiguous()


def shard_weights(model: LlamaModel, p: ShardPlan) -> dict:
    """The tensors rank ``p.rank`` needs, by name (replicated ones by reference: no copy).
    Quantized weights are refused (``ValueError``): their blocks are not split yet."""
    if model.quantized():
        raise ValueError(
            "tensor parallelism needs unquantized target weights (--quantization none): quantized "
            "blocks (Q4_1 / Q8_0 / int8 / int4) are not split across ranks yet"
        )
    cfg = model.cfg
    D, inter = cfg.head_dim, cfg.intermediate_size
    (q0, q1), (i0, i1), (v0, v1) = p.q_heads, p.inter, p.vocab
    out: dict = {"embed": model.embed.weight.detach(), "norm": model.norm.weight.detach()}
    head = model.lm_head.weight.detach()
    rows = head[v0:v1]
    if rows.shape[0] < p.vocab_rows:  # pad the last shard: every rank gathers the same shape
        rows = torch.cat([rows, rows.new_zeros((p.vocab_rows - rows.shape[0], rows.shape[1]))])
    out["head"] = rows.contiguous()
    for i, blk in enumerate(model.layers):
        a, m = blk.attn, blk.mlp
        gu = m.gate_up.weight.detach()
        out[f"{i}.input_norm"] = blk.input_norm.weight.detach()
        out[f"{i}.post_norm"] = blk.post_norm.weight.detach()
        out[f"{i}.qkv"] = _rows(a.qkv.weight.detach(), p, cfg)
        if a.qkv.bias is not None:
            out[f"{i}.qkv_bias"] = _rows(a.qkv.bias.detach(), p, cfg)
        out[f"{i}.o"] = a.o.weight.detach()[:, q0 * D : q1 * D].contiguous()
        out[f"{i}.gate_up"] = torch.cat([gu[i0:i1], gu[inter + i0 : inter + i1]]).contiguous()
        out[f"{i}.down"] = m.down.weight.detach()[:, i0:i1].contiguous()
    return out


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


def build_shard(cfg: ModelConfig, p: ShardPlan, weights: dict, max_positions: int, device) -> LlamaModel:
    """A ``LlamaModel`` of the rank's shape (``shard_config``) over ``weights`` (moved to ``device``);
    its ``_flat_weights`` give the folded fp32 copies as for one rank. ``head_rows``: the rank's
    vocabulary rows of the LM head."""
    with torch.device("meta"):
        m = LlamaModel(shard_config(cfg, p), max_positions=max_positions)
    w = {k: v.to(device) for k, v in weights.items()}
    m.embed.weight = _param(w["embed"])
    m.norm.weight = _param(w["norm"])
    m.lm_head = nn.Linear(1, 1, bias=False)  # (unused: the shard's head rows are ``head_rows``)
    m.head_rows = w["head"]
    for i, blk in enumerate(m.layers):
        blk.input_norm.weight = _param(w[f"{i}.input_norm"])
        blk.post_norm.weight = _param(w[f"{i}.post_norm"])
        blk.attn.qkv.weight = _param(w[f"{i}.qkv"])
        blk.attn.qkv.bias = _param(w[f"{i}.qkv_bias"]) if f"{i}.qkv_bias" in w else None
        blk.attn.o.weight = _param(w[f"{i}.o"])
        blk.mlp.gate_up.weight = _param(w[f"{i}.gate_up"])
        blk.mlp.down.weight = _param(w[f"{i}.down"])
    m.rotary = _rotary(cfg, max_positions, device)
    return m.eval()


def _rotary(cfg: ModelConfig, max_positions: int, device) -> nn.Module:
    return Rotary(cfg, max_positions).to(device)


Reduce = Callable[[torch.Tensor], torch.Tensor]


def _row_parallel(x: torch.Tensor, a: torch.Tensor, w_t, first: bool, reduce: Reduce) -> torch.Tensor:
    """``x + sum over ranks of a_r @ W_r^T``: rank 0 adds the residual in its matmul, the
    all-reduce sums the partial products."""
    part = torch.addmm(x, a, w_t) if first else torch.mm(a, w_t)
    return reduce(part)


def _folded_layers(m, x, cos, sin, kv, meta, backend, first: bool, reduce: Reduce):
    """The fp32 folded path of ``LlamaModel.forward`` (RMSNorm weights and RoPE folded into the
    projections), with row-parallel o / down."""
    cfg = m.cfg
    H, KVH, D, inter = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    _, _, layers, norm_w, _, mean_col, eps_col = m._flat_weights()
    T = x.shape[0]
    nq, nqk = H * D, (H + KVH) * D
    nqkv = nqk + KVH * D
    scale = D**-0.5
    for i, (w_ext_t, b_ext, w_o_t, w_gu_t, w_down_t) in enumerate(layers):
        h = x * torch.addmm(eps_col, x * x, mean_col).rsqrt_()
        qkv = torch.mm(h, w_ext_t) if b_ext is None else torch.addmm(b_ext, h, w_ext_t)
        qk = torch.addcmul(qkv[:, :nqk].view(T, H + KVH, D) * cos, qkv[:, nqkv:].view(T, H + KVH, D), sin)
        backend.write_kv(kv[i], qk[:, H:], qkv[:, nqk:nqkv].view(T, KVH, D), meta.slot_mapping)
        o = backend.attention(qk[:, :H], kv[i], meta, scale)  # [T, H_r, D]
        x = _row_parallel(x, o.reshape(T, nq), w_o_t, first, reduce)
        h = x * torch.addmm(eps_col, x * x, mean_col).rsqrt_()
        gu = torch.mm(h, w_gu_t)
        x = _row_parallel(x, F.silu(gu[:, :inter]) * gu[:, inter:], w_down_t, first, reduce)
    return x * torch.addmm(eps_col, x * x, mean_col).rsqrt_() * norm_w


def _plain_layers(m, x, cos, sin, kv, meta, backend, first: bool, reduce: Reduce):
    """The unfolded path of ``LlamaModel.forward`` (bf16 / fp16, large models)."""
    cfg = m.cfg
    H, KVH, D, inter, eps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size, cfg.rms_norm_eps
    _, _, layers, norm_w, rot, _, _ = m._flat_weights()
    T = x.shape[0]
    nq, nqk = H * D, (H + KVH) * D
    scale = D**-0.5

    def norm(x, w):
        return F.rms_norm(x.float(), (x.shape[-1],), w.float(), eps).to(x.dtype)

    for i, (w_in, w_qkv, b_qkv, w_o_t, w_post, w_gu, w_down_t) in enumerate(layers):
        qkv = linear(norm(x, w_in), w_qkv, b_qkv)  # [T, (H_r + 2 KVH_r) D]
        qk = qkv[:, :nqk].reshape(T, H + KVH, D)
        qk = torch.addcmul(qk * cos, qk @ rot, sin)
        backend.write_kv(kv[i], qk[:, H:], qkv[:, nqk:].view(T, KVH, D), meta.slot_mapping)
        o = backend.attention(qk[:, :H], kv[i], meta, scale)
        x = _row_parallel(x, o.reshape(T, nq), w_o_t, first, reduce)
        gu = linear(norm(x, w_post), w_gu)
        x = _row_parallel(x, F.silu(gu[:, :inter]) * gu[:, inter:], w_down_t, first, reduce)
    return norm(x, norm_w)


@torch.inference_mode()
def shard_forward(
    m: LlamaModel,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    kv: torch.Tensor,
    meta: AttentionMetadata,
    backend,
    first: bool,
    reduce: Reduce,
) -> torch.Tensor:
    """This rank's part of ``LlamaModel.forward``: ``hidden [T, d]`` (the same on every rank after
    the last all-reduce). ``kv``: the rank's cache ``[L, 2, NB, BS, KVH_r, D]``; ``first``: rank 0
    (adds the residual); ``reduce``: in-place sum over ranks, returns its argument."""
    emb, folded, _, norm_w, _, _, _ = m._flat_weights()
    x = F.embedding(input_ids, emb).to(norm_w.dtype)  # [T, d]
    cos = m.rotary.cos[positions].unsqueeze(1)  # [T, 1, D]
    sin = m.rotary.sin[positions].unsqueeze(1)
    if cos.dtype != x.dtype:
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    layers = _folded_layers if folded else _plain_layers
    return layers(m, x, cos, sin, kv, meta, backend, first, reduce)


@torch.inference_mode()
def shard_logits(m: LlamaModel, hidden: torch.Tensor) -> torch.Tensor:
    """``[N, vocab_rows]`` fp32 logits of this rank's vocabulary rows."""
    return linear(hidden, m.head_rows).float()
