"""Weight-only quantized GEMM on the GPU: ``y[M, N] = x[M, K] @ W^T (+ bias) (+ add)`` with W kept as
int8 or int4 codes and dequantized inside the kernel, fp32 accumulation.

Formats (the layouts of ``specd.model.quant.QuantLinear``; a group is ``group`` consecutive
weights of a row, a multiple of 32; K_pad is K rounded up to 32):

- ``int8``: ``qweight`` int8 [N, K_pad], ``scale`` fp32 [N, K_pad / group]; ``w = scale * q``
- ``int4``: ``qweight`` uint8 [N, K_pad / 2] in 32-weight blocks of 16 bytes, byte j holding weight
  j (low nibble) and j + 16 (high nibble) as GGUF Q4_0 / Q4_1; ``scale``, ``minv`` fp32
  [N, K_pad / group]; ``w = scale * q + min``

One program computes a ``BLOCK_M x BLOCK_N`` tile of y, stepping over K by ``BLOCK_K`` (a divisor
of ``group``, so one scale per row per step): it loads the codes, dequantizes them to the
activations' dtype and feeds ``tl.dot`` (fp16 / bf16 operands: tensor cores; fp32 activations:
``input_precision="ieee"``, no tf32; under the interpreter always fp32, whose bf16 arithmetic is
wrong). ``woq_matmul_ref`` is the pure-torch oracle.

Batch invariance (``--batch-invariant``, ``specd.model.invariant``): the tiles chosen by M change a
row's reduction order (``BLOCK_K``) and its MMA instructions (``BLOCK_M``), so a token's bits would
depend on how many rows share its step. With ``invariant`` (an argument, else the :func:`fixed_tiles`
context the engine's target pass opens for a batch-invariant step) every M gets the decode tile
(16 x 64, ``BLOCK_K`` a function of the group alone): row i of y is the same bits for M = 1 and M =
300, at the price of re-reading W tiles (from L2) on prefill widths.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch

from ._common import HAS_TRITON, cdiv, check_launchable, interpreting, next_pow2, tl, triton

FORMATS = ("int8", "int4")


def dequantize_ref(qweight: torch.Tensor, scale: torch.Tensor, minv, group: int, fmt: str, k: int) -> torch.Tensor:
    """fp32 W [N, k] from the packed layout (the same arithmetic as ``QuantLinear.dequantize``)."""
    N = qweight.shape[0]
    if fmt == "int4":
        b = qweight.view(N, -1, 16)
        codes = torch.cat([b & 0x0F, b >> 4], dim=-1).reshape(N, -1).float()
    else:
        codes = qweight.float()
    w = codes.view(N, -1, group) * scale.unsqueeze(-1)
    if minv is not None:
        w = w + minv.unsqueeze(-1)
    return w.view(N, -1)[:, :k]


def woq_matmul_ref(x, qweight, scale, minv, group: int, fmt: str, bias=None, add=None) -> torch.Tensor:
    """Pure-torch reference of :func:`woq_matmul`: fp32 math, the result in x's dtype."""
    w = dequantize_ref(qweight, scale, minv, group, fmt, x.shape[1])
    y = x.float() @ w.t()
    if bias is not None:
        y = y + bias.float()
    if add is not None:
        y = y + add.float()
    return y.to(x.dtype)


