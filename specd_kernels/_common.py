"""Shared helpers for the specd Triton kernels (import-safe without Triton)."""

from __future__ import annotations

import torch

try:  # Triton is optional: the pure-torch references must work without it.
    import triton  # noqa: F401
    import triton.language as tl  # noqa: F401

    HAS_TRITON = True
except Exception:  # pragma: no cover - depends on the environment
    triton = None
    tl = None
    HAS_TRITON = False

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

if HAS_TRITON:

    @triton.jit
    def _mode_kernel():  # never launched: what it was decorated as says interpreter or compiler
        pass


def interpreting() -> bool:
    """True when the kernels of this package run under the Triton CPU interpreter.

    Triton decides interpreter-vs-compiled when a ``@triton.jit`` function is *decorated*
    (i.e. when ``specd_kernels`` is imported), from ``TRITON_INTERPRET``; so this looks at a
    kernel object (``_mode_kernel``, decorated with the others) rather than at the environment
    variable now.
    """
    if not HAS_TRITON:
        return False
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except Exception:  # pragma: no cover
        return False
    return isinstance(_mode_kernel, InterpretedFunction)


def _row_exact_interpreter_dot() -> None:
    """Under the interpreter, ``tl.dot`` as an ordered sum per output element instead of
    ``np.matmul``: numpy's BLAS (OpenBLAS, measured on an AVX2 Zen 3) rounds the same row differently
    by its position in the block (10 of 16 positions of a [16, 64] x [64, 64] product differed from the
    row alone), which would make a batch-invariant kernel's rows depend on their neighbours on the CPU
    only; a GPU's MMA treats every row of a tile alike. Each element here sums its products over k in
    order (the accumulator's dtype), the same steps for every row, so the kernels' batch invariance is
    what the interpreter tests see. Applied once, when the package's kernels are interpreted."""
    import numpy as np
    from triton.runtime import interpreter as ti

    builder = ti.InterpreterBuilder
    if getattr(builder, "_specd_row_exact", False):
        return
    plain = builder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.data.ndim != 2 or a.dtype.primitive_bitwidth == 8:
            return plain(self, a, b, d, input_precision, max_num_imprecise_acc)  # (fp8 / batched dots: as Triton)
        acc = d.data.dtype
        prods = a.data.astype(acc)[:, :, None] * b.data.astype(acc)[None, :, :]  # [M, K, N]
        return ti.TensorHandle(np.add.reduce(prods, axis=1) + d.data, d.dtype.scalar)

    builder.create_dot = create_dot
    builder._specd_row_exact = True


if interpreting():
    _row_exact_interpreter_dot()


def next_pow2(x: int) -> int:
    x = int(x)
    return 1 if x <= 1 else 1 << (x - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-int(a) // int(b))


def check_launchable(*tensors: torch.Tensor, what: str) -> None:
    """Raise if the kernels cannot run on these tensors (no Triton / wrong device)."""
    if not HAS_TRITON:
        raise RuntimeError(f"{what}: triton is not installed; use the *_ref functions")
    dev = tensors[0].device
    for t in tensors:
        if t.device != dev:
            raise ValueError(f"{what}: all tensors must be on one device, got {dev} and {t.device}")
    if interpreting():
        if dev.type != "cpu":
            raise ValueError(f"{what}: under TRITON_INTERPRET=1 tensors must be on the CPU, got {dev}")
    elif dev.type != "cuda":
        raise ValueError(
            f"{what}: compiled Triton kernels need CUDA tensors (got {dev}); "
            "set TRITON_INTERPRET=1 before importing triton to run them on the CPU"
        )


def check_dtype(name: str, t: torch.Tensor, allowed, what: str) -> None:
    if t.dtype not in allowed:
        raise ValueError(f"{what}: {name} must have dtype in {list(allowed)}, got {t.dtype}")


def check_dims(name: str, t: torch.Tensor, ndim: int, what: str) -> None:
    if t.dim() != ndim:
        raise ValueError(f"{what}: {name} must be {ndim}-D, got shape {tuple(t.shape)}")
