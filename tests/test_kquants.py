"""GGUF K-quants (Q4_K, Q5_K, Q6_K, and Q8_0 parts beside them) kept as the file's numbers
(``KQuantLinear``, the CPU kernel's kq layout, cpu_kernel/gemm_kq.h): bit-exact dequantization
against the ``gguf`` package, the kernel against its int8-activation reference on every instruction
set, a tiny Llama file loaded without requantization (logits, fused layers, lossless speculation)
and the formats refused by name."""

from __future__ import annotations

from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch

from specd.config import CacheConfig, EngineConfig, SpecConfig
from specd.engine.engine import Engine
from specd.engine.kv_cache import KVCache
from specd.engine.sequence import SpecParams
from specd.model.attention import build_metadata, get_backend
from specd.model.cpu import cpu_info
from specd.model.fused import fused_layers
from specd.model.gguf import open_gguf
from specd.model.loader import LoadError, load_model
from specd.model.qkernel import kernel, x8_isa
from specd.model.quant import KQuantLinear, QuantLinear
from specd.model.quant_load import kq_fields, repack
from specd.sampling.params import SamplingParams
from tests.conftest import private_cache
from tests.test_gguf import hf_model, k_quant_bytes, write_gguf
from tests.test_quant import _q8_reference

Q = gguf.GGMLQuantizationType
KINDS = ("Q4_K", "Q5_K", "Q6_K")
CPU = torch.device("cpu")
needs_kernel = pytest.mark.skipif(kernel() is None, reason="no CPU kernel here")
AVX512_VNNI = {"avx512f", "avx512bw", "avx512dq", "avx512_vnni"}


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    private_cache(tmp_path, monkeypatch)


def _half(v: float) -> np.ndarray:
    return np.frombuffer(np.float16(v).tobytes(), np.uint8)


def q8_blocks(N: int, K: int, rng, scale: float = 4e-5, edges: bool = False) -> np.ndarray:
    """Random Q8_0 blocks [N, K/32 * 34] (every code byte random, -128 included) with scales d of
    about 40 x ``scale`` (weights as large as the K-quants' of ``kq_blocks``); ``edges``: some blocks
    with d zero, negative, subnormal or the largest half, and codes all -128 or all 127."""
    nb = N * K // 32
    raw = rng.integers(0, 256, (nb, 34), dtype=np.uint8)
    raw[:, 0:2] = (rng.uniform(0.5, 1.5, nb) * 40 * scale).astype(np.float16).view(np.uint8).reshape(nb, 2)
    if edges:
        for i, v in enumerate((0.0, -scale, 6e-8, 65504.0, -65504.0)):
            raw[i::7, 0:2] = _half(v)
        raw[5::7, 2:] = 0x80
        raw[6::7, 2:] = 0x7F
    return raw.reshape(N, -1)


def kq_blocks(kind: str, N: int, K: int, rng, scale: float = 4e-5, edges: bool = False) -> np.ndarray:
    """Random ``kind`` blocks [N, K/256 * type size] (every code and 6-bit / int8 sub-scale byte
    random) with super-block scales d (and dmin) of about ``scale``; ``edges``: some super-blocks
    with d or dmin zero, negative, subnormal or the largest half, and sub-scales all at their extremes.
    (Q8_0: ``q8_blocks``.)"""
    if kind == "Q8_0":
        return q8_blocks(N, K, rng, scale, edges)
    size = gguf.GGML_QUANT_SIZES[getattr(Q, kind)][1]
    nb = N * K // 256
    raw = rng.integers(0, 256, (nb, size), dtype=np.uint8)
    at = [size - 2] if kind == "Q6_K" else [0, 2]
    for a in at:
        raw[:, a : a + 2] = (rng.uniform(0.5, 1.5, nb) * scale).astype(np.float16).view(np.uint8).reshape(nb, 2)
    if edges:
        for i, v in enumerate((0.0, -scale, 6e-8, 65504.0, -65504.0)):
            raw[i::7, at[i % len(at)] : at[i % len(at)] + 2] = _half(v)
        if kind == "Q6_K":
            raw[5::7, 192:208] = np.frombuffer(np.array([-128, 127] * 8, np.int8).tobytes(), np.uint8)
        else:
            raw[5::7, 4:16] = 0xFF  # every 6-bit scale and min 63
            raw[6::7, 4:16] = 0
    return raw.reshape(N, -1)


