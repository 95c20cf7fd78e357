"""specd's CPU kernel (``cpu_kernel/``: headers split by job, one translation unit ``kernel.cpp``):
built once per machine with the system C++ compiler, loaded with ctypes, run on torch's own OpenMP
threads. It holds the weight-only matmuls, the paged attention and whole decoder layers
(``specd.model.fused``); each header's first lines say what it does.

Why not torch's kernels: on an AVX2-only CPU (measured on the AMD EPYC of docs/benchmarks.md)
``torch._weight_int8pack_mm`` and ``torch._weight_int4pack_mm_for_cpu`` with fp32 activations run
their reference path (10-20x slower than an fp32 matmul); with bf16 activations they are fast at one
row but change the numerics with the batch shape. The kernel computes in fp32 from the quantized
weights, reads a weight once for all rows of a call, and gives a row the same bits whatever the
other rows are, so speculative verification stays lossless.

GGUF's K-quants (Q4_K, Q5_K, Q6_K) run as the file's numbers in their own tile layout
(``cpu_kernel/gemm_kq.h``, int8 activations only; AVX2 and AVX512-VNNI, bitwise equal; under AMX
the AVX512-VNNI tiles). The int8-activation GEMM runs AVX512-VNNI tiles where the CPU has them, and AMX int8 tiles for
calls of 7 rows or more (5 with int8 weights) where it has those too (``x8_isa``; all bitwise equal to the AVX2 tiles;
``SPECD_QGEMM_AMX=0`` stops at AVX512-VNNI, ``SPECD_QGEMM_AVX512=0`` keeps AVX2); the paged
attention's scores and weighted sums run on AVX512 with either of the two (bitwise equal to AVX2
too). The library is still compiled for AVX2 only, the AVX512 and AMX functions carry their own
target attribute.

``kernel()`` returns the loaded library or None (no x86-64 with AVX2 + FMA, no compiler, or
``SPECD_QGEMM=0``): callers then fall back to dequantize + ``torch`` matmul, with a warning logged
once. The shared object is cached under ``$SPECD_CACHE_DIR/kernels`` keyed by a hash of every file
in ``cpu_kernel/`` and the flags, so editing any header rebuilds it.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from specd.model.errors import cache_dir

log = logging.getLogger("specd.quant")
KERNEL_DIR = Path(__file__).with_name("cpu_kernel")
SOURCE = KERNEL_DIR / "kernel.cpp"  # the one translation unit: it includes every header of KERNEL_DIR
FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC", "-std=c++17")


def _cpu_ok() -> bool:
    from specd.model.cpu import cpu_info

    return platform.machine() in ("x86_64", "AMD64") and {"avx2", "fma", "f16c"} <= cpu_info()["flags"]


def _source_key() -> str:
    """A hash of every kernel file (name and bytes, in name order) and the flags."""
    h = hashlib.sha256(" ".join(FLAGS).encode())
    for f in sorted(KERNEL_DIR.iterdir()):
        if f.suffix in (".h", ".cpp"):
            h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:12]


def _build(out: Path) -> None:
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++) on PATH")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        so = Path(tmp) / out.name
        r = subprocess.run([cxx, *FLAGS, "-o", str(so), str(SOURCE)], capture_output=True, text=True, timeout=300)
        if r.returncode != 0:
            raise RuntimeError(f"{cxx} failed: {(r.stderr or r.stdout).strip().splitlines()[-1:]}")
        so.rename(out)  # atomic: a concurrent build never sees half a file


@functools.cache
def kernel() -> ctypes.CDLL | None:
    """The loaded kernel library, or None where it cannot run here (see the module doc)."""
    if os.environ.get("SPECD_QGEMM", "1") == "0" or not _cpu_ok():
        return None
    path = cache_dir() / "kernels" / f"cpu_kernel-{_source_key()}.so"
    try:
        if not path.exists():
            _build(path)
        lib = ctypes.CDLL(str(path))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        log.warning("quantized CPU kernel unavailable (%s); falling back to dequantize + matmul", e)
        return None
    p, i = ctypes.c_void_p, ctypes.c_int64
    lib.specd_qgemm_i8.argtypes = [p, i, i, p, p, i, i, p, p, p]
    lib.specd_qgemm_i8.restype = None
    lib.specd_qgemm_i4.argtypes = [p, i, i, p, p, p, i, i, p, p, p, p]
    lib.specd_qgemm_i4.restype = None
    lib.specd_qgemm_x8.argtypes = [p, i, i, p, p, p, i, ctypes.c_int, p, p, p]
    lib.specd_qgemm_x8.restype = None
    f = ctypes.c_float
    # x, e, w_e, T, d, w_in, w_post, eps, lins, H, KVH, D, inter, cos, sin, pos, kv, then the attention's
    lib.specd_head_layer.argtypes = [p, p, p, i, i, p, p, f, p, i, i, i, i, p, p, p, p, i, p, p, i, p, i, i, p, i, i,
                                     f, i]  # fmt: skip
    lib.specd_head_layer.restype = None
    lib.specd_layers.argtypes = [p, i, p, p, p, p, i, i, f, i, i, i, i, p, p, p, p, i, i, p, p, i, p, i, i, p, i, i,
                                 f, i]  # fmt: skip
    lib.specd_layers.restype = None
    lib.specd_attention.argtypes = [p, p, p, i, i, i, i, i, i, ctypes.c_float, p]
    lib.specd_attention.restype = None
    lib.specd_x8_isa.argtypes = [ctypes.c_int]
    lib.specd_x8_isa.restype = ctypes.c_int
    lib.specd_apply_bitmask.argtypes = [p, i, p, i, i, p, i]
    lib.specd_apply_bitmask.restype = None
    lib.specd_pack_x8_gguf.argtypes = [p, i, i, p, i, i, p, p, p]
    lib.specd_pack_x8_gguf.restype = None
    lib.specd_pack_kq_gguf.argtypes = [p, i, i, p, i, p]
    lib.specd_pack_kq_gguf.restype = None
    lib.specd_kq_rows.argtypes = [p, p, i, p, i, p]
    lib.specd_kq_rows.restype = None
    log.info("quantized CPU kernel: int8-activation GEMMs on %s", ISAS[lib.specd_x8_isa(9)])
    return lib


ISAS = ("avx2", "avx512vnni", "amx")


def x8_isa(want: int | None = None) -> str | None:
    """The instruction set of the int8-activation GEMMs (``amx``, ``avx512vnni`` or ``avx2``; None
    without the kernel), and so of the paged attention (AVX512 with the first two). ``want``: 2 asks
    for AMX (where the CPU has it, else the best below), 1 for AVX512-VNNI (where the CPU has it), 0
    for AVX2, -1 lets the CPU decide. All give bitwise-equal results; tests compare them."""
    lib = kernel()
    if lib is None:
        return None
    return ISAS[lib.specd_x8_isa(9 if want is None else want)]


def _ptr(t: torch.Tensor | None):
    return None if t is None else t.data_ptr()


def qgemm(
    lib: ctypes.CDLL,
    x: torch.Tensor,
    q: torch.Tensor,
    scale: torch.Tensor,
    minv: torch.Tensor | None,
    group: int,
    int4: bool,
    add: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``add + x @ W^T + bias`` with fp32 activations for x fp32 [M, K] (contiguous), q the packed
    weight ([N, K] int8 or [N, K/2] uint8), scale / minv fp32 [N, K/group], add fp32 [M, N] or None;
    returns fp32 [M, N]. (int8 activations: ``qgemm_x8``.)"""
    M, K = x.shape
    N = q.shape[0]
    y = torch.empty((M, N), dtype=torch.float32)
    if add is not None:
        add = add.contiguous()
    if int4:
        xsum = torch.empty((M, K // group), dtype=torch.float32) if minv is not None else y
        lib.specd_qgemm_i4(
            x.data_ptr(), M, K, q.data_ptr(), scale.data_ptr(), _ptr(minv), N, group, _ptr(add), _ptr(bias),
            y.data_ptr(), xsum.data_ptr(),
        )  # fmt: skip
    else:
        lib.specd_qgemm_i8(
            x.data_ptr(), M, K, q.data_ptr(), scale.data_ptr(), N, group, _ptr(add), _ptr(bias), y.data_ptr()
        )
    return y


def x8_fmt(int4: bool, scale: torch.Tensor, off8: bool = False) -> int:
    """The kernel's X8_INT4 | X8_HALF | X8_OFF8 bits for an x8-layout weight (its ``Lin`` kind less 2:
    layer.h; ``off8``: int4 mins -8 x the scales, ``quant.X8``), or X8_KQ (4) for a K-quant weight in the
    kq layout (``scale`` its int64 tile table)."""
    if scale.dtype == torch.int64:
        return 4
    return int(int4) | (2 if scale.dtype == torch.float16 else 0) | (8 if int4 and off8 else 0)


def qgemm_x8(lib: ctypes.CDLL, x: torch.Tensor, packed: tuple, N: int, int4: bool, add=None, bias=None):
    """``add + x @ W^T + bias`` with int8 activations for x fp32 [M, K] (contiguous) and W in the
    interleaved layout ``packed`` (``quant.pack_x8``: fp32 or fp16 scales; or ``KQuantLinear.x8_pack``:
    the kq layout, int64 tile table); returns fp32 [M, N]."""
    w, scale, mins, off8 = packed
    M, K = x.shape
    add = None if add is None else add.contiguous()
    y = torch.empty((M, N), dtype=torch.float32)
    lib.specd_qgemm_x8(
        x.data_ptr(), M, K, w.data_ptr(), scale.data_ptr(), _ptr(mins), N, x8_fmt(int4, scale, off8), _ptr(add),
        _ptr(bias), y.data_ptr(),
    )  # fmt: skip
    return y


def attention_rows(
    lib: ctypes.CDLL, qg: torch.Tensor, kvg: torch.Tensor, mask: torch.Tensor, q_rows: int, scale: float
) -> torch.Tensor:
    """Attention of query rows ``qg`` fp32 [B, KVH, R, D] (row r takes mask row r % q_rows) over
    gathered keys and values ``kvg`` fp32 [2, B, L, KVH, D] with the additive ``mask`` fp32
    [B, q_rows, L]: each row computed on its own (batch-invariant; cpu_kernel/attention.h). -> [B, KVH, R, D]"""
    B, KVH, R, D = qg.shape
    L = kvg.shape[2]
    out = torch.empty_like(qg)
    lib.specd_attention(qg.data_ptr(), kvg.data_ptr(), mask.data_ptr(), B, KVH, R, q_rows, L, D, scale, out.data_ptr())
    return out


def apply_bitmask(lib: ctypes.CDLL, logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Forbidden logits := -inf in place (``specd_apply_bitmask``, cpu_kernel/bitmask.h): ``logits``
    [N, V] fp32 on the CPU with unit column stride, ``rows`` [k] int64 (which rows), ``bitmask`` [k, W]
    int32 contiguous (bit j of word w: token 32 w + j allowed)."""
    if logits.dtype != torch.float32 or logits.device.type != "cpu" or logits.stride(1) != 1:
        raise ValueError("apply_bitmask needs fp32 CPU logits with contiguous rows")
    if bitmask.dtype != torch.int32 or not bitmask.is_contiguous() or bitmask.shape[0] != rows.numel():
        raise ValueError("apply_bitmask needs a contiguous int32 bitmask with one row per logits row")
    rows = rows.to(torch.int64).contiguous()
    if rows.numel() and not (0 <= int(rows.min()) and int(rows.max()) < logits.shape[0]):
        raise IndexError("apply_bitmask: a row index is out of range")
    lib.specd_apply_bitmask(logits.data_ptr(), logits.stride(0), rows.data_ptr(), rows.numel(), logits.shape[1],
                            bitmask.data_ptr(), bitmask.shape[1])  # fmt: skip


def kq_rows(lib: ctypes.CDLL, tiles: torch.Tensor, table: torch.Tensor, K: int, ids: torch.Tensor) -> torch.Tensor:
    """fp32 rows ``ids`` of a kq-layout weight (``specd_kq_rows``, cpu_kernel/kq_pack.h): ``tiles`` its
    bytes, ``table`` its tile table (int64, offset << 2 | kind), ``K`` its columns; the bits of
    ``quant.KQFields.dequantize``. The caller checks the ids (0 <= id < rows)."""
    ids = ids.to(torch.int64).contiguous()
    out = torch.empty((ids.numel(), K), dtype=torch.float32)
    lib.specd_kq_rows(tiles.data_ptr(), table.data_ptr(), K, ids.data_ptr(), ids.numel(), out.data_ptr())
    return out
