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
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

log = logging.getLogger("specd.quant")
FORMATS = ("int8", "int4")
BLOCK = 32  # packing unit along a row (and the GGUF block size)


class QuantLinear(nn.Module):
    """``y = x @ W^T (+ bias)`` with W [N, K] kept quantized (see the module doc for the formats).

    Buffers: ``qweight`` int8 [N, K_pad] or uint8 [N, K_pad / 2]; ``scale`` fp32 [N, K_pad / group];
    ``minv`` fp32 like scale (int4) or None; ``bias`` [N] or None. After ``compact`` (``layout``
    "x8"): the CPU kernel's interleaved layout instead (``pack_x8``; scale and min as their bytes).
    """

    # Up to this many rows the quantized kernel runs; above it one dequantization into an fp32 matmul.
    # Measured on SmolLM2-135M's shapes (AVX2, 1-2 threads, docs/benchmarks.md): the kernel wins at
    # every width up to 256 rows (a --prefill-chunk), the dequantization alone costing more than it.
    KERNEL_MAX_ROWS = 1024
    # int8 activations in the CPU kernel (``LlamaModel.set_act_int8``): faster, row-independent, not
    # equal to the fp32-activation result (see cpu_kernel/gemm_x8_avx2.h). A class default, set per layer.
    act_int8 = False
    layout = "rows"  # "x8": the buffers hold the kernel's interleaved layout only (``compact``)
    _off8 = False  # (x8 layout) int4 mins not stored: -8 x the scales (``X8.off8``)

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
        if self.layout == "x8":
            return self._k_pad
        return self.qweight.shape[1] * (2 if self.fmt == "int4" else 1)

    def extra_repr(self) -> str:
        return f"{self.fmt}, in={self.in_features}, out={self.out_features}, group={self.group}"

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)  # .to(dtype) must not turn the fp32 scales into bf16
        for name in ("bias",) if self.layout == "x8" else ("scale", "minv", "bias"):  # (x8: bytes)
            t = getattr(self, name)
            if t is not None and t.dtype != torch.float32:
                setattr(self, name, t.float())
        if self.layout == "x8" and self.qweight.device.type != "cpu":
            self.expand()  # (the GPU kernels read the row layout)
        return self

    # one copy: the kernel's layout ----------------------------------------------------------------
    @classmethod
    def from_x8(
        cls, fmt: str, group: int, in_features: int, N: int, w, scale, mins, off8=False, bias=None
    ) -> QuantLinear:
        """A compact QuantLinear (``compact``) of N rows from ``pack_x8``'s tensors (an ``X8``)."""
        op = cls.__new__(cls)
        nn.Module.__init__(op)
        op.fmt, op.group, op.in_features, op.out_features = fmt, int(group), int(in_features), int(N)
        op._k_pad, op._x8, op._sdt, op.layout = scale.shape[1] * BLOCK, None, scale.dtype, "x8"
        op._off8 = bool(off8)
        as_bytes = lambda t: None if t is None else t.contiguous().view(torch.uint8)  # noqa: E731
        op.register_buffer("qweight", w.contiguous())
        op.register_buffer("scale", as_bytes(scale))
        op.register_buffer("minv", as_bytes(mins))
        op.register_buffer("bias", None if bias is None else bias.float().contiguous())
        return op

    def compact(self) -> QuantLinear:
        """Keep the weight in the CPU kernel's interleaved layout only (``pack_x8``; its scales and
        mins stored as bytes, so no dtype change touches them): one copy, about the GGUF file's bytes
        (the row layout with fp32 scales is 1.33x a Q4_0 file, both layouts together 2.4x). Lookups,
        dequantization and row selection read the tiles; the row layout comes back (``expand``) for
        fp32 activations or another device. Returns self."""
        if self.layout != "x8":
            w, scale, mins, self._off8 = self.x8_pack()
            self._k_pad, self._x8, self._sdt = self.k_pad, None, scale.dtype
            as_bytes = lambda t: None if t is None else t.contiguous().view(torch.uint8)  # noqa: E731
            self.qweight, self.scale, self.minv = w, as_bytes(scale), as_bytes(mins)
            self.layout = "x8"
        return self

    def expand(self) -> None:
        """Back to the row layout (buffers as at construction) from the interleaved one."""
        if self.layout == "x8":
            q, scale, mins = self._x8_rows(torch.arange(self.out_features, device=self.qweight.device))
            self.layout, self._x8, self._off8 = "rows", None, False
            self.qweight, self.scale, self.minv = q, scale, mins

    def _x8_rows(self, ids: torch.Tensor) -> tuple:
        """Rows ``ids`` of a compact weight in the row layout: (packed codes, fp32 scale, fp32 min)."""
        nbk, n = self._k_pad // BLOCK, ids.numel()
        t, c = ids // 8, ids % 8
        if self.fmt == "int4":  # a tile's block byte 4c + i of vector v is the row's byte 4v + i: as packed
            q = self.qweight.view(-1, nbk, 4, 8, 4)[t, :, :, c, :].reshape(n, self._k_pad // 2)
        else:
            q = self.qweight.view(-1, nbk, 8, 8, 4)[t, :, :, c, :].reshape(n, self._k_pad).view(torch.int8)
        step = self.group // BLOCK
        per_row = lambda b: None if b is None else b.view(self._sdt).view(-1, nbk, 8)[t, :, c][:, ::step].float()  # noqa: E731
        scale = per_row(self.scale).contiguous()
        return q.contiguous(), scale, -8.0 * scale if self._off8 else per_row(self.minv)

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
        if self.layout == "x8":
            return self._dequant(*self._x8_rows(torch.arange(self.out_features, device=self.qweight.device)))
        return self._dequant(self.qweight, self.scale, self.minv)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """fp32 rows ``W[ids]`` [len(ids), K] (an embedding lookup on a tied, quantized table)."""
        if self.layout == "x8":
            return self._dequant(*self._x8_rows(ids.reshape(-1))).view(*ids.shape, self.in_features)
        m = None if self.minv is None else self.minv[ids]
        return self._dequant(self.qweight[ids], self.scale[ids], m)

    def select(self, idx: torch.Tensor) -> QuantLinear:
        """A QuantLinear of the rows ``idx`` of this one (quantized, copied; in the row layout)."""
        pick = lambda t: None if t is None else t.index_select(0, idx).contiguous()  # noqa: E731
        q, scale, mins = self._x8_rows(idx) if self.layout == "x8" else map(pick, (self.qweight, self.scale, self.minv))
        return QuantLinear(self.fmt, q, scale, mins, self.group, self.in_features, pick(self.bias))

    def x8_pack(self) -> X8:
        """The weight in the CPU kernel's interleaved layout for int8 activations (``gemm_x8``,
        cpu_kernel/gemm_x8_avx2.h): ``X8(w uint8, scale [tiles, K_pad/32, 8], min or None, off8)``, scale and
        min in fp16 where every one of them is a half exactly (GGUF's Q4_0 / Q4_1 / Q8_0 blocks), else fp32;
        built on first use and kept (a second copy of the codes: same size as ``qweight``; none after
        ``compact``)."""
        if self.layout == "x8":
            view = lambda b: None if b is None else b.view(self._sdt).view(-1, self._k_pad // BLOCK, 8)  # noqa: E731
            return X8(self.qweight, view(self.scale), view(self.minv), self._off8)
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
        if self.layout == "x8" and (x.is_cuda or not self.act_int8):
            self.expand()  # (fp32 activations, or another device: the row layout from now on)
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


class X8(NamedTuple):
    """A weight as the CPU kernel's int8-activation GEMM reads it (``pack_x8``; a K-quant's kq tiles:
    ``KQuantLinear.x8_pack``): the codes, the block scales, the int4 mins or None, and ``off8``: int4
    mins that are -8 x the scales exactly (GGUF Q4_0's ``d * (q - 8)``) are not stored but computed in
    the kernel (X8_OFF8, cpu_kernel/layer.h: the same bits in 144 bytes per 8 x 32 weights, not 160)."""

    w: torch.Tensor
    scale: torch.Tensor
    mins: torch.Tensor | None
    off8: bool = False


def pack_x8(op: QuantLinear) -> X8:
    """``op``'s codes, scales and mins in the interleaved layout of the CPU kernel's ``gemm_x8``
    (cpu_kernel/gemm_x8_avx2.h): output rows in tiles of 8 (zero rows pad the last), per 32-block of
    k 8 steps of 4 k for the 8 rows. Each step's 4 bytes move as one int32 (a byte-wise permute
    copies ~5x slower). int4: a tile's block byte 4c + i of vector v is row c's packed byte 4v + i
    (low nibble k = 4v + i, high k = 16 + 4v + i), so the packed rows move as they are. Mins that
    are -8 x the scales exactly are dropped (``X8.off8``)."""
    N, T, nbk = op.out_features, (op.out_features + 7) // 8, op.k_pad // BLOCK
    pad_n = lambda t: t if N == 8 * T else F.pad(t, (0, 0, 0, 8 * T - N))  # noqa: E731
    per_block = lambda t: pad_n(t.repeat_interleave(op.group // BLOCK, dim=1))  # noqa: E731
    tiles = lambda t: t.view(T, 8, nbk).permute(0, 2, 1).contiguous()  # noqa: E731
    steps = 4 if op.fmt == "int4" else 8  # int32 words per row and block
    q = pad_n(op.qweight.view(torch.uint8)).view(T, 8, nbk * steps * 4).view(torch.int32).view(T, 8, nbk, steps)
    w = q.permute(0, 2, 3, 1).contiguous().view(torch.uint8).view(-1)
    mins = None if op.minv is None else tiles(per_block(op.minv))
    scale = tiles(per_block(op.scale))
    off8 = op.fmt == "int4" and mins is not None and os.environ.get("SPECD_X8_OFF8", "1") != "0"
    off8 = off8 and torch.equal(mins, -8.0 * scale)  # (SPECD_X8_OFF8=0: stored, for comparisons)
    scale, mins = as_halves(scale, None if off8 else mins)
    return X8(w, scale, mins, off8)


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


# GGUF K-quants kept as they are ---------------------------------------------------------------------
KQ_KINDS = ("Q4_K", "Q5_K", "Q6_K", "Q8_0")  # the kq layout's kind codes 0, 1, 2, 3 (cpu_kernel/gemm_kq.h)
KQ_Q8 = 3  # Q8_0: kept beside K-quants in one projection (llama.cpp's k / v of an 8-expert Q4_K_M model)
KQ_SUPER = 256  # weights per K-quant super-block
KQ_HDR = 32  # a K-quant tile's super-block header: d[8], dmin[8] halves (Q8_0: none)


def kq_block_bytes(kind: int) -> int:
    """Bytes of one 32-weight block of one 8-row tile in the kq layout (codes, high bits, scales;
    Q8_0: 256 bytes of codes and 8 half scales)."""
    return 256 + 16 if kind == KQ_Q8 else 128 + (0, 32, 64)[kind] + 16


def kq_tile_bytes(kind: int, K: int) -> int:
    """Bytes of one 8-row tile of ``kind`` and row length K (a multiple of 256) in the kq layout."""
    return K // KQ_SUPER * ((0 if kind == KQ_Q8 else KQ_HDR) + 8 * kq_block_bytes(kind))


class KQFields:
    """A K-quant weight's numbers, unpacked: codes ``u`` uint8 [N, K] (Q4_K 0..15, Q5_K 0..31, Q6_K
    0..63), per 32-block ``s1`` / ``s2`` uint8 [N, K/32] (Q4_K / Q5_K: the 6-bit scale and min; Q6_K:
    the int8 scales of the block's two halves, as their bytes) and per super-block ``d`` / ``dmin``
    fp16 [N, K/256] (Q6_K: dmin zero). A weight is ``(d * sc) * u - dmin * m`` (Q4_K / Q5_K) or
    ``(d * sc) * (u - 32)`` (Q6_K) in fp32, as the ``gguf`` package computes it.

    Q8_0 (kind 3, ``q8_fields``): ``u`` the int8 codes [N, K], ``d`` the per-32-block scales fp16
    [N, K/32], ``s1`` / ``s2`` / ``dmin`` empty [N, 0]; a weight is ``d * q`` in fp32."""

    def __init__(self, kind: int, u, s1, s2, d, dmin):
        self.kind, self.u, self.s1, self.s2, self.d, self.dmin = kind, u, s1, s2, d, dmin

    def dequantize(self) -> torch.Tensor:
        N, K = self.u.shape
        if self.kind == KQ_Q8:
            return (self.u.float().view(N, K // 32, 32) * self.d.float().unsqueeze(-1)).view(N, K)
        u = self.u.float().view(N, K // 32, 32)
        d = self.d.float().repeat_interleave(8, dim=1).unsqueeze(-1)  # per 32-block
        if self.kind == 2:
            sc = torch.stack([self.s1.view(torch.int8), self.s2.view(torch.int8)], -1).float()  # [N, K/32, 2]
            w = (d.unsqueeze(-1) * sc.unsqueeze(-1)) * (u.view(N, K // 32, 2, 16) - 32.0)
            return w.view(N, K)
        dm = self.dmin.float().repeat_interleave(8, dim=1).unsqueeze(-1)
        return ((d * self.s1.float().unsqueeze(-1)) * u - dm * self.s2.float().unsqueeze(-1)).view(N, K)


def q8_fields(q: torch.Tensor, d: torch.Tensor) -> KQFields:
    """Q8_0 blocks as kq fields: codes int8 [N, K], scales fp16 [N, K/32]."""
    none = q.new_zeros((q.shape[0], 0), dtype=torch.uint8)
    return KQFields(KQ_Q8, q, none, none, d, q.new_zeros((q.shape[0], 0), dtype=torch.float16))


def pack_kq(f: KQFields) -> torch.Tensor:
    """``f``'s rows in the kq layout (cpu_kernel/gemm_kq.h): uint8 [tiles, tile bytes] (zero rows pad
    the last tile)."""
    N, K = f.u.shape
    T, nsb = (N + 7) // 8, K // KQ_SUPER
    pad = lambda t: F.pad(t, (0, 0, 0, 8 * T - N))  # noqa: E731
    if f.kind == KQ_Q8:  # per 32-block: vector v byte 4c + i is q[c][32b + 4v + i], then the rows' 8 half scales
        q = pad(f.u.view(torch.uint8)).view(T, 8, K // 32, 8, 4).permute(0, 2, 3, 1, 4).reshape(T, K // 32, 256)
        d = pad(f.d).view(T, 8, K // 32).permute(0, 2, 1).contiguous().view(torch.uint8)  # [T, K/32, 16]
        return torch.cat([q, d], dim=-1).reshape(T, -1).contiguous()
    u = pad(f.u).view(T, 8, nsb, 8, 2, 4, 4).permute(0, 2, 3, 4, 5, 1, 6)  # [T, s, b, half, v, c, i]
    lo, hi = u[:, :, :, 0], u[:, :, :, 1]  # [T, s, b, v, c, i]
    parts = [((lo & 15) | ((hi & 15) << 4)).reshape(T, nsb, 8, 128)]
    if f.kind == 1:  # bit v: the 5th bit of vector v's low nibble; bit 4 + v: of its high nibble
        bits = [((lo[:, :, :, v] >> 4) & 1) << v | ((hi[:, :, :, v] >> 4) & 1) << (4 + v) for v in range(4)]
        parts.append((bits[0] | bits[1] | bits[2] | bits[3]).reshape(T, nsb, 8, 32))
    elif f.kind == 2:  # bits 2v, 2v + 1: the 5th and 6th bits of vector v's nibble
        for half in (lo, hi):
            bits = [((half[:, :, :, v] >> 4) & 3) << (2 * v) for v in range(4)]
            parts.append((bits[0] | bits[1] | bits[2] | bits[3]).reshape(T, nsb, 8, 32))
    per_row = lambda t: pad(t).view(T, 8, nsb, 8).permute(0, 2, 3, 1)  # noqa: E731  [T, s, b, c]
    parts += [per_row(f.s1), per_row(f.s2)]
    blocks = torch.cat(parts, dim=-1).reshape(T, nsb, -1)
    halves = lambda t: pad(t).view(T, 8, nsb).permute(0, 2, 1).contiguous().view(torch.uint8)  # noqa: E731
    return torch.cat([halves(f.d), halves(f.dmin), blocks], dim=-1).reshape(T, -1).contiguous()


def unpack_kq(kind: int, tiles: torch.Tensor, K: int) -> KQFields:
    """Inverse of ``pack_kq`` for tiles uint8 [T, tile bytes] of one kind: fields of T * 8 rows."""
    T, nsb, bb = tiles.shape[0], K // KQ_SUPER, kq_block_bytes(kind)
    if kind == KQ_Q8:
        blk = tiles.reshape(T, K // 32, bb)
        q = blk[..., :256].reshape(T, K // 32, 8, 8, 4).permute(0, 3, 1, 2, 4).reshape(8 * T, K).view(torch.int8)
        d = blk[..., 256:].contiguous().view(torch.float16).permute(0, 2, 1).reshape(8 * T, K // 32)
        return q8_fields(q, d)
    t = tiles.view(T, nsb, KQ_HDR + 8 * bb)
    halves = lambda a: a.contiguous().view(torch.float16).view(T, nsb, 8).permute(0, 2, 1).reshape(8 * T, nsb)  # noqa: E731
    d, dmin = halves(t[..., :16]), halves(t[..., 16:32])
    blk = t[..., KQ_HDR:].reshape(T, nsb, 8, bb)
    nib = blk[..., :128].reshape(T, nsb, 8, 4, 8, 4)  # [T, s, b, v, c, i]
    lo, hi = nib & 15, nib >> 4
    shifts = torch.arange(4, dtype=torch.uint8, device=tiles.device).view(1, 1, 1, 4, 1, 1)
    if kind == 1:
        bits = blk[..., 128:160].reshape(T, nsb, 8, 1, 8, 4)
        lo, hi = lo | (((bits >> shifts) & 1) << 4), hi | (((bits >> (shifts + 4)) & 1) << 4)
    elif kind == 2:
        h0, h1 = (blk[..., a : a + 32].reshape(T, nsb, 8, 1, 8, 4) for a in (128, 160))
        lo, hi = lo | (((h0 >> (2 * shifts)) & 3) << 4), hi | (((h1 >> (2 * shifts)) & 3) << 4)
    u = torch.stack([lo, hi], dim=3).permute(0, 5, 1, 2, 3, 4, 6).reshape(8 * T, K)  # [T, c, s, b, half, v, i]
    s1 = blk[..., bb - 16 : bb - 8].permute(0, 3, 1, 2).reshape(8 * T, K // 32)
    s2 = blk[..., bb - 8 :].permute(0, 3, 1, 2).reshape(8 * T, K // 32)
    return KQFields(kind, u, s1, s2, d, dmin)


def kq_tile_table(kinds: list, tile_bytes: list) -> torch.Tensor:
    """The kernel's tile table (int64 per tile: byte offset << 2 | kind) of tiles laid end to end."""
    off = torch.tensor([0, *tile_bytes], dtype=torch.int64).cumsum(0)[:-1]
    return (off << 2) | torch.tensor(kinds, dtype=torch.int64)


class KQuantLinear(QuantLinear):
    """``y = x @ W^T (+ bias)`` with W [N, K] in GGUF K-quant blocks (Q4_K / Q5_K / Q6_K, parts of
    several kinds stacked by rows: a fused projection; Q8_0 parts among them, as an 8-expert Q4_K_M
    file's k / v beside its Q4_K q) kept in the kq layout of the CPU kernel (cpu_kernel/gemm_kq.h):
    every number of the file as it is, about the file's bytes.

    Buffers: ``qweight`` uint8 [bytes] (the tiles end to end), ``scale`` int64 [tiles] (the tile
    table), ``bias`` [N] or None. ``parts``: (kind name, rows) in row order, each but the last a
    multiple of 8 rows. Always int8 activations (the kernel has no fp32-activation path for these
    blocks, as llama.cpp's); without the kernel (or on CUDA, or above ``KERNEL_MAX_ROWS`` rows) one
    dequantization into a float matmul."""

    fmt = "kquant"

    def __init__(self, parts: list, tiles: torch.Tensor, table: torch.Tensor, in_features: int, bias=None):
        nn.Module.__init__(self)
        self.parts = tuple((str(k), int(n)) for k, n in parts)
        self.group, self.in_features = KQ_SUPER, int(in_features)
        self.out_features = sum(n for _, n in self.parts)
        self.register_buffer("qweight", tiles.contiguous())
        self.register_buffer("scale", table.contiguous())
        self.register_buffer("minv", None)
        self.register_buffer("bias", None if bias is None else bias.float().contiguous())

    @classmethod
    def from_fields(cls, parts: list, bias=None) -> KQuantLinear:
        """From ``(kind name, KQFields)`` parts stacked by rows (each but the last a multiple of 8 rows)."""
        packed, kinds, sizes = [], [], []
        for i, (name, f) in enumerate(parts):
            if i < len(parts) - 1 and f.u.shape[0] % 8:
                raise ValueError(f"a {name} part of {f.u.shape[0]} rows inside a fused projection: not a multiple of 8")
            p = pack_kq(f)
            packed.append(p.view(-1))
            kinds += [f.kind] * p.shape[0]
            sizes += [p.shape[1]] * p.shape[0]
        rows = [(name, f.u.shape[0]) for name, f in parts]
        return cls(rows, torch.cat(packed), kq_tile_table(kinds, sizes), parts[0][1].u.shape[1], bias)

    @property
    def k_pad(self) -> int:
        return self.in_features

    @property
    def act_int8(self) -> bool:  # (set_act_int8 may set it; these blocks only run with int8 activations)
        return True

    @act_int8.setter
    def act_int8(self, on: bool) -> None:
        pass

    def extra_repr(self) -> str:
        kinds = "+".join(f"{k}x{n}" for k, n in self.parts)
        return f"{kinds}, in={self.in_features}, out={self.out_features}"

    def _apply(self, fn, recurse=True):
        nn.Module._apply(self, fn, recurse)  # (the tiles and table are integers: a float dtype leaves them)
        if self.bias is not None and self.bias.dtype != torch.float32:
            self.bias = self.bias.float()
        return self

    def fields(self) -> list:
        """``(kind name, KQFields)`` per part, unpacked from the tiles."""
        out, tile, K = [], 0, self.in_features
        for name, n in self.parts:
            kind, nt = KQ_KINDS.index(name), (n + 7) // 8
            off = int(self.scale[tile]) >> 2
            size = nt * kq_tile_bytes(kind, K)
            f = unpack_kq(kind, self.qweight[off : off + size].view(nt, -1), K)
            out.append((name, KQFields(kind, *(t[:n] for t in (f.u, f.s1, f.s2, f.d, f.dmin)))))
            tile += nt
        return out

    def dequantize(self) -> torch.Tensor:
        return torch.cat([f.dequantize() for _, f in self.fields()])

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """fp32 rows ``W[ids]``: only the tiles holding them are unpacked (on the CPU by the kernel, one
        row at a time: the same bits)."""
        ids = ids.reshape(-1)
        dev = self.qweight.device
        if dev.type == "cpu":
            from specd.model.qkernel import kernel, kq_rows

            lib = kernel()
            if lib is not None:
                if ids.numel() and not (0 <= int(ids.min()) and int(ids.max()) < self.out_features):
                    raise IndexError(f"row ids out of range for {self.out_features} rows")
                return kq_rows(lib, self.qweight, self.scale, self.in_features, ids)
        return self._rows_unpacked(ids)

    def _rows_unpacked(self, ids: torch.Tensor) -> torch.Tensor:
        """``rows`` without the kernel: the tiles holding ``ids`` unpacked and dequantized whole."""
        dev = self.qweight.device
        tiles, inv = torch.unique(ids.to(dev) // 8, return_inverse=True)
        kinds = self.scale[tiles] & 3
        w = torch.empty((tiles.numel() * 8, self.in_features), dtype=torch.float32, device=dev)
        for kind in kinds.unique().tolist():
            pick = (kinds == kind).nonzero()[:, 0]
            size = kq_tile_bytes(kind, self.in_features)
            start = (self.scale[tiles[pick]] >> 2).unsqueeze(1)
            data = self.qweight[start + torch.arange(size, device=dev)]  # [n, tile bytes]
            rows8 = (pick.unsqueeze(1) * 8 + torch.arange(8, device=dev)).reshape(-1)
            w[rows8] = unpack_kq(kind, data, self.in_features).dequantize()
        return w[inv * 8 + ids.to(dev) % 8]

    def select(self, idx: torch.Tensor) -> KQuantLinear:
        """The rows ``idx`` (one kind only) as a new K-quant projection (their blocks, repacked)."""
        if len(self.parts) != 1:
            raise ValueError(f"selecting rows of a fused K-quant projection ({self.extra_repr()}) is unsupported")
        name, f = self.fields()[0]
        pick = [t.index_select(0, idx) for t in (f.u, f.s1, f.s2, f.d, f.dmin)]
        bias = None if self.bias is None else self.bias.index_select(0, idx)
        return KQuantLinear.from_fields([(name, KQFields(f.kind, *pick))], bias)

    def compact(self) -> KQuantLinear:
        return self  # (one copy already: the kq tiles)

    def x8_pack(self) -> X8:
        """The kernel's operands: the tiles, the tile table and no mins (``qkernel.x8_fmt``: X8_KQ)."""
        return X8(self.qweight, self.scale, None)

    def _matmul(self, x, add):
        from specd.model.qkernel import kernel, qgemm_x8

        lib = kernel() if not x.is_cuda and x.shape[0] <= self.KERNEL_MAX_ROWS else None
        if lib is None:
            b = None if self.bias is None else self.bias.to(x.device)
            y = F.linear(x.float(), self.dequantize().to(x.device), b)
            return y if add is None else y.add_(add.float())
        a = None if add is None else add.float()
        return qgemm_x8(lib, x.float().contiguous(), self.x8_pack(), self.out_features, False, a, self.bias)