def _tensor(kind: str, raw: np.ndarray, name: str = "w"):
    block, size = gguf.GGML_QUANT_SIZES[getattr(Q, kind)]
    N, K = raw.shape[0], raw.shape[1] // size * block
    return SimpleNamespace(name=name, tensor_type=getattr(Q, kind), shape=np.array([K, N]), data=raw)


def _reference(kind: str, raw: np.ndarray) -> torch.Tensor:
    """The ``gguf`` package's dequantization [N, K] (fp32)."""
    w = gguf.quants.dequantize(raw, getattr(Q, kind))
    return torch.from_numpy(np.ascontiguousarray(w).reshape(raw.shape[0], -1))


def _op(parts: list, seed: int, K: int = 512, bias: bool = True) -> tuple[KQuantLinear, torch.Tensor]:
    """A fused K-quant projection of ``parts`` ((kind, rows) ...) and its reference weights."""
    rng = np.random.default_rng(seed)
    raws = [(k, kq_blocks(k, n, K, rng)) for k, n in parts]
    op = KQuantLinear.from_fields([(k, kq_fields(_tensor(k, r))) for k, r in raws])
    if bias:
        op.bias = torch.from_numpy(rng.standard_normal(op.out_features).astype(np.float32))
    return op, torch.cat([_reference(k, r) for k, r in raws])


