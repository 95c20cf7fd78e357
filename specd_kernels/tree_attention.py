"""Paged tree / causal attention over a block-table KV cache (prefill, decode, tree verification).

Layout and metadata follow ``docs/architecture.md``:

* ``q``            ``[T, H, D]`` new tokens of ``B`` ragged requests, request ``b`` owning rows
  ``query_start_loc[b] .. query_start_loc[b+1]``.
* ``kv_layer``     ``[2, num_blocks, block_size, KVH, D]`` one layer's paged cache, K then V. The new
  tokens' K/V are already in the cache: request ``b``'s keys are logical positions
  ``0 .. seq_lens[b]-1`` read through ``block_tables[b]``.
* ``context_lens`` ``[B]`` int32: every query of request ``b`` sees positions ``< context_lens[b]``.
* ``tree_mask``    ``[T, max_new]`` bool/uint8 or ``None``. ``None`` = causal among the new tokens
  (local query ``i`` sees new token ``j`` iff ``j <= i``; in general, when a request has fewer
  queries than new tokens ``seq_lens - context_lens``, bottom-right aligned: ``j <= i + (seq_lens[b]
  - context_lens[b] - q_len_b)``, as the torch backend of ``specd.model.attention`` does); otherwise query row ``t``
  sees new token
  ``j`` of its request iff ``tree_mask[t, j]``. The mask is read **dense** (one byte per entry,
  a ``bool`` tensor is reinterpreted as ``uint8``, nonzero = visible), only for the key tiles that
  hold new tokens; columns ``>= max_new`` read as invisible. The mask may be any pattern (it is not
  assumed lower-triangular).
* GQA: ``H = KVH * group``; query head ``h`` uses KV head ``h // group``.

Kernel design: one program per (request, query block, KV head[, KV split]). The rows of a program
are ``BLOCK_Q`` query tokens x the ``group`` query heads sharing that KV head, so each K/V tile is
loaded once per KV head (GQA-friendly, and decode with a single token still fills >= 16 MMA rows).
Flash-attention online softmax in the exp2 domain with fp32 statistics and fp32 accumulation,
output cast to ``q.dtype``. ``tl.dot`` operands (q, K, V and the probabilities ``p``) stay in their
16-bit storage dtype when q and the cache share fp16 or bf16 on a GPU (f16/bf16 tensor-core MMAs;
upcasting them ran tf32 MMAs at half that rate and spilled registers on sm_80, see
``specd_kernels.aot``); they are upcast to fp32 after loading (``DOT_F32``) under the Triton CPU
interpreter, whose bf16 arithmetic is wrong, and for fp32 or mixed-dtype inputs. With a tree mask,
each query token's mask row is loaded once and broadcast over its group's rows. The key loop runs
in two phases: the prefix (positions ``< context_len``, no mask but bounds) and the new tokens (tree mask or
causal; in the causal case the loop stops at the query block's last token). For small batches with
long contexts the key range is split over ``num_splits`` programs (flash-decoding) whose partial
(max, sum, acc) are merged by a second small kernel.

A query row with no visible key at all (only possible with an empty prefix and an all-false mask
row) gets an output of zeros (the reference does the same).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ._common import (
    FLOAT_DTYPES,
    HAS_TRITON,
    cdiv,
    check_dims,
    check_dtype,
    check_launchable,
    interpreting,
    next_pow2,
)

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _online_softmax_step(acc, m_i, l_i, q, kt, v, vis, qk_scale, PREC: tl.constexpr):
        # q [M, D], kt [D, N], v [N, D] in one dtype (fp16/bf16 on a GPU, else fp32), vis [M, N]
        # bool; acc, m_i (log2 domain) and l_i fp32; both dots accumulate in fp32.
        s = tl.dot(q, kt, input_precision=PREC) * qk_scale
        s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # rows that have seen nothing yet keep m = -inf; avoid (-inf) - (-inf) = nan
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
        return acc, m_new, l_i

    @triton.jit
    def _paged_kv_tile(k_head, v_head, bt_row, pos, valid, offs_d, d_mask, max_blocks, stride_kb, stride_ks,
                       stride_vb, stride_vs, BLOCK_SIZE: tl.constexpr, DOT_F32: tl.constexpr):  # fmt: skip
        # the keys (transposed, [D, N]) and values ([N, D]) at logical positions ``pos`` [N] of one KV
        # head, read through the sequence's block table ``bt_row``; invalid positions read 0
        blk_idx = tl.minimum(pos // BLOCK_SIZE, max_blocks - 1)
        blk = tl.load(bt_row + blk_idx, mask=valid, other=0).to(tl.int64)
        off = (pos % BLOCK_SIZE).to(tl.int64)
        kt = tl.load(
            k_head + blk[None, :] * stride_kb + off[None, :] * stride_ks + offs_d[:, None],
            mask=valid[None, :] & d_mask[:, None],
            other=0.0,
        )
        v = tl.load(
            v_head + blk[:, None] * stride_vb + off[:, None] * stride_vs + offs_d[None, :],
            mask=valid[:, None] & d_mask[None, :],
            other=0.0,
        )
        if DOT_F32:
            kt = kt.to(tl.float32)
            v = v.to(tl.float32)
        return kt, v

    # integer arguments that change from step to step (the block-table and tree-mask widths): not
    # specialized on (== 1, % 16), so a growing context or a new tree size does not compile a new
    # variant mid-stream (seen on an H200: a JIT compile per new combination). The split partials'
    # strides stay specialized (0 or multiples of 16 anyway; unspecializing them spills on sm_80).
    _STEP_VARYING = ("stride_btb", "stride_mt", "max_blocks", "mask_cols")

    @triton.jit(do_not_specialize=_STEP_VARYING)
    def _tree_attention_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        o_ptr,
        qsl_ptr,
        ctx_ptr,
        seqlen_ptr,
        bt_ptr,
        mask_ptr,
        part_ptr,
        ml_ptr,
        stride_qt,
        stride_qh,
        stride_kb,
        stride_ks,
        stride_kh,
        stride_vb,
        stride_vs,
        stride_vh,
        stride_ot,
        stride_oh,
        stride_btb,
        stride_mt,
        stride_ps,
        stride_pt,
        stride_ph,
        stride_mls,
        stride_mlt,
        stride_mlh,
        max_blocks,
        mask_cols,
        split_len,
        num_splits,
        qk_scale,
        HEAD_DIM: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        GROUP: tl.constexpr,
        GROUP_P: tl.constexpr,
        BLOCK_Q: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
        HAS_MASK: tl.constexpr,
        SPLIT: tl.constexpr,
        PREC: tl.constexpr,
        DOT_F32: tl.constexpr,
    ):
        BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_P
        pid_q = tl.program_id(0)
        b = tl.program_id(1)
        pid_hs = tl.program_id(2)
        if SPLIT:
            kvh = pid_hs // num_splits
            split = pid_hs % num_splits
        else:
            kvh = pid_hs
            split = 0

        q_start = tl.load(qsl_ptr + b)
        q_len = tl.load(qsl_ptr + b + 1) - q_start
        if pid_q * BLOCK_Q >= q_len:
            return
        ctx = tl.load(ctx_ptr + b)
        seq_len = tl.load(seqlen_ptr + b)

        rows = tl.arange(0, BLOCK_M)
        tok = pid_q * BLOCK_Q + rows // GROUP_P  # local query index within the request
        g = rows % GROUP_P
        row_valid = (tok < q_len) & (g < GROUP)
        head = kvh * GROUP + g
        t_idx = (q_start + tok).to(tl.int64)

        offs_d = tl.arange(0, BLOCK_D)
        d_mask = offs_d < HEAD_DIM
        offs_n = tl.arange(0, BLOCK_N)

        q = tl.load(
            q_ptr + t_idx[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
            mask=row_valid[:, None] & d_mask[None, :],
            other=0.0,
        )
        if DOT_F32:
            q = q.to(tl.float32)

        # key range of this program
        if not SPLIT:
            kv_lo = 0
            kv_hi = seq_len
        else:
            kv_lo = split * split_len
            kv_hi = tl.minimum(seq_len, kv_lo + split_len)
        # causal (no mask), bottom-right aligned: query i sees new token j iff j <= c_off + i
        c_off = seq_len - ctx - q_len  # 0 when the queries are exactly the new tokens
        if not HAS_MASK:
            # the last query of this block sees new tokens up to c_off + last_tok - 1
            last_tok = tl.minimum(q_len, (pid_q + 1) * BLOCK_Q)
            kv_hi = tl.minimum(kv_hi, ctx + c_off + last_tok)

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

        bt_row = bt_ptr + b.to(tl.int64) * stride_btb
        k_head = k_ptr + kvh.to(tl.int64) * stride_kh
        v_head = v_ptr + kvh.to(tl.int64) * stride_vh

        # ---- phase 1: the prefix, positions < ctx (visible to every query) ----
        pre_hi = tl.minimum(kv_hi, ctx)
        for start in range(kv_lo, pre_hi, BLOCK_N):
            pos = start + offs_n
            valid = pos < pre_hi
            kt, v = _paged_kv_tile(k_head, v_head, bt_row, pos, valid, offs_d, d_mask, max_blocks, stride_kb, stride_ks,
                                   stride_vb, stride_vs, BLOCK_SIZE, DOT_F32)  # fmt: skip
            vis = valid[None, :] & row_valid[:, None]
            acc, m_i, l_i = _online_softmax_step(acc, m_i, l_i, q, kt, v, vis, qk_scale, PREC)

        # ---- phase 2: the new tokens, positions ctx .. kv_hi-1 (tree mask or causal) ----
        new_lo = tl.maximum(kv_lo, ctx)
        if HAS_MASK:
            q_tok = pid_q * BLOCK_Q + tl.arange(0, BLOCK_Q)
            q_valid = q_tok < q_len
            mask_row = mask_ptr + (q_start + q_tok).to(tl.int64) * stride_mt
        for start in range(new_lo, kv_hi, BLOCK_N):
            pos = start + offs_n
            valid = pos < kv_hi
            j = pos - ctx  # local index of the new token
            kt, v = _paged_kv_tile(k_head, v_head, bt_row, pos, valid, offs_d, d_mask, max_blocks, stride_kb, stride_ks,
                                   stride_vb, stride_vs, BLOCK_SIZE, DOT_F32)  # fmt: skip
            if HAS_MASK:
                # one mask row per query token, shared by its GROUP_P head rows (row = tok * GROUP_P + g):
                # GROUP_P times fewer byte loads and live registers than loading it per row
                mq_ok = q_valid[:, None] & (valid & (j < mask_cols))[None, :]
                mv = tl.load(mask_row[:, None] + j[None, :], mask=mq_ok, other=0)
                mv = tl.broadcast_to(mv[:, None, :], (BLOCK_Q, GROUP_P, BLOCK_N))
                vis = row_valid[:, None] & (tl.reshape(mv, (BLOCK_M, BLOCK_N)) != 0)
            else:
                vis = row_valid[:, None] & valid[None, :] & (j[None, :] <= (c_off + tok)[:, None])
            acc, m_i, l_i = _online_softmax_step(acc, m_i, l_i, q, kt, v, vis, qk_scale, PREC)

        if not SPLIT:
            l_safe = tl.where(l_i == 0.0, 1.0, l_i)
            out = acc / l_safe[:, None]
            tl.store(
                o_ptr + t_idx[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                out.to(o_ptr.dtype.element_ty),
                mask=row_valid[:, None] & d_mask[None, :],
            )
        else:
            tl.store(
                part_ptr + split * stride_ps + t_idx[:, None] * stride_pt + head[:, None] * stride_ph + offs_d[None, :],
                acc,
                mask=row_valid[:, None] & d_mask[None, :],
            )
            ml_off = split * stride_mls + t_idx * stride_mlt + head * stride_mlh
            tl.store(ml_ptr + ml_off, m_i, mask=row_valid)
            tl.store(ml_ptr + ml_off + 1, l_i, mask=row_valid)

    @triton.jit
    def _tree_attention_combine_kernel(
        part_ptr,
        ml_ptr,
        o_ptr,
        stride_ps,
        stride_pt,
        stride_ph,
        stride_mls,
        stride_mlt,
        stride_mlh,
        stride_ot,
        stride_oh,
        num_splits,
        HEAD_DIM: tl.constexpr,
        SPLITS_P: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        offs_s = tl.arange(0, SPLITS_P)
        s_mask = offs_s < num_splits
        offs_d = tl.arange(0, BLOCK_D)
        d_mask = offs_d < HEAD_DIM
        ml_off = offs_s * stride_mls + t * stride_mlt + h * stride_mlh
        m = tl.load(ml_ptr + ml_off, mask=s_mask, other=float("-inf"))
        l_sum = tl.load(ml_ptr + ml_off + 1, mask=s_mask, other=0.0)
        m_max = tl.max(m, 0)
        m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
        w = tl.exp2(m - m_safe)  # 0 for empty splits (m = -inf)
        l_tot = tl.sum(w * l_sum, 0)
        acc = tl.load(
            part_ptr + offs_s[:, None] * stride_ps + t * stride_pt + h * stride_ph + offs_d[None, :],
            mask=s_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
        out = tl.sum(acc * w[:, None], 0)
        out = out / tl.where(l_tot == 0.0, 1.0, l_tot)
        tl.store(o_ptr + t * stride_ot + h * stride_oh + offs_d, out.to(o_ptr.dtype.element_ty), mask=d_mask)


_LOG2E = 1.4426950408889634
_CONFIG_CACHE: dict = {}

try:
    from triton.runtime.errors import OutOfResources
except Exception:  # pragma: no cover
    OutOfResources = None
_META_DTYPES = (torch.int32,)


def _check_args(q, kv_layer, query_start_loc, context_lens, seq_lens, block_tables, tree_mask, out, what):
    check_dims("q", q, 3, what)
    check_dims("kv_layer", kv_layer, 5, what)
    check_dtype("q", q, FLOAT_DTYPES, what)
    check_dtype("kv_layer", kv_layer, FLOAT_DTYPES, what)
    T, H, D = q.shape
    if kv_layer.shape[0] != 2:
        raise ValueError(f"{what}: kv_layer must be [2, num_blocks, block_size, KVH, D], got {tuple(kv_layer.shape)}")
    _, NB, BS, KVH, Dk = kv_layer.shape
    if Dk != D:
        raise ValueError(f"{what}: head dim of q ({D}) != head dim of kv_layer ({Dk})")
    if KVH == 0 or H % KVH != 0:
        raise ValueError(f"{what}: num query heads ({H}) must be a multiple of num kv heads ({KVH})")
    for name, t in (("query_start_loc", query_start_loc), ("context_lens", context_lens), ("seq_lens", seq_lens)):
        check_dims(name, t, 1, what)
        check_dtype(name, t, _META_DTYPES, what)
        if not t.is_contiguous():
            raise ValueError(f"{what}: {name} must be contiguous")
    B = query_start_loc.shape[0] - 1
    if B < 0:
        raise ValueError(f"{what}: query_start_loc must have B+1 >= 1 entries")
    if context_lens.shape[0] != B or seq_lens.shape[0] != B:
        raise ValueError(
            f"{what}: context_lens/seq_lens must have B={B} entries, got "
            f"{context_lens.shape[0]} and {seq_lens.shape[0]}"
        )
    check_dims("block_tables", block_tables, 2, what)
    check_dtype("block_tables", block_tables, _META_DTYPES, what)
    if block_tables.shape[0] != B:
        raise ValueError(f"{what}: block_tables must have B={B} rows, got {block_tables.shape[0]}")
    if block_tables.shape[1] > 0 and block_tables.stride(1) != 1:
        raise ValueError(f"{what}: block_tables rows must be contiguous (stride(1) == 1)")
    if tree_mask is not None:
        check_dims("tree_mask", tree_mask, 2, what)
        check_dtype("tree_mask", tree_mask, (torch.bool, torch.uint8), what)
        if tree_mask.shape[0] != T:
            raise ValueError(f"{what}: tree_mask must be [T={T}, max_new], got {tuple(tree_mask.shape)}")
        if tree_mask.shape[1] > 0 and tree_mask.stride(1) != 1:
            raise ValueError(f"{what}: tree_mask rows must be contiguous (stride(1) == 1)")
    if q.stride(2) != 1:
        raise ValueError(f"{what}: q must be contiguous in the head dim (stride(2) == 1)")
    if kv_layer.stride(4) != 1:
        raise ValueError(f"{what}: kv_layer must be contiguous in the head dim (stride(4) == 1)")
    if out is not None:
        if tuple(out.shape) != tuple(q.shape) or out.dtype != q.dtype:
            raise ValueError(
                f"{what}: out must match q ({tuple(q.shape)}, {q.dtype}), got {tuple(out.shape)}, {out.dtype}"
            )
        if out.stride(2) != 1:
            raise ValueError(f"{what}: out must be contiguous in the head dim (stride(2) == 1)")
        if out.device != q.device:
            raise ValueError(f"{what}: out must be on {q.device}, got {out.device}")
    return T, H, D, NB, BS, KVH, B


@functools.cache
def _num_sms_of(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return _num_sms_of(device.index if device.index is not None else torch.cuda.current_device())


@dataclass(frozen=True)
class TreeAttentionConfig:
    """One launch configuration of ``_tree_attention_kernel``, as the launcher picks it.

    ``num_stages`` None means Triton's default (3 for CUDA); ``maxnreg`` None, no register budget
    (ptxas picks); ``splits`` > 1 means flash-decoding (each program covers ``split_len`` keys, a
    multiple of ``block_n``) plus the combine kernel.
    """

    block_q: int  # query tokens per program
    block_n: int  # keys per tile
    block_d: int  # head dim padded to a power of two >= 16
    group: int  # query heads per KV head
    group_p: int  # group padded to a power of two
    n_qblocks: int  # programs along the query axis (grid dim 0)
    num_warps: int
    num_stages: int | None
    maxnreg: int | None  # PTX .maxnreg register budget; None: ptxas decides
    splits: int
    split_len: int

    @property
    def block_m(self) -> int:
        """MMA rows of a program: ``block_q`` tokens x ``group_p`` heads."""
        return self.block_q * self.group_p


def choose_blocks(
    head_dim: int,
    group: int,
    max_query_len: int,
    *,
    interpret: bool,
    block_q: int | None = None,
    block_n: int | None = None,
) -> tuple[int, int]:
    """The launcher's preferred ``(block_q, block_n)``; explicit ``block_q``/``block_n`` are rounded.

    Query tokens per program fill >= 16 MMA rows (``block_q * group_p``) and aim at 64 rows, or
    128 when the problem has that many rows, the padded head dim is < 128 and the kernel is
    compiled. Keys per tile: 64 for a padded head dim < 128, else 32; at least 16. (Up to 2026-12
    head_dim 128 took 128 rows and 64 keys too: ptxas spilled up to 736 bytes per thread on sm_80
    there, see ``python -m specd_kernels.aot``.)
    """
    group_p = next_pow2(group)
    wide = next_pow2(head_dim) >= 128  # the tiles are BLOCK_D = next_pow2(head_dim) wide
    if block_q is None:
        big = max_query_len * group_p >= 128 and not wide and not interpret
        block_q = max(1, (128 if big else 64) // group_p)
        block_q = min(block_q, next_pow2(max_query_len))
    block_q = max(next_pow2(block_q), cdiv(16, group_p))
    if block_n is None:
        block_n = 32 if wide else 64
    block_n = max(16, next_pow2(block_n))
    return block_q, block_n


def choose_warps(block_m: int, head_dim: int) -> int:
    """8 warps for 128-row tiles and for 64-row tiles with a padded head dim >= 128 (their
    accumulator and K/V operands need ~255 registers per thread with 4 warps on sm_80), else 4."""
    return 8 if block_m >= 128 or (block_m >= 64 and next_pow2(head_dim) >= 128) else 4


# Register budget (PTX .maxnreg) of compiled 16-row tiles (decode) up to 128-wide heads: without
# one, ptxas traded a few bytes of spill (one value kept across the key loop) for occupancy at
# 72-128 registers in some decode configurations; with 128 none spills and 4 programs of 4 warps
# still fit an SM. Wider heads (256) need ~180-200 registers there: budget 255.
DECODE_MAXNREG = 128


def decode_maxnreg(head_dim: int) -> int:
    """The register budget of a compiled 16-row tile (see ``DECODE_MAXNREG``)."""
    return DECODE_MAXNREG if next_pow2(head_dim) <= 128 else 255


def choose_splits(
    *,
    batch: int,
    num_kv_heads: int,
    n_qblocks: int,
    max_seq_len: int,
    block_n: int,
    num_sms: int | None,
    num_splits: int | None = None,
) -> tuple[int, int]:
    """``(splits, split_len)`` over the key range (flash-decoding).

    Default: 1 when not compiled for CUDA (``num_sms`` None), else enough programs for two per SM
    when ``batch * n_qblocks * num_kv_heads`` is small, at most one split per 256 keys and 32 in
    all. ``split_len`` is a multiple of ``block_n``; the split count is then recomputed from it.
    """
    splits = num_splits
    if splits is None:
        if num_sms is None:
            splits = 1
        else:
            base = batch * n_qblocks * num_kv_heads
            splits = max(1, min(cdiv(2 * num_sms, base), cdiv(max_seq_len, 256), 32))
    splits = max(1, min(int(splits), cdiv(max_seq_len, block_n)))
    split_len = cdiv(cdiv(max_seq_len, splits), block_n) * block_n
    if splits > 1:
        splits = cdiv(max_seq_len, split_len)
    return splits, split_len


@functools.lru_cache(maxsize=512)  # pure; a step's layers ask the same question (launch overhead on a GPU)
def launch_configs(
    *,
    head_dim: int,
    group: int,
    num_kv_heads: int,
    batch: int,
    max_query_len: int,
    max_seq_len: int,
    num_sms: int | None,
    interpret: bool = False,
    num_splits: int | None = None,
    block_q: int | None = None,
    block_n: int | None = None,
) -> tuple[TreeAttentionConfig, ...]:
    """Every configuration :func:`tree_attention` may launch for one problem, in the order it tries
    them (pure: no tensors, no device; ``num_sms`` None = interpreter / not CUDA; memoized).

    The first is the launcher's choice; the others are its fallbacks when compiling raises
    ``OutOfResources`` (shared memory / registers): one pipeline stage, then 32-key tiles, then
    halved query blocks with 16-key tiles, then the smallest query block. Warps: :func:`choose_warps`;
    compiled 16-row tiles get the register budget ``DECODE_MAXNREG``.
    """
    group_p = next_pow2(group)
    bq, bn = choose_blocks(head_dim, group, max_query_len, interpret=interpret, block_q=block_q, block_n=block_n)
    min_q = cdiv(16, group_p)
    ladder = [(bq, bn, None), (bq, bn, 1), (bq, min(bn, 32), 1), (max(min_q, bq // 2), 16, 1), (min_q, 16, 1)]
    out = []
    for lq, ln, stages in ladder:
        n_qblocks = cdiv(max_query_len, lq)
        splits, split_len = choose_splits(
            batch=batch,
            num_kv_heads=num_kv_heads,
            n_qblocks=n_qblocks,
            max_seq_len=max_seq_len,
            block_n=ln,
            num_sms=num_sms,
            num_splits=num_splits,
        )
        out.append(
            TreeAttentionConfig(
                block_q=lq,
                block_n=ln,
                block_d=max(16, next_pow2(head_dim)),
                group=group,
                group_p=group_p,
                n_qblocks=n_qblocks,
                num_warps=choose_warps(lq * group_p, head_dim),
                num_stages=stages,
                maxnreg=decode_maxnreg(head_dim) if (lq * group_p <= 16 and not interpret) else None,
                splits=splits,
                split_len=split_len,
            )
        )
    return tuple(out)


def dot_operands(q_dtype: torch.dtype, kv_dtype: torch.dtype, *, interpret: bool) -> tuple[bool, str]:
    """``(DOT_F32, PREC)`` for the kernel.

    ``DOT_F32`` (upcast q/K/V to fp32 before ``tl.dot``) is False only for a compiled launch whose
    q and cache are both fp16 or both bf16: the dots then run f16/bf16 MMAs with fp32 accumulation.
    The interpreter always upcasts (its bf16 arithmetic is wrong). ``PREC`` is "ieee" for fp32
    inputs (exact fp32 dots), else "tf32" (used only by upcast 16-bit operands, which tf32 holds
    exactly).
    """
    native = (not interpret) and q_dtype == kv_dtype and q_dtype in (torch.float16, torch.bfloat16)
    prec = "ieee" if (q_dtype == torch.float32 and kv_dtype == torch.float32) else "tf32"
    return (not native), prec


def _split_buffers(cfg: TreeAttentionConfig, q: torch.Tensor, out: torch.Tensor) -> tuple:
    """Split-KV partials ``part`` [S, T, H, D] and ``ml`` [S, T, H, 2] (fp32) and their strides; with
    one split, dummies (never read) and zero strides."""
    if cfg.splits <= 1:
        return out, out, (0, 0, 0), (0, 0, 0)
    T, H, D = q.shape
    part = torch.empty((cfg.splits, T, H, D), dtype=torch.float32, device=q.device)
    ml = torch.empty((cfg.splits, T, H, 2), dtype=torch.float32, device=q.device)
    return part, ml, tuple(part.stride()[:3]), tuple(ml.stride()[:3])


def _launch_plan(q, kv_layer, meta, tree_mask, out, scale, cfg: TreeAttentionConfig, dot) -> list:
    """``[(kernel, grid, args, kwargs)]``: the launches of one call, in order (nothing is launched).

    ``meta`` = ``(query_start_loc, context_lens, seq_lens, block_tables)``, ``dot`` = ``(DOT_F32,
    PREC)``. Allocates only the split-KV partials. ``specd_kernels.aot`` builds it from meta-device
    tensors to compile exactly what the launcher launches.
    """
    qsl, ctx_lens, seq_lens, block_tables = meta
    T, H, D = q.shape
    mask_arg = tree_mask.view(torch.uint8) if tree_mask is not None and tree_mask.dtype == torch.bool else tree_mask
    has_mask = mask_arg is not None
    if not has_mask:
        mask_arg = qsl  # dummy pointer, never read
    k_cache, v_cache = kv_layer[0], kv_layer[1]
    part, ml, p_strides, ml_strides = _split_buffers(cfg, q, out)
    tensors = (q, k_cache, v_cache, out, qsl, ctx_lens, seq_lens, block_tables, mask_arg, part, ml)
    strides = (
        *q.stride()[:2], *k_cache.stride()[:3], *v_cache.stride()[:3], *out.stride()[:2], block_tables.stride(0),
        mask_arg.stride(0) if has_mask else 0, *p_strides, *ml_strides,
    )  # fmt: skip
    sizes = (max(1, block_tables.shape[1]), mask_arg.shape[1] if has_mask else 0, cfg.split_len, cfg.splits)
    args = (*tensors, *strides, *sizes, float(scale) * _LOG2E)
    extra = {} if cfg.num_stages is None else {"num_stages": cfg.num_stages}
    if cfg.maxnreg is not None:
        extra["maxnreg"] = cfg.maxnreg
    kw = dict(
        HEAD_DIM=D, BLOCK_SIZE=kv_layer.shape[2], GROUP=cfg.group, GROUP_P=cfg.group_p, BLOCK_Q=cfg.block_q,
        BLOCK_N=cfg.block_n, BLOCK_D=cfg.block_d, HAS_MASK=has_mask, SPLIT=cfg.splits > 1, PREC=dot[1],
        DOT_F32=dot[0], num_warps=cfg.num_warps, **extra,
    )  # fmt: skip
    plan = [(_tree_attention_kernel, (cfg.n_qblocks, qsl.shape[0] - 1, kv_layer.shape[3] * cfg.splits), args, kw)]
    if cfg.splits > 1:
        cargs = (part, ml, out, *p_strides, *ml_strides, out.stride(0), out.stride(1), cfg.splits)
        ckw = dict(HEAD_DIM=D, SPLITS_P=next_pow2(cfg.splits), BLOCK_D=cfg.block_d, num_warps=4)
        plan.append((_tree_attention_combine_kernel, (T, H), cargs, ckw))
    return plan


def tree_attention(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    tree_mask: torch.Tensor | None,
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    out: torch.Tensor | None = None,
    *,
    num_splits: int | None = None,
    block_n: int | None = None,
    block_q: int | None = None,
) -> torch.Tensor:
    """Triton paged tree/causal attention. Returns ``out`` ``[T, H, D]`` in ``q.dtype``.

    ``max_query_len`` must be >= every request's new-token count and ``max_seq_len`` >= every
    ``seq_lens[b]`` (python ints, no host sync; they size the grid). Rows of ``q`` beyond
    ``query_start_loc[B]`` are not written. Keyword-only tuning knobs (tests use them to force
    code paths): ``num_splits`` (KV splits, default: heuristic, 1 under the interpreter),
    ``block_n`` (keys per tile), ``block_q`` (query tokens per program). The configuration comes
    from :func:`launch_configs`; if compiling one raises ``OutOfResources`` the next is tried, and
    the level that worked is remembered per problem class.
    """
    what = "tree_attention"
    T, H, D, NB, BS, KVH, B = _check_args(
        q, kv_layer, query_start_loc, context_lens, seq_lens, block_tables, tree_mask, out, what
    )
    others = [kv_layer, query_start_loc, context_lens, seq_lens, block_tables, tree_mask, out]
    check_launchable(q, *(x for x in others if x is not None), what=what)
    max_query_len = int(max_query_len)
    max_seq_len = int(max_seq_len)
    if out is None:
        out = torch.empty_like(q)
    if T == 0 or B == 0 or max_query_len <= 0 or max_seq_len <= 0:
        return out
    interp = interpreting()
    cfgs = launch_configs(
        head_dim=D,
        group=H // KVH,
        num_kv_heads=KVH,
        batch=B,
        max_query_len=max_query_len,
        max_seq_len=max_seq_len,
        num_sms=None if interp else _num_sms(q.device),
        interpret=interp,
        num_splits=num_splits,
        block_q=block_q,
        block_n=block_n,
    )
    dot = dot_operands(q.dtype, kv_layer.dtype, interpret=interp)
    meta = (query_start_loc, context_lens, seq_lens, block_tables)
    top = cfgs[0]
    key = (q.device.type, q.dtype, kv_layer.dtype, D, top.group_p, top.block_q, top.block_n, tree_mask is not None)
    return _launch_first_that_fits(
        cfgs, key, lambda cfg: _launch_plan(q, kv_layer, meta, tree_mask, out, scale, cfg, dot), out
    )


def _launch_first_that_fits(cfgs: tuple, key: tuple, plan_for, out: torch.Tensor) -> torch.Tensor:
    """Launch the plan of the first configuration (from the one remembered for ``key``) that
    compiles; ``OutOfResources`` moves on to the next, anything else is re-raised."""
    last_err = None
    for level in range(_CONFIG_CACHE.get(key, 0), len(cfgs)):
        try:
            for kernel, grid, args, kw in plan_for(cfgs[level]):
                kernel[grid](*args, **kw)
        except Exception as err:  # OutOfResources (compile time); anything else is re-raised
            if OutOfResources is None or not isinstance(err, OutOfResources):
                raise
            last_err = err
            continue
        _CONFIG_CACHE[key] = level
        return out
    raise last_err


def tree_attention_ref(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    tree_mask: torch.Tensor | None,
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pure-torch reference of :func:`tree_attention` (any device, fp32 math, one request at a time)."""
    what = "tree_attention_ref"
    T, H, D, NB, BS, KVH, B = _check_args(
        q, kv_layer, query_start_loc, context_lens, seq_lens, block_tables, tree_mask, out, what
    )
    if out is None:
        out = torch.empty_like(q)
    group = H // KVH
    qsl = query_start_loc.tolist()
    ctxs = context_lens.tolist()
    sls = seq_lens.tolist()
    for b in range(B):
        qs, qe, ctx, sl = qsl[b], qsl[b + 1], ctxs[b], sls[b]
        n = qe - qs
        if n <= 0:
            continue
        dev = q.device
        pos = torch.arange(sl, device=dev)
        blocks = block_tables[b].long()[pos // BS]
        offs = pos % BS
        k = kv_layer[0][blocks, offs].float()  # [sl, KVH, D]
        v = kv_layer[1][blocks, offs].float()
        k = k.repeat_interleave(group, dim=1)  # [sl, H, D]
        v = v.repeat_interleave(group, dim=1)
        vis = torch.zeros(n, sl, dtype=torch.bool, device=dev)
        vis[:, : min(ctx, sl)] = True
        n_new = sl - ctx
        if n_new > 0:
            i = torch.arange(n, device=dev)[:, None]
            j = torch.arange(n_new, device=dev)[None, :]
            if tree_mask is None:
                new_vis = j <= i + (n_new - n)  # bottom-right aligned causal
            else:
                cols = min(n_new, tree_mask.shape[1])
                new_vis = torch.zeros(n, n_new, dtype=torch.bool, device=dev)
                new_vis[:, :cols] = tree_mask[qs:qe, :cols] != 0
            vis[:, ctx:] = new_vis
        qf = q[qs:qe].float()  # [n, H, D]
        s = torch.einsum("qhd,khd->hqk", qf, k) * float(scale)
        s = s.masked_fill(~vis[None], float("-inf"))
        p = torch.softmax(s, dim=-1)
        p = torch.nan_to_num(p, nan=0.0)  # rows with no visible key -> zeros
        o = torch.einsum("hqk,khd->qhd", p, v)
        out[qs:qe] = o.to(out.dtype)
    return out
