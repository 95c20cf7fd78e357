"""Weight-only quantized linear layers: the weights stay int8 / int4 in memory and in every step.

Formats (``QuantLinear.fmt``); a *group* is ``group`` consecutive weights of one output row:

- ``int8``: ``w = scale * q``, q int8 in [-127, 127], one fp32 scale per group (``group`` = the
  padded row length for per-channel int8; 32 for GGUF Q8_0 blocks).
- ``int4``: ``w = scale * q + min``, q in [0, 15], fp32 scale and min per group (32 for GGUF Q4_0 /
  Q4_1 blocks, Q4_0 being ``min = -8 * scale``). Nibbles are packed per 32 weights as GGUF does:
  byte j of a block holds weight j (low nibble) and weight j + 16 (high nibble).

Rows whose length K is not a multiple of 32 are zero-padded to ``K_pad`` (and so is x in the
forward), so any shape works. ``QuantLinear`` computes ``x @ W^T (+ bias)`` with the CPU kernel of
``specd.model.qkernel`` (fp32 arithmetic, weights read once per call for all rows, a row's result
independent of the other rows) for up to ``KERNEL_MAX_ROWS`` rows (every step shape measured), and
by dequantizing once into a torch matmul for more or where the kernel cannot be built; on CUDA with the
Triton kernels of ``specd_kernels.woq``. ``linear`` / ``addmm`` dispatch between a plain weight
tensor and a ``QuantLinear`` so that ``LlamaModel.forward`` stays one path.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

log = logging.getLogger("specd.quant")
FORMATS = ("int8", "int4")
BLOCK = 32  # packing unit along a row (and the GGUF block size)


class QuantLinear(nn.Module):
    """``y = x @ W^T (+ bias)`` with W [N, K] kept quantized (see the module doc for the formats).

    Buffers: ``qweight`` int8 [N, K_pad] or uint8 [N, K_pad / 2]; ``scale`` fp32 [N, K_pad / group];
    ``minv`` fp32 like scale (int4) or None; ``bias`` [N] or None.
    """

    # Up to this many rows the quantized kernel runs; above it one dequantization into an fp32 matmul.
    # Measured on SmolLM2-135M's shapes (AVX2, 1-2 threads, docs/benchmarks.md): the kernel wins at
    # every width up to 256 rows (a --prefill-chunk), the dequantization alone costing more than it.
    KERNEL_MAX_ROWS = 1024
    # int8 activations in the CPU kernel (``LlamaModel.set_act_int8``): faster, row-independent, not
    # equal to the fp32-activation result (see cpu_kernel/gemm_x8_avx2.h). A class default, set per layer.
    act_int8 = False

    def __init__(self, fmt: str, qweight, scale, minv, group: int, in_features: int, bias=None):
        super().__init__()
        if fmt not in FORMATS:
            raise ValueError(f"unknown quantized format {fmt!r}; supported: {', '.join(FORMATS)}")
        self.fmt, self.group, self.in_features = fmt, int(group), int(in_features)
        self.out_features = int(qweight.shape[0])
        self.register_buffer("qweight", qweight.contiguous())
        self.register_buffer("scale", scale.float().contiguous())
        self.register_buffer("minv", None if minv is None else minv.float().contiguous())
        self.register_buffer("bias", None if bias is None else bias.float().contiguous())

    @property
    def k_pad(self) -> int:
        return self.qweight.shape[1] * (2 if self.fmt == "int4" else 1)

    def extra_repr(self) -> str:
        return f"{self.fmt}, in={self.in_features}, out={self.out_features}, group={self.group}"

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)  # .to(dtype) must not turn the fp32 scales into bf16
        for name in ("scale", "minv", "bias"):
            t = getattr(self, name)
            if t is not None and t.dtype != torch.float32:
                setattr(self, name, t.float())
        return self

    def nbytes(self) -> int:
        """Bytes one full read of the weight costs (packed weights, scales, mins)."""
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scale, self.minv) if t is not None)

    # dequantization -------------------------------------------------------------------------------
    def _codes(self, q: torch.Tensor) -> torch.Tensor:
        """Integer codes [R, K_pad] (float32) of packed rows ``q``."""
        if self.fmt == "int8":
            return q.float()
        return unpack_int4(q).float()

    def _dequant(self, q, scale, minv) -> torch.Tensor:
        R, G = q.shape[0], self.group
        w = self._codes(q).view(R, -1, G) * scale.unsqueeze(-1)
        if minv is not None:
            w = w + minv.unsqueeze(-1)
        return w.view(R, -1)[:, : self.in_features]

    def dequantize(self) -> torch.Tensor:
        """fp32 W [N, K]: the reference every kernel is tested against."""
        return self._dequant(self.qweight, self.scale, self.minv)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """fp32 rows ``W[ids]`` [len(ids), K] (an embedding lookup on a tied, quantized table)."""
        m = None if self.minv is None else self.minv[ids]
        return self._dequant(self.qweight[ids], self.scale[ids], m)

    def select(self, idx: torch.Tensor) -> QuantLinear:
        """A QuantLinear of the rows ``idx`` of this one (quantized, copied)."""
        pick = lambda t: None if t is None else t.index_select(0, idx).contiguous()  # noqa: E731
        return QuantLinear(self.fmt, pick(self.qweight), pick(self.scale), pick(self.minv), self.group,
                           self.in_features, pick(self.bias))  # fmt: skip

    def x8_pack(self) -> tuple:
        """The weight in the CPU kernel's interleaved layout for int8 activations (``gemm_x8``,
        cpu_kernel/gemm_x8_avx2.h): ``(w uint8, scale [tiles, K_pad/32, 8], min or None)``, scale and min in fp16
        where every one of them is a half exactly (GGUF's Q4_0 / Q4_1 / Q8_0 blocks), else fp32; built
        on first use and kept (a second copy of the codes: same size as ``qweight``)."""
        if getattr(self, "_x8", None) is None:
            self._x8 = pack_x8(self)
        return self._x8

    # compute --------------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, add: torch.Tensor | None = None) -> torch.Tensor:
        """``add + x @ W^T + bias`` for x [..., K] (add [..., N] or None); the result in x's dtype."""
        if x.dim() == 2:  # the forward's case: [T, K]
            return self._matmul(x, add).to(x.dtype)
        shape, dt = x.shape, x.dtype
        x2 = x.reshape(-1, shape[-1])
        a2 = None if add is None else add.reshape(-1, self.out_features)
        y = self._matmul(x2, a2)
        return y.view(*shape[:-1], self.out_features).to(dt)

    def _matmul(self, x, add):
        M = x.shape[0]
        if x.is_cuda:
            from specd.model.quant_gpu import woq_matmul

            return woq_matmul(self, x, add)
        from specd.model.qkernel import kernel, qgemm, qgemm_x8

        lib = kernel() if M <= self.KERNEL_MAX_ROWS else None
        if lib is None:
            y = F.linear(x.float(), self.dequantize(), self.bias)
            return y if add is None else y.add_(add.float())
        xf = x.float()
        if self.k_pad != self.in_features:
            xf = F.pad(xf, (0, self.k_pad - self.in_features))
        a = None if add is None else add.float()
        if self.act_int8:
            return qgemm_x8(lib, xf.contiguous(), self.x8_pack(), self.out_features, self.fmt == "int4", a, self.bias)
        return qgemm(lib, xf.contiguous(), self.qweight, self.scale, self.minv, self.group, self.fmt == "int4", a,
                     self.bias)  # fmt: skip


def set_act_int8(model: nn.Module, on: bool) -> int:
    """Turn the CPU kernel's int8 activations on or off for every ``QuantLinear`` of ``model``;
    returns how many there are. (Drops the fused layers' arguments built for the old setting.)"""
    n = 0
    for m in model.modules():
        if isinstance(m, QuantLinear):
            m.act_int8 = on
            n += 1
        if hasattr(m, "_fused"):
            del m._fused
    return n


# the one forward's dispatch ------------------------------------------------------------------------
def linear(x: torch.Tensor, w, b: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W^T + b`` for a plain weight tensor W [N, K] or a ``QuantLinear`` (its own bias)."""
    if isinstance(w, torch.Tensor):
        return F.linear(x, w, b)
    return w.forward(x)  # (no hooks on decoder projections: skip nn.Module.__call__'s per-call cost)


def addmm(res: torch.Tensor, x: torch.Tensor, w) -> torch.Tensor:
    """``res + x @ W^T``: ``w`` is a plain transposed weight W^T [K, N] or a ``QuantLinear``."""
    if isinstance(w, torch.Tensor):
        return torch.addmm(res, x, w)
    return w.forward(x, add=res)


def embedding(ids: torch.Tensor, table) -> torch.Tensor:
    """Rows of an embedding table: a plain tensor [V, d] or a (tied, quantized) ``QuantLinear``."""
    if isinstance(table, torch.Tensor):
        return F.embedding(ids, table)
    return table.rows(ids)


# quantizers ----------------------------------------------------------------------------------------
def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """[N, K] codes 0..15 (K a multiple of 32) -> uint8 [N, K/2] in GGUF block order."""
    N, K = q.shape
    b = q.to(torch.uint8).view(N, K // BLOCK, BLOCK)
    return (b[..., :16] | (b[..., 16:] << 4)).reshape(N, K // 2).contiguous()


def unpack_int4(p: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack_int4``: uint8 [N, K/2] -> uint8 codes [N, K]."""
    N = p.shape[0]
    b = p.view(N, -1, 16)
    return torch.cat([b & 0x0F, b >> 4], dim=-1).reshape(N, -1)


def pack_x8(op: QuantLinear) -> tuple:
    """``op``'s codes, scales and mins in the interleaved layout of the CPU kernel's ``gemm_x8``
    (cpu_kernel/gemm_x8_avx2.h): output rows in tiles of 8 (zero rows pad the last), per 32-block of
    k 8 steps of 4 k for the 8 rows."""
    N, T, nbk = op.out_features, (op.out_features + 7) // 8, op.k_pad // BLOCK
    pad_n = lambda t: F.pad(t, (0, 0, 0, 8 * T - N))  # noqa: E731
    per_block = lambda t: pad_n(t.repeat_interleave(op.group // BLOCK, dim=1))  # noqa: E731
    tiles = lambda t: t.view(T, 8, nbk).permute(0, 2, 1).contiguous()  # noqa: E731
    if op.fmt == "int4":
        c = pad_n(unpack_int4(op.qweight)).view(T, 8, nbk, 2, 4, 4).permute(0, 2, 4, 1, 5, 3)
        w = (c[..., 0] | (c[..., 1] << 4)).contiguous().view(-1)
    else:
        w = pad_n(op.qweight).view(T, 8, nbk, 8, 4).permute(0, 2, 3, 1, 4).contiguous().view(torch.uint8).view(-1)
    mins = None if op.minv is None else tiles(per_block(op.minv))
    return (w, *as_halves(tiles(per_block(op.scale)), mins))


def as_halves(scale: torch.Tensor, mins: torch.Tensor | None) -> tuple:
    """``(scale, mins)`` in fp16 where both are halves exactly (widened back on load, they give the
    kernel the same fp32 values bit for bit, in 5/6 of the bytes per 32-weight int4 block: a decode
    step reads its weights from memory), else as they are."""
    if os.environ.get("SPECD_X8_HALF_SCALES", "1") == "0":
        return scale, mins
    exact = lambda t: t is None or torch.equal(t.half().float(), t)  # noqa: E731  (inf, overflow: not equal)
    if not (exact(scale) and exact(mins)):
        return scale, mins
    return scale.half(), None if mins is None else mins.half()


def _pad_cols(w: torch.Tensor) -> torch.Tensor:
    K = w.shape[1]
    pad = -K % BLOCK
    return F.pad(w, (0, pad)) if pad else w


def quantize_int8(w: torch.Tensor, bias=None, group: int | None = None) -> QuantLinear:
    """Symmetric int8 of W [N, K]: per output channel (``group`` None) or per ``group`` weights."""
    K = w.shape[1]
    wp = _pad_cols(w.detach().float())
    G = wp.shape[1] if group is None else int(group)
    _check_group(wp.shape[1], G)
    g = wp.view(wp.shape[0], -1, G)
    scale = g.abs().amax(-1) / 127.0  # [N, K_pad / G]
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(g / scale.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8).view_as(wp)
    return QuantLinear("int8", q, scale, None, G, K, bias)


def quantize_int4(w: torch.Tensor, bias=None, group: int = 32) -> QuantLinear:
    """Asymmetric int4 of W [N, K] in groups of ``group`` (a multiple of 32): per group the min and
    (max - min) / 15 (as GGUF Q4_1)."""
    K = w.shape[1]
    wp = _pad_cols(w.detach().float())
    _check_group(wp.shape[1], group)
    g = wp.view(wp.shape[0], -1, group)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = (hi - lo) / 15.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round((g - lo.unsqueeze(-1)) / scale.unsqueeze(-1)).clamp_(0, 15).view_as(wp)
    return QuantLinear("int4", pack_int4(q), scale, lo, group, K, bias)


def _check_group(k_pad: int, group: int) -> None:
    if group <= 0 or group % BLOCK or k_pad % group:
        raise ValueError(f"quantization group {group} must be a positive multiple of {BLOCK} dividing {k_pad}")


def quantize(w: torch.Tensor, fmt: str, bias=None) -> QuantLinear:
    """W [N, K] in format ``fmt`` (int8 per channel, int4 in groups of 32)."""
    if fmt == "int8":
        return quantize_int8(w, bias)
    if fmt == "int4":
        return quantize_int4(w, bias)
    raise ValueError(f"unknown quantized format {fmt!r}; supported: {', '.join(FORMATS)}")
