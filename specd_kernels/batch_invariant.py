"""Batch-invariant kernels: a row's result is bitwise the same whatever else shares its step.

cuBLAS and torch's reductions pick their kernel (tile shape, split-K, reduction tree) from the
problem's size, so the logits of one token differ in their last bits between a 1-row decode step
and a 17-row tree verification, and greedy speculative output drifts from plain output on a GPU.
Here every reduction a decode / verify step makes has an order fixed by the weights' shape alone:

* :func:`matmul` ``y [M, N] = x [M, K] @ w [N, K]^T (+ bias [N]) (+ add [M, N])`` (``nn.Linear``'s
  layout; ``add`` is the residual of ``torch.addmm(res, x, W^T)``). One program per
  ``BLOCK_M x BLOCK_N`` output tile, the K loop in steps of ``BLOCK_K`` from 0 upwards, fp32
  accumulation, no split-K; the tile sizes depend on (N, K, dtype) only (:func:`matmul_config`),
  never on M. Padded rows load zeros, and an MMA row depends only on its own row of x, so row i of y
  is the same bits for M = 1 and M = 300. The LM head is the same GEMM.
* :func:`rms_norm` ``y = x * rsqrt(mean(x^2) + eps) * w`` per row of ``x [..., D]`` with ``w`` [D]
  or [W, D] (a per-head weight: row r of the flattened x takes weight row r % W, as q/k norms do):
  one program per row, the sum of squares over ``BLOCK_D`` chunks in a fixed order, fp32.
* :func:`attention` paged causal / tree attention with the metadata of
  ``specd_kernels.tree_attention`` (``query_start_loc``, ``context_lens``, ``seq_lens``,
  ``block_tables``, ``tree_mask``) plus an optional sliding window. One program per (query token, KV
  head); the keys a token sees are walked in *logical* order: the prefix positions ``0 .. ctx-1``,
  then the new-token columns it sees in column order (causal: ``0 .. i + region - q_len``; a tree
  node: its root path, the set bits of its mask row). Tiles of ``BLOCK_N`` keys sit at fixed
  logical offsets (0, BLOCK_N, ...), so a token decoded plainly at position p (``ctx = p``, one new
  token) and the same token verified as a tree node at depth d (``ctx = p - d``, its ancestors in
  scattered cache slots) reduce the same keys in the same tiles: bitwise the same output.
  ``tree_attention`` is not invariant in that sense: it tiles by cache slot in two phases split at
  ``ctx``, sizes its query blocks by ``max_query_len`` and splits the key range by the batch.
  The cost: no key-range split and no K/V tile shared between a request's query tokens (each
  (token, KV head) program streams its own keys; a tree's tokens mostly hit L2).

Under the Triton CPU interpreter the 16-bit operands are upcast to fp32 in the kernels (its bf16
arithmetic is wrong); the interpreter's tiles are small (slow launches) but just as fixed. Every
launcher has a pure-torch ``*_ref`` twin (fp32 math) used as the oracle in the tests.
"""

from __future__ import annotations

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
    tl,
    triton,
)

# ---------------------------------------------------------------------------------------------
# references (pure torch, any device, fp32 math)
# ---------------------------------------------------------------------------------------------


def matmul_ref(x: torch.Tensor, w: torch.Tensor, bias=None, add=None) -> torch.Tensor:
    """``x [M, K] @ w [N, K]^T (+ bias [N]) (+ add [M, N])`` in fp32, the result in x's dtype."""
    y = x.float() @ w.float().t()  # [M, N]
    if bias is not None:
        y = y + bias.float()
    if add is not None:
        y = y + add.float()
    return y.to(x.dtype)


