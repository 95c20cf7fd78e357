"""Attention metadata for one engine step and the backend dispatch (one place).

A step's batch is a flat list of ``T`` new tokens from ``B`` sequences (see docs/architecture.md).
The new tokens' K/V are written into the paged cache first (``write_kv``), then every query attends
to its sequence's cached prefix plus the new tokens it may see (causal, or an ancestor mask for
draft trees). Backends:

- ``torch``: the pure-torch reference, the CPU default and the oracle for the kernels.
- ``triton``: ``specd_kernels`` tree attention over the paged cache, the CUDA default.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    query_start_loc: torch.Tensor  # [B+1] int32
    context_lens: torch.Tensor  # [B] int32
    seq_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, max_blocks] int32
    slot_mapping: torch.Tensor  # [T] int64
    tree_mask: Optional[torch.Tensor]  # [T, max_region] bool, None = causal among new tokens
    max_query_len: int
    max_seq_len: int
    block_size: int
    # host copies (python lists) so the reference backend builds its gather plan without syncs
    query_lens_host: list = field(default_factory=list)
    context_lens_host: list = field(default_factory=list)
    seq_lens_host: list = field(default_factory=list)
    cache: dict = field(default_factory=dict)  # per-step derived tensors, shared by all layers

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens_host)


def build_metadata(
    query_lens: Sequence[int],
    context_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    slot_mapping: Sequence[int],
    block_size: int,
    device: torch.device,
    tree_masks: Optional[Sequence[Optional[torch.Tensor]]] = None,
    seq_lens: Optional[Sequence[int]] = None,
) -> AttentionMetadata:
    """Build metadata from host-side per-sequence lists.

    The *region* of sequence b is positions ``[context_lens[b], seq_lens[b])`` (default: exactly its
    new tokens). ``tree_masks[b]`` is None (causal: new token i sits at region column
    ``region - q + i``) or a [q_b, region_b] bool mask saying which region columns each query sees;
    a query always sees the whole prefix. With an explicit mask the queries may be any subset of the
    region (draft-tree levels use this). The int32 fields are views of one tensor, so a step costs
    two host->device copies (plus the mask), not one per field.
    """
    B = len(query_lens)
    qsl = [0]
    for q in query_lens:
        qsl.append(qsl[-1] + q)
    context_lens = list(context_lens)
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)] if seq_lens is None else list(seq_lens)
    max_blocks = max(1, max(len(t) for t in block_tables)) if B else 1
    flat_tables = []
    for t in block_tables:
        flat_tables += t
        if len(t) < max_blocks:
            flat_tables += [0] * (max_blocks - len(t))
    ints = torch.tensor(qsl + context_lens + seq_lens + flat_tables, dtype=torch.int32)
    if ints.device != device:
        ints = ints.to(device, non_blocking=True)
    max_q = max(query_lens) if B else 0
    mask = None
    if tree_masks is not None and any(m is not None for m in tree_masks):
        max_r = max(s - c for s, c in zip(seq_lens, context_lens))
        mask = torch.zeros((qsl[-1], max(max_r, 1)), dtype=torch.bool)
        for b, m in enumerate(tree_masks):
            q, r = query_lens[b], seq_lens[b] - context_lens[b]
            if m is None:
                m = torch.ones((q, r), dtype=torch.bool).tril_(r - q)
            mask[qsl[b]: qsl[b] + q, : m.shape[1]] = m
        mask = mask.to(device, non_blocking=True)
    return AttentionMetadata(
        query_start_loc=ints[: B + 1],
        context_lens=ints[B + 1: 2 * B + 1],
        seq_lens=ints[2 * B + 1: 3 * B + 1],
        block_tables=ints[3 * B + 1:].view(B, max_blocks),
        slot_mapping=torch.tensor(slot_mapping if isinstance(slot_mapping, list) else list(slot_mapping),
                                  dtype=torch.int64, device=device),
        tree_mask=mask,
        max_query_len=max_q,
        max_seq_len=max(seq_lens) if B else 0,
        block_size=block_size,
        query_lens_host=list(query_lens),
        context_lens_host=context_lens,
        seq_lens_host=seq_lens,
    )


class TorchAttention:
    """Pure-torch reference: gather each sequence's keys into a padded batch, mask, SDPA."""

    name = "torch"

    @staticmethod
    def write_kv(kv_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor):
        # kv_layer [2, NB, BS, KVH, D]; k, v [T, KVH, D]
        flat = kv_layer.view(2, -1, kv_layer.shape[-2], kv_layer.shape[-1])
        if k.dtype != flat.dtype:
            k, v = k.to(flat.dtype), v.to(flat.dtype)
        flat[0].index_copy_(0, slot_mapping, k)
        flat[1].index_copy_(0, slot_mapping, v)

    @staticmethod
    def _decode_plan(meta: AttentionMetadata, device: torch.device):
        """Decode-only steps (one causal query per sequence): whole blocks are gathered (one
        index_select of contiguous block rows), keys past a sequence's length are masked."""
        B, BS = meta.num_seqs, meta.block_size
        nb = -(-meta.max_seq_len // BS)
        blocks = meta.block_tables[:, :nb].reshape(-1).long()  # [B * nb]
        Lp = nb * BS
        seen = torch.arange(Lp, device=device).unsqueeze(0) < meta.seq_lens.unsqueeze(1)  # [B, Lp]
        bias = torch.zeros((B, Lp), dtype=torch.float32, device=device).masked_fill_(~seen, float("-inf"))
        plan = ("decode", blocks, bias.view(B, 1, 1, Lp))
        meta.cache["torch_plan"] = plan
        return plan

    @classmethod
    def _plan(cls, meta: AttentionMetadata, device: torch.device):
        plan = meta.cache.get("torch_plan")
        if plan is not None:
            return plan
        if meta.max_query_len == 1 and meta.tree_mask is None:
            return cls._decode_plan(meta, device)
        B = meta.num_seqs
        Q, L, BS = meta.max_query_len, meta.max_seq_len, meta.block_size
        qlens, clens = meta.query_lens_host, meta.context_lens_host
        pos = torch.arange(L, device=device)
        # key slots [B, L]: block_tables[b, p // BS] * BS + p % BS (padding keys read slot 0, masked)
        blk = meta.block_tables.long().gather(1, (pos // BS).clamp(max=meta.block_tables.shape[1] - 1)
                                              .unsqueeze(0).expand(B, L))
        key_slots = blk * BS + (pos % BS).unsqueeze(0)
        # query index into the flat batch [B, Q]; flat position of each token in the padded batch [T]
        qi = torch.arange(Q, device=device)
        qlen_t = torch.tensor(qlens, device=device)
        start = meta.query_start_loc[:-1].long()
        q_index = (start.unsqueeze(1) + qi.unsqueeze(0)).clamp(max=max(sum(qlens) - 1, 0))
        q_valid = qi.unsqueeze(0) < qlen_t.unsqueeze(1)  # [B, Q]
        flat_pos = (torch.arange(B, device=device).unsqueeze(1) * Q + qi.unsqueeze(0))[q_valid]  # [T]
        ctx = torch.tensor(clens, device=device)
        region = torch.tensor(meta.seq_lens_host, device=device) - ctx  # [B]
        rel = pos.view(1, 1, L) - ctx.view(B, 1, 1)  # key position relative to the region start
        in_prefix = rel < 0  # [B, 1, L]
        in_new = (rel >= 0) & (rel < region.view(B, 1, 1))
        if meta.tree_mask is None:
            new_ok = rel <= (region - qlen_t).view(B, 1, 1) + qi.view(1, Q, 1)
        else:
            tm = meta.tree_mask[q_index]  # [B, Q, max_new]
            relc = rel.clamp(0, meta.tree_mask.shape[1] - 1).expand(B, Q, L)
            new_ok = tm.gather(2, relc)
        mask = in_prefix | (in_new & new_ok)  # [B, Q, L]
        mask = mask & q_valid.unsqueeze(2)
        # fully masked padding rows would give NaN: let them see key 0 (their output is dropped)
        mask[..., 0] |= ~q_valid
        # additive bias [B, 1, 1, Q, L]: broadcasts over (kv head, query heads of the group)
        bias = torch.zeros(mask.shape, dtype=torch.float32, device=device).masked_fill_(~mask, float("-inf"))
        plan = ("general", key_slots.reshape(-1), q_index, flat_pos, bias.view(B, 1, 1, Q, L))
        meta.cache["torch_plan"] = plan
        return plan

    @classmethod
    def attention(cls, q: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata, scale: float):
        # q [T, H, D] -> [T, H, D]
        T, H, D = q.shape
        KVH = kv_layer.shape[-2]
        G = H // KVH
        plan = cls._plan(meta, q.device)
        if plan[0] == "decode":  # T == B single queries: GQA grouping is a plain view of q
            _, blocks, bias = plan
            B, Lp = bias.shape[0], bias.shape[-1]
            kvg = kv_layer.index_select(1, blocks).view(2, B, Lp, KVH, D)  # [2, B, Lp, KVH, D]
            k, v = kvg[0].transpose(1, 2), kvg[1].transpose(1, 2)  # [B, KVH, Lp, D]
            if k.dtype != torch.float32:
                k, v = k.float(), v.float()
            o = F.scaled_dot_product_attention(q.float().view(B, KVH, G, D), k, v, attn_mask=bias, scale=scale)
            return o.reshape(B, H, D).to(q.dtype)
        _, key_slots, q_index, flat_pos, bias = plan
        B, Q = q_index.shape
        L = bias.shape[-1]
        kvg = kv_layer.view(2, -1, KVH, D).index_select(1, key_slots).view(2, B, L, KVH, D)  # one gather for K, V
        if kvg.dtype != torch.float32:
            kvg = kvg.float()
        k = kvg[0].permute(0, 2, 3, 1)  # [B, KVH, D, L]
        v = kvg[1].transpose(1, 2)  # [B, KVH, L, D]
        single = B == 1 and Q == T
        qp = q if single else q[q_index.view(-1)]  # [B*Q, H, D]
        # query heads grouped under their KV head: [B, KVH, G*Q, D] (head h uses KV head h // G)
        qg = qp.float().view(B, Q, KVH, G, D).permute(0, 2, 3, 1, 4).reshape(B, KVH, G * Q, D)
        scores = torch.matmul(qg, k).view(B, KVH, G, Q, L).mul_(scale).add_(bias)  # [B, KVH, G, Q, L]
        probs = torch.softmax(scores, dim=-1).view(B, KVH, G * Q, L)
        o = torch.matmul(probs, v).view(B, KVH, G, Q, D).permute(0, 3, 1, 2, 4).reshape(B * Q, H, D)
        o = o.to(q.dtype)
        return o if single else o[flat_pos]


class TritonAttention:
    """Triton tree attention over the paged cache (``specd_kernels``)."""

    name = "triton"

    def __init__(self):
        import specd_kernels  # noqa: F401  (imported lazily: TRITON_INTERPRET must be set before)

        self._k = specd_kernels

    def write_kv(self, kv_layer, k, v, slot_mapping):
        self._k.write_kv(kv_layer, k, v, slot_mapping)

    def attention(self, q, kv_layer, meta: AttentionMetadata, scale: float):
        return self._k.tree_attention(
            q, kv_layer, meta.query_start_loc, meta.context_lens, meta.seq_lens, meta.block_tables,
            meta.tree_mask, scale, meta.max_query_len, meta.max_seq_len)


def copy_slots(kv: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, backend=None) -> None:
    """KV compaction: copy every layer's K and V from slot src[i] to dst[i] (all sources read first)."""
    if src.numel() == 0:
        return
    if isinstance(backend, TritonAttention):
        backend._k.copy_slots(kv, src, dst)
        return
    L, two, NB, BS, KVH, D = kv.shape
    flat = kv.view(L, 2, NB * BS, KVH, D)
    flat[:, :, dst] = flat[:, :, src]  # advanced indexing reads all sources before writing


def get_backend(name: str, device: torch.device):
    """``auto``: triton on CUDA, torch reference elsewhere. ``triton`` on CPU needs TRITON_INTERPRET=1."""
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "torch":
        return TorchAttention()
    if name == "triton":
        return TritonAttention()
    raise ValueError(f"unknown attention backend {name!r} (auto|torch|triton)")
