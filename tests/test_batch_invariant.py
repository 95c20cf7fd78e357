"""specd_kernels.batch_invariant: the GEMM, RMSNorm and attention whose rows do not depend on the batch.

Two properties, per dtype: each kernel equals its pure-torch reference within the tolerance table,
and a row's result is bitwise the same (``torch.equal``) whether it is computed alone or among 3, 8
or 17 rows of other data, at any position; for attention, a token decoded plainly (its context in
the cache, one new token) gives the same bits as the same token verified as a tree node at depth d
(its ancestors in scattered cache slots, siblings around it, other requests in the batch). Control
checks show the comparisons can fail: a GEMM whose K step depends on M, and the tree-attention
kernel (two-phase tiles split at the context length) in fp32, both differ in the last bits.

Without CUDA the kernels run under the Triton interpreter (``TRITON_INTERPRET=1`` set before triton
is imported, here or in tests/conftest.py); shapes are small (slow launches). On a GPU the same
tests run compiled (eval/gpu_check.sh).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

import specd_kernels as sk
from specd_kernels import batch_invariant as bi
from specd_kernels.tree_attention import tree_attention

DEVICE = torch.device("cuda" if (torch.cuda.is_available() and not sk.interpreting()) else "cpu")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (atol, rtol) per dtype: fp32 math in both; the 16-bit results differ by the output's rounding
# (the interpreter truncates fp32 -> bf16 instead of rounding: up to 1 ulp = 2^-7 relative)
TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 2e-2)}
BATCHES = (1, 3, 8, 17)


def _id(dt):
    return str(dt).replace("torch.", "")


def _randn(*shape, dtype, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEVICE)


def assert_close(out, ref, dtype, what):
    assert out.shape == ref.shape and out.dtype == ref.dtype, what
    assert not torch.isnan(out).any(), f"{what}: NaN"
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out.float().cpu(), ref.float().cpu(), atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")


def test_environment():
    assert sk.HAS_TRITON
    if DEVICE.type == "cpu":
        assert sk.interpreting(), "no CUDA: TRITON_INTERPRET=1 must be set before triton is imported"


# ---------------------------------------------------------------------------------------------
# GEMM
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
@pytest.mark.parametrize(("M", "K", "N", "extras"), [(1, 1, 1, ""), (3, 70, 45, "bias"), (17, 33, 129, "add"),
                                                      (5, 130, 16, "bias,add"), (20, 64, 31, "")])  # fmt: skip
def test_matmul_matches_reference(dtype, M, K, N, extras):
    x = _randn(M, K, dtype=dtype, seed=M + K)
    w = _randn(N, K, dtype=dtype, seed=N, scale=K**-0.5)
    bias = _randn(N, dtype=dtype, seed=1) if "bias" in extras else None
    add = _randn(M, N, dtype=dtype, seed=2) if "add" in extras else None
    y = bi.matmul(x, w, bias, add)
    assert_close(y, bi.matmul_ref(x, w, bias, add), dtype, f"matmul {M}x{K}x{N} {extras}")


@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
def test_matmul_takes_strided_operands(dtype):
    """``torch.addmm(res, x, W^T)`` hands the model's W^T view: W as a transposed view, x a column slice."""
    w_t = _randn(40, 24, dtype=dtype, seed=3)  # [K, N] storage: W = w_t.t() has strides (1, N)
    x = _randn(6, 50, dtype=dtype, seed=4)[:, 5:45]  # [6, 40] with row stride 50
    res = _randn(6, 24, dtype=dtype, seed=5)
    out = torch.empty(6, 24, dtype=dtype, device=DEVICE)
    y = bi.matmul(x, w_t.t(), add=res, out=out)
    assert y is out
    assert_close(y, bi.matmul_ref(x, w_t.t(), add=res), dtype, "strided matmul")


@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
def test_matmul_rows_are_bitwise_the_same_in_any_batch(dtype):
    K, N = 70, 45
    w = _randn(N, K, dtype=dtype, seed=10, scale=K**-0.5)
    bias = _randn(N, dtype=dtype, seed=11)
    rows = _randn(4, K, dtype=dtype, seed=12)  # the rows under test
    alone = [bi.matmul(rows[i : i + 1], w, bias) for i in range(4)]
    for M in BATCHES:
        for i in range(4):
            batch = _randn(M, K, dtype=dtype, seed=100 + M + i, scale=3.0)  # other rows, other magnitudes
            at = (i * 5) % M
            batch[at] = rows[i]
            y = bi.matmul(batch, w, bias)
            assert torch.equal(y[at], alone[i][0]), f"row {i} at {at} of a batch of {M} differs from the row alone"


