"""Attention metadata for one engine step and the backend dispatch (one place).

A step's batch is a flat list of ``T`` new tokens from ``B`` sequences (see docs/architecture.md).
The new tokens' K/V are written into the paged cache first (``write_kv``), then every query attends
to its sequence's cached prefix plus the new tokens it may see (causal, or an ancestor mask for
draft trees). Backends:

- ``torch``: the pure-torch reference, the CPU default and the oracle for the kernels.
- ``triton``: ``specd_kernels`` tree attention over the paged cache, the CUDA default.

Sliding windows (Mistral, Qwen2's windowed layers, Gemma): ``attention(..., window=W)`` masks the keys
a query at position p may not see, those at positions <= p - W (transformers' rule: key k visible iff
p - k < W), on prefill chunks, decode rows and tree rows alike. A query's position is its context
plus the number of region columns it sees, minus one (a tree node sees its root path: its depth + 1
columns), and a region key's position is its rank among the columns the query sees (a root path's
nodes sit at depths 0, 1, ...), so no positions travel with the metadata. A window no query can
reach past (``W >= max_seq_len``) is no mask at all: the plain plan is used.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    query_start_loc: torch.Tensor  # [B+1] int32
    context_lens: torch.Tensor  # [B] int32
    seq_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, max_blocks] int32
    slot_mapping: torch.Tensor  # [T] int64
    tree_mask: torch.Tensor | None  # [T, max_region] bool, None = causal among new tokens
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
    tree_masks: Sequence[torch.Tensor | None] | None = None,
    seq_lens: Sequence[int] | None = None,
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
        mask = _region_mask(tree_masks, query_lens, qsl, context_lens, seq_lens).to(device, non_blocking=True)
    return AttentionMetadata(
        query_start_loc=ints[: B + 1],
        context_lens=ints[B + 1 : 2 * B + 1],
        seq_lens=ints[2 * B + 1 : 3 * B + 1],
        block_tables=ints[3 * B + 1 :].view(B, max_blocks),
        slot_mapping=torch.tensor(
            slot_mapping if isinstance(slot_mapping, list) else list(slot_mapping), dtype=torch.int64, device=device
        ),
        tree_mask=mask,
        max_query_len=max_q,
        max_seq_len=max(seq_lens) if B else 0,
        block_size=block_size,
        query_lens_host=list(query_lens),
        context_lens_host=context_lens,
        seq_lens_host=seq_lens,
    )


def _region_mask(tree_masks, query_lens, qsl: list, context_lens: list, seq_lens: list) -> torch.Tensor:
    """[T, max region] bool: each sequence's mask rows (a causal block where its mask is None)."""
    max_r = max(s - c for s, c in zip(seq_lens, context_lens))
    mask = torch.zeros((qsl[-1], max(max_r, 1)), dtype=torch.bool)
    for b, m in enumerate(tree_masks):
        q, r = query_lens[b], seq_lens[b] - context_lens[b]
        if m is None:
            m = torch.ones((q, r), dtype=torch.bool).tril_(r - q)
        mask[qsl[b] : qsl[b] + q, : m.shape[1]] = m
    return mask


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
    def copy_slots(kv: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """KV compaction: every layer's K and V from slot src[i] to dst[i] (all sources read first).
        ``kv`` [L, 2, NB, BS, KVH, D]; src, dst [N] int64."""
        if src.numel() == 0:
            return
        L, two, NB, BS, KVH, D = kv.shape
        flat = kv.view(L, 2, NB * BS, KVH, D)
        flat[:, :, dst] = flat[:, :, src]  # advanced indexing reads all sources before writing

    @staticmethod
    def _decode_plan(meta: AttentionMetadata, device: torch.device, window: int | None, key: str):
        """Decode-only steps (one causal query per sequence): whole blocks are gathered (one
        index_select of contiguous block rows), keys past a sequence's length (and with a window,
        those ``window`` or more positions behind its query) are masked."""
        B, BS = meta.num_seqs, meta.block_size
        nb = -(-meta.max_seq_len // BS)
        blocks = meta.block_tables[:, :nb].reshape(-1).long()  # [B * nb]
        Lp = nb * BS
        pos = torch.arange(Lp, device=device).unsqueeze(0)  # [1, Lp]
        seen = pos < meta.seq_lens.unsqueeze(1)  # [B, Lp]
        if window is not None:  # the query sits at seq_len - 1
            seen &= pos >= meta.seq_lens.unsqueeze(1) - window
        bias = torch.zeros((B, Lp), dtype=torch.float32, device=device).masked_fill_(~seen, float("-inf"))
        plan = ("decode", blocks, bias.view(B, 1, 1, Lp))
        meta.cache[key] = plan
        return plan

    @classmethod
    def _plan(cls, meta: AttentionMetadata, device: torch.device, window: int | None = None):
        """Per-step gather plan and additive mask, built once per window and shared by every layer.

        Keys are gathered as whole blocks (one index_select of contiguous rows, padded to a block
        multiple); the mask [B, Q, Lp] says which keys each query sees: its prefix, plus the region
        columns allowed by causality or by the tree mask, minus (``window``) keys outside its sliding
        window. When every sequence has the same number of queries (decode, equal chains, one
        sequence) the flat batch is already [B, Q]: no padding.
        """
        if window is not None and window >= meta.max_seq_len:
            window = None  # no query reaches past it: the plain plan
        key = "torch_plan" if window is None else f"torch_plan@{window}"
        plan = meta.cache.get(key)
        if plan is not None:
            return plan
        if meta.max_query_len == 1 and meta.tree_mask is None:
            return cls._decode_plan(meta, device, window, key)
        B, Q, BS = meta.num_seqs, meta.max_query_len, meta.block_size
        nb = -(-meta.max_seq_len // BS)
        Lp = nb * BS
        blocks = meta.block_tables[:, :nb].reshape(-1).long()  # [B * nb]
        qlens = meta.query_lens_host
        uniform = sum(qlens) == B * Q
        pos = torch.arange(Lp, device=device).view(1, 1, Lp)
        qi = torch.arange(Q, device=device).view(1, Q, 1)
        qsl = meta.query_start_loc.long()
        q_index = flat_pos = None
        if not uniform:
            # query index into the flat batch [B, Q]; flat position of each real query in the padded batch
            q_index = (qsl[:-1].unsqueeze(1) + qi.view(1, Q)).clamp(max=max(sum(qlens) - 1, 0))
            q_valid = qi.view(1, Q) < torch.tensor(qlens, device=device).unsqueeze(1)  # [B, Q]
            flat_pos = (torch.arange(B, device=device).unsqueeze(1) * Q + qi.view(1, Q))[q_valid]
        seq_lens = meta.seq_lens.long().view(B, 1, 1)
        if meta.tree_mask is None:
            # causal: query i of sequence b sits at position seq_len - q_b + i and sees keys up to it
            qlen = (qsl[1:] - qsl[:-1]).view(B, 1, 1)
            visible = pos <= seq_lens - qlen + qi  # [B, Q, Lp]
            if window is not None:
                visible &= pos > seq_lens - qlen + qi - window
        else:
            ctx = meta.context_lens.long().view(B, 1, 1)
            rel = pos - ctx  # key position relative to the region start
            maxr = meta.tree_mask.shape[1]
            rows = meta.tree_mask[q_index] if q_index is not None else meta.tree_mask.view(B, Q, maxr)
            new_ok = rows.gather(2, rel.clamp(0, maxr - 1).expand(B, Q, Lp))
            visible = (rel < 0) | ((pos < seq_lens) & new_ok)
            if window is not None:
                visible &= _tree_window(rows, rel, pos, ctx, window)
        if not uniform:  # padding rows: never fully masked (NaN); their output is dropped
            visible[:, :, 0] |= ~q_valid
        bias = torch.zeros((B, Q, Lp), dtype=torch.float32, device=device).masked_fill_(~visible, float("-inf"))
        plan = ["general", blocks, q_index, flat_pos, bias, None]  # [5]: bias expanded over query groups
        meta.cache[key] = plan
        return plan

    @staticmethod
    def _gather_kv(kv_layer: torch.Tensor, blocks: torch.Tensor, B: int, Lp: int):
        """K and V of each sequence's whole blocks in one index_select: two [B, KVH, Lp, D] fp32 views."""
        KVH, D = kv_layer.shape[-2], kv_layer.shape[-1]
        kvg = kv_layer.index_select(1, blocks).view(2, B, Lp, KVH, D)
        k, v = kvg[0].transpose(1, 2), kvg[1].transpose(1, 2)
        if k.dtype != torch.float32:
            k, v = k.float(), v.float()
        return k, v

    @classmethod
    def attention(
        cls, q: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata, scale: float, window: int | None = None
    ):
        # q [T, H, D] -> [T, H, D]; window: a sliding window (keys >= window positions behind a query masked)
        T, H, D = q.shape
        KVH = kv_layer.shape[-2]
        G = H // KVH
        plan = cls._plan(meta, q.device, window)
        if plan[0] == "decode":  # T == B single queries: GQA grouping is a plain view of q
            _, blocks, bias = plan
            B, Lp = bias.shape[0], bias.shape[-1]
            k, v = cls._gather_kv(kv_layer, blocks, B, Lp)
            o = F.scaled_dot_product_attention(q.float().view(B, KVH, G, D), k, v, attn_mask=bias, scale=scale)
            return o.reshape(B, H, D).to(q.dtype)
        _, blocks, q_index, flat_pos, bias, bias_g = plan
        B, Q, Lp = bias.shape
        if bias_g is None:  # rows ordered (group member g, query i), as in qg below
            bias_g = plan[5] = bias.unsqueeze(1).expand(B, G, Q, Lp).reshape(B, 1, G * Q, Lp)
        k, v = cls._gather_kv(kv_layer, blocks, B, Lp)
        qp = q if q_index is None else q[q_index.view(-1)]  # [B*Q, H, D]
        # query heads grouped under their KV head: [B, KVH, G*Q, D] (head h uses KV head h // G)
        qg = qp.float().view(B, Q, KVH, G, D).permute(0, 2, 3, 1, 4).reshape(B, KVH, G * Q, D)
        o = F.scaled_dot_product_attention(qg, k, v, attn_mask=bias_g, scale=scale)  # [B, KVH, G*Q, D]
        o = o.view(B, KVH, G, Q, D).permute(0, 3, 1, 2, 4).reshape(B * Q, H, D).to(q.dtype)
        return o if flat_pos is None else o[flat_pos]


def _tree_window(rows: torch.Tensor, rel: torch.Tensor, pos: torch.Tensor, ctx: torch.Tensor, window: int):
    """[B, Q, Lp] bool: keys within ``window`` of each query under a tree (or explicit) mask.

    ``rows`` [B, Q, max_region] the region columns each query sees, ``rel`` / ``pos`` [1, 1, Lp] key
    positions (relative to the region start / absolute), ``ctx`` [B, 1, 1]. A query sees its root
    path, so it sits at ctx + (columns seen) - 1 and the k-th column it sees at ctx + k - 1 (k from
    1): a prefix key is ``q - pos`` behind it, a region key ``seen - k``.
    """
    maxr = rows.shape[-1]
    seen = rows.sum(-1, keepdim=True)  # [B, Q, 1]
    rank = rows.cumsum(-1).gather(2, rel.clamp(0, maxr - 1).expand(rows.shape[0], rows.shape[1], -1))
    behind = torch.where(rel < 0, ctx + seen - 1 - pos, seen - rank)  # [B, Q, Lp]
    return behind < window


class CpuAttention(TorchAttention):
    """The torch backend's gather plans and masks, with the attention itself in specd's CPU kernel
    (``specd.model.qkernel.attention_rows``): each query row is computed alone, so a row's output
    does not depend on the batch (how many sequences, queries or padded keys share the step), which
    keeps a quantized model's speculative output bitwise equal to its plain output. (torch's SDPA
    blocks query rows through GEMMs whose kernels change with the row count.) An fp32 or fp16 KV
    cache on a CPU; anything else goes to the torch path."""

    name = "cpu"

    def __init__(self, lib):
        self.lib = lib

    def attention(
        self, q: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata, scale: float, window: int | None = None
    ):
        if kv_layer.dtype not in (torch.float32, torch.float16) or q.device.type != "cpu":
            return TorchAttention.attention(q, kv_layer, meta, scale, window)
        from specd.model.qkernel import attention_rows

        T, H, D = q.shape
        KVH = kv_layer.shape[-2]
        G = H // KVH
        plan = self._plan(meta, q.device, window)
        if plan[0] == "decode":
            _, blocks, bias = plan
            B, Lp = bias.shape[0], bias.shape[-1]
            qg = q.float().reshape(B, KVH, G, D).contiguous()
            o = attention_rows(self.lib, qg, self._kv(kv_layer, blocks, B, Lp), bias.view(B, 1, Lp), 1, scale)
            return o.reshape(B, H, D).to(q.dtype)
        _, blocks, q_index, flat_pos, bias, _ = plan
        B, Q, Lp = bias.shape
        qp = q if q_index is None else q[q_index.view(-1)]
        qg = qp.float().view(B, Q, KVH, G, D).permute(0, 2, 3, 1, 4).reshape(B, KVH, G * Q, D).contiguous()
        o = attention_rows(self.lib, qg, self._kv(kv_layer, blocks, B, Lp), bias, Q, scale)
        o = o.view(B, KVH, G, Q, D).permute(0, 3, 1, 2, 4).reshape(B * Q, H, D).to(q.dtype)
        return o if flat_pos is None else o[flat_pos]

    @staticmethod
    def _kv(kv_layer: torch.Tensor, blocks: torch.Tensor, B: int, Lp: int) -> torch.Tensor:
        """Each sequence's whole blocks, keys and values: one contiguous fp32 [2, B, Lp, KVH, D] (an fp16
        cache widened exactly, as the fused layers' kernel reads it)."""
        KVH, D = kv_layer.shape[-2], kv_layer.shape[-1]
        return kv_layer.index_select(1, blocks).view(2, B, Lp, KVH, D).float()


class TritonAttention:
    """Triton tree attention over the paged cache (``specd_kernels``)."""

    name = "triton"

    def __init__(self):
        import specd_kernels  # noqa: F401  (imported lazily: TRITON_INTERPRET must be set before)

        self._k = specd_kernels

    def write_kv(self, kv_layer, k, v, slot_mapping):
        self._k.write_kv(kv_layer, k, v, slot_mapping)

    def copy_slots(self, kv: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """KV compaction with the Triton kernel (same contract as ``TorchAttention.copy_slots``)."""
        if src.numel():
            self._k.copy_slots(kv, src, dst)

    def attention(self, q, kv_layer, meta: AttentionMetadata, scale: float, window: int | None = None):
        if window is not None and window < meta.max_seq_len:  # (the kernel has no window: the torch reference)
            return TorchAttention.attention(q, kv_layer, meta, scale, window)
        return self._k.tree_attention(
            q,
            kv_layer,
            meta.query_start_loc,
            meta.context_lens,
            meta.seq_lens,
            meta.block_tables,
            meta.tree_mask,
            scale,
            meta.max_query_len,
            meta.max_seq_len,
        )


def get_backend(name: str, device: torch.device):
    """``auto``: triton on CUDA; on a CPU specd's kernel where it is built (``cpu``), else the torch
    reference. ``triton`` on CPU needs TRITON_INTERPRET=1."""
    if name in ("auto", "cpu") and device.type == "cpu":
        from specd.model.qkernel import kernel

        lib = kernel()
        if lib is not None:
            return CpuAttention(lib)
        if name == "cpu":
            raise ValueError("the cpu attention backend needs specd's CPU kernel (x86-64 AVX2 + FMA and g++)")
        name = "torch"
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "torch":
        return TorchAttention()
    if name == "triton":
        return TritonAttention()
    raise ValueError(f"unknown attention backend {name!r} (auto|cpu|torch|triton)")
