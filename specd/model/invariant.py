"""Batch-invariant GEMMs, norms and attention for the model's forward (``--batch-invariant``).

On a GPU, cuBLAS and torch's reductions choose their kernel from the number of rows, so a token's
logits differ in their last bits between a 1-row decode step and a tree verification, and greedy
speculative output drifts from plain output. ``specd_kernels.batch_invariant`` has a GEMM, an
RMSNorm and a paged attention whose reduction order depends on the weights' shape only; this
module picks them where they apply (CUDA tensors, a plain weight tensor) and the ordinary ops
everywhere else. The CPU path is row-independent already (DESIGN.md, exactness rules) and keeps its
own ops; quantized projections (``QuantLinear``) keep theirs.

Modes (``EngineConfig.batch_invariant``): ``on`` every step; ``off`` never (cuBLAS); ``auto`` the
steps that hold at least one greedy row (:func:`step_ops`): a greedy request runs every one of its
steps, plain or speculative, through the invariant kernels, so its speculative output is token for
token its plain output; an all-sampling step keeps cuBLAS (sampling is exact in distribution
either way).

API for the model (``specd/model/llama.py`` on CUDA; nothing global: the ops object is passed):

    ops = invariant.step_ops(cfg.batch_invariant, any_greedy)       # or invariant.ops_for(mode)
    qkv = ops.linear(ops.rms_norm(x, w_in, eps), w_qkv, b_qkv)     # x @ W^T + b
    x = ops.addmm(x, o.reshape(T, nq), w_o_t)                      # x + o @ W_o^T (W^T view)
    o = ops.attention(backend, q, kv_layer, meta, scale, window)   # or ops.backend(backend)
    logits = ops.linear(hidden, lm_head.weight).float()

Module-level ``linear`` / ``addmm`` / ``rms_norm`` do the same with ``enabled`` as an argument.
``InvariantOps(devices=("cuda", "cpu"))`` lets tests run the kernels on the CPU under
``TRITON_INTERPRET=1``; by default only CUDA tensors take them (an engine on a CPU never does).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specd.model import quant

MODES = ("auto", "on", "off")


@functools.cache
def _bi():
    """``specd_kernels.batch_invariant``, imported on first use (TRITON_INTERPRET is read when
    the kernels are decorated, so importing this module must not import them)."""
    from specd_kernels import batch_invariant

    return batch_invariant


def _torch_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """fp32 RMSNorm of ``x [..., D]`` by ``w`` [D] or [W, D] (per head), in x's dtype (transformers')."""
    if w.dim() == 1:
        return F.rms_norm(x.float(), (x.shape[-1],), w.float(), eps).to(x.dtype)
    xf = x.float()
    return (xf * (xf * xf).mean(-1, keepdim=True).add_(eps).rsqrt_() * w.float()).to(x.dtype)


@dataclass(frozen=True)
class InvariantOps:
    """The forward's reducing ops, batch-invariant where ``enabled`` and the tensors allow."""

    enabled: bool = False
    devices: tuple = ("cuda",)  # tensors on these device types take the kernels

    def applies(self, x: torch.Tensor, w=None) -> bool:
        """Whether the invariant kernel runs for ``x`` (and weight ``w``): enabled, a kernel device,
        a float dtype, and a plain weight tensor of x's dtype (a ``QuantLinear`` keeps its own op)."""
        if not self.enabled or x.device.type not in self.devices:
            return False
        if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            return False
        return w is None or (isinstance(w, torch.Tensor) and w.dtype == x.dtype)

    def linear(self, x: torch.Tensor, w, b: torch.Tensor | None = None) -> torch.Tensor:
        """``x [..., K] @ W^T + b`` (``W`` [N, K] or a ``QuantLinear``) -> [..., N]."""
        if not self.applies(x, w):
            return quant.linear(x, w, b)
        y = _bi().matmul(x.reshape(-1, x.shape[-1]), w, b)  # [rows, N]
        return y.view(*x.shape[:-1], w.shape[0])

    def addmm(self, res: torch.Tensor, x: torch.Tensor, w_t) -> torch.Tensor:
        """``res [M, N] + x [M, K] @ W^T`` with ``w_t`` the W^T view [K, N] (``torch.addmm``'s
        operands) or a ``QuantLinear``; the sum is rounded once, as cuBLAS's epilogue does."""
        if not self.applies(x, w_t) or res.dtype != x.dtype:
            return quant.addmm(res, x, w_t)
        return _bi().matmul(x, w_t.t(), add=res)

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm of ``x [..., D]`` by ``w`` [D] or per head [W, D], fp32 math, in x's dtype."""
        if not self.applies(x):
            return _torch_rms_norm(x, w, eps)
        return _bi().rms_norm(x, w, eps)

    def attention(self, backend, q, kv_layer, meta, scale: float, window: int | None = None) -> torch.Tensor:
        """``backend.attention(q, kv_layer, meta, scale, window)``, or the invariant kernel over the
        same metadata (``specd.model.attention.AttentionMetadata``)."""
        if not self.applies(q) or kv_layer.dtype != q.dtype:
            return backend.attention(q, kv_layer, meta, scale, window)
        return _bi().attention(q, kv_layer, meta.query_start_loc, meta.context_lens, meta.seq_lens,
                               meta.block_tables, meta.tree_mask, scale, window)  # fmt: skip

    def backend(self, backend):
        """``backend`` with its attention replaced by :meth:`attention` (KV writes and copies its own)."""
        return InvariantAttention(backend, self) if self.enabled else backend


