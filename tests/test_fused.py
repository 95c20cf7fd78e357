"""The fused CPU layer (``specd.model.fused``: one C call per decoder layer of a quantized model):
equal to the op-by-op forward on prefill, decode, draft trees and mixed batches (logits, the new
K/V written to the cache, and the features a feature head captures), taken whenever it applies,
and batch-invariant like the op-by-op path (a row's bits do not depend on the other rows)."""

from __future__ import annotations

import os
import random
import shutil

import pytest
import torch

from specd.engine.kv_cache import KVCache
from specd.model.attention import build_metadata, get_backend
from specd.model.cpu import cpu_info
from specd.model.fused import fused_layers
from specd.model.loader import load_model
from specd.model.qkernel import x8_isa
from specd.model.quant import set_act_int8
from tests.conftest import TARGET
from tests.test_cpu_attention import _tree_mask

CPU = torch.device("cpu")
PROMPTS = [[1, 403, 407, 261, 378, 365, 167], [1, 282, 395], [1, 263, 320, 326, 403, 407, 261, 378, 365, 167, 282]]


@pytest.fixture(scope="module", params=["int4", "int8"])
def lm(request):
    return load_model(TARGET, "cpu", "float32", quantization=request.param)


def _step(lm, fused: bool, monkeypatch, capture=None, prompts=PROMPTS, kv=torch.float32):
    """Prefill three prompts, then one mixed step (a decode row, a causal chunk of 3, a 6-node tree)
    over a KV cache of ``kv``: (logits of the step, the cache, the captured features)."""
    monkeypatch.setenv("SPECD_FUSED", "1" if fused else "0")
    c, m, be = lm.config, lm.model, get_backend("auto", CPU)
    cache = KVCache(c.num_layers, c.num_kv_heads, c.head_dim, 64, 4, kv, CPU)
    seqs = [cache.new_seq() for _ in prompts]
    for s, p in zip(seqs, prompts):
        s.reserve(len(p) + 8)
    meta = build_metadata([len(p) for p in prompts], [0, 0, 0], [s.blocks for s in seqs],
                          sum((s.slots(0, len(p)) for s, p in zip(seqs, prompts)), []), 4, CPU)  # fmt: skip
    ids = torch.tensor(sum(prompts, []))
    pos = torch.cat([torch.arange(len(p)) for p in prompts])
    m(ids, pos, cache.kv, meta, be)
    tree = _tree_mask(6, random.Random(2))
    qlens, masks = [1, 3, 6], [None, None, tree]
    ctx = [len(p) for p in prompts]
    slots = sum((s.slots(n, n + q) for s, n, q in zip(seqs, ctx, qlens)), [])
    meta = build_metadata(qlens, ctx, [s.blocks for s in seqs], slots, 4, CPU, tree_masks=masks)
    ids = torch.tensor([5, 17, 99, 254, 7, 8, 9, 10, 11, 12])
    pos = torch.cat([torch.tensor([ctx[0]]), torch.arange(ctx[1], ctx[1] + 3), ctx[2] + tree.sum(1) - 1])
    caps = None if capture is None else dict.fromkeys(capture)
    h = m(ids, pos, cache.kv, meta, be) if caps is None else m(ids, pos, cache.kv, meta, be, capture=caps)
    return m.compute_logits(h), cache.kv.clone(), caps


