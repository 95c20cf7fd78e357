"""Quantized linear layers: every format's matmul against its pure-torch reference (a tolerance table),
row-independence of the CPU kernel, quantization error bounds, and GGUF blocks repacked bit-exactly."""

from __future__ import annotations

import os
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch

from specd.model.cpu import cpu_info
from specd.model.qkernel import kernel, x8_isa
from specd.model.quant import QuantLinear, addmm, linear, quantize_int4, quantize_int8, unpack_int4
from specd.model.quant_load import repack

Q = gguf.GGMLQuantizationType
# |y - y_ref| <= TOL[dtype] * (|x| @ |W|^T): fp32 accumulation of K products (reference in fp64);
# bf16 activations round x to 8 bits of mantissa on the way in and y on the way out
TOL = {torch.float32: 2e-6, torch.bfloat16: 1.6e-2}
FORMATS = {
    "int8/channel": lambda w, b=None: quantize_int8(w, b),
    "int8/g32": lambda w, b=None: quantize_int8(w, b, group=32),
    "int4/g32": lambda w, b=None: quantize_int4(w, b, group=32),
    "int4/g64": lambda w, b=None: quantize_int4(w, b, group=64),
    "int4/g128": lambda w, b=None: quantize_int4(w, b, group=128),
}
SHAPES = [(37, 128), (13, 172), (96, 576), (5, 1536)]  # (N, K): odd N, K not a multiple of 32


def _check(y, x, op, dtype, add=None):
    w = op.dequantize().double()
    ref = x.double() @ w.t()
    bound = x.double().abs() @ w.abs().t()
    if op.bias is not None:
        ref, bound = ref + op.bias.double(), bound + op.bias.double().abs()
    if add is not None:
        ref, bound = ref + add.double(), bound + add.double().abs()
    assert y.dtype == dtype and y.shape == ref.shape
    err = (y.double() - ref).abs()
    assert (err <= TOL[dtype] * bound + 1e-30).all(), float((err / (bound + 1e-30)).max())


# (group 128 only where the padded row length is a multiple of it)
CASES = [(f, s) for f in FORMATS for s in SHAPES if "g128" not in f or (s[1] + -s[1] % 32) % 128 == 0]


@pytest.mark.parametrize("fmt,shape", CASES, ids=[f"{f}-{n}x{k}" for f, (n, k) in CASES])
def test_matmul_matches_reference(fmt, shape):
    """Kernel rows (1..13), the dequantize-into-matmul rows (> KERNEL_MAX_ROWS), bias and residual."""
    N, K = shape
    g = torch.Generator().manual_seed(N * K)
    op = FORMATS[fmt](torch.randn(N, K, generator=g) * 0.05, torch.randn(N, generator=g))
    for M in (1, 2, 3, 4, 5, 7, 13, QuantLinear.KERNEL_MAX_ROWS + 3):
        x = torch.randn(M, K, generator=g)
        for dt in TOL:
            _check(op(x.to(dt)), x.to(dt).float(), op, dt)
        res = torch.randn(M, N, generator=g)
        _check(addmm(res, x, op), x, op, torch.float32, add=res)
        _check(linear(x, op), x, op, torch.float32)


def test_the_cpu_kernel_is_built_here():
    """This machine (x86-64, AVX2 + FMA, g++) runs the compiled kernel, not the fallback."""
    assert kernel() is not None


def test_the_kernel_is_one_unit_of_every_file_and_its_cache_key_covers_them_all(tmp_path, monkeypatch):
    """``cpu_kernel/kernel.cpp`` includes every header of its folder (one translation unit), and the
    cached library's key hashes every file there, so editing any header rebuilds it, not only an
    edit of kernel.cpp."""
    import re
    import shutil

    from specd.model import qkernel

    files = sorted(p.name for p in qkernel.KERNEL_DIR.iterdir() if p.suffix in (".h", ".cpp"))
    assert qkernel.SOURCE.name == "kernel.cpp" and len(files) > 2
    assert set(re.findall(r'#include "([^"]+)"', qkernel.SOURCE.read_text())) == set(files) - {"kernel.cpp"}
    copy = tmp_path / "cpu_kernel"
    shutil.copytree(qkernel.KERNEL_DIR, copy)
    monkeypatch.setattr(qkernel, "KERNEL_DIR", copy)
    key = qkernel._source_key()
    for name in files:
        text = (copy / name).read_bytes()
        (copy / name).write_bytes(text + b"\n")
        assert qkernel._source_key() != key, name
        (copy / name).write_bytes(text)
    assert qkernel._source_key() == key


