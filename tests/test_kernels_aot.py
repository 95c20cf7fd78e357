"""The Triton kernels compiled ahead of time for CUDA sm_80 and sm_90a, with no GPU.

``specd_kernels.aot`` compiles the configurations the launchers choose with ``triton.compile`` and
the ptxas bundled with Triton. Here: every decode and tree-verify configuration of the tree
attention launcher (head_dim 64/128, GQA groups 1/3/4/8; a full batch and a single long sequence
that splits the KV range) in fp16, the same in bf16 for group 3 (the launcher's choice does not
depend on the dtype, and bf16 compiles to the same registers, spills and shared memory as fp16 in
all 222 pairs of the full report in docs/benchmarks.md), plus the KV-cache kernels and the int8 /
int4 weight-only GEMM (specd_kernels.woq) at decode, tree and prefill widths, and the batch-invariant
GEMM, RMSNorm and attention (specd_kernels.batch_invariant; fp16 here, bf16 in their own test).
The tests fail on any register spill, on shared memory beyond the target's limit, and on
tree-attention dots whose operands are not the 16-bit storage type (an fp32 upcast compiles to
tf32 MMAs). The compiles run in a subprocess without TRITON_INTERPRET, one process per CPU;
Triton's on-disk cache makes reruns quick (the ptxas log is cached with the kernel).
"""

from __future__ import annotations

import pytest

from specd_kernels import aot
from specd_kernels.tree_attention import launch_configs

SHAPES = ("decode", "tree")  # the prefill and mixed shapes: `python -m specd_kernels.aot` (docs/benchmarks.md)
BF16_GROUPS = (3,)
WANT = {"fp16": "f16", "bf16": "bf16"}


@pytest.fixture(scope="module")
def rows():
    shapes = ["--shapes", ",".join(SHAPES)]
    fp16 = aot.run_clean([*shapes, "--dtypes", "fp16"], timeout=1200)
    bf16 = aot.run_clean(
        [*shapes, "--dtypes", "bf16", "--groups", ",".join(map(str, BF16_GROUPS)), "--no-others"], timeout=1200
    )
    return fp16 + bf16


def _what(r):
    return f"{r['kernel']} {r['target']} {r['dtype']} D={r['head_dim']} g={r['group']} {r['shape']} b={r['batch']}"


def test_every_configuration_compiles_for_both_targets(rows):
    attn = {
        (r["target"], r["dtype"], r["head_dim"], r["group"], r["shape"], r["batch"])
        for r in rows
        if r["kernel"] == "tree_attention"
    }
    want = {
        (t, dt, d, g, s, b)
        for t in aot.TARGETS
        for dt in aot.DTYPES
        for d in aot.HEAD_DIMS
        for g in (aot.GROUPS if dt == "fp16" else BF16_GROUPS)
        for s in SHAPES
        for b, _ in aot.PROBLEMS
    }
    assert attn == want
    split = [r for r in rows if r["kernel"] == "tree_attention" and r["split_kv"] > 1]
    assert {r["batch"] for r in split} == {1}, "the single long sequence, and only it, splits the KV range"
    combine = {_what(r) for r in rows if r["kernel"] == "tree_attention_combine"}
    assert combine == {_what(dict(r, kernel="tree_attention_combine")) for r in split}
    others = {(r["kernel"], r["target"]) for r in rows if not r["kernel"].startswith("tree_attention")}
    kinds = ("write_kv", "copy_slots", "woq_int8", "woq_int4", "bi_matmul", "bi_rms_norm", "bi_attention")
    assert others == {(k, t) for k in kinds for t in aot.TARGETS}


