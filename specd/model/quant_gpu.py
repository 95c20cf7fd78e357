"""``QuantLinear`` on CUDA: the Triton weight-only GEMM of ``specd_kernels.woq`` (dequantization fused
into the matmul, fp32 accumulation)."""

from __future__ import annotations

import torch


def woq_matmul(op, x: torch.Tensor, add: torch.Tensor | None) -> torch.Tensor:
    """``add + x @ W^T + bias`` for a ``QuantLinear`` ``op`` on the GPU; x [M, K] (padded to the
    layout's row length here), add [M, N] or None; the result in x's dtype."""
    import torch.nn.functional as F

    from specd_kernels.woq import woq_matmul as kernel

    if op.k_pad != op.in_features:
        x = F.pad(x, (0, op.k_pad - op.in_features))
    return kernel(x, op.qweight, op.scale, op.minv, op.group, op.fmt, op.bias, add)
