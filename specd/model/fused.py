"""A quantized model's decoder layers on a CPU, one C call per layer (``specd_layer`` in qgemm.cpp).

At decode and verification widths a layer's ~60 small torch ops (norms, RoPE, KV writes, the
attention gather, SiLU, reshapes, allocations) cost more than its quantized matmuls: on
SmolLM2-135M (AVX2, 2 threads) about 9 of a 14 ms one-row forward. ``specd_layer`` runs the layer's
RMSNorm, q/k/v projection, RoPE, KV write, attention over the paged cache (through the block table,
no gather copy of the cache), output projection with the residual, RMSNorm, gate/up, SiLU and down
projection with the residual in one call, with the same kernels as the op-by-op path (the quantized
matmuls, the row-at-a-time attention). Each step is row-wise or row-independent, so a token's result
still depends on that token alone: speculative verification stays bitwise equal to plain decoding.

Used by ``LlamaModel.forward`` when every projection is a ``QuantLinear`` the CPU kernel takes, the
activations and the KV cache are fp32 on the CPU and the attention backend is the CPU kernel's;
``SPECD_FUSED=0`` turns it off (the op-by-op path then runs, for comparisons).
"""

from __future__ import annotations

import ctypes
import os

import torch

from specd.model.qkernel import _ptr
from specd.model.quant import QuantLinear


class Lin(ctypes.Structure):
    """One projection as ``specd_layer`` reads it (see ``Lin`` in qgemm.cpp)."""

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
        w, scale, mins = op.x8_pack()
        lin = Lin(3 if int4 else 2, op.out_features, op.k_pad, 32, op.in_features, _ptr(w), _ptr(scale), _ptr(mins),
                  _ptr(op.bias))  # fmt: skip
        return lin, (w, scale, mins, op.bias)
    lin = Lin(1 if int4 else 0, op.out_features, op.k_pad, op.group, op.in_features, _ptr(op.qweight), _ptr(op.scale),
              _ptr(op.minv), _ptr(op.bias))  # fmt: skip
    return lin, (op.qweight, op.scale, op.minv, op.bias)


def _projections(blk) -> tuple:
    return blk.attn.qkv, blk.attn.o, blk.mlp.gate_up, blk.mlp.down


def _usable(op) -> bool:
    return isinstance(op, QuantLinear) and not op.qweight.is_cuda


class FusedLayers:
    """The per-layer arguments of ``specd_layer`` for one model, built once per activation format."""

    def __init__(self, lib, model):
        self.lib = lib
        cfg = model.cfg
        self.cfg = cfg
        self.keep: list = []
        self.layers = []
        for blk in model.layers:
            arr = (Lin * 4)()
            for j, op in enumerate(_projections(blk)):
                arr[j], tensors = _lin(op)
                self.keep.append(tensors)
            w_in, w_post = blk.input_norm.weight.float().contiguous(), blk.post_norm.weight.float().contiguous()
            self.keep.append((w_in, w_post))
            self.layers.append((arr, w_in.data_ptr(), w_post.data_ptr()))
        self.cos = model.rotary.cos.float().contiguous()
        self.sin = model.rotary.sin.float().contiguous()

    def run(self, x, positions, kv, meta, backend, capture: dict | None) -> None:
        """All layers on ``x`` [T, d] (fp32, contiguous; updated in place); K/V written to ``kv``."""
        cfg = self.cfg
        plan = backend._plan(meta, x.device)
        bias = plan[2] if plan[0] == "decode" else plan[4]
        B, Lp = bias.shape[0], bias.shape[-1]
        Qm = 1 if plan[0] == "decode" else bias.shape[1]
        pos = positions.long().contiguous()
        bt, qsl, slots = meta.block_tables.contiguous(), meta.query_start_loc.contiguous(), meta.slot_mapping
        nslots = kv.shape[2] * kv.shape[3]
        T, d = x.shape
        # the C code does no bounds checks: refuse what the op-by-op path's index_copy_ would refuse
        # (positions: LlamaModel.forward's RoPE-table lookup already did)
        if int(slots.max()) >= nslots or int(slots.min()) < 0:
            raise IndexError(f"KV slot out of range of the cache ({nslots} slots)")
        scale = cfg.head_dim**-0.5
        for i, (arr, w_in, w_post) in enumerate(self.layers):
            if capture is not None and i in capture:
                capture[i] = x.clone()  # (x is updated in place below)
            self.lib.specd_layer(
                x.data_ptr(), T, d, w_in, w_post, cfg.rms_norm_eps, arr, cfg.num_heads, cfg.num_kv_heads,
                cfg.head_dim, cfg.intermediate_size, self.cos.data_ptr(), self.sin.data_ptr(), pos.data_ptr(),
                kv[i].data_ptr(), nslots, slots.data_ptr(), qsl.data_ptr(), B, bt.data_ptr(), bt.shape[1],
                meta.block_size, bias.data_ptr(), Qm, Lp, scale,
            )  # fmt: skip


def fused_layers(model, backend, kv: torch.Tensor, x: torch.Tensor) -> FusedLayers | None:
    """The model's ``FusedLayers`` when this forward can take them (see the module doc), else None."""
    if getattr(backend, "name", None) != "cpu" or os.environ.get("SPECD_FUSED", "1") == "0":
        return None
    if x.dtype != torch.float32 or kv.dtype != torch.float32 or x.device.type != "cpu":
        return None
    if x.shape[0] > QuantLinear.KERNEL_MAX_ROWS or not x.is_contiguous() or not kv.is_contiguous():
        return None
    fused = getattr(model, "_fused", None)  # built once (``quant.set_act_int8`` drops it); False: not usable
    if fused is None:
        usable = all(_usable(op) for blk in model.layers for op in _projections(blk))
        fused = model._fused = FusedLayers(backend.lib, model) if usable else False
    return fused or None
