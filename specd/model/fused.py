"""A quantized model's decoder layers on a CPU in one C call (``specd_layers`` in the CPU kernel,
``cpu_kernel/kernel.cpp``; the layer itself in ``cpu_kernel/layer.h``, one ``specd_head_layer`` per layer).

At decode and verification widths a layer's ~60 small torch ops (norms, RoPE, KV writes, the
attention gather, SiLU, reshapes, allocations) cost more than its quantized matmuls: on
SmolLM2-135M (AVX2, 2 threads) about 9 of a 14 ms one-row forward. The C layer runs the layer's
RMSNorm, q/k/v projection, RoPE, KV write, attention over the paged cache (through the block table,
no gather copy of the cache), output projection with the residual, RMSNorm, gate/up, SiLU and down
projection with the residual in one call, with the same kernels as the op-by-op path (the quantized
matmuls, the row-at-a-time attention). Each step is row-wise or row-independent, so a token's result
still depends on that token alone: speculative verification stays bitwise equal to plain decoding.

Used by ``LlamaModel.forward`` when every projection is a ``QuantLinear`` the CPU kernel takes, the
activations are fp32 and the KV cache fp32 or fp16 on the CPU and the attention backend is the CPU kernel's;
``SPECD_FUSED=0`` turns it off (the op-by-op path then runs, for comparisons).
"""

from __future__ import annotations

import ctypes
import os

import torch

from specd.model.qkernel import _ptr, x8_fmt
from specd.model.quant import QuantLinear


class Lin(ctypes.Structure):
    """One projection as ``specd_layers`` reads it (see ``Lin`` in cpu_kernel/layer.h)."""

    _fields_ = [
        ("kind", ctypes.c_int64),
        ("N", ctypes.c_int64),
        ("K", ctypes.c_int64),
        ("G", ctypes.c_int64),
        ("Kin", ctypes.c_int64),
        ("w", ctypes.c_void_p),
        ("scale", ctypes.c_void_p),
        ("mins", ctypes.c_void_p),
        ("bias", ctypes.c_void_p),
    ]


def _lin(op: QuantLinear) -> tuple[Lin, tuple]:
    """``op`` as a ``Lin`` and the tensors it points into (kept alive by the caller)."""
    int4 = op.fmt == "int4"
    if op.act_int8:
        w, scale, mins, off8 = op.x8_pack()
        lin = Lin(2 + x8_fmt(int4, scale, off8), op.out_features, op.k_pad, 32, op.in_features, _ptr(w), _ptr(scale),
                  _ptr(mins), _ptr(op.bias))  # fmt: skip
        return lin, (w, scale, mins, op.bias)
    op.expand()  # (a compact op, ``QuantLinear.compact``: fp32 activations read the row layout)
    lin = Lin(1 if int4 else 0, op.out_features, op.k_pad, op.group, op.in_features, _ptr(op.qweight), _ptr(op.scale),
              _ptr(op.minv), _ptr(op.bias))  # fmt: skip
    return lin, (op.qweight, op.scale, op.minv, op.bias)


def _projections(blk) -> tuple:
    return blk.attn.qkv, blk.attn.o, blk.mlp.gate_up, blk.mlp.down


def _usable(op) -> bool:
    return isinstance(op, QuantLinear) and not op.qweight.is_cuda


class FusedLayers:
    """The arguments of ``specd_layers`` for one model (every layer in one call), built once per
    activation format."""

    def __init__(self, lib, model):
        self.lib = lib
        cfg = model.cfg
        self.cfg, self.n = cfg, len(model.layers)
        self.keep: list = []
        self.lins = (Lin * (4 * self.n))()
        self.w_in, self.w_post = (ctypes.c_void_p * self.n)(), (ctypes.c_void_p * self.n)()
        for i, blk in enumerate(model.layers):
            for j, op in enumerate(_projections(blk)):
                self.lins[4 * i + j], tensors = _lin(op)
                self.keep.append(tensors)
            w_in, w_post = blk.input_norm.weight.float().contiguous(), blk.post_norm.weight.float().contiguous()
            self.keep.append((w_in, w_post))
            self.w_in[i], self.w_post[i] = w_in.data_ptr(), w_post.data_ptr()
        self.cos = model.rotary.cos.float().contiguous()
        self.sin = model.rotary.sin.float().contiguous()
        self.no_caps = (ctypes.c_void_p * self.n)()
        self.window = model.windows[0]  # every layer's (``kernel_arch``): the C attention reads it in its mask

    def run(self, x, positions, kv, meta, backend, capture: dict | None) -> None:
        """All layers on ``x`` [T, d] (fp32, contiguous; updated in place); K/V written to ``kv``
        (contiguous, [layers, ...]); ``capture`` (layer -> None) gets x as it enters those layers."""
        cfg = self.cfg
        _keep, pos, *attn = _attention_args(positions, kv, meta, backend, cfg.head_dim**-0.5, self.window)
        T, d = x.shape
        caps = self.no_caps
        if capture:
            caps = (ctypes.c_void_p * self.n)()
            for i in capture:
                capture[i] = torch.empty_like(x)
                caps[i] = capture[i].data_ptr()
        self.lib.specd_layers(
            x.data_ptr(), self.n, self.lins, self.w_in, self.w_post, caps, T, d, cfg.rms_norm_eps, cfg.num_heads,
            cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size, self.cos.data_ptr(), self.sin.data_ptr(), pos,
            kv.data_ptr(), kv[0].numel() * kv.element_size(), *attn,
        )  # fmt: skip