@pytest.mark.parametrize("fmt", list(FORMATS)[:3] + ["int4/g32"])
def test_a_row_does_not_depend_on_the_other_rows(fmt):
    """Bitwise: row i of an M-row call equals the same row alone (lossless verification)."""
    g = torch.Generator().manual_seed(7)
    op = FORMATS[fmt](torch.randn(67, 576, generator=g) * 0.05)
    x = torch.randn(13, 576, generator=g)
    alone = torch.cat([op(x[i : i + 1]) for i in range(13)])
    for M in range(1, 14):
        assert torch.equal(op(x[:M]), alone[:M]), M


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_quantization_error_is_half_a_step(fmt):
    g = torch.Generator().manual_seed(3)
    w = torch.randn(64, 256, generator=g)
    op = quantize_int8(w, group=32) if fmt == "int8" else quantize_int4(w, group=32)
    step = op.scale.repeat_interleave(32, dim=1)  # [N, K]
    assert ((op.dequantize() - w).abs() <= step / 2 + 1e-6).all()
    if fmt == "int4":
        codes = unpack_int4(op.qweight)
        assert int(codes.max()) <= 15 and codes.shape == w.shape


def test_rows_and_select_are_views_of_the_same_weights():
    op = quantize_int4(torch.randn(50, 96))
    ids = torch.tensor([3, 0, 49, 3])
    assert torch.equal(op.rows(ids), op.dequantize()[ids])
    assert torch.equal(op.select(ids).dequantize(), op.dequantize()[ids])


def _gguf_tensor(w: np.ndarray, qtype) -> SimpleNamespace:
    """What ``GGUFReader`` gives for a quantized tensor: raw bytes [N, bytes per row], ggml dims."""
    raw = gguf.quants.quantize(w, qtype)
    return SimpleNamespace(name="t", tensor_type=qtype, shape=np.array([w.shape[1], w.shape[0]]), data=raw)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1], ids=["Q8_0", "Q4_0", "Q4_1"])
def test_repacked_gguf_blocks_equal_gguf_dequantization(qtype):
    """Bit-exact: the kernel layout holds the file's codes and fp16 scales; nothing is rounded."""
    w = np.random.default_rng(0).standard_normal((45, 320)).astype(np.float32)
    t = _gguf_tensor(w, qtype)
    op = repack(t)
    want = torch.from_numpy(gguf.quants.dequantize(t.data, qtype).reshape(w.shape).astype(np.float32))
    assert op.fmt == ("int8" if qtype == Q.Q8_0 else "int4") and op.group == 32
    assert torch.equal(op.dequantize(), want)
    assert op.nbytes() < w.nbytes / 3  # the codes stay 8 / 4 bits (plus fp32 scales)
    x = torch.randn(3, 320)
    _check(op(x), x, op, torch.float32)
    _, scale, mins, _ = op.x8_pack()  # the int8-activation kernel reads the file's fp16 scales as halves
    assert scale.dtype == torch.float16 and (mins is None or mins.dtype == torch.float16)


