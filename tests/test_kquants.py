"""GGUF K-quants (Q4_K, Q5_K, Q6_K) kept as the file's numbers (``KQuantLinear``, the CPU kernel's
kq layout, cpu_kernel/gemm_kq.h): bit-exact dequantization against the ``gguf`` package, the kernel
against its int8-activation reference on every instruction set, a tiny Llama file loaded without
requantization (logits, fused layers, lossless speculation) and the formats refused by name."""

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
from specd.model.quant_load import kq_fields
from specd.sampling.params import SamplingParams
from tests.test_gguf import hf_model, k_quant_bytes, write_gguf
from tests.test_quant import _q8_reference

Q = gguf.GGMLQuantizationType
KINDS = ("Q4_K", "Q5_K", "Q6_K")
CPU = torch.device("cpu")
needs_kernel = pytest.mark.skipif(kernel() is None, reason="no CPU kernel here")
AVX512_VNNI = {"avx512f", "avx512bw", "avx512dq", "avx512_vnni"}


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECD_CACHE_DIR", str(tmp_path / "cache"))


def _half(v: float) -> np.ndarray:
    return np.frombuffer(np.float16(v).tobytes(), np.uint8)


def kq_blocks(kind: str, N: int, K: int, rng, scale: float = 4e-5, edges: bool = False) -> np.ndarray:
    """Random ``kind`` blocks [N, K/256 * type size] (every code and 6-bit / int8 sub-scale byte
    random) with super-block scales d (and dmin) of about ``scale``; ``edges``: some super-blocks
    with d or dmin zero, negative, subnormal or the largest half, and sub-scales all at their extremes."""
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
    N, K = raw.shape[0], raw.shape[1] // gguf.GGML_QUANT_SIZES[getattr(Q, kind)][1] * 256
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
@pytest.mark.parametrize("kind", KINDS)
def test_blocks_dequantize_bit_exactly_like_the_gguf_package(kind):
    """Random blocks with edge scales (zero, negative, subnormal and the largest halves; sub-scales
    all 0 or all 63, Q6_K's -128 / 127): the file's fields, the kq tiles unpacked again and a lookup
    of rows all give the gguf package's fp32 values bit for bit."""
    rng = np.random.default_rng(KINDS.index(kind))
    raw = kq_blocks(kind, 37, 768, rng, edges=True)  # 37 rows: a padded last tile
    ref = _reference(kind, raw)
    assert torch.isfinite(ref).all() and (ref == 0).any() and ref.abs().max() > 1e6
    f = kq_fields(_tensor(kind, raw))
    assert torch.equal(f.dequantize().view(torch.int32), ref.view(torch.int32))
    op = KQuantLinear.from_fields([(kind, f)])
    assert op.parts == ((kind, 37),) and op.out_features == 37 and op.in_features == 768
    assert torch.equal(op.dequantize().view(torch.int32), ref.view(torch.int32))
    ids = torch.tensor([36, 0, 9, 9, 17, 35])
    assert torch.equal(op.rows(ids).view(torch.int32), ref[ids].view(torch.int32))
    assert torch.equal(op.select(ids).dequantize().view(torch.int32), ref[ids].view(torch.int32))
    size = gguf.GGML_QUANT_SIZES[getattr(Q, kind)][1]
    # the kept bytes per row and 256 weights: the file's, plus dmin unpacked with d (4 bytes; Q6_K 2)
    assert op.qweight.numel() == 40 * 3 * (size + (2 if kind == "Q6_K" else 4))


# the kernel ------------------------------------------------------------------------------------------
MIXED = [("Q4_K", 24), ("Q6_K", 40), ("Q5_K", 3)]  # a pair of tiles straddling two kinds, a partial last tile


@needs_kernel
@pytest.mark.parametrize("parts", [[("Q4_K", 64)], [("Q5_K", 67)], [("Q6_K", 50)], MIXED],
                         ids=["Q4_K", "Q5_K", "Q6_K", "mixed"])  # fmt: skip
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
def test_a_row_does_not_depend_on_the_other_rows():
    op, _ = _op(MIXED, 5)
    x = torch.randn(13, 512, generator=torch.Generator().manual_seed(6))
    alone = torch.cat([op(x[i : i + 1]) for i in range(13)])
    for M in range(1, 14):
        assert torch.equal(op(x[:M]), alone[:M]), M


@pytest.mark.skipif(kernel() is None or not AVX512_VNNI <= cpu_info()["flags"], reason="no AVX512-VNNI here")
def test_avx512_vnni_and_amx_give_the_avx2_bits():
    """Two tiles per vector (vpdpbusd) against one (maddubs): the same bits for every row count,
    a tile pair of two kinds included; under AMX the AVX512-VNNI tiles run these blocks."""
    op, _ = _op([("Q4_K", 24), ("Q6_K", 40), ("Q5_K", 8), ("Q6_K", 16), ("Q4_K", 17)], 7)
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
def test_a_q4_k_m_like_file_keeps_its_blocks_and_its_logits(kq_file, mode, monkeypatch):
    """Every projection holds the file's own kinds and numbers (the fields unpacked from its tiles
    are the file's: its bytes, one for one); the logits equal a float model of the dequantized
    weights within the int8 activations' noise, fused layers and op by op alike."""
    lm = load_model(kq_file, "cpu", "float32", quantization=mode)
    ref = load_model(kq_file, "cpu", "float32", quantization="none")  # the dequantized weights in fp32
    tensors = {t.name: t for t in open_gguf(kq_file).tensors}
    for i, (blk, fblk) in enumerate(zip(lm.model.layers, ref.model.layers)):
        qkv, down = blk.attn.qkv, blk.mlp.down
        v = "Q6_K" if i == 0 else "Q5_K"
        assert isinstance(qkv, KQuantLinear) and [k for k, _ in qkv.parts] == ["Q4_K", "Q4_K", v]
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
    two block families under gguf: one-line errors naming the tensor and its format."""
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
    path = kquant_model(mix, 1, dict(_types(1), **{layer0 + "self_attn.v_proj.weight": Q.Q8_0}))
    with pytest.raises(LoadError, match=r"cannot keep blk\.0\.attn_q\.weight \(Q4_K\), .* \(Q8_0\) as one fused"):
        load_model(path, "cpu", "float32", quantization="gguf")
    assert load_model(path, "cpu", "float32", quantization="auto").model.layers[0].attn.qkv.fmt == "int8"