class InvariantAttention:
    """An attention backend whose ``attention`` is batch-invariant where the ops apply; the KV writes
    and slot copies (no reductions) are the wrapped backend's."""

    def __init__(self, inner, ops: InvariantOps):
        self.inner, self.ops = inner, ops
        self.name = f"invariant({getattr(inner, 'name', type(inner).__name__)})"

    def write_kv(self, kv_layer, k, v, slot_mapping):
        self.inner.write_kv(kv_layer, k, v, slot_mapping)

    def copy_slots(self, kv: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        self.inner.copy_slots(kv, src, dst)

    def attention(self, q, kv_layer, meta, scale: float, window: int | None = None):
        return self.ops.attention(self.inner, q, kv_layer, meta, scale, window)


ON = InvariantOps(True)
OFF = InvariantOps(False)


def ops_for(mode: str) -> InvariantOps:
    """The ops of a fixed mode: ``on`` / ``auto`` (before knowing the step's rows) -> ON, ``off`` -> OFF."""
    if mode not in MODES:
        raise ValueError(f"batch_invariant must be one of {MODES}, got {mode!r}")
    return OFF if mode == "off" else ON


def step_invariant(mode: str, any_greedy: bool) -> bool:
    """Whether a step runs the invariant kernels: ``on`` always, ``off`` never, ``auto`` when the step
    holds a greedy row (temperature 0)."""
    if mode not in MODES:
        raise ValueError(f"batch_invariant must be one of {MODES}, got {mode!r}")
    return mode == "on" or (mode == "auto" and any_greedy)


def step_ops(mode: str, any_greedy: bool) -> InvariantOps:
    """:func:`step_invariant` as an ops object (ON / OFF)."""
    return ON if step_invariant(mode, any_greedy) else OFF


def linear(x: torch.Tensor, w, b: torch.Tensor | None = None, *, enabled: bool = True) -> torch.Tensor:
    """``x @ W^T + b``: the invariant GEMM on CUDA when ``enabled``, else ``specd.model.quant.linear``."""
    return (ON if enabled else OFF).linear(x, w, b)


def addmm(res: torch.Tensor, x: torch.Tensor, w_t, *, enabled: bool = True) -> torch.Tensor:
    """``res + x @ W^T`` (``w_t``: the W^T view): the invariant GEMM on CUDA when ``enabled``."""
    return (ON if enabled else OFF).addmm(res, x, w_t)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, *, enabled: bool = True) -> torch.Tensor:
    """RMSNorm (fp32 math): the invariant kernel on CUDA when ``enabled``, else torch."""
    return (ON if enabled else OFF).rms_norm(x, w, eps)