# dequantization ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS + ("Q8_0",))
def test_blocks_dequantize_bit_exactly_like_the_gguf_package(kind):
    """Random blocks with edge scales (zero, negative, subnormal and the largest halves; sub-scales
    all 0 or all 63, Q6_K's -128 / 127; Q8_0's codes all -128 or 127): the file's fields, the kq
    tiles unpacked again and a lookup of rows all give the gguf package's fp32 values bit for bit."""
    rng = np.random.default_rng((KINDS + ("Q8_0",)).index(kind))
    raw = kq_blocks(kind, 37, 768, rng, edges=True)  # 37 rows: a padded last tile
    ref = _reference(kind, raw)
    assert torch.isfinite(ref).all() and (ref == 0).any() and ref.abs().max() > 1e6
    f = kq_fields(_tensor(kind, raw))
    assert torch.equal(f.dequantize().view(torch.int32), ref.view(torch.int32))
    op = KQuantLinear.from_fields([(kind, f)])
    assert op.parts == ((kind, 37),) and op.out_features == 37 and op.in_features == 768
    assert torch.equal(op.dequantize().view(torch.int32), ref.view(torch.int32))
    ids = torch.tensor([36, 0, 9, 9, 17, 35])
    assert torch.equal(op.rows(ids).view(torch.int32), ref[ids].view(torch.int32))  # the kernel's, where it runs
    assert torch.equal(op._rows_unpacked(ids).view(torch.int32), ref[ids].view(torch.int32))
    assert torch.equal(op.select(ids).dequantize().view(torch.int32), ref[ids].view(torch.int32))
    block, size = gguf.GGML_QUANT_SIZES[getattr(Q, kind)]
    # the kept bytes per row and 256 weights: the file's, plus dmin unpacked with d (4 bytes; Q6_K 2;
    # Q8_0 none: its 8 blocks' bytes exactly)
    extra = {"Q6_K": 2, "Q8_0": 0}.get(kind, 4)
    assert op.qweight.numel() == 40 * 3 * (size * 256 // block + extra)


# the kernel ------------------------------------------------------------------------------------------
MIXED = [("Q4_K", 24), ("Q6_K", 40), ("Q5_K", 3)]  # a pair of tiles straddling two kinds, a partial last tile
# an 8-expert Q4_K_M model's q/k/v (llama.cpp: k and v Q8_0), and Q8_0 tiles paired with three K-quant kinds
MIXED_Q8 = [("Q4_K", 24), ("Q8_0", 16), ("Q8_0", 16)]
MIXED_Q8_ALL = [("Q6_K", 8), ("Q8_0", 24), ("Q5_K", 8), ("Q8_0", 8), ("Q4_K", 16), ("Q8_0", 5)]


@needs_kernel
@pytest.mark.parametrize("parts", [[("Q4_K", 64)], [("Q5_K", 67)], [("Q6_K", 50)], MIXED, MIXED_Q8, MIXED_Q8_ALL],
                         ids=["Q4_K", "Q5_K", "Q6_K", "mixed", "q4_k+q8_0", "mixed+q8_0"])  # fmt: skip
def test_kernel_equals_its_int8_activation_reference(parts):
    """The result is the dequantized weights times the int8-quantized activations (fp64 reference,
    fp32 accumulation tolerance as the other int8-activation kernels), plus the bias and the
    residual, and within 2% of the fp32-activation product; any row count."""
    op, w = _op(parts, 3)
    g = torch.Generator().manual_seed(4)
    for M in (1, 2, 5, 8, 9, 13):
        x, res = torch.randn(M, 512, generator=g), torch.randn(M, op.out_features, generator=g)
        y = op(x, add=res).double()
        xq = _q8_reference(x, 512)
        ref = xq @ w.double().t() + op.bias.double() + res.double()
        bound = xq.abs() @ w.abs().double().t() + op.bias.double().abs() + res.double().abs()
        assert ((y - ref).abs() <= 4e-6 * bound).all(), float(((y - ref).abs() / bound).max())
        exact = x.double() @ w.double().t() + op.bias.double() + res.double()
        assert ((y - exact).abs() <= 0.02 * (x.double().abs() @ w.abs().double().t()) + 1e-6).all()


@needs_kernel
@pytest.mark.parametrize("parts", [MIXED, MIXED_Q8_ALL], ids=["mixed", "mixed+q8_0"])
def test_a_row_does_not_depend_on_the_other_rows(parts):
    op, _ = _op(parts, 5)
    x = torch.randn(13, 512, generator=torch.Generator().manual_seed(6))
    alone = torch.cat([op(x[i : i + 1]) for i in range(13)])
    for M in range(1, 14):
        assert torch.equal(op(x[:M]), alone[:M]), M


@needs_kernel
@pytest.mark.parametrize("parts", [MIXED, MIXED_Q8_ALL], ids=["mixed", "mixed+q8_0"])
def test_the_kernels_row_lookup_gives_the_unpacked_tiles_bits(parts):
    """An embedding's lookup (``rows``: ``specd_kq_rows``, one row at a time from the kq tiles) gives the
    bits of the tiles unpacked and dequantized whole, for every row of a projection mixing the kinds
    (parts' boundaries, the padded last tile), in any order, repeated, and as many rows as a prompt's;
    an id past the rows is an IndexError, not a read beyond the tiles."""
    op, ref = _op(parts, 11)
    assert torch.equal(op.dequantize().view(torch.int32), ref.view(torch.int32))
    n = op.out_features
    every = torch.randperm(n, generator=torch.Generator().manual_seed(12))
    none = torch.tensor([], dtype=torch.int64)
    for ids in (every, torch.tensor([n - 1, 0, 0, n - 1]), every.repeat(3)[: 2 * n + 5], none):
        got = op.rows(ids)
        assert got.shape == (ids.numel(), op.in_features)
        assert torch.equal(got.view(torch.int32), op._rows_unpacked(ids).view(torch.int32))
        assert torch.equal(got.view(torch.int32), ref[ids].view(torch.int32))
    for bad in ([n], [-1], [0, n + 7]):
        with pytest.raises(IndexError):
            op.rows(torch.tensor(bad))


@needs_kernel
def test_q8_0_tiles_give_the_bits_of_the_x8_layout():
    """A Q8_0 part of a fused K-quant projection computes what the same blocks do as a ``QuantLinear``
    in the x8 layout (gemm_x8's int8 steps, the same fp32 operations per block): bit for bit, any
    row count, with the bias and the residual added."""
    rng = np.random.default_rng(9)
    q4, q8 = kq_blocks("Q4_K", 16, 768, rng), q8_blocks(21, 768, rng)
    op = KQuantLinear.from_fields([("Q4_K", kq_fields(_tensor("Q4_K", q4))), ("Q8_0", kq_fields(_tensor("Q8_0", q8)))])
    x8 = repack(_tensor("Q8_0", q8)).compact()
    x8.act_int8 = True
    assert x8.layout == "x8" and x8.fmt == "int8"
    g = torch.Generator().manual_seed(10)
    x, res = torch.randn(13, 768, generator=g) * 3, torch.randn(13, 37, generator=g)
    bias = torch.randn(37, generator=g)
    op.bias, x8.bias = bias, bias[16:].clone()
    for M in (1, 2, 5, 8, 9, 13):
        y = op(x[:M], add=res[:M])
        assert torch.equal(y[:, 16:], x8(x[:M], add=res[:M, 16:].contiguous())), M


@pytest.mark.skipif(kernel() is None or not AVX512_VNNI <= cpu_info()["flags"], reason="no AVX512-VNNI here")
def test_avx512_vnni_and_amx_give_the_avx2_bits():
    """Two tiles per vector (vpdpbusd; one row: one tile's two vectors per register, kq_tile1) against
    one (maddubs): the same bits for every row count,
    tile pairs of two kinds (Q8_0 beside a K-quant) included; under AMX the AVX512-VNNI tiles run
    these blocks."""
    # (tile pairs Q5_K | Q8_0 and Q4_K | Q8_0 split, Q8_0 | Q8_0 together, a partial Q8_0 tile alone)
    op, _ = _op([("Q4_K", 24), ("Q6_K", 40), ("Q5_K", 8), ("Q8_0", 24), ("Q6_K", 16), ("Q4_K", 24), ("Q8_0", 9)], 7)
    g = torch.Generator().manual_seed(8)
    x, res = torch.randn(40, 512, generator=g) * 3, torch.randn(40, op.out_features, generator=g)
    try:
        for M in (1, 2, 3, 7, 8, 9, 16, 17, 33, 40):
            assert x8_isa(0) == "avx2"
            slow = op(x[:M], add=res[:M])
            x8_isa(1)
            assert torch.equal(op(x[:M], add=res[:M]), slow), M
            x8_isa(2)
            assert torch.equal(op(x[:M], add=res[:M]), slow), M
    finally:
        x8_isa(-1)


@needs_kernel
@pytest.mark.parametrize(
    "parts",
    [[("Q4_K", 45)], [("Q5_K", 45)], [("Q6_K", 45)], [("Q8_0", 45)], MIXED_Q8_ALL[:-1] + [("Q6_K", 21)]],
    ids=["Q4_K", "Q5_K", "Q6_K", "Q8_0", "mixed"],
)
def test_native_repacking_equals_the_torch_repacking(parts, monkeypatch):
    """A load's repacking in the kernel (``specd_pack_kq_gguf``, kq_pack.h) gives the bytes of the
    numpy / torch path (``pack_kq`` of ``kq_fields``), tile table included: random blocks with edge
    scales (every 6-bit scale / min bit pattern, as random bytes give them), a row order on a part
    (llama.cpp's q/k permutation undone), chunks smaller than a part, a last part of rows not a
    multiple of 8 (its padding rows zero); and the gguf package's values."""
    from specd.model import quant_load

    rng = np.random.default_rng(11)
    raws = [(k, kq_blocks(k, n, 768, rng, edges=True)) for k, n in parts]
    tensors = [_tensor(k, r) for k, r in raws]
    perms = [rng.permutation(n) if i % 2 == 0 else None for i, (_, n) in enumerate(parts)]
    monkeypatch.setattr(quant_load, "CHUNK_BYTES", 4096)  # (a few tiles per chunk)
    native = quant_load.kquant(tensors, perms)
    torch_path = quant_load.kquant(tensors, perms, native=False)
    assert native.parts == torch_path.parts == tuple(parts)
    assert torch.equal(native.scale, torch_path.scale)
    assert torch.equal(native.qweight, torch_path.qweight)
    want = torch.cat([_reference(k, r if p is None else r[p]) for (k, r), p in zip(raws, perms)])
    assert torch.equal(native.dequantize().view(torch.int32), want.view(torch.int32))


# a model file ----------------------------------------------------------------------------------------
def _types(layers: int) -> dict:
    """llama.cpp's Q4_K_M mix on a tiny model: q, k, o, gate, up Q4_K; v and down Q6_K in the first
    layer, Q5_K / Q4_K after; embeddings Q6_K, the output Q6_K."""
    t = {"model.embed_tokens.weight": Q.Q6_K, "lm_head.weight": Q.Q6_K}
    for i in range(layers):
        p = f"model.layers.{i}."
        for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj"):
            t[p + n + ".weight"] = Q.Q4_K
        t[p + "self_attn.v_proj.weight"] = Q.Q6_K if i == 0 else Q.Q5_K
        t[p + "mlp.down_proj.weight"] = Q.Q6_K if i == 0 else Q.Q4_K
    return t


def centered_blocks(w: np.ndarray, qtype, rng) -> np.ndarray:
    """Random blocks for a model file (the writer's stand-in for quantizing ``w``, whose values it
    ignores): weights centred on zero with a spread of about 1 / sqrt(K), as ``hf_model``'s, so the
    random model's logits stay a few units (Q4_K / Q5_K: each min the middle code times the scale;
    IQ4_XS: random bytes, refused before use)."""
    N, K = w.shape
    if qtype == Q.IQ4_XS:
        return rng.integers(0, 256, (N, K // 256 * 136), dtype=np.uint8)
    kind = qtype.name
    if kind not in KINDS:
        return k_quant_bytes(w, qtype, rng)
    raw = kq_blocks(kind, N, K, rng).reshape(N * K // 256, -1)
    if kind == "Q6_K":
        raw[:, 208:210] = _half(0.8 / (18 * 64 * K**0.5))
        return raw.reshape(N, -1)
    top = (15, 31)[KINDS.index(kind)]
    sc = rng.integers(1, 63 * 2 // (top + 1), (raw.shape[0], 8))
    m = np.round(sc * top / 2).astype(np.uint8)
    sc = sc.astype(np.uint8)  # (12-byte packing of 6-bit sc, m: llama.cpp's get_scale_min_k4 inverted)
    packed = np.zeros((raw.shape[0], 12), np.uint8)
    packed[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    packed[:, 4:8] = (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
    raw[:, 4:16] = packed
    d = 1.0 / (K**0.5 * sc.mean() * top * 0.29)
    raw[:, 0:2] = _half(d)
    raw[:, 2:4] = _half(d)
    return raw.reshape(N, -1)


def kquant_model(tmp_path, layers: int = 2, types: dict | None = None):
    import tests.test_gguf as tg  # (its writer's stand-in for K-quants, swapped for ours while writing)

    model = hf_model("llama", layers)
    weights = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    cfg = dict(model.config.to_dict(), rope_theta=10000.0)
    real, tg.k_quant_bytes = tg.k_quant_bytes, centered_blocks
    try:
        return write_gguf(tmp_path / "kq.gguf", "llama", cfg, weights, Q.F32, types=types or _types(layers))
    finally:
        tg.k_quant_bytes = real


@pytest.fixture(scope="module")
def kq_file(tmp_path_factory):
    return kquant_model(tmp_path_factory.mktemp("kq"))


def _eight_expert_types(layers: int) -> dict:
    """``_types`` with k and v in Q8_0: llama.cpp's Q4_K_M mix for a model of exactly 8 experts
    (llama-quant.cpp: "for the 8-expert model, bumping this to Q8_0"; Mixtral-8x7B's attention)."""
    t = _types(layers)
    for i in range(layers):
        for n in ("k_proj", "v_proj"):
            t[f"model.layers.{i}.self_attn.{n}.weight"] = Q.Q8_0
    return t


@pytest.fixture(scope="module")
def kq8_file(tmp_path_factory):
    return kquant_model(tmp_path_factory.mktemp("kq8"), types=_eight_expert_types(2))


class _Q8Reference(QuantLinear):
    """A float weight whose products take the kernel's int8 activations computed in torch (fp64):
    the reference of a model of int8-activation projections."""

    def __init__(self, w: torch.Tensor):
        torch.nn.Module.__init__(self)
        self.w, self.in_features, self.out_features = w, w.shape[1], w.shape[0]
        self.register_buffer("bias", None)

    def dequantize(self) -> torch.Tensor:
        return self.w

    def _matmul(self, x, add):
        y = (_q8_reference(x.float(), self.in_features) @ self.w.double().t()).float()
        return y if add is None else y + add


def _q8_model(lm):
    """``lm`` (a float model) with every projection and the head through ``_Q8Reference``."""
    for blk in lm.model.layers:
        for parent, name in ((blk.attn, "qkv"), (blk.attn, "o"), (blk.mlp, "gate_up"), (blk.mlp, "down")):
            setattr(parent, name, _Q8Reference(getattr(parent, name).weight))
    lm.model.lm_head = _Q8Reference(lm.model.lm_head.weight)
    lm.model._flat = None
    return lm


def _logits(lm, ids: list, fused: bool, monkeypatch) -> torch.Tensor:
    """Logits of every token of ``ids`` prefilled in chunks of 5 then one token at a time through
    the paged cache and the CPU kernel's attention (fused layers or op by op)."""
    monkeypatch.setenv("SPECD_FUSED", "1" if fused else "0")
    c, m, be = lm.config, lm.model, get_backend("auto", CPU)
    cache = KVCache(c.num_layers, c.num_kv_heads, c.head_dim, 64, 4, torch.float32, CPU)
    seq = cache.new_seq()
    seq.reserve(len(ids))
    out, pos = [], 0
    for n in [5] + [1] * (len(ids) - 5):
        meta = build_metadata([n], [pos], [seq.blocks], seq.slots(pos, pos + n), 4, CPU)
        h = m(torch.tensor(ids[pos : pos + n]), torch.arange(pos, pos + n), cache.kv, meta, be)
        if fused:
            assert fused_layers(m, be, cache.kv, h) is not None
        out.append(m.compute_logits(h))
        pos += n
    return torch.cat(out)


@needs_kernel
@pytest.mark.parametrize("mode", ["gguf", "auto"])
@pytest.mark.parametrize("file", ["kq_file", "kq8_file"], ids=["q4_k_m", "q4_k_m-8-experts"])
def test_a_q4_k_m_like_file_keeps_its_blocks_and_its_logits(file, mode, request, monkeypatch):
    """Every projection holds the file's own kinds and numbers (the fields unpacked from its tiles
    are the file's: its bytes, one for one; with an 8-expert model's Q8_0 k and v, one q/k/v of
    Q4_K and Q8_0 tiles); the logits equal a float model of the dequantized weights within the int8
    activations' noise, fused layers and op by op alike."""
    path = request.getfixturevalue(file)
    lm = load_model(path, "cpu", "float32", quantization=mode)
    ref = load_model(path, "cpu", "float32", quantization="none")  # the dequantized weights in fp32
    tensors = {t.name: t for t in open_gguf(path).tensors}
    for i, (blk, fblk) in enumerate(zip(lm.model.layers, ref.model.layers)):
        qkv, down = blk.attn.qkv, blk.mlp.down
        kinds = [tensors[f"blk.{i}.attn_{n}.weight"].tensor_type.name for n in "qkv"]
        kv = ["Q8_0", "Q8_0"] if file == "kq8_file" else ["Q4_K", "Q6_K" if i == 0 else "Q5_K"]
        assert kinds == ["Q4_K", *kv]
        assert isinstance(qkv, KQuantLinear) and [k for k, _ in qkv.parts] == kinds
        (_, got), want = qkv.fields()[2], kq_fields(tensors[f"blk.{i}.attn_v.weight"])  # (v: rows not permuted)
        assert all(torch.equal(getattr(got, a), getattr(want, a)) for a in ("u", "s1", "s2", "d", "dmin"))
        assert [k for k, _ in blk.mlp.gate_up.parts] == ["Q4_K", "Q4_K"] and blk.attn.o.parts[0][0] == "Q4_K"
        assert down.parts == ((tensors[f"blk.{i}.ffn_down.weight"].tensor_type.name, down.out_features),)
        (_, got), want = down.fields()[0], kq_fields(tensors[f"blk.{i}.ffn_down.weight"])
        for a in ("u", "s1", "s2", "d", "dmin"):
            assert torch.equal(getattr(got, a), getattr(want, a)), a
        for a, b in ((qkv, fblk.attn.qkv), (blk.attn.o, fblk.attn.o), (blk.mlp.gate_up, fblk.mlp.gate_up)):
            assert torch.equal(a.dequantize(), b.weight)  # (q and k: rows un-permuted as the float path's)
    V = lm.config.vocab_size
    assert isinstance(lm.model.embed, KQuantLinear) and lm.model.lm_head.parts == (("Q6_K", V),)
    ids = torch.randint(0, V, (12,), generator=torch.Generator().manual_seed(1)).tolist()
    fp32 = _logits(ref, ids, False, monkeypatch)
    want = _logits(_q8_model(ref), ids, False, monkeypatch)
    noise = (want - fp32).abs().mean()  # the int8 activations' own difference
    assert fp32.abs().max() > 1.0 and noise > 0
    for fused in (False, True):
        got = _logits(lm, ids, fused, monkeypatch)
        assert (got - want).abs().mean() <= 0.1 * noise, (fused, float((got - want).abs().mean()), float(noise))
        assert (got.argmax(-1) == want.argmax(-1)).all()


@needs_kernel
def test_greedy_speculation_is_lossless_on_k_quants(kq_file):
    """Target: the file's K-quants; draft: the same file requantized to int4 (its own numbers, so
    some drafts are rejected). Chain and tree, batch 1 and 3: speculative == plain."""
    t = load_model(kq_file, "cpu", "float32", quantization="gguf")
    d = load_model(kq_file, "cpu", "float32", quantization="int4")
    assert isinstance(t.model.layers[0].mlp.down, KQuantLinear) and d.model.layers[0].mlp.down.fmt == "int4"
    cfg = EngineConfig(target=str(kq_file), draft=str(kq_file), dtype="float32", quantization="gguf",
                       act_quant="int8", cache=CacheConfig(num_blocks=128),
                       spec=SpecConfig(adaptive=False))  # fmt: skip
    eng = Engine(cfg, target=t, draft=d)
    prompts = [[1, 5, 9, 200, 17], [3, 4], [300, 12, 44, 45]]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    for batch in (prompts[:1], prompts):
        plain = [s.output_ids for s in eng.generate(batch, params, SpecParams("off"))]
        for mode in ("chain", "tree"):
            seqs = eng.generate(batch, params, SpecParams(mode))
            assert [s.output_ids for s in seqs] == plain, (mode, len(batch))
            assert sum(s.stats.accepted_tokens for s in seqs) > 0


def test_int8_and_int4_still_convert_k_quants(kq_file):
    for q in ("int8", "int4"):
        lm = load_model(kq_file, "cpu", "float32", quantization=q)
        ops = [lm.model.layers[0].attn.qkv, lm.model.layers[1].mlp.down]
        assert all(type(o) is QuantLinear and o.fmt == q for o in ops)


def test_formats_it_cannot_keep_are_refused_by_name(tmp_path):
    """IQ formats (any --quantization), K-quants below Q4_K under gguf, and a fused projection of
    two block families the kq layout cannot hold together (a K-quant with Q4_0; with Q8_0 it keeps
    them, see test_a_q4_k_m_like_file_keeps_its_blocks_and_its_logits) under gguf: one-line errors
    naming the tensor and its format."""
    layer0 = "model.layers.0."
    iq = dict(_types(1), **{layer0 + "mlp.up_proj.weight": Q.IQ4_XS})
    with pytest.raises(NotImplementedError):
        gguf.quants.quantize(np.zeros((8, 256), np.float32), Q.IQ4_XS)  # (so the writer's random blocks)
    path = kquant_model(tmp_path, 1, iq)
    for mode in ("auto", "gguf", "none"):
        with pytest.raises(LoadError, match=r"unsupported tensor type IQ4_XS for blk\.0\.ffn_up\.weight") as e:
            load_model(path, "cpu", "float32", quantization=mode)
        assert "\n" not in str(e.value)
    q3 = tmp_path / "q3"
    q3.mkdir()
    path = kquant_model(q3, 1, dict(_types(1), **{layer0 + "mlp.down_proj.weight": Q.Q3_K}))
    with pytest.raises(
        LoadError, match=r"keeps Q8_0/Q4_0/Q4_1/Q4_K/Q5_K/Q6_K blocks, but blk\.0\.ffn_down\.weight is Q3_K"
    ):
        load_model(path, "cpu", "float32", quantization="gguf")
    assert load_model(path, "cpu", "float32", quantization="auto").model.layers[0].mlp.down.fmt == "int4"
    mix = tmp_path / "mix"
    mix.mkdir()
    path = kquant_model(mix, 1, dict(_types(1), **{layer0 + "self_attn.v_proj.weight": Q.Q4_0}))
    with pytest.raises(LoadError, match=r"cannot keep blk\.0\.attn_q\.weight \(Q4_K\), .* \(Q4_0\) as one fused"):
        load_model(path, "cpu", "float32", quantization="gguf")
    assert load_model(path, "cpu", "float32", quantization="auto").model.layers[0].attn.qkv.fmt == "int4"