def test_weight_only_gemm_compiles_without_spills_with_16bit_mmas(rows):
    """The int8 / int4 weight-only GEMMs (issue 19) at decode, tree and prefill widths, and with the
    fixed tiles of a batch-invariant step (issue 43) at tree and prefill widths, both targets: no
    spills (test_no_register_spills covers every row) and dots on the 16-bit activation type."""
    woq = [r for r in rows if r["kernel"].startswith("woq_")]
    got = {(r["kernel"], r["target"], r["shape"]) for r in woq}
    shapes = [*aot.WOQ_SHAPES, "tree invariant", "prefill invariant"]
    assert got == {(f"woq_{f}", t, s) for f in ("int8", "int4") for t in aot.TARGETS for s in shapes}
    assert all(r["mma"] and {m.split()[1] for m in r["mma"]} == {WANT[r["dtype"]]} for r in woq)
    assert not [r for r in woq if r["spill_stores"] or r["spill_loads"]]


def test_batch_invariant_kernels_compile_without_spills_with_16bit_mmas(rows):
    """The batch-invariant GEMM (a 4096 x 4096 projection and a 128256-row LM head at decode, tree and
    prefill widths), RMSNorm and attention (head_dim 64 / group 3 and 128 / group 4, causal and tree),
    fp16 (in the module fixture) and bf16, both targets: 0 spills, dots on the 16-bit type."""
    bf16 = aot.run_clean(["--shapes", "", "--dtypes", "bf16", "--kernels", "bi_"], timeout=1200)
    assert {r["kernel"] for r in bf16} == {"bi_matmul", "bi_rms_norm", "bi_attention"}
    inv = [r for r in rows if r["kernel"].startswith("bi_")] + bf16
    got = {(r["kernel"], r["target"], r["dtype"], r["shape"]) for r in inv}
    gemm = {f"{nk} {s}" for nk in aot.INVARIANT_NK for s in aot.WOQ_SHAPES}
    for t in aot.TARGETS:
        for dt in aot.DTYPES:
            assert {s for k, tt, d, s in got if (k, tt, d) == ("bi_matmul", t, dt)} == gemm
            assert {s for k, tt, d, s in got if (k, tt, d) == ("bi_attention", t, dt)} == {"decode", "tree"}
            assert {s for k, tt, d, s in got if (k, tt, d) == ("bi_rms_norm", t, dt)} == {"d=4096", "d=576"}
    assert not [_what(r) for r in inv if r["spill_stores"] or r["spill_loads"]]
    dots = [r for r in inv if r["kernel"] != "bi_rms_norm"]
    assert all(r["mma"] and {m.split()[1] for m in r["mma"]} == {WANT[r["dtype"]]} for r in dots)
    assert not aot.problems(inv)


def test_no_register_spills(rows):
    spilled = [
        f"{_what(r)}: {r['spill_stores']} B stores, {r['spill_loads']} B loads, {r['registers']} regs"
        for r in rows
        if r["spill_stores"] or r["spill_loads"]
    ]
    assert not spilled, "\n".join(spilled)
    assert all(0 < r["registers"] <= 255 for r in rows)


def test_shared_memory_fits_the_target(rows):
    over = [
        f"{_what(r)}: {r['shared_bytes']} B"
        for r in rows
        if r["shared_bytes"] > aot.SMEM_LIMIT[aot.TARGETS[r["target"]]]
    ]
    assert not over, "\n".join(over)  # so the launcher's OutOfResources fallback is never needed there


def test_dots_take_16bit_operands(rows):
    attn = [r for r in rows if r["kernel"] == "tree_attention"]
    wrong = [f"{_what(r)}: {r['mma']}" for r in attn if {m.split()[1] for m in r["mma"]} != {WANT[r["dtype"]]}]
    assert not wrong, "\n".join(wrong)
    # sm_80 runs mma.sync; sm_90a runs wgmma once a program has >= 64 rows (one warpgroup)
    assert all(m.startswith("mma.sync") for r in attn if r["target"] == "sm_80" for m in r["mma"])
    assert all("wgmma " + WANT[r["dtype"]] in r["mma"] for r in attn if r["target"] == "sm_90a" and r["block_m"] >= 64)
    assert not aot.problems(rows)