@pytest.mark.parametrize("kvd", [torch.float32, torch.float16], ids=["kv32", "kv16"])
def test_the_fused_layers_equal_the_op_by_op_forward(lm, kvd, monkeypatch):
    """fp32 activations: equal within 1e-4 (only the sum orders of RMSNorm and SiLU differ); over an
    fp16 cache within 1e-3 (a last-bit difference before the cache's rounding can move a key or value
    by one fp16 step: the C code rounds as torch's ``.to(float16)`` does, both widen exactly)."""
    layers = (0, lm.config.num_layers // 2, lm.config.num_layers - 1)
    ref, ref_kv, ref_caps = _step(lm, False, monkeypatch, layers, kv=kvd)
    out, kv, caps = _step(lm, True, monkeypatch, layers, kv=kvd)
    assert kv.dtype == kvd
    assert fused_layers(lm.model, get_backend("auto", CPU), kv, torch.zeros(1, 8)) is not None  # (it was taken)
    tol = 1e-4 if kvd == torch.float32 else 1e-3
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    torch.testing.assert_close(kv.float(), ref_kv.float(), rtol=tol, atol=tol)
    for i in layers:
        torch.testing.assert_close(caps[i], ref_caps[i], rtol=tol, atol=tol)
    assert not torch.equal(caps[layers[0]], caps[layers[-1]])  # each layer's own input, not the last x


def test_with_int8_activations_the_fused_layers_stay_within_the_activation_noise(lm, monkeypatch):
    """int8 activations: a last-bit difference before a quantization moves a code, so the two paths
    differ by int8 activations' own noise, not more: the fused output is no further from the
    op-by-op one than int8 activations are from fp32 ones (mean |difference| of the logits)."""
    fp32, _, _ = _step(lm, False, monkeypatch)
    set_act_int8(lm.model, True)
    try:
        ref, _, _ = _step(lm, False, monkeypatch)
        out, _, _ = _step(lm, True, monkeypatch)
    finally:
        set_act_int8(lm.model, False)
    noise = (ref - fp32).abs().mean()
    assert 0 < (out - ref).abs().mean() <= 1.5 * noise
    assert (out.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.8


@pytest.mark.parametrize("act", [False, True], ids=["fp32-act", "int8-act"])
def test_a_fused_row_does_not_depend_on_the_batch(lm, act, monkeypatch):
    """The decode row of the mixed step equals the same decode row stepped alone, bit for bit."""
    set_act_int8(lm.model, act)
    try:
        mixed, _, _ = _step(lm, True, monkeypatch)
        monkeypatch.setenv("SPECD_FUSED", "1")
        c, m, be = lm.config, lm.model, get_backend("auto", CPU)
        cache = KVCache(c.num_layers, c.num_kv_heads, c.head_dim, 32, 4, torch.float32, CPU)
        s = cache.new_seq()
        s.reserve(8)
        p = PROMPTS[0]
        m(
            torch.tensor(p),
            torch.arange(len(p)),
            cache.kv,
            build_metadata([7], [0], [s.blocks], s.slots(0, 7), 4, CPU),
            be,
        )
        meta = build_metadata([1], [7], [s.blocks], s.slots(7, 8), 4, CPU)
        alone = m.compute_logits(m(torch.tensor([5]), torch.tensor([7]), cache.kv, meta, be))
        assert torch.equal(alone[0], mixed[0])
    finally:
        set_act_int8(lm.model, False)


@pytest.mark.parametrize("act", [False, True], ids=["fp32", "a8"])
def test_a_wide_prefill_equals_the_same_prompt_in_narrow_chunks(lm, act, monkeypatch):
    """From 32 rows a layer's row-wise steps (norms, RoPE, SiLU, KV writes, group sums) run on every
    thread: a 45-token prompt in one call and in chunks of 5 (one thread for them) give the same last
    hidden state and the same K/V, bit for bit (fp16 cache: partial blocks of 4 too)."""
    monkeypatch.setenv("SPECD_FUSED", "1")
    set_act_int8(lm.model, act)
    try:
        c, m, be = lm.config, lm.model, get_backend("auto", CPU)
        ids = torch.randint(3, c.vocab_size, (45,), generator=torch.Generator().manual_seed(5))
        out = []
        for chunk in (45, 5):
            cache = KVCache(c.num_layers, c.num_kv_heads, c.head_dim, 16, 4, torch.float16, CPU)
            s = cache.new_seq()
            s.reserve(45)
            for a in range(0, 45, chunk):
                meta = build_metadata([chunk], [a], [s.blocks], s.slots(a, a + chunk), 4, CPU)
                h = m(ids[a : a + chunk], torch.arange(a, a + chunk), cache.kv, meta, be)
            assert fused_layers(m, be, cache.kv, h) is not None
            out.append((h[-1].clone(), cache.kv.clone()))
        assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1])
    finally:
        set_act_int8(lm.model, False)


@pytest.mark.parametrize("kvd", [torch.float32, torch.float16], ids=["kv32", "kv16"])
def test_two_phase_attention_equals_the_one_phase_kernel(lm, kvd, monkeypatch):
    """Decode and verification widths run the paged attention in two phases (scores by key chunk,
    then softmax and weighted sums by row pair, balanced over threads); wide prefills, and every
    call with ``SPECD_ATT2_MAX_BYTES=0``, one task per (sequence, KV head). Bit for bit the same:
    the step's logits and the K/V it wrote."""
    two, two_kv, _ = _step(lm, True, monkeypatch, kv=kvd)
    monkeypatch.setenv("SPECD_ATT2_MAX_BYTES", "0")
    one, one_kv, _ = _step(lm, True, monkeypatch, kv=kvd)
    assert torch.equal(one, two) and torch.equal(one_kv, two_kv)


