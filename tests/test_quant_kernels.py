"""The Triton weight-only GEMM (specd_kernels.woq) against its pure-torch reference, under the Triton
interpreter on the CPU (compiled on CUDA): odd shapes, every format and group, fp32 / fp16 / bf16
activations (a per-dtype tolerance table), bias and residual; and against QuantLinear's layout."""

from __future__ import annotations

import pytest
import torch

from specd.model.quant import quantize_int4, quantize_int8
from specd_kernels.woq import dequantize_ref, woq_matmul, woq_matmul_ref

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# |y - ref| <= TOL * (|x| @ |W|^T + 1): fp32 accumulation; 16-bit operands (x and the dequantized
# weight rounded to the activation dtype) and a 16-bit result
TOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
CASES = [  # (fmt, group, N, K, M)
    ("int8", 32, 19, 64, 1),
    ("int8", 96, 33, 96, 5),  # per channel: one group per row
    ("int4", 32, 17, 96, 3),
    ("int4", 64, 40, 128, 17),
    ("int4", 128, 7, 256, 2),
]


def _op(fmt, group, N, K, g):
    w = torch.randn(N, K, generator=g) * 0.1
    b = torch.randn(N, generator=g)
    return quantize_int8(w, b, group=group) if fmt == "int8" else quantize_int4(w, b, group=group)


@pytest.mark.parametrize("fmt,group,N,K,M", CASES, ids=[f"{c[0]}-g{c[1]}-{c[2]}x{c[3]}-m{c[4]}" for c in CASES])
@pytest.mark.parametrize("dtype", list(TOL), ids=["fp32", "fp16", "bf16"])
def test_woq_matmul_matches_reference(fmt, group, N, K, M, dtype):
    g = torch.Generator().manual_seed(N + K + M)
    op = _op(fmt, group, N, K, g)
    x = torch.randn(M, K, generator=g).to(dtype)
    add = torch.randn(M, N, generator=g).to(dtype)
    args = [t.to(DEV) if t is not None else None for t in (op.qweight, op.scale, op.minv)]
    for a in (None, add):
        y = woq_matmul(x.to(DEV), *args, group, fmt, op.bias.to(DEV), None if a is None else a.to(DEV)).cpu()
        ref = woq_matmul_ref(x, op.qweight, op.scale, op.minv, group, fmt, op.bias, a)
        w = op.dequantize()
        bound = x.float().abs() @ w.abs().t() + op.bias.abs() + (0 if a is None else a.float().abs()) + 1
        assert y.dtype == dtype and y.shape == (M, N)
        assert ((y.float() - ref.float()).abs() <= TOL[dtype] * bound).all()


def test_reference_dequantization_is_quantlinears():
    g = torch.Generator().manual_seed(0)
    for fmt, group in (("int8", 32), ("int4", 64)):
        op = _op(fmt, group, 11, 128, g)
        assert torch.equal(dequantize_ref(op.qweight, op.scale, op.minv, group, fmt, 128), op.dequantize())


def test_bad_layouts_are_refused():
    op = quantize_int4(torch.randn(8, 64))
    x = torch.randn(2, 64, device=DEV)
    with pytest.raises(ValueError, match="fmt must be one of"):
        woq_matmul(x, op.qweight.to(DEV), op.scale.to(DEV), op.minv.to(DEV), 32, "int2")
    with pytest.raises(ValueError, match="does not match"):
        woq_matmul(x, op.qweight.to(DEV), op.scale.to(DEV), op.minv.to(DEV), 64, "int4")