def test_a_tile_chosen_by_the_batch_would_be_caught():
    """Control: with BLOCK_K picked by M (as a library picks its kernel by shape) the bitwise check
    fails, so the check above sees what it claims to."""
    K, N = 130, 45
    w = _randn(N, K, dtype=torch.float32, seed=20)
    x = _randn(17, K, dtype=torch.float32, seed=21)

    def run(xs, block_k):
        y = torch.empty(xs.shape[0], N, dtype=xs.dtype, device=DEVICE)
        cfg = bi.MatmulConfig(16, 16, block_k, 1 if sk.interpreting() else 4, 1)
        for kernel, grid, args, kw in bi._matmul_plan(xs, w, None, None, y, cfg, sk.interpreting()):
            kernel[grid](*args, **kw)
        return y

    assert torch.equal(run(x[:1], 32)[0], run(x, 32)[0])
    assert not torch.equal(run(x[:1], 32)[0], run(x, 64)[0]), "a different K step should change the last bits"


def test_matmul_configuration_never_depends_on_the_rows():
    w = torch.empty(4096, 4096, dtype=torch.bfloat16, device="meta")
    plans = []
    for M in (1, 17, 300):
        x = torch.empty(M, 4096, dtype=torch.bfloat16, device="meta")
        y = torch.empty(M, 4096, dtype=torch.bfloat16, device="meta")
        plans.append(bi._matmul_plan(x, w, None, None, y, bi.matmul_config(4096, 4096, torch.bfloat16))[0])
    assert plans[0][3] == plans[1][3] == plans[2][3]  # every constexpr and launch option
    assert [p[1] for p in plans] == [(1, 128), (2, 128), (19, 128)]  # only the grid's M axis grows


def test_matmul_launcher_checks():
    x = torch.randn(2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="dtype"):
        bi.matmul(x, torch.randn(3, 8, device=DEVICE).half())
    with pytest.raises(ValueError, match="disagree on K"):
        bi.matmul(x, torch.randn(3, 9, device=DEVICE))
    with pytest.raises(ValueError, match="bias"):
        bi.matmul(x, torch.randn(3, 8, device=DEVICE), bias=torch.randn(4, device=DEVICE))
    with pytest.raises(ValueError, match="add"):
        bi.matmul(x, torch.randn(3, 8, device=DEVICE), add=torch.randn(3, 2, device=DEVICE))
    assert bi.matmul(x[:0], torch.randn(3, 8, device=DEVICE)).shape == (0, 3)


# ---------------------------------------------------------------------------------------------
# RMSNorm
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
@pytest.mark.parametrize(("shape", "w_shape"), [((1, 1), (1,)), ((5, 7), (7,)), ((9, 200), (200,)),
                                                ((4, 3, 72), (3, 72)), ((2, 6, 16), (16,))])  # fmt: skip
def test_rms_norm_matches_reference(dtype, shape, w_shape):
    x = _randn(*shape, dtype=dtype, seed=sum(shape), scale=2.0)
    w = _randn(*w_shape, dtype=dtype, seed=7)
    y = bi.rms_norm(x, w, 1e-6)
    assert y.shape == x.shape
    assert_close(y, bi.rms_norm_ref(x, w, 1e-6), dtype, f"rms_norm {shape} by {w_shape}")


@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
def test_rms_norm_rows_are_bitwise_the_same_in_any_batch(dtype):
    D = 200  # more than one interpreter step of 64: the looped path
    w = _randn(D, dtype=dtype, seed=30)
    rows = _randn(3, D, dtype=dtype, seed=31)
    alone = [bi.rms_norm(rows[i : i + 1], w, 1e-5) for i in range(3)]
    for M in BATCHES:
        for i in range(3):
            batch = _randn(M, D, dtype=dtype, seed=200 + M + i, scale=5.0)
            at = (i * 7) % M
            batch[at] = rows[i]
            assert torch.equal(bi.rms_norm(batch, w, 1e-5)[at], alone[i][0]), f"row {i} at {at} of {M}"