@pytest.mark.skipif(kernel() is None, reason="no CPU kernel here")
def test_q4_0_mins_implied_by_the_scales_give_the_stored_mins_bits():
    """A Q4_0 block is d * (q - 8): its packed mins (-8 d) are not stored (``X8.off8``) but computed
    from the scales in the kernel, exactly: every instruction set this CPU has and every row count
    give the bits of the same weight with the mins stored, whole projections (``specd_layers``'s
    kinds) and ``compact`` included, in 144 bytes per 8 x 32 weights instead of 160."""
    from specd.model.quant import X8, pack_x8

    w = np.random.default_rng(3).standard_normal((67, 576)).astype(np.float32)
    op = repack(_gguf_tensor(w, Q.Q4_0))
    packed = pack_x8(op)
    assert packed.off8 and packed.mins is None and packed.scale.dtype == torch.float16
    stored = X8(packed.w, packed.scale, (-8.0 * packed.scale.float()).half(), False)  # the mins, as stored before
    assert sum(t.numel() * t.element_size() for t in (packed.w, packed.scale)) * 10 == 9 * sum(
        t.numel() * t.element_size() for t in (stored.w, stored.scale, stored.mins)
    )
    g = torch.Generator().manual_seed(4)
    x, res = torch.randn(40, 576, generator=g) * 3, torch.randn(40, 67, generator=g)
    isas = [0] + ([1, 2] if AVX512_VNNI <= cpu_info()["flags"] else [])
    op.act_int8 = True
    try:
        for isa in isas:
            x8_isa(isa)
            for M in (1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 33, 40):
                op._x8 = stored
                want = addmm(res[:M], x[:M], op)
                op._x8 = packed
                assert torch.equal(addmm(res[:M], x[:M], op), want), (isa, M)
        x8_isa(-1)
        op._x8 = packed
        want = addmm(res, x, op)
        compact = op.compact()
        assert compact.minv is None and torch.equal(addmm(res, x, compact), want)
        assert torch.equal(
            compact.dequantize(),
            torch.from_numpy(gguf.quants.dequantize(_gguf_tensor(w, Q.Q4_0).data, Q.Q4_0)).reshape(w.shape),
        )
    finally:
        x8_isa(-1)
        op.act_int8 = False


@pytest.mark.skipif(kernel() is None, reason="no CPU kernel here")
@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1], ids=["Q8_0", "Q4_0", "Q4_1"])
def test_native_repacking_equals_the_torch_repacking(qtype, monkeypatch):
    """A load's repacking in the kernel (``specd_pack_x8_gguf``) gives the bytes of the torch path
    (``pack_x8`` of ``repack``): a fused projection of parts with rows not a multiple of 8 (tiles
    spanning parts; the last tile's padding zero), one part with a row order (llama.cpp's q/k
    permutation undone), chunks of rows smaller than a part."""
    from specd.model import quant_load
    from specd.model.quant_load import native_x8, repack_x8

    rng = np.random.default_rng(7)
    parts = [_gguf_tensor(rng.standard_normal((n, 320)).astype(np.float32), qtype) for n in (45, 19, 30)]
    perms = [None, rng.permutation(19), None]
    monkeypatch.setattr(quant_load, "CHUNK_BYTES", 2048)  # (a few rows per chunk)
    native = native_x8(parts, perms)
    assert native is not None and native.layout == "x8"
    monkeypatch.setattr(quant_load, "native_x8", lambda *a: None)
    torch_path = repack_x8(parts, perms)
    assert torch_path is not None
    for a, b in zip(native.x8_pack(), torch_path.x8_pack()):
        assert (a is None and b is None) or (a is b) or torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert native.x8_pack().off8 == (qtype == Q.Q4_0)
    rows = [repack(t).dequantize() for t in parts]
    want = torch.cat([r if p is None else r[torch.from_numpy(p)] for r, p in zip(rows, perms)])
    assert torch.equal(native.dequantize(), want)


# int8 activations (--act-quant int8) ------------------------------------------------------------------
def _q8_reference(x: torch.Tensor, k_pad: int) -> torch.Tensor:
    """x quantized as the kernel does (per row, blocks of 32: d = max|x| / 127, round half to even),
    dequantized again: fp64 [M, k_pad]."""
    xp = torch.nn.functional.pad(x.double(), (0, k_pad - x.shape[1])).view(x.shape[0], -1, 32)
    d = (xp.abs().amax(-1, keepdim=True).float() / 127.0).double()  # (the kernel divides in fp32)
    inv = torch.where(d > 0, 1.0 / d.float(), torch.zeros_like(d.float())).double()
    q = torch.round((xp.float() * inv.float()).double()).clamp(-127, 127)
    return (q * d).view(x.shape[0], -1)