def _attention_args(positions, kv, meta, backend, scale: float, window: int | None = None) -> tuple:
    """(the tensors to keep alive during the call, the positions pointer, then ``specd_layers``'
    attention arguments after its KV pointer) for a forward over ``meta`` (``window``: a sliding
    window, masked out in the additive mask the C attention reads). Refuses a KV slot
    outside the cache: the C code does no bounds checks, and this is what the op-by-op path's
    index_copy_ would refuse (positions were checked by the caller's RoPE-table lookup)."""
    plan = backend._plan(meta, positions.device, window)
    bias = plan[2] if plan[0] == "decode" else plan[4]
    B, Lp = bias.shape[0], bias.shape[-1]
    Qm = 1 if plan[0] == "decode" else bias.shape[1]
    pos = positions.long().contiguous()
    bt, qsl, slots = meta.block_tables.contiguous(), meta.query_start_loc.contiguous(), meta.slot_mapping
    nslots = kv.shape[-4] * kv.shape[-3]
    if int(slots.max()) >= nslots or int(slots.min()) < 0:
        raise IndexError(f"KV slot out of range of the cache ({nslots} slots)")
    keep = (pos, bt, qsl, slots, bias)
    return (keep, pos.data_ptr(), nslots, slots.data_ptr(), qsl.data_ptr(), B, bt.data_ptr(), bt.shape[1],
            meta.block_size, bias.data_ptr(), Qm, Lp, scale, int(kv.dtype == torch.float16))  # fmt: skip


class HeadLayer:
    """A feature head's decoder layer (``specd.model.head.EagleHead``) as one ``specd_head_layer``
    call, over its int8 drafting projections (``EagleHead.use_kernel``)."""

    def __init__(self, lib, head):
        self.lib, self.cfg = lib, head.cfg
        self.arr = (Lin * 4)()
        self.keep: list = []
        for j, name in enumerate(("qkv", "o", "gate_up", "down")):
            self.arr[j], tensors = _lin(head.ops[name])
            self.keep.append(tensors)
        f32 = lambda t: t.detach().float().contiguous()  # noqa: E731
        self.w_e, self.w_h = f32(head.input_norm.weight), f32(head.hidden_norm.weight)
        self.w_post = f32(head.post_norm.weight)
        self.cos, self.sin = f32(head.rotary.cos), f32(head.rotary.sin)

    def run(self, x: torch.Tensor, e: torch.Tensor, positions, kvl: torch.Tensor, meta, backend) -> torch.Tensor:
        """The layer's output hidden states [T, d] for hidden inputs ``x`` and token embeddings ``e``."""
        c = self.cfg
        out = x.float().contiguous().clone()  # (updated in place by the call)
        e = e.float().contiguous()
        _keep, pos, *attn = _attention_args(positions, kvl, meta, backend, c.head_dim**-0.5)
        T, d = out.shape
        self.lib.specd_head_layer(
            out.data_ptr(), e.data_ptr(), self.w_e.data_ptr(), T, d, self.w_h.data_ptr(), self.w_post.data_ptr(),
            c.rms_norm_eps, self.arr, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size,
            self.cos.data_ptr(), self.sin.data_ptr(), pos, kvl.data_ptr(), *attn,
        )  # fmt: skip
        return out


KERNEL_KV_DTYPES = (torch.float32, torch.float16)  # the cache element types the C attention reads (fp16: F16C)
MAX_HEAD_DIM = 256  # cpu_kernel/attention_scores.h's score_keys: keys transposed 8 at a time on the stack


def takes(backend, kv: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether a forward of rows ``x`` over cache ``kv`` can run as C calls (a target's layers or a
    feature head's): the CPU kernel's attention backend, fp32 rows on the CPU, a contiguous fp32 or
    fp16 cache there, at most ``KERNEL_MAX_ROWS`` rows, a head size of at most 256 (the paged
    attention's per-block key buffer); ``SPECD_FUSED=0`` turns it off."""
    return (
        getattr(backend, "name", None) == "cpu"
        and kv.shape[-1] <= MAX_HEAD_DIM
        and os.environ.get("SPECD_FUSED", "1") != "0"
        and x.dtype == torch.float32
        and kv.dtype in KERNEL_KV_DTYPES
        and x.device.type == "cpu"
        and kv.is_contiguous()
        and x.shape[0] <= QuantLinear.KERNEL_MAX_ROWS
    )


def kernel_arch(model) -> bool:
    """Whether the C layer computes this model's layers: Llama's layer (``ModelConfig.beyond_kernel``:
    no q/k norms, Gemma's layer, partial rotary, ...; other models run op by op) with one attention
    mask for all of them (every layer the same sliding window, or none). Layers with different windows (Qwen2's
    ``max_window_layers``) take the op-by-op path, whatever the context: a token's path (and so its
    bits) must not depend on the batch it is in."""
    return len(set(model.windows)) == 1 and not model.cfg.beyond_kernel()


def fused_layers(model, backend, kv: torch.Tensor, x: torch.Tensor) -> FusedLayers | None:
    """The model's ``FusedLayers`` when this forward can take them (see the module doc), else None."""
    if not takes(backend, kv, x) or not x.is_contiguous():
        return None
    fused = getattr(model, "_fused", None)  # built once (``quant.set_act_int8`` drops it); False: not usable
    if fused is None:
        usable = kernel_arch(model) and all(_usable(op) for blk in model.layers for op in _projections(blk))
        fused = model._fused = FusedLayers(backend.lib, model) if usable else False
    return fused or None
