"""The CPU kernel's grammar-mask application (cpu_kernel/bitmask.h) against a pure-torch reference:
random and all-one / all-zero words, partial last words, columns past the bitmask, row indices."""

import pytest
import torch

from specd.model.qkernel import apply_bitmask, kernel

pytestmark = pytest.mark.skipif(kernel() is None, reason="no C++ compiler for the CPU kernel")


def _reference(logits: torch.Tensor, rows: torch.Tensor, bm: torch.Tensor) -> torch.Tensor:
    out = logits.clone()
    V = logits.shape[1]
    bits = ((bm.to(torch.int64).unsqueeze(-1) >> torch.arange(32)) & 1).reshape(bm.shape[0], -1).bool()
    allowed = torch.zeros(bm.shape[0], V, dtype=torch.bool)
    n = min(V, bits.shape[1])
    allowed[:, :n] = bits[:, :n]
    for k, r in enumerate(rows.tolist()):
        out[r] = out[r].masked_fill(~allowed[k], float("-inf"))
    return out


@pytest.mark.parametrize("V,W", [(49152, 1536), (49155, 1537), (100, 4), (70, 2), (64, 1), (33, 2)])
def test_bitmask_kernel_equals_the_torch_reference(V, W):
    g = torch.Generator().manual_seed(V)
    rows = torch.tensor([4, 0, 2, 5])
    bm = torch.randint(-(2**31), 2**31 - 1, (4, W), dtype=torch.int32, generator=g)
    bm[1] = -1  # every token allowed
    bm[2] = 0  # none
    bm[3, : W // 2] = -1
    logits = torch.randn(6, V, generator=g)
    want = _reference(logits, rows, bm)
    apply_bitmask(kernel(), logits, rows, bm)
    assert torch.equal(logits, want)


def test_bitmask_kernel_refuses_what_it_cannot_read():
    lib = kernel()
    with pytest.raises(ValueError):
        apply_bitmask(
            lib, torch.zeros(2, 64, dtype=torch.float64), torch.tensor([0]), torch.zeros(1, 2, dtype=torch.int32)
        )
    with pytest.raises(IndexError):
        apply_bitmask(lib, torch.zeros(2, 64), torch.tensor([2]), torch.zeros(1, 2, dtype=torch.int32))
    with pytest.raises(ValueError):
        apply_bitmask(lib, torch.zeros(2, 64), torch.tensor([0, 1]), torch.zeros(1, 2, dtype=torch.int32))