if HAS_TRITON:

    @triton.jit
    def _woq_kernel(
        x_ptr, q_ptr, s_ptr, m_ptr, b_ptr, a_ptr, y_ptr,
        M, N, K, NG,
        sxm, sqn, sam, sym,
        GROUP: tl.constexpr, INT4: tl.constexpr, HAS_MIN: tl.constexpr, HAS_BIAS: tl.constexpr,
        HAS_ADD: tl.constexpr, DOT_F32: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        mm = rm < M
        nm = rn < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk  # [BLOCK_K]
            x = tl.load(x_ptr + rm[:, None] * sxm + kk[None, :], mask=mm[:, None] & (kk[None, :] < K), other=0.0)
            if INT4:
                byte = (kk // 32) * 16 + (kk % 16)
                shift = ((kk % 32) // 16) * 4
                raw = tl.load(q_ptr + rn[None, :] * sqn + byte[:, None], mask=nm[None, :], other=0)  # [BK, BN]
                codes = ((raw.to(tl.int32) >> shift[:, None]) & 0x0F).to(tl.float32)
            else:
                codes = tl.load(q_ptr + rn[None, :] * sqn + kk[:, None], mask=nm[None, :], other=0).to(tl.float32)
            g = k0 // GROUP
            s = tl.load(s_ptr + rn * NG + g, mask=nm, other=0.0)  # [BN]
            w = codes * s[None, :]
            if HAS_MIN:
                w += tl.load(m_ptr + rn * NG + g, mask=nm, other=0.0)[None, :]
            if DOT_F32:
                acc += tl.dot(x.to(tl.float32), w, input_precision="ieee")
            else:
                acc += tl.dot(x, w.to(x.dtype))
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=nm, other=0.0)[None, :]
        if HAS_ADD:
            acc += tl.load(a_ptr + rm[:, None] * sam + rn[None, :], mask=mm[:, None] & nm[None, :], other=0.0).to(
                tl.float32
            )
        tl.store(
            y_ptr + rm[:, None] * sym + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=mm[:, None] & nm[None, :]
        )


_INVARIANT = contextvars.ContextVar("specd_woq_invariant", default=False)


@contextlib.contextmanager
def fixed_tiles(on: bool = True):
    """Within the block, :func:`woq_matmul` calls without an explicit ``invariant`` use the fixed,
    M-independent tiles when ``on`` (the engine's target pass, in a batch-invariant step)."""
    token = _INVARIANT.set(bool(on))
    try:
        yield
    finally:
        _INVARIANT.reset(token)


def fixed_tiles_on() -> bool:
    """Whether the current context asks for the fixed tiles (:func:`fixed_tiles`)."""
    return _INVARIANT.get()


def launch_config(M: int, N: int, group: int, interpret: bool = False, invariant: bool = False) -> dict:
    """Tile sizes for an M x N problem: 16-row tiles for decode / verification widths (memory-bound:
    wide N tiles, more K per step), larger M tiles for prefill chunks. BLOCK_K divides the group.
    ``invariant``: the decode tile for every M (a function of the group alone: batch-invariant rows).
    The interpreter's tile is fixed too (small: slow launches)."""
    block_k = next(b for b in (128, 64, 32) if group % b == 0)
    if interpret:
        return {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32, "num_warps": 1, "num_stages": 1}
    if M <= 16 or invariant:
        return {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": block_k, "num_warps": 4, "num_stages": 3}
    if M <= 64:
        return {"BLOCK_M": next_pow2(max(M, 16)), "BLOCK_N": 64, "BLOCK_K": min(block_k, 64), "num_warps": 4,
                "num_stages": 3}  # fmt: skip
    return {"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": min(block_k, 64), "num_warps": 8, "num_stages": 3}


def _launch_plan(
    x, qweight, scale, minv, bias, add, y, group: int, fmt: str, interpret: bool = False, invariant: bool = False,
    cfg: dict | None = None,
) -> list:  # fmt: skip
    """``[(kernel, grid, args, kwargs)]`` of one :func:`woq_matmul` (nothing launched; used by
    ``specd_kernels.aot`` on meta-device tensors); ``cfg``: tiles other than :func:`launch_config`'s."""
    M, K = x.shape
    N = qweight.shape[0]
    cfg = cfg or launch_config(M, N, group, interpret, invariant)
    grid = (cdiv(M, cfg["BLOCK_M"]), cdiv(N, cfg["BLOCK_N"]))
    args = (x, qweight, scale, minv if minv is not None else scale, bias if bias is not None else scale,
            add if add is not None else y, y, M, N, K, scale.shape[1], x.stride(0), qweight.stride(0),
            add.stride(0) if add is not None else 0, y.stride(0))  # fmt: skip
    kw = dict(
        GROUP=group,
        INT4=fmt == "int4",
        HAS_MIN=minv is not None,
        HAS_BIAS=bias is not None,
        HAS_ADD=add is not None,
        DOT_F32=x.dtype == torch.float32 or interpret,  # (the interpreter's bf16 arithmetic is wrong)
        **cfg,
    )
    return [(_woq_kernel, grid, args, kw)]


def woq_matmul(x, qweight, scale, minv, group: int, fmt: str, bias=None, add=None, invariant=None) -> torch.Tensor:
    """``x [M, K] @ W^T (+ bias [N]) (+ add [M, N])`` -> [M, N] in x's dtype (fp16 / bf16 / fp32
    activations); W as in the module doc. Same signature as :func:`woq_matmul_ref`, plus
    ``invariant`` (None: the :func:`fixed_tiles` context's choice): tiles independent of M."""
    invariant = fixed_tiles_on() if invariant is None else bool(invariant)
    what = "woq_matmul"
    check_launchable(x, qweight, scale, what=what)
    if fmt not in FORMATS:
        raise ValueError(f"{what}: fmt must be one of {FORMATS}, got {fmt!r}")
    if group % 32 or scale.shape[1] * group != qweight.shape[1] * (2 if fmt == "int4" else 1):
        raise ValueError(
            f"{what}: group {group} does not match qweight {tuple(qweight.shape)} / scale {tuple(scale.shape)}"
        )
    x = x.contiguous()
    y = torch.empty((x.shape[0], qweight.shape[0]), dtype=x.dtype, device=x.device)
    if add is not None:
        add = add.contiguous()
    plan = _launch_plan(x, qweight, scale, minv, bias, add, y, group, fmt, interpreting(), invariant)
    for kernel, grid, args, kw in plan:
        kernel[grid](*args, **kw)
    return y