def test_an_fp16_cache_holds_the_keys_and_values_rounded_as_torch_rounds_them(lm, monkeypatch):
    """Layer 0's keys and values do not depend on the cache's contents: the fp16 cache holds exactly
    the fp32 cache's, rounded to nearest even (``.to(float16)``)."""
    _, kv32, _ = _step(lm, True, monkeypatch)
    _, kv16, _ = _step(lm, True, monkeypatch, kv=torch.float16)
    assert kv32[0].abs().sum() > 0 and torch.equal(kv16[0], kv32[0].to(torch.float16))


@pytest.fixture(scope="module")
def lm64(tmp_path_factory):
    """A small random Llama with SmolLM2's head size (64: the AVX512 weighted sums' case), int4."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=384, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=256)  # fmt: skip
    out = tmp_path_factory.mktemp("lm64")
    LlamaForCausalLM(cfg).save_pretrained(str(out))
    for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json"):
        if (TARGET / f).exists():
            shutil.copy(TARGET / f, out / f)
    return load_model(out, "cpu", "float32", quantization="int4")


@pytest.mark.parametrize("kvd", [torch.float32, torch.float16], ids=["kv32", "kv16"])
def test_every_kernel_instruction_set_gives_the_same_bits(lm64, kvd, monkeypatch):
    """AVX2, AVX512 (16-key scores, 64-wide weighted sums in registers; int8 GEMMs on VNNI) and, where
    the CPU has it, AMX (the step's 10 rows take the int8 tiles): one mixed step over contexts of
    30-70 keys (16-key blocks and an 8-key tail), bit for bit: the logits and the K/V written."""
    rng = random.Random(7)
    prompts = [[rng.randrange(1, 512) for _ in range(n)] for n in (45, 30, 70)]
    set_act_int8(lm64.model, True)
    runs = {}
    try:
        for want in (0, 1, 2):
            isa = x8_isa(want)
            runs[isa] = _step(lm64, True, monkeypatch, prompts=prompts, kv=kvd)[:2]
    finally:
        x8_isa(-1)
        set_act_int8(lm64.model, False)
    flags = cpu_info()["flags"]
    amx = {"amx_tile", "amx_int8"} <= flags and os.environ.get("SPECD_QGEMM_AMX") != "0"
    assert len(runs) == 1 + ({"avx512f", "avx512_vnni"} <= flags) + amx
    ref_logits, ref_kv = runs.pop("avx2")
    assert ref_logits.abs().sum() > 0
    for isa, (logits, kv) in runs.items():
        assert torch.equal(logits, ref_logits) and torch.equal(kv, ref_kv), isa


def test_the_fused_path_steps_aside_where_it_does_not_apply(lm):
    x, kv = torch.zeros(1, lm.config.hidden_size), torch.zeros(2, 2, 4, 4, 2, 8)
    assert fused_layers(lm.model, get_backend("torch", CPU), kv, x) is None  # not the CPU kernel's attention
    assert fused_layers(lm.model, get_backend("auto", CPU), kv, x.bfloat16()) is None
    plain = load_model(TARGET, "cpu", "float32")
    assert fused_layers(plain.model, get_backend("auto", CPU), kv, x) is None  # not quantized


def test_out_of_range_positions_or_slots_are_refused_not_written(lm, monkeypatch):
    """The C layer does no bounds checks: a position past the RoPE table or a slot past the cache is
    refused before it runs (the op-by-op path's indexing raises the same), the cache untouched."""
    monkeypatch.setenv("SPECD_FUSED", "1")
    c, m, be = lm.config, lm.model, get_backend("auto", CPU)
    cache = KVCache(c.num_layers, c.num_kv_heads, c.head_dim, 4, 4, torch.float32, CPU)
    s = cache.new_seq()
    s.reserve(2)
    meta = build_metadata([2], [0], [s.blocks], s.slots(0, 2), 4, CPU)
    before = cache.kv.clone()
    far = m.rotary.cos.shape[0]
    with pytest.raises(IndexError, match="out of"):
        m(torch.tensor([5, 6]), torch.tensor([0, far]), cache.kv, meta, be)
    bad = build_metadata([2], [0], [s.blocks], [0, 4 * 4], 4, CPU)
    with pytest.raises(IndexError, match="slot out of range"):
        m(torch.tensor([5, 6]), torch.tensor([0, 1]), cache.kv, bad, be)
    assert torch.equal(cache.kv, before)