def test_fp32_upcast_would_be_caught():
    """The old kernel's path (q/K/V upcast to fp32 before tl.dot) compiles to tf32 MMAs, and the
    report flags it, on the headline configuration (SmolLM2-style head_dim 64, GQA group 3)."""
    up = aot.run_clean(
        ["--shapes", "tree", "--dtypes", "fp16", "--head-dims", "64", "--groups", "3", "--no-others", "--dot-f32"],
        timeout=600,
    )
    attn = [r for r in up if r["kernel"] == "tree_attention"]
    assert {r["target"] for r in attn} == set(aot.TARGETS)
    assert all(m.split()[1] == "tf32" for r in attn for m in r["mma"]) and all(r["mma"] for r in attn)
    assert sum("MMA operands" in p for p in aot.problems(up)) == len(attn)


def test_report_parsing_flags_spills_and_upcasts():
    log = (
        "ptxas info    : Function properties for _tree_attention_kernel\n"
        "    48 bytes stack frame, 52 bytes spill stores, 48 bytes spill loads\n"
        "ptxas info    : Used 255 registers, used 1 barriers, 48 bytes cumulative stack size\n"
    )
    assert aot.parse_ptxas(log) == {"registers": 255, "spill_stores": 52, "spill_loads": 48}
    with pytest.raises(ValueError):
        aot.parse_ptxas("ptxas info    : Compile time = 1 ms")
    ptx = (
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%r1}, {%r2}, {%r3}, {%r4};\n"
        "wgmma.mma_async.sync.aligned.m64n64k8.f32.tf32.tf32 {%r5}, %rd1, %rd2, p, 1, 1;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {%r5}, %rd1, %rd2, p, 1, 1;\n"
    )
    assert aot.mma_kinds(ptx) == ["mma.sync f16", "wgmma bf16", "wgmma tf32"]
    row = {
        "kernel": "tree_attention",
        "target": "sm_80",
        "dtype": "fp16",
        "head_dim": 64,
        "group": 3,
        "shape": "tree",
        "registers": 255,
        "spill_stores": 0,
        "spill_loads": 0,
        "shared_bytes": 1024,
        "mma": ["mma.sync f16"],
    }
    assert aot.problems([row]) == []
    assert len(aot.problems([dict(row, spill_stores=4, spill_loads=4)])) == 1
    assert len(aot.problems([dict(row, mma=["mma.sync tf32"])])) == 1
    assert len(aot.problems([dict(row, shared_bytes=aot.SMEM_LIMIT[80] + 1)])) == 1


def test_launch_configs_is_pure_and_spill_safe():
    """The launcher's choice without tensors: the headline tree tile; head_dim 128 takes 32-key,
    at most 64-row tiles with 8 warps; compiled 16-row (decode) tiles get a 128-register budget."""
    common = dict(num_kv_heads=3, batch=64, max_seq_len=512, num_sms=108)
    tree = launch_configs(head_dim=64, group=3, max_query_len=17, **common)[0]
    assert (tree.block_q, tree.block_n, tree.block_m, tree.num_warps, tree.num_stages, tree.maxnreg, tree.splits) == (
        16,
        64,
        64,
        4,
        None,
        None,
        1,
    )
    prefill = launch_configs(head_dim=64, group=1, max_query_len=256, **common)[0]
    assert (prefill.block_m, prefill.block_n, prefill.num_warps) == (128, 64, 8)
    for group, mql in ((8, 17), (1, 256), (4, 256)):
        big = launch_configs(head_dim=128, group=group, max_query_len=mql, **common)[0]
        assert (big.block_n, big.block_m, big.num_warps) == (32, 64, 8)
    dec = launch_configs(head_dim=64, group=8, max_query_len=1, **dict(common, batch=1, max_seq_len=16384))[0]
    assert (dec.block_m, dec.num_stages, dec.maxnreg, dec.splits) == (16, None, 128, 32)
    interp = launch_configs(
        head_dim=64, group=8, max_query_len=1, num_kv_heads=3, batch=1, max_seq_len=16384, num_sms=None, interpret=True
    )
    assert (interp[0].num_stages, interp[0].maxnreg, interp[0].splits) == (None, None, 1)
    assert [c.num_stages for c in interp[1:]] == [1, 1, 1, 1]