def test_rms_norm_launcher_checks():
    with pytest.raises(ValueError, match="must be"):
        bi.rms_norm(torch.randn(2, 8, device=DEVICE), torch.randn(7, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="cycle"):
        bi.rms_norm(torch.randn(5, 8, device=DEVICE), torch.randn(2, 8, device=DEVICE), 1e-6)


# ---------------------------------------------------------------------------------------------
# attention
# ---------------------------------------------------------------------------------------------


def paged_problem(dtype, seqs, q, ctxs, tree_mask, *, bs=16, seed=0):
    """Launcher arguments for requests whose logical K/V are ``seqs`` [(k [S, KVH, D], v)], stored in
    shuffled blocks of a NaN-poisoned cache (any read outside a request's keys gives NaN)."""
    g = torch.Generator().manual_seed(seed)
    kvh, d = seqs[0][0].shape[1:]
    nblk = [-(-k.shape[0] // bs) for k, _ in seqs]
    kv = torch.full((2, 1 + sum(nblk) + 2, bs, kvh, d), float("nan"), dtype=dtype)
    free = (torch.randperm(kv.shape[1] - 1, generator=g) + 1).tolist()
    tables = torch.zeros(len(seqs), max(nblk) + 1, dtype=torch.int32)
    for b, (k, v) in enumerate(seqs):
        ids = [free.pop() for _ in range(nblk[b])]
        tables[b, : nblk[b]] = torch.tensor(ids, dtype=torch.int32)
        for p in range(k.shape[0]):
            kv[0, ids[p // bs], p % bs], kv[1, ids[p // bs], p % bs] = k[p], v[p]
    qlens = [len(x) for x in q]
    qsl = torch.tensor([0] + torch.tensor(qlens).cumsum(0).tolist(), dtype=torch.int32)
    i32 = dict(dtype=torch.int32, device=DEVICE)
    return dict(
        q=torch.cat(q).to(DEVICE),
        kv_layer=kv.to(DEVICE),
        query_start_loc=qsl.to(DEVICE),
        context_lens=torch.tensor(ctxs, **i32),
        seq_lens=torch.tensor([k.shape[0] for k, _ in seqs], **i32),
        block_tables=tables.to(DEVICE),
        tree_mask=None if tree_mask is None else tree_mask.to(DEVICE),
        scale=d**-0.5,
    )


def _kv(n, kvh, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, kvh, d, generator=g).to(dtype), torch.randn(n, kvh, d, generator=g).to(dtype)


def ancestor_rows(parents):
    """[n, n] bool: row i sees its root path."""
    n = len(parents)
    m = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            m[i, j], j = True, parents[j]
    return m


@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
@pytest.mark.parametrize("window", [None, 5, 20])
def test_attention_causal_ragged_matches_reference(dtype, window):
    """A prefill chunk after a prefix, a decode row, an empty request, a chunk with no prefix; GQA 3."""
    kvh, group, d = 2, 3, 16
    qlens, ctxs = [5, 1, 0, 4], [17, 40, 9, 0]
    seqs = [_kv(c + n, kvh, d, dtype, seed=i) for i, (c, n) in enumerate(zip(ctxs, qlens))]
    q = [_randn(n, kvh * group, d, dtype=dtype, seed=50 + i).cpu() for i, n in enumerate(qlens)]
    args = paged_problem(dtype, seqs, q, ctxs, None)
    out = bi.attention(**args, window=window)
    assert_close(out, bi.attention_ref(**args, window=window), dtype, f"causal window={window}")


@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
def test_attention_tree_masks_match_reference(dtype):
    """Two trees side by side, the mask wider than either tree (padding columns poisoned True)."""
    kvh, group, d = 1, 4, 32
    trees = [[-1, 0, 0, 1, 2, 2, 3], [-1, 0, 1]]
    ctxs = [21, 3]
    mask = torch.ones(sum(map(len, trees)), 9, dtype=torch.bool)
    row = 0
    for p in trees:
        mask[row : row + len(p), :] = False
        mask[row : row + len(p), : len(p)] = ancestor_rows(p)
        row += len(p)
    seqs = [_kv(c + len(p), kvh, d, dtype, seed=i) for i, (c, p) in enumerate(zip(ctxs, trees))]
    q = [_randn(len(p), kvh * group, d, dtype=dtype, seed=60 + i).cpu() for i, p in enumerate(trees)]
    args = paged_problem(dtype, seqs, q, ctxs, mask)
    assert_close(bi.attention(**args), bi.attention_ref(**args), dtype, "tree")


def plain_and_tree(dtype, *, ctx0=37, others=True, seed=0):
    """The same token at depth 3 of an accepted path, attended (a) as a plain decode row (context
    ctx0 + 3 in the cache) next to another request, (b) as node 6 of an 8-node tree (context ctx0,
    its ancestors at nodes 0, 2, 5 between siblings) next to a prefill chunk. Returns both rows' args
    and where the token sits in each."""
    kvh, group, d = 2, 3, 32
    parents, path = [-1, 0, 0, 1, 2, 2, 5, 3], [0, 2, 5, 6]
    k, v = _kv(ctx0 + len(path), kvh, d, dtype, seed)
    token_q = _randn(1, kvh * group, d, dtype=dtype, seed=seed + 1).cpu()
    tk, tv = _kv(ctx0 + len(parents), kvh, d, dtype, seed + 2)  # siblings: other keys
    tk[:ctx0], tv[:ctx0] = k[:ctx0], v[:ctx0]
    for depth, node in enumerate(path):
        tk[ctx0 + node], tv[ctx0 + node] = k[ctx0 + depth], v[ctx0 + depth]
    tq = _randn(len(parents), kvh * group, d, dtype=dtype, seed=seed + 3).cpu()
    tq[6] = token_q[0]
    other = _kv(30, kvh, d, dtype, seed + 4)
    oq = _randn(6, kvh * group, d, dtype=dtype, seed=seed + 5).cpu()
    plain = paged_problem(dtype, [other, (k, v)] if others else [(k, v)], [oq, token_q] if others else [token_q],
                          [24, ctx0 + 3] if others else [ctx0 + 3], None, seed=seed)  # fmt: skip
    mask = torch.zeros(6 + len(parents), len(parents), dtype=torch.bool)
    mask[:6, :6] = torch.ones(6, 6, dtype=torch.bool).tril()
    mask[6:] = ancestor_rows(parents)
    tree = paged_problem(dtype, [other, (tk, tv)], [oq, tq], [24, ctx0], mask, seed=seed + 7)
    return plain, (6 if others else 0), tree, 6 + 6


@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
@pytest.mark.parametrize("ctx0", [5, 37, 70])
def test_attention_plain_row_equals_tree_node_bitwise(dtype, ctx0):
    plain, at_p, tree, at_t = plain_and_tree(dtype, ctx0=ctx0, seed=ctx0)
    a, b = bi.attention(**plain), bi.attention(**tree)
    assert_close(b, bi.attention_ref(**tree), dtype, "tree batch")
    assert torch.equal(a[at_p], b[at_t]), "the token's attention depends on how its keys were laid out"
    alone, at_a, _, _ = plain_and_tree(dtype, ctx0=ctx0, others=False, seed=ctx0)
    assert torch.equal(bi.attention(**alone)[at_a], a[at_p]), "the token's attention depends on its batch"
    for w in (4, 33):  # a sliding window keeps the property
        assert torch.equal(bi.attention(**plain, window=w)[at_p], bi.attention(**tree, window=w)[at_t])


def test_tree_attention_is_not_invariant_in_that_sense():
    """Control: the tree-attention kernel tiles the prefix and the new tokens separately, so in fp32
    the same token's bits differ between the two layouts: the check above can fail."""
    plain, at_p, tree, at_t = plain_and_tree(torch.float32, ctx0=37, seed=37)
    a = tree_attention(**plain, max_query_len=6, max_seq_len=40, num_splits=1)
    b = tree_attention(**tree, max_query_len=8, max_seq_len=45, num_splits=1)
    torch.testing.assert_close(a[at_p], b[at_t], atol=1e-5, rtol=1e-5)  # the same attention ...
    assert not torch.equal(a[at_p], b[at_t])  # ... in other bits


def test_attention_rows_past_the_batch_are_zeros():
    """A padded step (e.g. a graph bucket) may carry query rows past query_start_loc[B]: zeros."""
    dtype, kvh, d = torch.float32, 1, 16
    seqs = [_kv(10, kvh, d, dtype, seed=1)]
    q = [_randn(3, 2, d, dtype=dtype, seed=2).cpu()]
    args = paged_problem(dtype, seqs, q, [7], None)
    args["q"] = torch.cat([args["q"], torch.ones(2, 2, d, device=DEVICE)])
    out = bi.attention(**args)
    assert torch.equal(out[3:], torch.zeros(2, 2, d, device=DEVICE))
    assert_close(out[:3], bi.attention_ref(**args)[:3], dtype, "real rows")


def test_mask_columns():
    m = torch.tensor([[1, 0, 1, 1], [0, 0, 0, 0], [0, 1, 0, 0]], dtype=torch.bool)
    cols, nvis = bi.mask_columns(m)
    assert nvis.tolist() == [3, 0, 1]
    assert [cols[i, : nvis[i]].tolist() for i in range(3)] == [[0, 2, 3], [], [1]]
    assert bi.visible_keys(3, 4, 2, 1, None, None) == [0, 1, 2, 3, 4, 5, 6]
    assert bi.visible_keys(3, 4, 4, 0, [1, 0, 1, 0], 2) == [3, 5]


# ---------------------------------------------------------------------------------------------
# the model's dispatch (specd.model.invariant)
# ---------------------------------------------------------------------------------------------


def test_modes_pick_the_kernels_per_step():
    from specd.model import invariant as inv

    assert [inv.step_invariant(m, g) for m in ("on", "auto", "off") for g in (True, False)] == [
        True, True, True, False, False, False,
    ]  # fmt: skip
    assert inv.step_ops("auto", True) is inv.ON and inv.step_ops("auto", False) is inv.OFF
    assert inv.ops_for("auto") is inv.ON and inv.ops_for("off") is inv.OFF
    with pytest.raises(ValueError, match="batch_invariant"):
        inv.step_invariant("sometimes", True)
    from specd.config import EngineConfig

    assert EngineConfig(target="t").batch_invariant == "auto"
    with pytest.raises(ValueError, match="batch_invariant"):
        EngineConfig(target="t", batch_invariant="yes")


def test_cpu_tensors_keep_the_torch_ops_by_default():
    """An engine on a CPU never takes the kernels, enabled or not: the ops are torch's, bit for bit."""
    import torch.nn.functional as F

    from specd.model import invariant as inv

    x, w, b = torch.randn(5, 24), torch.randn(7, 24), torch.randn(7)
    res, nw = torch.randn(5, 7), torch.randn(24)
    assert not inv.ON.applies(x, w)
    assert torch.equal(inv.linear(x, w, b), F.linear(x, w, b))
    assert torch.equal(inv.addmm(res, x, w.t()), torch.addmm(res, x, w.t()))
    assert torch.equal(inv.rms_norm(x, nw, 1e-6), F.rms_norm(x, (24,), nw, 1e-6))
    from specd.model.attention import TorchAttention

    torch_backend = TorchAttention()
    assert isinstance(inv.ON.backend(torch_backend), inv.InvariantAttention)
    assert inv.OFF.backend(torch_backend) is torch_backend


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_id)
def test_enabled_ops_run_the_kernels_and_keep_rows_invariant(dtype):
    from specd.model import invariant as inv

    ops = inv.InvariantOps(True, devices=(DEVICE.type,))
    w = _randn(45, 70, dtype=dtype, seed=40, scale=0.1)
    w_t = w.t()  # the model keeps o / down as W^T views for addmm
    nw = _randn(70, dtype=dtype, seed=41)
    rows = _randn(17, 70, dtype=dtype, seed=42)
    res = _randn(17, 45, dtype=dtype, seed=43)
    assert ops.applies(rows, w) and not ops.applies(rows, w.float() if dtype != torch.float32 else w.half())
    assert torch.equal(ops.linear(rows, w), bi.matmul(rows, w))
    assert torch.equal(ops.addmm(res, rows, w_t), bi.matmul(rows, w, add=res))
    assert torch.equal(ops.rms_norm(rows, nw, 1e-5), bi.rms_norm(rows, nw, 1e-5))
    assert ops.linear(rows.view(1, 17, 70), w).shape == (1, 17, 45)
    w2 = _randn(70, 70, dtype=dtype, seed=44, scale=0.1)
    for M in (1, 3, 8):  # a layer's worth of ops: row 0 alone == row 0 among others
        y = ops.addmm(res[:M], ops.linear(ops.rms_norm(rows[:M], nw, 1e-5), w2), w_t)  # [M, 45]
        assert torch.equal(y[0], ops.addmm(res[:1], ops.linear(ops.rms_norm(rows[:1], nw, 1e-5), w2), w_t)[0])


def test_invariant_attention_backend_wraps_the_kv_ops():
    """The wrapped backend writes the KV; attention is the invariant kernel over the step's metadata."""
    from specd.model import invariant as inv
    from specd.model.attention import TorchAttention, build_metadata

    kvh, group, d, bs = 2, 2, 16, 4
    kv = torch.zeros(2, 8, bs, kvh, d, device=DEVICE)
    tables = [[3, 1, 6], [2, 5]]
    qlens, ctxs = [3, 2], [6, 4]
    slots = [tables[0][p // bs] * bs + p % bs for p in range(6, 9)] + [tables[1][p // bs] * bs + p % bs for p in (4, 5)]
    mask = [ancestor_rows([-1, 0, 0]), None]
    meta = build_metadata(qlens, ctxs, tables, slots, bs, DEVICE, tree_masks=mask)
    backend = inv.InvariantOps(True, devices=(DEVICE.type,)).backend(TorchAttention())
    assert backend.name == "invariant(torch)"
    g = torch.Generator().manual_seed(5)
    for c, tab in zip(ctxs, tables):  # the prefixes, written directly
        for p in range(c):
            kv[:, tab[p // bs], p % bs] = torch.randn(2, kvh, d, generator=g).to(DEVICE)
    k, v, q = (torch.randn(5, n, d, generator=g).to(DEVICE) for n in (kvh, kvh, kvh * group))
    backend.write_kv(kv, k, v, meta.slot_mapping)
    assert torch.equal(kv[0].view(-1, kvh, d)[meta.slot_mapping], k)
    out = backend.attention(q, kv, meta, d**-0.5)
    want = bi.attention(q, kv, meta.query_start_loc, meta.context_lens, meta.seq_lens, meta.block_tables,
                        meta.tree_mask, d**-0.5)  # fmt: skip
    assert torch.equal(out, want)
    assert_close(out, TorchAttention.attention(q, kv, meta, d**-0.5), torch.float32, "vs the torch backend")


# ---------------------------------------------------------------------------------------------
# the quantized (weight-only) GEMM in a batch-invariant step: fixed tiles (specd_kernels.woq)
# ---------------------------------------------------------------------------------------------


def _woq_case(fmt: str, N=70, K=256, group=128, M=40, seed=30):
    from specd.model.quant import quantize_int4, quantize_int8

    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g) * 0.1
    op = quantize_int8(w, group=group) if fmt == "int8" else quantize_int4(w, group=group)
    x = torch.randn(M, K, generator=g)
    return op, x


def _woq_run(op, x, cfg: dict):
    """The weight-only GEMM with the compiled tiles ``cfg`` (interpreted without CUDA: fp32 dots)."""
    from specd_kernels import woq

    x = x.to(DEVICE).contiguous()
    q, s, m = (t.to(DEVICE) if t is not None else None for t in (op.qweight, op.scale, op.minv))
    y = torch.empty(x.shape[0], q.shape[0], dtype=x.dtype, device=DEVICE)
    for kernel, grid, args, kw in woq._launch_plan(x, q, s, m, None, None, y, op.group, op.fmt, sk.interpreting(),
                                                   cfg=cfg):  # fmt: skip
        kernel[grid](*args, **kw)
    return y


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_woq_rows_are_bitwise_the_same_in_any_batch_with_the_fixed_tiles(fmt):
    """The compiled tiles of a batch-invariant step (``launch_config(..., invariant=True)``, run here
    under the interpreter where there is no GPU): a row's result has the same bits for M = 1, 3, 17
    and 40, equal to the reference within fp32 tolerance. Control: the tiles chosen by M (16 x 64 x
    128 for one row, 64 x 64 x 64 for 40) change the last bits of the same row."""
    from specd_kernels import woq

    op, x = _woq_case(fmt)
    N, group = op.qweight.shape[0], op.group
    full = _woq_run(op, x, woq.launch_config(40, N, group, invariant=True))
    ref = woq.woq_matmul_ref(x, op.qweight, op.scale, op.minv, group, fmt)
    torch.testing.assert_close(full.cpu(), ref, atol=1e-5, rtol=1e-5)
    for M in (1, 3, 17):
        for start in (0, 40 - M):
            part = _woq_run(op, x[start : start + M], woq.launch_config(M, N, group, invariant=True))
            assert torch.equal(part, full[start : start + M]), (M, start)
    one = _woq_run(op, x[:1], woq.launch_config(1, N, group))
    many = _woq_run(op, x, woq.launch_config(40, N, group))
    assert torch.equal(one[0], full[0]) and not torch.equal(one[0], many[0]), "tiles by M change the bits"


def test_woq_configuration_never_depends_on_the_rows_with_fixed_tiles():
    from specd_kernels import woq

    def plan(M, invariant):
        meta = dict(device="meta")
        x, y = torch.empty(M, 4096, dtype=torch.bfloat16, **meta), torch.empty(M, 4096, dtype=torch.bfloat16, **meta)
        q, s = torch.empty(4096, 2048, dtype=torch.uint8, **meta), torch.empty(4096, 128, **meta)
        return woq._launch_plan(x, q, s, s, None, None, y, 32, "int4", invariant=invariant)[0]

    fixed = [plan(M, True) for M in (1, 17, 64, 300)]
    assert all(p[3] == fixed[0][3] for p in fixed)  # every constexpr and launch option
    assert [p[1] for p in fixed] == [(1, 64), (2, 64), (4, 64), (19, 64)]  # only the grid's M axis grows
    assert len({str(sorted(plan(M, False)[3].items())) for M in (1, 17, 64, 300)}) == 4  # (by M otherwise)


def test_the_target_pass_opens_the_fixed_tiles_in_an_invariant_step(monkeypatch, shared_pair):
    """``woq_matmul`` takes the fixed tiles inside ``woq.fixed_tiles`` (the launcher reads the context);
    the engine's target pass opens it for the forward and the logits of a step that runs the
    invariant ops, and only then (on a CPU the ops never run: forced here)."""
    from specd.config import EngineConfig
    from specd.engine import stages
    from specd.engine.engine import Engine
    from specd.model import invariant
    from specd.model.graphs import invariant_tiles
    from specd.sampling.params import SamplingParams
    from specd_kernels import woq

    seen = []
    real = woq.launch_config

    def spy(M, N, group, interpret=False, invariant=False):
        seen.append(invariant)
        return real(M, N, group, interpret, invariant)

    monkeypatch.setattr(woq, "launch_config", spy)
    op, x = _woq_case("int4", M=3)
    args = [t.to(DEVICE) for t in (op.qweight, op.scale, op.minv)]
    woq.woq_matmul(x.to(DEVICE), *args, op.group, "int4")
    with woq.fixed_tiles():
        woq.woq_matmul(x.to(DEVICE), *args, op.group, "int4")
        assert woq.woq_matmul(x.to(DEVICE), *args, op.group, "int4", invariant=False).shape == (3, 70)
    assert seen == [False, True, False] and not woq.fixed_tiles_on()
    with invariant_tiles(invariant.ON):
        assert woq.fixed_tiles_on()
    with invariant_tiles(invariant.OFF):
        assert not woq.fixed_tiles_on()

    target, _ = shared_pair
    eng = Engine(EngineConfig(target=str(target.path), dtype="float32", attention_backend="torch"), target=target)
    model, states = eng.target.model, []

    class Spy:  # the target as the target pass sees it, recording the context of each call
        cfg = model.cfg

        def __call__(self, *a, **kw):
            states.append(("forward", woq.fixed_tiles_on(), "ops" in kw))
            return model(*a, **{k: v for k, v in kw.items() if k != "ops"})

        def compute_logits(self, h, **kw):
            states.append(("logits", woq.fixed_tiles_on(), "ops" in kw))
            return model.compute_logits(h)

    monkeypatch.setattr(eng.target, "model", Spy())
    greedy = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    eng.generate([[1, 2, 3]], greedy)
    assert states and all(not on and not ops for _, on, ops in states)  # a CPU step: no invariant ops
    states.clear()
    forced = {"ops": invariant.InvariantOps(True, devices=("cpu",))}
    monkeypatch.setattr(stages, "step_ops_kwargs", lambda *a: forced)
    eng.generate([[1, 2, 3]], greedy)
    assert {s[0] for s in states} == {"forward", "logits"} and all(on and ops for _, on, ops in states)
    assert not woq.fixed_tiles_on()
