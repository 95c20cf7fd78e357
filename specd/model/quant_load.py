"""Quantized models at load time: a loaded float model quantized in place (``quantize_model``), or
a GGUF file's blocks repacked into ``QuantLinear`` layouts one tensor at a time (``load_gguf``).

``--quantization`` (``resolve``): ``none`` keeps floats; ``int8`` (per channel) and ``int4`` (groups
of 32) quantize every decoder projection; ``gguf`` keeps a GGUF file's own Q8_0 / Q4_0 / Q4_1 blocks
and its K-quants Q4_K / Q5_K / Q6_K (``KQuantLinear``: each tensor of a fused projection keeps its
own type; bit-exact: the kernels dequantize to exactly what the ``gguf`` package does) and refuses
other types; ``auto`` is ``gguf`` for a GGUF file, with any other quantized type converted to the
nearest supported format (Q5_0, Q5_1, Q8_K -> int8; Q2_K, Q3_K -> int4; a fused projection mixing
kept types of two families likewise; float tensors stay float), and ``none`` for a Hugging Face
folder.

What stays in floats: RMSNorm weights (tiny) and, for a folder, untied token embeddings (a lookup
reads one row per token). The LM head is quantized to int8 per channel under ``int8`` and
``int4`` (it is ~21% of SmolLM2-135M's weights and its fp32 read costs more than the rest of a
1-row step's overheads; int4 on it costs more quality for little time, see docs/benchmarks.md); a
GGUF head keeps its blocks. With tied embeddings the quantized head also serves lookups
(``QuantLinear.rows``), so the table exists once. Peak memory of ``load_gguf``: the repacked weights
plus one projection's temporaries (the file is memory-mapped; nothing is dequantized whole).
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

from specd.model.errors import LoadError
from specd.model.moe import gguf_experts, mlp_projections
from specd.model.quant import KQ_KINDS, KQ_SUPER, KQFields, KQuantLinear, QuantLinear, quantize, quantize_int8

log = logging.getLogger("specd.quant")
QUANTIZATIONS = ("auto", "none", "int8", "int4", "gguf")
KERNEL_TYPES = ("Q8_0", "Q4_0", "Q4_1")  # GGUF block types kept as they are (QuantLinear)
KEPT_TYPES = KERNEL_TYPES + KQ_KINDS  # ... and with the K-quants (KQuantLinear)
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


def repack(t) -> QuantLinear:
    """A Q8_0 / Q4_0 / Q4_1 GGUF tensor (a ``GGUFReader`` tensor, torch shape [N, K]) as a
    ``QuantLinear`` of the same blocks: no value is rounded."""
    kind = t.tensor_type.name
    N, K = (int(n) for n in reversed(t.shape.tolist()))
    size = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}[kind]
    raw = np.asarray(t.data).reshape(N, K // 32, size)
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


def kq_fields(t) -> KQFields:
    """A Q4_K / Q5_K / Q6_K GGUF tensor's numbers (torch shape [N, K]) unpacked as the ``gguf``
    package's dequantization reads them (``gguf.quants``; llama.cpp's block_q4_K, block_q5_K,
    block_q6_K): nothing rounded."""
    from gguf.quants import Q4_K

    kind = t.tensor_type.name
    N, K = (int(n) for n in reversed(t.shape.tolist()))
    nsb = K // KQ_SUPER
    raw = np.asarray(t.data).reshape(N, nsb, {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}[kind])
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


def kquant(tensors: list, perms: list) -> KQuantLinear:
    """GGUF K-quant tensors stacked by rows as one ``KQuantLinear`` (``perms``: row orders to apply)."""
    parts = []
    for t, p in zip(tensors, perms):
        f = kq_fields(t)
        if p is not None:
            idx = torch.from_numpy(p)
            f = KQFields(f.kind, *(a.index_select(0, idx) for a in (f.u, f.s1, f.s2, f.d, f.dmin)))
        parts.append((t.tensor_type.name, f))
    return KQuantLinear.from_fields(parts)


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
    if all(t in KQ_KINDS for t in types) and all(n % 8 == 0 for n in rows[:-1]):
        return "kquant"
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
    if how == "repack":
        ops = [repack(t) for t in tensors]
        ops = [o if p is None else o.select(torch.from_numpy(p)) for o, p in zip(ops, perms)]
        return ops[0] if len(ops) == 1 else _cat(ops)
    parts = [torch.from_numpy(_dequantize(t, path)) for t in tensors]
    w = torch.cat([x if p is None else x[torch.from_numpy(p)] for x, p in zip(parts, perms)])
    return w if how == "float" else quantize(w, how)


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


def load_gguf(path: Path, mode: str, cfg, hf_cfg: dict, max_positions: int | None):
    """A ``LlamaModel`` (on the CPU, fp32 floats) whose projections hold the GGUF file's blocks
    (``mode`` gguf) or their conversion to int8 / int4, built one tensor at a time."""
    from specd.model.gguf import PERMUTED_QK, _dequantize, check_tensors, open_gguf
    from specd.model.llama import LlamaModel, Rotary

    reader = open_gguf(path)
    check_tensors(reader, hf_cfg, path)
    tensors = {t.name: t for t in reader.tensors}
    with torch.device("meta"):
        model = LlamaModel(cfg, max_positions=max_positions)
    model.rotary = Rotary(cfg, max_positions or cfg.max_position_embeddings)
    heads = None
    if hf_cfg["model_type"] in PERMUTED_QK:
        heads = {"attn_q": cfg.num_heads, "attn_k": cfg.num_kv_heads}
    with torch.no_grad():
        for i, blk in enumerate(model.layers):
            _layer(blk, i, tensors, mode, path, heads)
        model.norm.weight = nn.Parameter(torch.from_numpy(_dequantize(tensors["output_norm.weight"], path)))
        model.norm.weight.requires_grad_(False)
        _embeddings(model, tensors, mode, path)
    left = [n for n, p in list(model.named_parameters()) + list(model.named_buffers()) if p.is_meta]
    if left:
        raise LoadError(f"{path}: no weights for {left[0]} after loading the GGUF file")
    return model
