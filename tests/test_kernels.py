"""specd_kernels: Triton kernels vs pure-torch references (and vs attention written here directly).

On a machine without CUDA the kernels run under the Triton interpreter (``TRITON_INTERPRET=1``,
set by ``tests/conftest.py`` or, failing that, at the top of this file before triton is imported).
Shapes are kept small: the interpreter runs programs one after the other in numpy.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import math
import random

import pytest

import specd_kernels as sk
from specd.sampling.tree import DraftTree
from specd_kernels import (
    copy_slots,
    copy_slots_ref,
    tree_attention,
    tree_attention_ref,
    write_kv,
    write_kv_ref,
)

DEVICE = torch.device("cuda" if (torch.cuda.is_available() and not sk.interpreting()) else "cpu")

# (atol, rtol) per storage dtype. bf16 is loose: the interpreter truncates fp32 -> bf16 instead of
# rounding (up to 1 ulp = 2^-7 relative), on top of the reference's own rounding.
TOL = {
    torch.float32: (2e-5, 2e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (2e-2, 2e-2),
}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _dt_id(dt):
    return str(dt).replace("torch.", "")


def assert_close(out, ref, dtype, what=""):
    assert out.shape == ref.shape, what
    assert not torch.isnan(out).any(), f"{what}: NaN in output (unwritten or poisoned element read)"
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out.float().cpu(), ref.float().cpu(), atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")


def test_environment():
    assert sk.HAS_TRITON
    if DEVICE.type == "cpu":
        assert sk.interpreting(), "no CUDA: TRITON_INTERPRET=1 must be set before triton is imported"


# ---------------------------------------------------------------------------------------------
# problem construction
# ---------------------------------------------------------------------------------------------


def random_parents(n, rng):
    return [-1] + [rng.randrange(0, i) for i in range(1, n)]


def ancestor_mask(parents):
    return DraftTree([0] * len(parents), parents).ancestor_mask().clone()


def build_problem(
    dtype,
    qlens,
    ctxs,
    *,
    kvh=2,
    group=2,
    d=32,
    bs=16,
    new_masks=None,
    use_mask=None,
    seed=0,
    spare_blocks=3,
    mask_extra_cols=0,
):
    """Ragged batch with a NaN-poisoned paged cache and shuffled (non-contiguous) block tables.

    new_masks: per request None (causal) or a [n, n] bool mask over its new tokens.
    use_mask: pass a tree_mask tensor (default: iff some request has a mask); causal requests then
    get a lower-triangular block.
    Returns a dict of the launcher args plus the logical per-request K/V for direct oracles.
    """
    g = torch.Generator().manual_seed(seed)
    B = len(qlens)
    H = kvh * group
    sls = [c + n for c, n in zip(ctxs, qlens)]
    nblk = [math.ceil(s / bs) for s in sls]
    max_blocks = max(nblk + [1]) + 1  # one padded column more than anyone needs
    NB = 1 + sum(nblk) + spare_blocks  # block 0 is poison (what the padding points to)
    # poison everything: any read outside a sequence's positions turns the output into NaN
    kv = torch.full((2, NB, bs, kvh, d), float("nan"), dtype=dtype)
    perm = (torch.randperm(NB - 1, generator=g) + 1).tolist()
    block_tables = torch.zeros(B, max_blocks, dtype=torch.int32)
    k_log, v_log = [], []
    for b in range(B):
        ids = [perm.pop() for _ in range(nblk[b])]
        block_tables[b, : nblk[b]] = torch.tensor(ids, dtype=torch.int32)
        kl = torch.randn(sls[b], kvh, d, generator=g).to(dtype)
        vl = torch.randn(sls[b], kvh, d, generator=g).to(dtype)
        for p in range(sls[b]):
            kv[0, ids[p // bs], p % bs] = kl[p]
            kv[1, ids[p // bs], p % bs] = vl[p]
        k_log.append(kl)
        v_log.append(vl)
    qsl = torch.zeros(B + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(qlens, dtype=torch.int64).cumsum(0).to(torch.int32)
    T = int(qsl[-1])
    q = torch.randn(T, H, d, generator=g).to(dtype)
    if new_masks is None:
        new_masks = [None] * B
    if use_mask is None:
        use_mask = any(m is not None for m in new_masks)
    tree_mask = None
    if use_mask:
        max_new = max(qlens + [1]) + mask_extra_cols
        # poison the unused mask area with True: a kernel reading beyond a request's new tokens
        # would see keys it must not see (or read past seq_len)
        tree_mask = torch.ones(T, max_new, dtype=torch.bool)
        for b in range(B):
            n = qlens[b]
            m = new_masks[b] if new_masks[b] is not None else torch.ones(n, n, dtype=torch.bool).tril()
            tree_mask[qsl[b] : qsl[b + 1], :n] = m
    dev = DEVICE
    args = dict(
        q=q.to(dev),
        kv_layer=kv.to(dev),
        query_start_loc=qsl.to(dev),
        context_lens=torch.tensor(ctxs, dtype=torch.int32, device=dev),
        seq_lens=torch.tensor(sls, dtype=torch.int32, device=dev),
        block_tables=block_tables.to(dev),
        tree_mask=None if tree_mask is None else tree_mask.to(dev),
        scale=d**-0.5,
        max_query_len=max(qlens + [1]),
        max_seq_len=max(sls + [1]),
    )
    return args, dict(k_log=k_log, v_log=v_log, qsl=qsl.tolist(), group=group)


def run_both(args, **knobs):
    out = torch.full_like(args["q"], float("nan"))
    res = tree_attention(**args, out=out, **knobs)
    assert res is out
    ref = tree_attention_ref(**args)
    return out, ref


def direct_attention(q, k, v, scale, group, causal_offset):
    """Plain softmax attention written out: q [n, H, D], k/v [S, KVH, D]; query i sees keys
    0 .. causal_offset + i."""
    qf, kf, vf = q.float(), k.float().repeat_interleave(group, 1), v.float().repeat_interleave(group, 1)
    s = torch.einsum("ihd,shd->his", qf, kf) * scale
    n, S = q.shape[0], k.shape[0]
    allowed = torch.arange(S)[None, :] <= (causal_offset + torch.arange(n))[:, None]
    s = s.masked_fill(~allowed[None], float("-inf"))
    return torch.einsum("his,shd->ihd", torch.softmax(s, -1), vf)


# ---------------------------------------------------------------------------------------------
# tree attention
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=_dt_id)
@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_causal_ragged(dtype, group):
    # ragged chunks, contexts not multiples of the block size, one context of 0, one empty request
    qlens = [5, 1, 0, 13, 3]
    ctxs = [17, 0, 9, 40, 16]
    args, _ = build_problem(dtype, qlens, ctxs, kvh=8 // group if group < 8 else 1, group=group, seed=group)
    out, ref = run_both(args)
    assert_close(out, ref, dtype, "causal ragged")


@pytest.mark.parametrize("dtype", DTYPES, ids=_dt_id)
def test_prefill_chunk_long(dtype):
    # a prefill chunk of a few hundred tokens after a prefix, next to a decode token
    qlens = [200, 1]
    ctxs = [37, 90]
    args, _ = build_problem(dtype, qlens, ctxs, kvh=1, group=2, d=16, bs=32, seed=11)
    out, ref = run_both(args)
    assert_close(out, ref, dtype, "prefill chunk")


@pytest.mark.parametrize("dtype", DTYPES, ids=_dt_id)
@pytest.mark.parametrize("group", [1, 4])
def test_decode(dtype, group):
    ctxs = [0, 1, 15, 16, 17, 63, 100]
    qlens = [1] * len(ctxs)
    args, _ = build_problem(dtype, qlens, ctxs, kvh=2, group=group, d=64, bs=16, seed=3 + group)
    out, ref = run_both(args)
    assert_close(out, ref, dtype, "decode")
    # same problem through an all-true 1x1 tree mask
    args["tree_mask"] = torch.ones(len(ctxs), 1, dtype=torch.bool, device=DEVICE)
    out2, _ = run_both(args)
    assert_close(out2, ref, dtype, "decode with mask")


@pytest.mark.parametrize("dtype", DTYPES, ids=_dt_id)
@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_tree_random(dtype, group):
    rng = random.Random(100 + group)
    qlens = [7, 1, 13, 33]
    ctxs = [21, 48, 0, 5]
    masks = [ancestor_mask(random_parents(n, rng)) for n in qlens]
    args, _ = build_problem(
        dtype, qlens, ctxs, kvh=1 if group == 8 else 2, group=group, new_masks=masks, seed=7, mask_extra_cols=3
    )
    out, ref = run_both(args)
    assert_close(out, ref, dtype, "tree")


@pytest.mark.parametrize("dtype", DTYPES, ids=_dt_id)
def test_mixed_batch(dtype):
    # one launch: a causal chunk (lower-triangular block), a tree, a decode token, a chain tree;
    # block size 6 (not a power of two)
    rng = random.Random(5)
    qlens = [24, 11, 1, 6]
    ctxs = [3, 30, 77, 16]
    masks = [None, ancestor_mask(random_parents(11, rng)), None, ancestor_mask([-1, 0, 1, 2, 3, 4])]
    args, _ = build_problem(dtype, qlens, ctxs, kvh=2, group=4, d=24, bs=6, new_masks=masks, seed=9)
    out, ref = run_both(args)
    assert_close(out, ref, dtype, "mixed")


@pytest.mark.parametrize("dtype", DTYPES, ids=_dt_id)
@pytest.mark.parametrize("num_splits", [2, 5])
def test_kv_splits(dtype, num_splits):
    rng = random.Random(num_splits)
    qlens = [9, 1, 4]
    ctxs = [150, 70, 0]
    masks = [ancestor_mask(random_parents(9, rng)), None, ancestor_mask(random_parents(4, rng))]
    args, _ = build_problem(dtype, qlens, ctxs, kvh=2, group=2, d=32, bs=16, new_masks=masks, seed=num_splits)
    out, ref = run_both(args, num_splits=num_splits, block_n=16)
    assert_close(out, ref, dtype, f"splits={num_splits}")
    args["tree_mask"] = None  # causal + splits
    out, ref = run_both(args, num_splits=num_splits, block_n=16)
    assert_close(out, ref, dtype, f"causal splits={num_splits}")


@pytest.mark.parametrize("d", [8, 40, 128])
def test_head_dims_and_blocks(d):
    dtype = torch.float16
    rng = random.Random(d)
    qlens = [10, 3]
    ctxs = [33, 8]
    masks = [ancestor_mask(random_parents(10, rng)), None]
    args, _ = build_problem(dtype, qlens, ctxs, kvh=2, group=2, d=d, bs=4, new_masks=masks, seed=d)
    for knobs in ({}, {"block_n": 16, "block_q": 1}, {"block_n": 128, "block_q": 16}):
        out, ref = run_both(args, **knobs)
        assert_close(out, ref, dtype, f"d={d} {knobs}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_dt_id)
def test_causal_fewer_queries_than_new_tokens(dtype):
    # queries = the last q of a longer new-token region (context_lens smaller than the cached
    # prefix): causal is bottom-right aligned, so the result equals plain causal with the true prefix
    qlens, ctxs = [5, 1, 9], [20, 33, 4]
    args, _ = build_problem(dtype, qlens, ctxs, kvh=2, group=2, seed=12)
    want, _ = run_both(args)
    args["context_lens"] = torch.tensor([17, 30, 0], dtype=torch.int32, device=DEVICE)
    out, ref = run_both(args)
    assert_close(out, ref, dtype, "region > queries")
    assert_close(out, want, dtype, "region > queries vs true prefix")


def test_matches_torch_backend_of_specd_attention():
    # integration: the kernel agrees with specd.model.attention's torch backend on metadata it builds
    attn = pytest.importorskip("specd.model.attention")
    rng = random.Random(3)
    dtype = torch.float32
    qlens, ctxs = [7, 1, 12], [9, 30, 0]
    masks = [ancestor_mask(random_parents(7, rng)), None, None]
    args, _ = build_problem(dtype, qlens, ctxs, kvh=2, group=4, d=16, bs=8, new_masks=masks, seed=21)
    bt = args["block_tables"].cpu()
    tables = [[int(x) for x in bt[b, : math.ceil((c + n) / 8)]] for b, (c, n) in enumerate(zip(ctxs, qlens))]
    meta = attn.build_metadata(qlens, ctxs, tables, [0] * sum(qlens), 8, DEVICE, tree_masks=masks)
    kv = torch.nan_to_num(args["kv_layer"])  # the torch backend reads padding slots (then masks)
    want = attn.TorchAttention.attention(args["q"], kv, meta, args["scale"])
    out = torch.full_like(args["q"], float("nan"))
    tree_attention(
        args["q"],
        kv,
        meta.query_start_loc,
        meta.context_lens,
        meta.seq_lens,
        meta.block_tables,
        meta.tree_mask,
        args["scale"],
        meta.max_query_len,
        meta.max_seq_len,
        out=out,
    )
    assert_close(out, want, dtype, "vs specd.model.attention torch backend")


def test_no_visible_key_gives_zeros():
    # empty prefix and an all-false mask row: defined as zeros (kernel and reference agree)
    m = ancestor_mask([-1, 0, 0])
    m[2] = False
    args, _ = build_problem(torch.float32, [3], [0], new_masks=[m], seed=1)
    out, ref = run_both(args)
    assert_close(out, ref, torch.float32, "empty row")
    assert torch.all(out[2] == 0)


def test_rows_beyond_batch_untouched_and_out_none():
    args, _ = build_problem(torch.float32, [4, 2], [5, 6], seed=2)
    q = args["q"]
    extra = torch.cat([q, torch.randn(3, *q.shape[1:], device=DEVICE)])
    args["q"] = extra
    out = torch.full_like(extra, float("nan"))
    tree_attention(**args, out=out)
    assert torch.isnan(out[6:]).all() and not torch.isnan(out[:6]).any()
    res = tree_attention(**args)  # out=None allocates
    assert res.shape == extra.shape and res.dtype == extra.dtype
    torch.testing.assert_close(res[:6], out[:6])


@pytest.mark.parametrize("dtype", DTYPES, ids=_dt_id)
@pytest.mark.parametrize("group", [1, 4])
def test_tree_invariant_branch_equals_causal(dtype, group):
    """Every tree node's output equals plain causal attention over prefix + its root-to-node
    branch (attention written here, not the reference)."""
    rng = random.Random(31 * group)
    qlens = [1, 6, 19, 12]
    ctxs = [40, 13, 16, 0]
    parents = [random_parents(n, rng) for n in qlens]
    parents[3] = [-1, 0, 0, 1, 1, 2, 2, 3, 4, 5, 6, 0]  # bushy
    masks = [ancestor_mask(p) for p in parents]
    args, logs = build_problem(dtype, qlens, ctxs, kvh=2, group=group, d=32, bs=8, new_masks=masks, seed=group)
    out = torch.full_like(args["q"], float("nan"))
    tree_attention(**args, out=out)
    ref = tree_attention_ref(**args)
    q = args["q"].cpu()
    out = out.cpu()
    ref = ref.cpu()
    for b, (n, ctx, par) in enumerate(zip(qlens, ctxs, parents)):
        qs = logs["qsl"][b]
        kl, vl = logs["k_log"][b], logs["v_log"][b]
        for node in range(n):
            branch = []
            j = node
            while j >= 0:
                branch.append(j)
                j = par[j]
            branch.reverse()  # root .. node
            idx = torch.tensor(list(range(ctx)) + [ctx + j for j in branch], dtype=torch.long)
            rows = torch.tensor([qs + j for j in branch], dtype=torch.long)
            want = direct_attention(q[rows], kl[idx], vl[idx], args["scale"], group, ctx)
            assert_close(out[qs + node], want[-1], dtype, f"seq {b} node {node}")
            assert_close(ref[qs + node], want[-1], dtype, f"ref seq {b} node {node}")


def test_causal_invariant_direct():
    # a causal chunk against the direct formula (also checks the reference)
    args, logs = build_problem(torch.float32, [9, 4], [11, 0], kvh=1, group=4, seed=4)
    out, ref = run_both(args)
    q = args["q"].cpu()
    for b, (n, ctx) in enumerate(zip([9, 4], [11, 0])):
        qs = logs["qsl"][b]
        want = direct_attention(q[qs : qs + n], logs["k_log"][b], logs["v_log"][b], args["scale"], 4, ctx)
        assert_close(out[qs : qs + n].cpu(), want, torch.float32, "causal direct")
        assert_close(ref[qs : qs + n].cpu(), want, torch.float32, "ref causal direct")


def test_out_of_resources_fallback(monkeypatch):
    """A config that does not fit the GPU (OutOfResources at compile time) falls back to smaller
    tiles / fewer stages, and the working level is remembered."""
    import importlib

    from triton.runtime.errors import OutOfResources

    ta = importlib.import_module("specd_kernels.tree_attention")  # the module, not the function
    real = ta._tree_attention_kernel
    calls = []
    failures = [2]  # the first two launches "do not fit"

    class Flaky:
        def __getitem__(self, grid):
            def launch(*a, **kw):
                calls.append((kw["BLOCK_Q"], kw["BLOCK_N"], kw.get("num_stages")))
                if failures[0] > 0:
                    failures[0] -= 1
                    raise OutOfResources(300000, 232448, "shared memory")
                return real[grid](*a, **kw)

            return launch

    monkeypatch.setattr(ta, "_tree_attention_kernel", Flaky())
    monkeypatch.setattr(ta, "_CONFIG_CACHE", {})
    args, _ = build_problem(torch.float16, [6, 1], [20, 3], seed=5)
    out, ref = run_both(args, block_n=64)
    assert_close(out, ref, torch.float16, "fallback")
    assert calls[0][2] is None and calls[1][2] == 1 and calls[2][1] == 32
    calls.clear()
    run_both(args, block_n=64)  # remembered: straight to the working level
    assert len(calls) == 1 and calls[0][1] == 32


def test_gpu_check_dry_run():
    # eval/gpu_check.py builds its smallest problem and runs it under the interpreter
    import pathlib
    import subprocess
    import sys

    if DEVICE.type == "cuda":
        pytest.skip("the dry run is for machines without a GPU")
    script = pathlib.Path(__file__).resolve().parents[1] / "eval" / "gpu_check.py"
    r = subprocess.run([sys.executable, str(script), "--dry-run"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "dry run OK" in r.stdout


def test_tree_attention_validation():
    args, _ = build_problem(torch.float16, [3, 2], [4, 5], seed=0)

    def bad(**over):
        a = dict(args)
        a.update(over)
        with pytest.raises(ValueError):
            tree_attention(**a)

    q = args["q"]
    bad(q=q[:, :3])  # H not a multiple of KVH
    bad(q=q[..., :16])  # head dim mismatch
    bad(q=q.to(torch.int32))
    bad(q=q.transpose(1, 2).contiguous().transpose(1, 2))  # not contiguous in D
    bad(query_start_loc=args["query_start_loc"].long())
    bad(context_lens=args["context_lens"][:1])
    bad(seq_lens=args["seq_lens"].float())
    bad(block_tables=args["block_tables"].long())
    bad(block_tables=args["block_tables"][:1])
    bad(tree_mask=torch.ones(2, 3, dtype=torch.bool, device=DEVICE))
    bad(tree_mask=torch.ones(q.shape[0], 3, dtype=torch.float32, device=DEVICE))
    bad(kv_layer=args["kv_layer"][0])
    bad(out=torch.empty(q.shape, dtype=torch.float32, device=DEVICE))
    with pytest.raises(ValueError):
        tree_attention(**args, out=torch.empty(3, 1, 1, dtype=q.dtype, device=DEVICE))
    if DEVICE.type == "cuda":  # compiled kernels refuse CPU tensors with a clear message
        with pytest.raises(ValueError):
            tree_attention(**{k: (v.cpu() if torch.is_tensor(v) else v) for k, v in args.items()})


# ---------------------------------------------------------------------------------------------
# write_kv
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=_dt_id)
def test_write_kv(dtype):
    g = torch.Generator().manual_seed(0)
    NB, BS, KVH, D = 9, 4, 3, 24
    T = 13
    kv = torch.randn(2, NB, BS, KVH, D, generator=g).to(dtype).to(DEVICE)
    qkv = torch.randn(T, 2 * KVH + 1, D, generator=g).to(dtype).to(DEVICE)
    k = qkv[:, :KVH]  # non-contiguous views, as produced by a fused projection
    v = qkv[:, KVH + 1 :]
    slots = torch.randperm(NB * BS, generator=g)[:T].long()
    slots[3] = -1  # padding
    slots = slots.to(DEVICE)
    a, b = kv.clone(), kv.clone()
    write_kv(a, k, v, slots)
    write_kv_ref(b, k, v, slots)
    assert torch.equal(a, b)
    s = slots.cpu().tolist()
    for t in range(T):
        if s[t] >= 0:
            assert torch.equal(a[0, s[t] // BS, s[t] % BS], k[t])
            assert torch.equal(a[1, s[t] // BS, s[t] % BS], v[t])
    # untouched slots keep their values
    touched = torch.zeros(NB * BS, dtype=torch.bool)
    touched[[x for x in s if x >= 0]] = True
    flat_a = a.view(2, NB * BS, KVH, D)[:, ~touched.to(DEVICE)]
    flat_k = kv.view(2, NB * BS, KVH, D)[:, ~touched.to(DEVICE)]
    assert torch.equal(flat_a, flat_k)


def test_write_kv_int32_slots_and_cast():
    kv = torch.zeros(2, 4, 8, 2, 16, dtype=torch.bfloat16, device=DEVICE)
    k = torch.randn(5, 2, 16, device=DEVICE)  # fp32 into a bf16 cache
    v = torch.randn(5, 2, 16, device=DEVICE)
    slots = torch.tensor([31, 0, 9, 100, 17], dtype=torch.int32, device=DEVICE)  # 100: out of range
    a, b = kv.clone(), kv.clone()
    write_kv(a, k, v, slots)
    write_kv_ref(b, k, v, slots)
    # the interpreter truncates fp32 -> bf16, torch rounds: allow one bf16 ulp
    torch.testing.assert_close(a.float(), b.float(), atol=1e-2, rtol=1e-2)


def test_write_kv_validation():
    kv = torch.zeros(2, 4, 8, 2, 16, device=DEVICE)
    k = torch.zeros(3, 2, 16, device=DEVICE)
    slots = torch.arange(3, device=DEVICE)
    for args in (
        (kv, k, k[:, :1], slots),
        (kv, k, k, slots[:2]),
        (kv, k, k, slots.float()),
        (kv[0], k, k, slots),
        (kv, k.to(torch.int32), k, slots),
    ):
        with pytest.raises(ValueError):
            write_kv(*args)


# ---------------------------------------------------------------------------------------------
# copy_slots
# ---------------------------------------------------------------------------------------------


def compaction_pairs(ctxs, trees, paths, block_tables, bs, rng):
    """src/dst slot pairs of the KV compaction after verification. Request b's tree nodes sit at
    positions ctx .. ctx+n-1; the kept nodes (root + accepted path) move to ctx, ctx+1, ..."""
    src, dst = [], []
    order = list(range(len(ctxs)))
    rng.shuffle(order)  # requests may come in any order; within a request dst increases
    for b in order:
        kept = [0] + paths[b]
        for new_i, node in enumerate(kept):
            ps, pd = ctxs[b] + node, ctxs[b] + new_i
            if ps == pd:
                continue
            slot = lambda p, b=b: block_tables[b][p // bs] * bs + p % bs  # noqa: E731
            src.append(slot(ps))
            dst.append(slot(pd))
    return torch.tensor(src, dtype=torch.int64), torch.tensor(dst, dtype=torch.int64)


def _check_copy(kv, src, dst, **knobs):
    a, b = kv.clone(), kv.clone()
    copy_slots(a, src.to(DEVICE), dst.to(DEVICE), **knobs)
    copy_slots_ref(b, src.to(DEVICE), dst.to(DEVICE))
    assert torch.equal(a, b)
    # and against the snapshot semantics spelled out
    L, _, NB, BS, KVH, D = kv.shape
    before = kv.view(L, 2, NB * BS, KVH, D).cpu()
    after = a.view(L, 2, NB * BS, KVH, D).cpu()
    s, d = src.tolist(), dst.tolist()
    for i in range(len(s)):
        if 0 <= s[i] < NB * BS and 0 <= d[i] < NB * BS:
            assert torch.equal(after[:, :, d[i]], before[:, :, s[i]]), f"pair {i}: {s[i]} -> {d[i]}"
    return a


@pytest.mark.parametrize("dtype", DTYPES, ids=_dt_id)
@pytest.mark.parametrize("max_tile", [None, 64], ids=["registers", "temporary"])
def test_copy_slots_compaction(dtype, max_tile):
    rng = random.Random(42)
    g = torch.Generator().manual_seed(1)
    L, BS, KVH, D = 3, 4, 2, 8
    ctxs = [5, 0, 13, 7]
    ns = [9, 6, 12, 3]
    paths = [[2, 4, 6, 8], [1, 3, 5], [1, 2, 7, 9, 11], [2]]  # chains: later dst == earlier src
    need = [math.ceil((c + n) / BS) for c, n in zip(ctxs, ns)]
    NB = sum(need) + 2
    perm = torch.randperm(NB, generator=g).tolist()
    bts = []
    for k in need:
        bts.append([perm.pop() for _ in range(k)])
    src, dst = compaction_pairs(ctxs, ns, paths, bts, BS, rng)
    # the hazard the kernel must survive is present
    assert any(dst[j] == src[i] for i in range(len(src)) for j in range(i + 1, len(src)))
    kv = torch.randn(L, 2, NB, BS, KVH, D, generator=g).to(dtype).to(DEVICE)
    _check_copy(kv, src, dst, max_tile=max_tile)


@pytest.mark.parametrize("max_tile", [None, 128])
def test_copy_slots_arbitrary_overlap(max_tile):
    # any overlap (swaps, cycles, dst > src) with distinct destinations: snapshot semantics
    g = torch.Generator().manual_seed(7)
    L, NB, BS, KVH, D = 2, 6, 4, 1, 16
    S = NB * BS
    kv = torch.randn(L, 2, NB, BS, KVH, D, generator=g).to(DEVICE)
    dst = torch.randperm(S, generator=g)[:19]
    src = torch.randint(0, S, (19,), generator=g)
    src[:5] = dst[5:10]  # many sources are also destinations
    src = torch.cat([src, torch.tensor([-1, 3, 200])])  # out-of-range pairs are skipped
    dst = torch.cat([dst, torch.tensor([-1, S, -5])])
    _check_copy(kv, src, dst, max_tile=max_tile)
    # a pure swap
    _check_copy(kv, torch.tensor([3, 9]), torch.tensor([9, 3]), max_tile=max_tile)


def test_copy_slots_many_pairs():
    # more pairs than the register tile at default settings -> temporary path
    g = torch.Generator().manual_seed(3)
    L, NB, BS, KVH, D = 1, 80, 16, 1, 16
    S = NB * BS
    kv = torch.randn(L, 2, NB, BS, KVH, D, generator=g).to(torch.float16).to(DEVICE)
    dst = torch.randperm(S, generator=g)[:1100]
    src = torch.randint(0, S, (1100,), generator=g)
    _check_copy(kv, src, dst)


def test_copy_slots_empty_and_validation():
    kv = torch.zeros(2, 2, 3, 4, 1, 8, device=DEVICE)
    e = torch.zeros(0, dtype=torch.int64, device=DEVICE)
    copy_slots(kv, e, e)
    with pytest.raises(ValueError):
        copy_slots(kv[0], e, e)
    with pytest.raises(ValueError):
        copy_slots(kv, e, torch.zeros(1, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError):
        copy_slots(kv, e.float(), e.float())
    with pytest.raises(ValueError):
        copy_slots(kv.transpose(2, 3), e, e)
