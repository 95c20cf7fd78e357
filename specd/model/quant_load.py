"""Quantized models at load time: a loaded float model quantized in place (``quantize_model``), or
a GGUF file's blocks repacked into ``QuantLinear`` layouts one tensor at a time (``load_gguf``).

``--quantization`` (``resolve``): ``none`` keeps floats; ``int8`` (per channel) and ``int4`` (groups
of 32) quantize every decoder projection; ``gguf`` keeps a GGUF file's own Q8_0 / Q4_0 / Q4_1 blocks
and its K-quants Q4_K / Q5_K / Q6_K (``KQuantLinear``: each tensor of a fused projection keeps its
own type, Q8_0 parts beside K-quant ones included, as an 8-expert Q4_K_M file's k / v beside its
Q4_K q; bit-exact: the kernels dequantize to exactly what the ``gguf`` package does) and refuses
other types; ``auto`` is ``gguf`` for a GGUF file, with any other quantized type converted to the
nearest supported format (Q5_0, Q5_1, Q8_K -> int8; Q2_K, Q3_K -> int4; a fused projection mixing
kept types it cannot hold in one layout, such as Q4_0 with a K-quant, likewise; float tensors stay
float), and ``none`` for a Hugging Face folder.

What stays in floats: RMSNorm weights (tiny) and, for a folder, untied token embeddings (a lookup
reads one row per token). The LM head is quantized to int8 per channel under ``int8`` and
``int4`` (it is ~21% of SmolLM2-135M's weights and its fp32 read costs more than the rest of a
1-row step's overheads; int4 on it costs more quality for little time, see docs/benchmarks.md); a
GGUF head keeps its blocks. With tied embeddings the quantized head also serves lookups
(``QuantLinear.rows``), so the table exists once.

Memory, where the CPU kernel runs: a GGUF file's blocks go straight into the kernel's layouts (the
interleaved x8 layout, ``QuantLinear.compact``; the kq tiles of ``KQuantLinear``), a chunk of rows
at a time into the final buffers, and nothing else is kept: resident memory after a load is about
the file's size (a 1.7B Q4_0 file: 1.16x, Q4_K_M: 1.08x, docs/benchmarks.md), and so is the load's
peak: the file is mapped (``TensorFile``, the metadata not decoded) and each chunk's pages leave
the resident set once repacked.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn as nn

from specd.model.errors import LoadError
from specd.model.moe import gguf_experts, mlp_projections
from specd.model.quant import (
    KQ_KINDS,
    KQ_SUPER,
    KQFields,
    KQuantLinear,
    QuantLinear,
    kq_tile_bytes,
    kq_tile_table,
    pack_kq,
    pack_x8,
    q8_fields,
    quantize,
    quantize_int8,
)

log = logging.getLogger("specd.quant")
QUANTIZATIONS = ("auto", "none", "int8", "int4", "gguf")
KERNEL_TYPES = ("Q8_0", "Q4_0", "Q4_1")  # GGUF block types kept as they are (QuantLinear)
K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")  # ... and the K-quants (KQuantLinear, with any Q8_0 parts beside them)
KEPT_TYPES = KERNEL_TYPES + K_QUANTS
FLOAT_TYPES = ("F32", "F16", "BF16")
INT8_NEAREST = ("Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_1", "Q8_K")


def resolve(quantization: str, is_gguf: bool, path) -> str:
    """The effective mode for a checkpoint: ``auto`` stays ``auto`` for a GGUF file (its blocks where
    a kernel takes them, the nearest format elsewhere) and is ``none`` for a folder."""
    if quantization not in QUANTIZATIONS:
        raise LoadError(f"unsupported quantization {quantization!r}; supported: {', '.join(QUANTIZATIONS)}")
    if quantization == "auto":
        return "auto" if is_gguf else "none"
    if quantization == "gguf" and not is_gguf:
        raise LoadError(f"{path}: --quantization gguf needs a .gguf file (use int8 or int4 for a folder)")
    return quantization


# a float model, in place ---------------------------------------------------------------------------
def quantize_model(model, fmt: str, head: bool = True) -> None:
    """Replace every decoder projection of ``model`` (a loaded ``LlamaModel``) by a ``QuantLinear``
    of format ``fmt``, one at a time (the float weight is freed as its layer is done); ``head``:
    the LM head too (int8 per channel; with tied embeddings it then serves lookups as well)."""
    with torch.no_grad():
        for blk in model.layers:
            for parent, name in ((blk.attn, "qkv"), (blk.attn, "o"), *mlp_projections(blk.mlp)):  # (MoE: experts)
                lin = getattr(parent, name)
                setattr(parent, name, quantize(lin.weight, fmt, lin.bias))
        if head:
            q = quantize_int8(model.lm_head.weight)
            if model.cfg.tie_word_embeddings:
                model.embed = q
            model.lm_head = q
    model._flat = None


# GGUF blocks -----------------------------------------------------------------------------------------
def _f16(raw: np.ndarray) -> torch.Tensor:
    """fp16 fields [..., 2] (uint8) -> fp32 [...] (exact)."""
    return torch.from_numpy(np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32))


def _dims(t) -> tuple[int, int]:
    *rows, K = (int(n) for n in reversed(t.shape.tolist()))  # (ggml dims are innermost first)
    return int(np.prod(rows)), K  # (a 3-D tensor, a mixture's experts: all its matrices' rows)


def repack(t, rows=None) -> QuantLinear:
    """A Q8_0 / Q4_0 / Q4_1 GGUF tensor (a ``GGUFReader`` tensor, torch shape [N, K]; ``rows``: an
    index of the rows to take) as a ``QuantLinear`` of the same blocks: no value is rounded."""
    kind = t.tensor_type.name
    N, K = _dims(t)
    size = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}[kind]
    raw = np.asarray(t.data).reshape(N, K // 32, size)
    if rows is not None:
        raw = raw[rows]
        N = len(raw)
    if kind == "Q8_0":
        q = torch.from_numpy(np.ascontiguousarray(raw[..., 2:]).view(np.int8).reshape(N, K))
        return QuantLinear("int8", q, _f16(raw[..., 0:2]), None, 32, K)
    d = _f16(raw[..., 0:2])
    if kind == "Q4_0":
        m, qs = -8.0 * d, raw[..., 2:]
    else:
        m, qs = _f16(raw[..., 2:4]), raw[..., 4:]
    return QuantLinear("int4", torch.from_numpy(np.ascontiguousarray(qs).reshape(N, K // 2)), d, m, 32, K)


def _halves(raw: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(raw).view(np.float16)[..., 0])


def kq_fields(t, rows=None) -> KQFields:
    """A Q4_K / Q5_K / Q6_K / Q8_0 GGUF tensor's numbers (torch shape [N, K]; ``rows``: an index of the
    rows to take) unpacked as the ``gguf`` package's dequantization reads them (``gguf.quants``;
    llama.cpp's block_q4_K, block_q5_K, block_q6_K, block_q8_0): nothing rounded."""
    from gguf.quants import Q4_K

    kind = t.tensor_type.name
    N, K = _dims(t)
    if kind == "Q8_0":  # 34 bytes per 32 weights: d (half), 32 int8 codes
        raw8 = np.asarray(t.data).reshape(N, K // 32, 34)
        raw8 = raw8 if rows is None else raw8[rows]
        q = torch.from_numpy(np.ascontiguousarray(raw8[..., 2:]).view(np.int8).reshape(len(raw8), K))
        return q8_fields(q, _halves(raw8[..., 0:2]))
    nsb = K // KQ_SUPER
    raw = np.asarray(t.data).reshape(N, nsb, {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}[kind])
    if rows is not None:
        raw = raw[rows]
        N = len(raw)
    if kind == "Q6_K":
        ql = (raw[..., :128].reshape(N, nsb, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(2, 1)) & 15
        qh = (raw[..., 128:192].reshape(N, nsb, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)) & 3
        u = ql.reshape(N, K) | (qh.reshape(N, K) << 4)
        sc = raw[..., 192:208].reshape(N, K // 32, 2)
        d = _halves(raw[..., 208:210])
        s1, s2, dmin = sc[..., 0], sc[..., 1], torch.zeros_like(d)
    else:
        d, dmin = _halves(raw[..., 0:2]), _halves(raw[..., 2:4])
        sc, m = Q4_K.get_scale_min(np.ascontiguousarray(raw[..., 4:16]).reshape(N * nsb, 12))
        s1, s2 = sc.reshape(N, K // 32), m.reshape(N, K // 32)
        qs = raw[..., -128:].reshape(N, nsb, 4, 1, 32)
        u = ((qs >> np.array([0, 4], np.uint8).reshape(2, 1)) & 15).reshape(N, nsb, 8, 32)
        if kind == "Q5_K":
            qh = raw[..., 16:48].reshape(N, nsb, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(8, 1)
            u = u | ((qh & 1) << 4)
        u = u.reshape(N, K)
    as_t = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.uint8))  # noqa: E731
    return KQFields(KQ_KINDS.index(kind), as_t(u), as_t(s1), as_t(s2), d, dmin)


CHUNK_BYTES = 256 << 10  # the file's bytes repacked at a time: a load's temporaries are a few times one chunk


def _chunk_rows(t) -> int:
    """Rows of ``t`` per chunk: a multiple of 8 (whole tiles), about CHUNK_BYTES of the file."""
    row = t.data.nbytes // _dims(t)[0]
    return max(8, CHUNK_BYTES // row // 8 * 8)


def _release(t, perm, r0: int, r1: int) -> None:
    """Rows r0 .. r1 - 1 of ``t`` are repacked: their pages leave the resident set (``TensorFile``;
    a permuted tensor's rows are scattered: all of it once its last rows are done)."""
    release = getattr(t, "release", None)
    if release is not None and perm is None:
        release(r0, r1)
    elif release is not None and r1 >= len(perm):
        release()


def _order(t, perm) -> np.ndarray:
    return np.arange(_dims(t)[0]) if perm is None else perm


KQ_FILE_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210, "Q8_0": 272}  # a file's bytes per 256 weights


def _kq_raw(t, K: int) -> np.ndarray | None:
    """``t``'s file bytes as one C-contiguous uint8 array the kernel can read, else None."""
    raw = np.asarray(t.data)
    row = KQ_FILE_BYTES[t.tensor_type.name] * K // KQ_SUPER
    ok = raw.flags["C_CONTIGUOUS"] and raw.dtype == np.uint8 and K % KQ_SUPER == 0
    return raw if ok and raw.nbytes == _dims(t)[0] * row else None


def kquant(tensors: list, perms: list, native: bool = True) -> KQuantLinear:
    """GGUF K-quant tensors stacked by rows as one ``KQuantLinear`` (``perms``: row orders to
    apply), packed a chunk of rows at a time into the final buffer (each chunk's pages released
    after it): by the CPU kernel (``specd_pack_kq_gguf``: the file's bytes moved, the same bytes
    as ``pack_kq`` of ``kq_fields``) where it runs and ``native``, else by numpy and torch."""
    from specd.model.qkernel import kernel

    K = _dims(tensors[0])[1]
    kinds = [KQ_KINDS.index(t.tensor_type.name) for t in tensors]
    tiles = [(_dims(t)[0] + 7) // 8 for t in tensors]
    tile_bytes = [kq_tile_bytes(k, K) for k in kinds]
    buf = torch.empty(sum(n * b for n, b in zip(tiles, tile_bytes)), dtype=torch.uint8)
    lib = kernel() if native else None
    at = 0
    for t, p, kind, size in zip(tensors, perms, kinds, tile_bytes):
        order, step = _order(t, p), _chunk_rows(t)
        raw = None if lib is None else _kq_raw(t, K)
        for r0 in range(0, len(order), step):
            if raw is not None:
                rows = np.ascontiguousarray(order[r0 : r0 + step], dtype=np.int64)
                lib.specd_pack_kq_gguf(raw.ctypes.data, kind, K, rows.ctypes.data, len(rows), buf.data_ptr() + at)
                at += (len(rows) + 7) // 8 * size
            else:
                packed = pack_kq(kq_fields(t, order[r0 : r0 + step])).view(-1)
                buf[at : at + packed.numel()] = packed
                at += packed.numel()
            _release(t, p, r0, r0 + step)
    table = kq_tile_table(sum(([k] * n for k, n in zip(kinds, tiles)), []),
                          sum(([b] * n for b, n in zip(tile_bytes, tiles)), []))  # fmt: skip
    return KQuantLinear([(t.tensor_type.name, _dims(t)[0]) for t in tensors], buf, table, K)


def _x8_chunks(tensors: list, perms: list):
    """The fused projection's rows a chunk at a time as row-layout ``QuantLinear``s (each chunk
    across the parts it spans)."""
    orders = [_order(t, p) for t, p in zip(tensors, perms)]
    bounds = np.cumsum([0] + [len(o) for o in orders])
    step = min(_chunk_rows(t) for t in tensors)
    for r0 in range(0, int(bounds[-1]), step):
        r1 = min(r0 + step, int(bounds[-1]))
        span = [(t, p, o, max(r0, a) - a, min(r1, b) - a) for t, p, o, a, b in
                zip(tensors, perms, orders, bounds[:-1], bounds[1:]) if max(r0, a) < min(r1, b)]  # fmt: skip
        ops = [repack(t, o[a:b]) for t, _, o, a, b in span]
        yield ops[0] if len(ops) == 1 else _cat(ops)
        for t, p, _, a, b in span:
            _release(t, p, a, b)


def native_x8(tensors: list, perms: list) -> QuantLinear | None:
    """``repack_x8`` by the CPU kernel (``specd_pack_x8_gguf``: the blocks' bytes moved, at memory
    speed) for parts of one GGUF type among Q4_0 / Q4_1 / Q8_0, a chunk of file rows at a time (each
    chunk's pages released after it, as ``repack_x8``); None where it does not apply (mixed types,
    SPECD_X8_OFF8=0, a part whose bytes are not one contiguous array, no kernel)."""
    from specd.model.qkernel import kernel

    kinds = {t.tensor_type.name for t in tensors}
    lib = kernel()
    if lib is None or len(kinds) != 1 or not kinds <= set(KERNEL_TYPES) or os.environ.get("SPECD_X8_OFF8") == "0":
        return None
    kind = kinds.pop()
    raws = [np.asarray(t.data) for t in tensors]
    block = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}[kind]  # (the kernel reads rows of K / 32 such blocks)
    fits = lambda t, r: r.nbytes == _dims(t)[0] * (_dims(t)[1] // 32) * block and _dims(t)[1] % 32 == 0  # noqa: E731
    if not all(r.flags["C_CONTIGUOUS"] and r.dtype == np.uint8 and fits(t, r) for t, r in zip(tensors, raws)):
        return None
    N, K = sum(_dims(t)[0] for t in tensors), _dims(tensors[0])[1]
    T, nbk, words = (N + 7) // 8, K // 32, 8 if kind == "Q8_0" else 4  # (GGUF blocks of 32 weights)
    w = torch.empty(T * nbk * words * 32, dtype=torch.uint8)
    scale = torch.empty((T, nbk, 8), dtype=torch.float16)
    mins = torch.empty_like(scale) if kind == "Q4_1" else None
    for b in (w.view(T, -1), scale, mins):
        if b is not None:
            b[T - 1].zero_()  # (the last tile's padding rows)
    o0, code = 0, ("Q4_0", "Q4_1", "Q8_0").index(kind)
    for t, p, raw in zip(tensors, perms, raws):
        order, step = _order(t, p), _chunk_rows(t)
        for r0 in range(0, len(order), step):
            rows = np.ascontiguousarray(order[r0 : r0 + step], dtype=np.int64)
            lib.specd_pack_x8_gguf(raw.ctypes.data, code, K, rows.ctypes.data, len(rows), o0 + r0, w.data_ptr(),
                                   scale.data_ptr(), None if mins is None else mins.data_ptr())  # fmt: skip
            _release(t, p, r0, r0 + step)
        o0 += len(order)
    return QuantLinear.from_x8(_fmt_of(kind), 32, K, N, w, scale, mins, off8=kind == "Q4_0")


def repack_x8(tensors: list, perms: list) -> QuantLinear | None:
    """The ``repack`` of GGUF tensors stacked by rows straight into the CPU kernel's layout
    (``QuantLinear.compact``), a chunk of rows at a time into the final buffers (``native_x8`` where
    it applies); None where the chunks' scales are not all halves or their mins not all stored or all
    implied (``X8.off8``: then the whole projection is repacked at once)."""
    native = native_x8(tensors, perms)
    if native is not None:
        return native
    N = sum(_dims(t)[0] for t in tensors)
    out: list = []  # w, scale, mins: the whole projection's
    tile, off8 = 0, False
    for op in _x8_chunks(tensors, perms):
        w, *sm, chunk_off8 = pack_x8(op)
        n = sm[0].shape[0]  # tiles in this chunk
        if not out:
            fmt, group, K, per_tile, off8 = op.fmt, op.group, op.in_features, w.numel() // n, chunk_off8
            out = [torch.empty(((N + 7) // 8 * per_tile,), dtype=torch.uint8)]
            out += [None if c is None else torch.empty(((N + 7) // 8, *c.shape[1:]), dtype=c.dtype) for c in sm]
        if chunk_off8 != off8 or any(
            (c is None) != (o is None) or (c is not None and c.dtype != o.dtype) for c, o in zip(sm, out[1:])
        ):
            return None
        out[0][tile * per_tile : (tile + n) * per_tile] = w
        for c, o in zip(sm, out[1:]):
            if c is not None:
                o[tile : tile + n] = c
        tile += n
    return QuantLinear.from_x8(fmt, group, K, N, *out, off8=off8)


def _cat(ops: list) -> QuantLinear:
    """Row-wise concatenation of QuantLinears of one format and group (a fused projection)."""
    a = ops[0]
    cat = lambda name: None if getattr(a, name) is None else torch.cat([getattr(o, name) for o in ops])  # noqa: E731
    return QuantLinear(a.fmt, cat("qweight"), cat("scale"), cat("minv"), a.group, a.in_features, cat("bias"))


def _target_format(types: list, mode: str, names: list, path: Path, rows: list) -> str:
    """What a projection of GGUF tensors of ``types`` (``rows`` each) becomes: ``repack``,
    ``kquant``, ``float``, int8 or int4."""
    if mode in ("int8", "int4"):
        return "repack" if all(_exact(t, mode) for t in types) else mode
    if all(t in KERNEL_TYPES for t in types) and len({_fmt_of(t) for t in types}) == 1:
        return "repack"
    if all(t in KQ_KINDS for t in types) and any(t in K_QUANTS for t in types) and all(n % 8 == 0 for n in rows[:-1]):
        return "kquant"  # (Q8_0 parts among K-quants too; all Q8_0: the x8 layout's repack above)
    if mode == "gguf":
        bad = next(((n, t) for n, t in zip(names, types) if t not in KEPT_TYPES), None)
        if bad is None:
            raise LoadError(
                f"{path}: --quantization gguf cannot keep {', '.join(f'{n} ({t})' for n, t in zip(names, types))} "
                f"as one fused projection; use --quantization auto, int8, int4 or none"
            )
        raise LoadError(
            f"{path}: --quantization gguf keeps {'/'.join(KEPT_TYPES)} blocks, but {bad[0]} is {bad[1]}; "
            f"use --quantization auto, int8, int4 or none"
        )
    if all(t in FLOAT_TYPES for t in types):
        return "float"
    return "int8" if any(t in INT8_NEAREST or t in FLOAT_TYPES or t == "Q8_0" for t in types) else "int4"


def _fmt_of(kind: str) -> str:
    return "int8" if kind == "Q8_0" else "int4"


def _exact(kind: str, mode: str) -> bool:
    return kind in KERNEL_TYPES and _fmt_of(kind) == mode


def projection(tensors: list, mode: str, path: Path, row_perms: list | None = None):
    """One (fused) projection from GGUF tensors stacked by rows: a ``QuantLinear`` or an fp32 weight
    tensor. ``row_perms``: per tensor, a row order to apply (llama.cpp's q/k permutation undone)."""
    from specd.model.gguf import _dequantize

    perms = row_perms or [None] * len(tensors)
    rows = [int(t.shape[-1]) for t in tensors]  # (ggml dims are innermost first)
    how = _target_format([t.tensor_type.name for t in tensors], mode, [t.name for t in tensors], path, rows)
    if how == "kquant":
        return kquant(tensors, perms)
    if how == "repack" and _kernel():
        op = repack_x8(tensors, perms)
        if op is not None:
            return op
    if how == "repack":
        ops = [repack(t) for t in tensors]
        ops = [o if p is None else o.select(torch.from_numpy(p)) for o, p in zip(ops, perms)]
        return _compact(ops[0] if len(ops) == 1 else _cat(ops))
    parts = [torch.from_numpy(_dequantize(t, path)) for t in tensors]
    w = torch.cat([x if p is None else x[torch.from_numpy(p)] for x, p in zip(parts, perms)])
    return w if how == "float" else _compact(quantize(w, how))


def _kernel() -> bool:
    from specd.model.qkernel import kernel

    return kernel() is not None


def _compact(op: QuantLinear) -> QuantLinear:
    """``op`` in the CPU kernel's layout only where the kernel runs (``QuantLinear.compact``)."""
    return op.compact() if _kernel() else op


def _set_linear(parent: nn.Module, name: str, op, bias: torch.Tensor | None) -> None:
    if isinstance(op, QuantLinear):
        if bias is not None:
            op.bias = bias.float()
        setattr(parent, name, op)
        return
    lin = nn.Linear(op.shape[1], op.shape[0], bias=bias is not None)
    lin.weight = nn.Parameter(op, requires_grad=False)
    if bias is not None:
        lin.bias = nn.Parameter(bias.float(), requires_grad=False)
    setattr(parent, name, lin)


def _layer(blk, i: int, tensors: dict, mode: str, path: Path, perm_heads: dict | None) -> None:
    """Layer ``i``'s norms and projections from the file (q/k/v and gate/up fused by rows)."""
    from specd.model.gguf import _dequantize, layer_norms, layer_projections, unpermute_qk

    def t(name):
        return tensors[f"blk.{i}.{name}.weight"]

    def perm(name):
        if perm_heads is None or name not in perm_heads:
            return None
        n = int(t(name).shape[-1])  # rows (ggml dims are innermost first)
        return unpermute_qk(np.arange(n).reshape(n, 1), perm_heads[name])[:, 0]

    qkv, gate_up = layer_projections(tensors, i)  # (Phi-3: one fused tensor each)
    bias = None
    if f"blk.{i}.attn_q.bias" in tensors:
        bs = [torch.from_numpy(_dequantize(tensors[f"blk.{i}.{n}.bias"], path)) for n in qkv]
        bs = [b if perm(n) is None else b[torch.from_numpy(perm(n))] for b, n in zip(bs, qkv)]
        bias = torch.cat(bs)
    _set_linear(blk.attn, "qkv", projection([t(n) for n in qkv], mode, path, [perm(n) for n in qkv]), bias)
    _trim()
    _set_linear(blk.attn, "o", projection([t("attn_output")], mode, path), None)
    if f"blk.{i}.ffn_gate_inp.weight" in tensors:  # a mixture of experts: its router, each expert's projections
        for parent, name, parts in gguf_experts(blk.mlp, i, tensors, path):
            _set_linear(parent, name, projection(parts, mode, path), None)
    else:
        _set_linear(blk.mlp, "gate_up", projection([t(n) for n in gate_up], mode, path), None)
        _set_linear(blk.mlp, "down", projection([t("ffn_down")], mode, path), None)
    for norm, name in layer_norms(blk):  # (Qwen3's q/k norms, Gemma's four: the file's 1 + w as they are)
        norm.weight = nn.Parameter(torch.from_numpy(_dequantize(t(name), path)), requires_grad=False)


def _embeddings(model, tensors: dict, mode: str, path: Path) -> None:
    """Token embeddings and LM head: the file's blocks (``gguf``), int8 under int8 / int4; a quantized
    table serves lookups through ``QuantLinear.rows``; float tables become ordinary modules."""
    head_mode = "int8" if mode in ("int8", "int4") else mode
    emb = projection([tensors["token_embd.weight"]], head_mode, path)
    if isinstance(emb, QuantLinear):
        model.embed = emb
    else:
        model.embed = nn.Embedding(emb.shape[0], emb.shape[1], _weight=emb)
        model.embed.weight.requires_grad_(False)
    if "output.weight" not in tensors:  # tied
        model.lm_head = emb if isinstance(emb, QuantLinear) else nn.Linear(emb.shape[1], emb.shape[0], bias=False)
        if not isinstance(emb, QuantLinear):
            model.lm_head.weight = model.embed.weight
        return
    _set_linear(model, "lm_head", projection([tensors["output.weight"]], head_mode, path), None)


@contextlib.contextmanager
def _one_thread():
    """torch on one thread meanwhile: the repacking's ops are small (a chunk each), and an OpenMP
    region per op on a busy 2-core machine made a 1.7B Q4_0 load 75 s instead of 4 s."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def _trim() -> None:
    """Hand the allocator's free pages back (glibc's malloc_trim): a layer's temporaries are freed
    below live blocks, where glibc keeps them resident (measured: ~2x a layer's weights per layer)."""
    import ctypes

    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


# the file's tensors, mapped ---------------------------------------------------------------------------
def _tensor_infos(buf, path: Path) -> tuple[list, int]:
    """(name, ggml dims, type, offset) of every tensor in a GGUF header, and where their data starts;
    the metadata's arrays are skipped, not decoded (``gguf.read_header(arrays=False)``: ~8 ms for a
    49k-token vocabulary, where a loop over its items in Python took ~0.2 s)."""
    import mmap
    import struct

    from gguf import GGMLQuantizationType

    from specd.model.gguf import read_header

    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            _, infos, start = read_header(m, arrays=False)
        return [(name, dims, GGMLQuantizationType(kind), off) for name, dims, kind, off in infos], start
    except (struct.error, ValueError, UnicodeDecodeError) as e:
        raise LoadError(f"{path}: cannot read the GGUF header ({e})") from None


class TensorFile:
    """A GGUF file's tensors as ``GGUFReader`` gives them (name, tensor_type, shape in ggml order,
    data: a view of one read-only memory map), read from the header without decoding the metadata
    (``GGUFReader`` builds Python objects for every vocabulary entry: ~160 MB while a 49k-token file
    is open, more than a small model's weights). ``release(t)`` drops a tensor's pages from this
    process's resident set once its blocks are repacked (the file stays mapped; a later read maps
    them again), so a load holds one projection of the file at a time, not the whole file."""

    def __init__(self, path: Path):
        import mmap

        from gguf import GGML_QUANT_SIZES

        self.map = buf = np.memmap(path, dtype=np.uint8, mode="r")
        if bytes(buf[:4]) != b"GGUF":
            raise LoadError(f"{path}: not a GGUF file (no GGUF magic)")
        infos, start = _tensor_infos(buf, path)
        self.page = mmap.PAGESIZE
        self.tensors = []
        for name, dims, kind, off in infos:
            block, size = GGML_QUANT_SIZES[kind]
            a, b = start + off, start + off + int(np.prod(dims)) // block * size
            if b > len(buf):
                raise LoadError(f"{path}: truncated: tensor {name} ends at byte {b}, the file has {len(buf)}")
            rows = tuple(reversed(dims))
            dt = {"F32": np.float32, "F16": np.float16}.get(kind.name)
            data = buf[a:b].view(dt).reshape(rows) if dt else buf[a:b].reshape(*rows[:-1], -1)
            t = SimpleNamespace(name=name, tensor_type=kind, shape=np.array(dims, np.uint64), data=data, span=(a, b))
            t.release = functools.partial(self.release, t)
            self.tensors.append(t)

    def release(self, t, r0: int = 0, r1: int | None = None) -> None:
        """Drop tensor ``t``'s pages (of its rows r0 .. r1 - 1, else all) from the resident set
        (MADV_DONTNEED; the file is unchanged), the first page whole where it starts mid-page."""
        import mmap

        a, b = t.span
        rows = _dims(t)[0] if len(t.shape) > 1 else 1
        a, b = a + (b - a) * r0 // rows, a + (b - a) * (rows if r1 is None else r1) // rows
        a -= a % self.page
        mm = getattr(self.map, "_mmap", None)
        if mm is not None and hasattr(mmap, "MADV_DONTNEED") and b > a:
            mm.madvise(mmap.MADV_DONTNEED, a, b - a)


def load_gguf(path: Path, mode: str, cfg, hf_cfg: dict, max_positions: int | None):
    """A ``LlamaModel`` (on the CPU, fp32 floats) whose projections hold the GGUF file's blocks
    (``mode`` gguf) or their conversion to int8 / int4, built one tensor at a time."""
    from specd.model.gguf import PERMUTED_QK, _dequantize, check_tensors
    from specd.model.llama import LlamaModel, Rotary

    reader = TensorFile(path)
    check_tensors(reader, hf_cfg, path)
    tensors = {t.name: t for t in reader.tensors}
    with torch.device("meta"):
        model = LlamaModel(cfg, max_positions=max_positions)
    model.rotary = Rotary(cfg, max_positions or cfg.max_position_embeddings)
    heads = None
    if hf_cfg["model_type"] in PERMUTED_QK:
        heads = {"attn_q": cfg.num_heads, "attn_k": cfg.num_kv_heads}
    with torch.no_grad(), _one_thread():
        for i, blk in enumerate(model.layers):
            _layer(blk, i, tensors, mode, path, heads)
            for name, t in tensors.items():
                if name.startswith(f"blk.{i}."):
                    reader.release(t)
            _trim()
        model.norm.weight = nn.Parameter(torch.from_numpy(_dequantize(tensors["output_norm.weight"], path)))
        model.norm.weight.requires_grad_(False)
        _embeddings(model, tensors, mode, path)
    _trim()
    left = [n for n, p in list(model.named_parameters()) + list(model.named_buffers()) if p.is_meta]
    if left:
        raise LoadError(f"{path}: no weights for {left[0]} after loading the GGUF file")
    return model