@pytest.mark.parametrize("fmt,shape", CASES, ids=[f"{f}-{n}x{k}" for f, (n, k) in CASES])
def test_int8_activations_equal_their_exact_reference(fmt, shape):
    """``act_int8``: the result is the fp32 product of the int8-quantized activations with the
    weights' codes times scales, plus (int4) each group's min times the exact activation sum (fp64
    reference, fp32 accumulation tolerance), and within 2% of the fp32-activation result."""
    N, K = shape
    g = torch.Generator().manual_seed(N + K)
    op = FORMATS[fmt](torch.randn(N, K, generator=g) * 0.05, torch.randn(N, generator=g))
    w = torch.nn.functional.pad(op.dequantize().double(), (0, op.k_pad - K))
    mins = torch.zeros_like(w)
    if op.minv is not None:
        mins = op.minv.double().repeat_interleave(op.group, dim=1)
    for M in (1, 2, 5, 7, 13):
        x = torch.randn(M, K, generator=g)
        res = torch.randn(M, N, generator=g)
        op.act_int8 = True
        y = addmm(res, x, op).double()
        op.act_int8 = False
        xq = _q8_reference(x, op.k_pad)
        xp = torch.nn.functional.pad(x.double(), (0, op.k_pad - K))
        ref = xq @ (w - mins).t() + xp @ mins.t() + op.bias.double() + res.double()
        bound = xq.abs() @ w.abs().t() + op.bias.double().abs() + res.double().abs()
        assert ((y - ref).abs() <= 4e-6 * bound).all(), float(((y - ref).abs() / bound).max())
        exact = x.double() @ op.dequantize().double().t() + op.bias.double() + res.double()
        assert ((y - exact).abs() <= 0.02 * (x.double().abs() @ w[:, :K].abs().t()) + 1e-6).all()


@pytest.mark.parametrize("fmt", ["int8/channel", "int8/g32", "int4/g32", "int4/g64"])
def test_int8_activations_keep_a_row_independent_of_the_others(fmt):
    g = torch.Generator().manual_seed(11)
    op = FORMATS[fmt](torch.randn(67, 576, generator=g) * 0.05)
    op.act_int8 = True
    x = torch.randn(13, 576, generator=g)
    alone = torch.cat([op(x[i : i + 1]) for i in range(13)])
    for M in range(1, 14):
        assert torch.equal(op(x[:M]), alone[:M]), M
    op.act_int8 = False
    assert not torch.equal(op(x), alone)  # (and it is a different computation from fp32 activations)


AVX512_VNNI = {"avx512f", "avx512bw", "avx512dq", "avx512_vnni"}


@pytest.mark.skipif(
    kernel() is None or not AVX512_VNNI <= cpu_info()["flags"],
    reason="no CPU kernel here, or this CPU has no AVX512-VNNI",
)
@pytest.mark.parametrize("fmt", ["int8/channel", "int8/g32", "int4/g32", "int4/g64"])
def test_int8_activations_avx512_vnni_and_amx_equal_avx2_bitwise(fmt):
    """The AVX512-VNNI tiles (two 8-row tiles per vector, vpdpbusd; 1-4 rows: one tile's two vectors per
    register, x8_tile1) and, where the CPU has them, the
    AMX tiles (from 5 or 7 rows, up to 16 rows per tile op; 17, 19 and 33 rows: tile ops for 16 or 32
    and the AVX512-VNNI tile for the rest, 40 rows: two halves of 20) give the
    AVX2 tiles' bits for every row count and an odd number of tiles (N = 67: 9 tiles); the best of
    them is the path in use here."""
    g = torch.Generator().manual_seed(5)
    op = FORMATS[fmt](torch.randn(67, 576, generator=g) * 0.05, torch.randn(67, generator=g))
    op.act_int8 = True
    x, res = torch.randn(40, 576, generator=g) * 3, torch.randn(40, 67, generator=g)
    amx = {"amx_tile", "amx_int8"} <= cpu_info()["flags"] and os.environ.get("SPECD_QGEMM_AMX") != "0"
    try:
        for M in (1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 17, 19, 33, 40):
            assert x8_isa(0) == "avx2"
            slow = addmm(res[:M], x[:M], op)
            assert x8_isa(1) == "avx512vnni"
            assert torch.equal(addmm(res[:M], x[:M], op), slow), M
            assert x8_isa(2) == ("amx" if amx else "avx512vnni")
            assert torch.equal(addmm(res[:M], x[:M], op), slow), M
    finally:
        x8_isa(-1)
        op.act_int8 = False
    assert x8_isa() == ("amx" if amx else "avx512vnni")