def rms_norm_ref(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """``x * rsqrt(mean(x^2, -1) + eps) * w`` in fp32, the result in x's dtype; ``w`` [D] or [W, D]
    (row r of ``x`` flattened to [R, D] takes weight row r % W)."""
    D = x.shape[-1]
    xf = x.float().reshape(-1, D)  # [R, D]
    wf = w.float().reshape(-1, D)  # [W, D]
    rows = torch.arange(xf.shape[0], device=x.device) % wf.shape[0]
    y = xf * torch.rsqrt((xf * xf).mean(-1, keepdim=True) + eps) * wf[rows]
    return y.reshape(x.shape).to(x.dtype)


def visible_keys(ctx: int, region: int, q_len: int, i: int, mask_row, window: int | None) -> list:
    """The cache positions query ``i`` of a request sees, in the logical order :func:`attention`
    walks them: prefix ``0 .. ctx-1``, then its new-token columns (causal: ``0 .. i + region -
    q_len``; ``mask_row``: its set bits) at ``ctx + column``; a window keeps the last ``window``."""
    cols = range(i + region - q_len + 1) if mask_row is None else [j for j, v in enumerate(mask_row) if v]
    keys = list(range(ctx)) + [ctx + j for j in cols]
    return keys[max(0, len(keys) - window) :] if window else keys


def attention_ref(q, kv_layer, query_start_loc, context_lens, seq_lens, block_tables, tree_mask, scale, window=None):
    """Pure-torch reference of :func:`attention`: per token, softmax over :func:`visible_keys` (fp32)."""
    T, H, D = q.shape
    BS, KVH = kv_layer.shape[2], kv_layer.shape[3]
    out = torch.zeros_like(q)
    qsl, ctxs, sls = query_start_loc.tolist(), context_lens.tolist(), seq_lens.tolist()
    mask = None if tree_mask is None else tree_mask.bool().tolist()
    for b in range(len(ctxs)):
        q_len = qsl[b + 1] - qsl[b]
        for i in range(q_len):
            t = qsl[b] + i
            pos = torch.tensor(
                visible_keys(ctxs[b], sls[b] - ctxs[b], q_len, i, None if mask is None else mask[t], window),
                dtype=torch.long,
                device=q.device,
            )
            if pos.numel() == 0:
                continue
            slots = block_tables[b].long()[pos // BS] * BS + pos % BS  # [n]
            k = kv_layer[0].reshape(-1, KVH, D)[slots].float().repeat_interleave(H // KVH, dim=1)  # [n, H, D]
            v = kv_layer[1].reshape(-1, KVH, D)[slots].float().repeat_interleave(H // KVH, dim=1)
            p = torch.softmax(torch.einsum("hd,nhd->hn", q[t].float(), k) * float(scale), dim=-1)  # [H, n]
            out[t] = torch.einsum("hn,nhd->hd", p, v).to(q.dtype)
    return out


# ---------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------

if HAS_TRITON:
    from .tree_attention import _online_softmax_step, _paged_kv_tile

    @triton.jit
    def _bi_matmul_kernel(
        x_ptr, w_ptr, b_ptr, a_ptr, y_ptr,
        M, N, K,
        sxm, sxk, swn, swk, sam, san, sym, syn,
        HAS_BIAS: tl.constexpr, HAS_ADD: tl.constexpr, DOT_F32: tl.constexpr, PREC: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        pid_m = tl.program_id(0)  # fastest: the programs sharing a W tile run together (L2)
        pid_n = tl.program_id(1)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        mm = rm < M
        nm = rn < N
        x_rows = x_ptr + rm[:, None].to(tl.int64) * sxm
        w_cols = w_ptr + rn[None, :].to(tl.int64) * swn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):  # the one reduction order over K, whatever M is
            kk = k0 + rk  # [BLOCK_K]
            km = kk < K
            x = tl.load(x_rows + kk[None, :] * sxk, mask=mm[:, None] & km[None, :], other=0.0)  # [BM, BK]
            w = tl.load(w_cols + kk[:, None] * swk, mask=km[:, None] & nm[None, :], other=0.0)  # [BK, BN]
            if DOT_F32:
                acc += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision=PREC)
            else:
                acc += tl.dot(x, w)
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=nm, other=0.0).to(tl.float32)[None, :]
        if HAS_ADD:
            acc += tl.load(a_ptr + rm[:, None] * sam + rn[None, :] * san, mask=mm[:, None] & nm[None, :], other=0.0).to(
                tl.float32
            )
        y = y_ptr + rm[:, None].to(tl.int64) * sym + rn[None, :] * syn
        tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=mm[:, None] & nm[None, :])

    @triton.jit
    def _bi_rms_norm_kernel(
        x_ptr, w_ptr, y_ptr, D, W, sx, sw, sy, eps,
        BLOCK_D: tl.constexpr, ONE_TILE: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        x_row = x_ptr + row * sx
        w_row = w_ptr + (row % W) * sw
        y_row = y_ptr + row * sy
        offs = tl.arange(0, BLOCK_D)
        if ONE_TILE:  # the row in registers: one read of x
            m = offs < D
            x = tl.load(x_row + offs, mask=m, other=0.0).to(tl.float32)
            rstd = tl.math.rsqrt(tl.sum(x * x, 0) / D + eps)
            w = tl.load(w_row + offs, mask=m, other=0.0).to(tl.float32)
            tl.store(y_row + offs, (x * rstd * w).to(y_ptr.dtype.element_ty), mask=m)
        else:
            acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
            for d0 in range(0, D, BLOCK_D):
                m = d0 + offs < D
                x = tl.load(x_row + d0 + offs, mask=m, other=0.0).to(tl.float32)
                acc += x * x
            rstd = tl.math.rsqrt(tl.sum(acc, 0) / D + eps)
            for d0 in range(0, D, BLOCK_D):
                m = d0 + offs < D
                x = tl.load(x_row + d0 + offs, mask=m, other=0.0).to(tl.float32)
                w = tl.load(w_row + d0 + offs, mask=m, other=0.0).to(tl.float32)
                tl.store(y_row + d0 + offs, (x * rstd * w).to(y_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _bi_attention_kernel(
        q_ptr, k_ptr, v_ptr, o_ptr, req_ptr, qsl_ptr, ctx_ptr, seqlen_ptr, bt_ptr, cols_ptr, nvis_ptr,
        stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
        stride_ot, stride_oh, stride_btb, stride_ct,
        max_blocks, window, qk_scale,
        HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_P: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HAS_MASK: tl.constexpr, DOT_F32: tl.constexpr,
        PREC: tl.constexpr,
    ):  # fmt: skip
        t = tl.program_id(0)
        kvh = tl.program_id(1)
        b = tl.load(req_ptr + t)
        ctx = tl.load(ctx_ptr + b)
        q_start = tl.load(qsl_ptr + b)
        q_end = tl.load(qsl_ptr + b + 1)
        if HAS_MASK:
            n_keys = ctx + tl.load(nvis_ptr + t)
        else:  # bottom-right aligned causal: local query i sees new columns 0 .. i + region - q_len
            n_keys = tl.load(seqlen_ptr + b) - (q_end - q_start) + (t - q_start) + 1
        n_keys = tl.where(t < q_end, n_keys, 0)  # rows past the last request: no keys, zeros out
        lo = tl.where(window > 0, tl.maximum(n_keys - window, 0), 0)

        g = tl.arange(0, GROUP_P)
        row_valid = g < GROUP
        head = kvh * GROUP + g
        offs_d = tl.arange(0, BLOCK_D)
        d_mask = offs_d < HEAD_DIM
        offs_n = tl.arange(0, BLOCK_N)
        t64 = t.to(tl.int64)
        q = tl.load(
            q_ptr + t64 * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
            mask=row_valid[:, None] & d_mask[None, :],
            other=0.0,
        )
        if DOT_F32:
            q = q.to(tl.float32)
        m_i = tl.full([GROUP_P], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([GROUP_P], dtype=tl.float32)
        acc = tl.zeros([GROUP_P, BLOCK_D], dtype=tl.float32)
        bt_row = bt_ptr + b.to(tl.int64) * stride_btb
        k_head = k_ptr + kvh.to(tl.int64) * stride_kh
        v_head = v_ptr + kvh.to(tl.int64) * stride_vh
        for start in range((lo // BLOCK_N) * BLOCK_N, n_keys, BLOCK_N):  # tiles at fixed logical offsets
            lg = start + offs_n  # logical key index
            valid = (lg < n_keys) & (lg >= lo)
            pos = lg
            if HAS_MASK:  # past the prefix: the lg - ctx'th column this token sees
                new = valid & (lg >= ctx)
                col = tl.load(cols_ptr + t64 * stride_ct + (lg - ctx), mask=new, other=0)
                pos = tl.where(new, ctx + col, lg)
            kt, v = _paged_kv_tile(k_head, v_head, bt_row, pos, valid, offs_d, d_mask, max_blocks, stride_kb, stride_ks,
                                   stride_vb, stride_vs, BLOCK_SIZE, DOT_F32)  # fmt: skip
            vis = valid[None, :] & row_valid[:, None]
            acc, m_i, l_i = _online_softmax_step(acc, m_i, l_i, q, kt, v, vis, qk_scale, PREC)
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(
            o_ptr + t64 * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
            out.to(o_ptr.dtype.element_ty),
            mask=row_valid[:, None] & d_mask[None, :],
        )


# ---------------------------------------------------------------------------------------------
# launch configurations: functions of the weights' / heads' shape and dtype, never of the rows
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MatmulConfig:
    """Tile of :func:`matmul` for a weight of shape [N, K]; M never enters."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def matmul_config(N: int, K: int, dtype: torch.dtype, interpret: bool = False) -> MatmulConfig:
    """16-row tiles (decode and verification widths; a prefill chunk re-reads W tiles from L2),
    32 output columns for N < 32768 (more programs for a 1-row GEMV-like step) else 64, K in
    steps of 128 (fp32: 32, ieee dots). Interpreter: 16 x 64 x 64 (few programs: each launch is slow)."""
    if interpret:
        return MatmulConfig(16, 64, 64, 1, 1)
    if dtype == torch.float32:
        return MatmulConfig(16, 32, 32, 4, 3)
    return MatmulConfig(16, 32 if N < 32768 else 64, 128, 4, 4)


def dot_mode(dtype: torch.dtype, interpret: bool) -> tuple[bool, str]:
    """``(DOT_F32, PREC)``: 16-bit operands straight into the MMA when compiled; the interpreter
    and fp32 inputs upcast / stay fp32 with exact ("ieee") dots."""
    return (dtype == torch.float32 or interpret), "ieee"


def _matmul_plan(x, w, bias, add, y, cfg: MatmulConfig, interpret: bool = False) -> list:
    """``[(kernel, grid, args, kwargs)]`` of one :func:`matmul` (nothing launched; ``aot`` builds
    it from meta-device tensors)."""
    M, K = x.shape
    N = w.shape[0]
    dot_f32, prec = dot_mode(x.dtype, interpret)
    grid = (cdiv(M, cfg.block_m), cdiv(N, cfg.block_n))
    args = (
        x, w, bias if bias is not None else w, add if add is not None else y, y, M, N, K,
        x.stride(0), x.stride(1), w.stride(0), w.stride(1),
        add.stride(0) if add is not None else 0, add.stride(1) if add is not None else 0, y.stride(0), y.stride(1),
    )  # fmt: skip
    kw = dict(
        HAS_BIAS=bias is not None, HAS_ADD=add is not None, DOT_F32=dot_f32, PREC=prec, BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return [(_bi_matmul_kernel, grid, args, kw)]


def matmul(x: torch.Tensor, w: torch.Tensor, bias=None, add=None, out=None) -> torch.Tensor:
    """``x [M, K] @ w [N, K]^T (+ bias [N]) (+ add [M, N])`` -> [M, N] in x's dtype, batch-invariant
    (see the module doc). Any strides; ``w`` and ``x`` share a dtype (fp32 / fp16 / bf16)."""
    what = "batch_invariant.matmul"
    check_dims("x", x, 2, what)
    check_dims("w", w, 2, what)
    check_dtype("x", x, FLOAT_DTYPES, what)
    if w.dtype != x.dtype:
        raise ValueError(f"{what}: w must have x's dtype {x.dtype}, got {w.dtype}")
    M, K = x.shape
    N = w.shape[0]
    if w.shape[1] != K:
        raise ValueError(f"{what}: x [M, {K}] and w {tuple(w.shape)} disagree on K")
    if bias is not None and tuple(bias.shape) != (N,):
        raise ValueError(f"{what}: bias must be [{N}], got {tuple(bias.shape)}")
    if add is not None and tuple(add.shape) != (M, N):
        raise ValueError(f"{what}: add must be [{M}, {N}], got {tuple(add.shape)}")
    check_launchable(x, w, *(t for t in (bias, add, out) if t is not None), what=what)
    if out is None:
        out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    elif tuple(out.shape) != (M, N) or out.dtype != x.dtype:
        raise ValueError(f"{what}: out must be [{M}, {N}] {x.dtype}, got {tuple(out.shape)} {out.dtype}")
    if M == 0 or N == 0:
        return out
    interp = interpreting()
    cfg = matmul_config(N, K, x.dtype, interp)
    for kernel, grid, args, kw in _matmul_plan(x, w, bias, add, out, cfg, interp):
        kernel[grid](*args, **kw)
    return out


def rms_norm_block(D: int, interpret: bool = False) -> int:
    """Elements per step of the RMSNorm row loop: the whole row up to 8192 (one read of x), else 4096;
    the interpreter: 64."""
    if interpret:
        return min(next_pow2(D), 64)
    return next_pow2(D) if next_pow2(D) <= 8192 else 4096


def _rms_norm_plan(x2, w2, y2, eps: float, interpret: bool = False) -> list:
    R, D = x2.shape
    block = rms_norm_block(D, interpret)
    args = (x2, w2, y2, D, w2.shape[0], x2.stride(0), w2.stride(0), y2.stride(0), float(eps))
    kw = dict(BLOCK_D=block, ONE_TILE=block >= D, num_warps=1 if interpret else (4 if block <= 2048 else 8))
    return [(_bi_rms_norm_kernel, (R,), args, kw)]


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Row-wise RMSNorm of ``x [..., D]`` by ``w`` [D] or [W, D] (see :func:`rms_norm_ref`), in x's
    dtype; one program per row."""
    what = "batch_invariant.rms_norm"
    check_dtype("x", x, FLOAT_DTYPES, what)
    check_dtype("w", w, FLOAT_DTYPES, what)
    D = x.shape[-1]
    if w.shape[-1] != D or w.dim() > 2:
        raise ValueError(f"{what}: w must be [{D}] or [W, {D}], got {tuple(w.shape)}")
    check_launchable(x, w, what=what)
    x2 = x.reshape(-1, D)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    w2 = w.reshape(-1, D).contiguous()
    if x2.shape[0] % w2.shape[0]:
        raise ValueError(f"{what}: {x2.shape[0]} rows do not cycle through {w2.shape[0]} weight rows")
    y2 = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.numel():
        for kernel, grid, args, kw in _rms_norm_plan(x2, w2, y2, eps, interpreting()):
            kernel[grid](*args, **kw)
    return y2.view(x.shape)


# ---------------------------------------------------------------------------------------------
# attention
# ---------------------------------------------------------------------------------------------


def attention_block_n(head_dim: int, interpret: bool = False) -> int:
    """Keys per tile (a function of the head dim only): 64 below 128-wide heads, else 32; 16 under
    the interpreter."""
    if interpret:
        return 16
    return 64 if next_pow2(head_dim) < 128 else 32


def mask_columns(tree_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cols [T, C] int32, nvis [T] int32)``: each row's visible columns in column order (the rest
    of the row is padding), and how many. Pure tensor ops (no host sync; capturable)."""
    m = tree_mask.bool()
    nvis = m.sum(1, dtype=torch.int32)
    cols = torch.argsort((~m).to(torch.int8), dim=1, stable=True).to(torch.int32)  # visible first, in order
    return cols.contiguous(), nvis


def token_requests(query_start_loc: torch.Tensor, T: int) -> torch.Tensor:
    """[T] int32: the request of every query row (rows past ``query_start_loc[B]`` get the last)."""
    rows = torch.arange(T, device=query_start_loc.device, dtype=query_start_loc.dtype)
    req = torch.searchsorted(query_start_loc, rows, right=True) - 1
    return req.clamp_(0, max(0, query_start_loc.shape[0] - 2)).to(torch.int32)


def _attention_plan(q, kv_layer, meta, extra, out, scale, window, interpret: bool = False) -> list:
    """``meta`` = (query_start_loc, context_lens, seq_lens, block_tables); ``extra`` = (req, cols,
    nvis) (cols / nvis None: causal)."""
    qsl, ctx_lens, seq_lens, bt = meta
    req, cols, nvis = extra
    T, H, D = q.shape
    kvh = kv_layer.shape[3]
    k_cache, v_cache = kv_layer[0], kv_layer[1]
    has_mask = cols is not None
    dot_f32, prec = dot_mode(q.dtype if q.dtype == kv_layer.dtype else torch.float32, interpret)
    group = H // kvh
    args = (
        q, k_cache, v_cache, out, req, qsl, ctx_lens, seq_lens, bt, cols if has_mask else req,
        nvis if has_mask else req, q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
        out.stride(0), out.stride(1), bt.stride(0), cols.stride(0) if has_mask else 0, max(1, bt.shape[1]),
        int(window or 0), float(scale) * 1.4426950408889634,
    )  # fmt: skip
    kw = dict(
        HEAD_DIM=D, BLOCK_SIZE=kv_layer.shape[2], GROUP=group, GROUP_P=max(16, next_pow2(group)),
        BLOCK_N=attention_block_n(D, interpret), BLOCK_D=max(16, next_pow2(D)), HAS_MASK=has_mask,
        DOT_F32=dot_f32, PREC=prec, num_warps=1 if interpret else 4,
    )  # fmt: skip
    return [(_bi_attention_kernel, (T, kvh), args, kw)]


def attention(
    q, kv_layer, query_start_loc, context_lens, seq_lens, block_tables, tree_mask, scale, window=None, out=None
) -> torch.Tensor:
    """Batch-invariant paged tree / causal attention -> ``out`` [T, H, D] in q's dtype. Arguments as
    ``specd_kernels.tree_attention`` (no host ints: the grid is (T, KVH) and each program reads its
    own key count, so a captured graph replays at any context length); ``window``: keys at most
    ``window - 1`` positions behind the query (None: all). Rows past ``query_start_loc[B]`` are
    written as their last request's rows would be, from whatever they hold."""
    from .tree_attention import _check_args

    what = "batch_invariant.attention"
    T, H, D, _NB, _BS, _KVH, B = _check_args(
        q, kv_layer, query_start_loc, context_lens, seq_lens, block_tables, tree_mask, out, what
    )
    others = [kv_layer, query_start_loc, context_lens, seq_lens, block_tables, tree_mask, out]
    check_launchable(q, *(x for x in others if x is not None), what=what)
    if out is None:
        out = torch.empty_like(q)
    if T == 0 or B == 0:
        return out
    cols, nvis = mask_columns(tree_mask) if tree_mask is not None else (None, None)
    extra = (token_requests(query_start_loc, T), cols, nvis)
    meta = (query_start_loc, context_lens, seq_lens, block_tables)
    for kernel, grid, args, kw in _attention_plan(q, kv_layer, meta, extra, out, scale, window, interpreting()):
        kernel[grid](*args, **kw)
    return out