@pytest.mark.skipif(kernel() is None, reason="no CPU kernel here")
@pytest.mark.parametrize("fmt", ["int8/g32", "int4/g32", "int4/g64"])
def test_half_scales_give_the_fp32_scales_bits(fmt, monkeypatch):
    """Scales and mins that are halves exactly (as GGUF's Q4_0 / Q4_1 / Q8_0 blocks store them) are
    packed as fp16 and widened on load: every instruction set and row count (AVX2, AVX512-VNNI, AMX
    tiles, AMX halves and tails) gives the bits of the same weights packed with fp32 scales. Scales
    that are not halves exactly stay fp32."""
    from specd.model.quant import pack_x8

    g = torch.Generator().manual_seed(9)
    op = FORMATS[fmt](torch.randn(67, 576, generator=g) * 0.05, torch.randn(67, generator=g))
    assert pack_x8(op)[1].dtype == torch.float32  # random fp32 scales: not halves
    op.scale = op.scale.half().float()
    op.minv = None if op.minv is None else op.minv.half().float()
    half = pack_x8(op)
    assert half[1].dtype == torch.float16 and (half[2] is None or half[2].dtype == torch.float16)
    monkeypatch.setenv("SPECD_X8_HALF_SCALES", "0")
    full = pack_x8(op)
    assert full[1].dtype == torch.float32 and torch.equal(full[1], half[1].float())
    x, res = torch.randn(40, 576, generator=g) * 3, torch.randn(40, 67, generator=g)
    op.act_int8 = True
    try:
        for want in (0, 1, 2):
            x8_isa(want)
            for M in (1, 2, 3, 4, 5, 7, 8, 16, 17, 19, 33, 40):
                op._x8 = full
                want_y = addmm(res[:M], x[:M], op)
                op._x8 = half
                assert torch.equal(addmm(res[:M], x[:M], op), want_y), (want, M)
    finally:
        x8_isa(-1)
        op.act_int8 = False


@pytest.mark.skipif(kernel() is None, reason="no CPU kernel (or compiler) here")
@pytest.mark.parametrize("driver", ["qgemm_rows.cpp", "kq_rows.cpp"])
def test_the_gemm_timing_drivers_still_compile_against_the_kernel(driver):
    """``eval/qgemm_rows.cpp`` and ``eval/kq_rows.cpp`` (docs/benchmarks.md's GEMM-only timings) include
    the kernel (``cpu_kernel/kernel.cpp``) and call ``specd_qgemm_x8`` / ``gemm_kq``, ``quantize_q8`` and
    ``code_sums``: a signature change there must not leave them silently broken."""
    import shutil
    import subprocess
    from pathlib import Path

    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    src = Path(__file__).resolve().parents[1] / "eval" / driver
    flags = ["-fsyntax-only", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-std=c++17"]
    r = subprocess.run([cxx, *flags, str(src)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]


@pytest.mark.skipif(kernel() is None, reason="no CPU kernel (or compiler) here")
def test_the_attention_timing_driver_runs_and_every_instruction_set_gives_its_checksum(tmp_path):
    """``eval/att_rows.cpp`` (docs/benchmarks.md's attention-only timings) builds against the kernel
    and runs; its output checksums are the attention's bits, so the AVX2 and AVX512 paths (where
    the CPU has AVX512), on two threads or one (``SPECD_ATT_PAR_WORK``: the suite's own processes
    run the kernel on one thread), must print the same ones, masked verification rows included."""
    import shutil
    import subprocess
    from pathlib import Path

    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    src = Path(__file__).resolve().parents[1] / "eval" / "att_rows.cpp"
    exe = tmp_path / "att_rows"
    flags = ["-O1", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-std=c++17"]
    r = subprocess.run([cxx, *flags, "-o", str(exe), str(src)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    sums = {}
    for isa in ("0", "2"):
        for par in ("0", "1e12"):  # the attention always on two threads, or always on one
            env = {**os.environ, "OMP_NUM_THREADS": "2", "REPS": "2", "SPECD_ATT_PAR_WORK": par}
            out = subprocess.run([str(exe), isa, "8:1", "40:3", "70:17"], capture_output=True, text=True, env=env,
                                 timeout=120)  # fmt: skip
            assert out.returncode == 0, out.stderr[-2000:]
            lines = [ln for ln in out.stdout.splitlines() if ln.startswith("context")]
            assert len(lines) == 3, out.stdout
            sums[isa, par] = [ln.split("checksum")[1] for ln in lines]
    assert len(set(map(tuple, sums.values()))) == 1, sums
