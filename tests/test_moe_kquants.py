"""Mixtures of experts whose expert tensors are GGUF K-quants (a Qwen3-30B-A3B-Q4_K_M file's 3-D
``ffn_{gate,up,down}_exps`` in Q4_K / Q5_K / Q6_K, mixed with Q8_0): every expert keeps the file's
own blocks (``KQuantLinear``, no requantization), the logits on prefill, decode and draft-tree rows
equal a model of the dequantized weights (the ``gguf`` package's numbers) with int8 activations
within the tolerance of tests/test_kquants.py, with the same experts chosen, and greedy speculation
is lossless. An 8-expert Q4_K_M file's Q4_K q with Q8_0 k / v (what llama.cpp's quantizer writes for
Mixtral-8x7B) keeps them as one fused projection of Q4_K and Q8_0 tiles.

The files are written here with random K-quant blocks (tests/test_kquants.py's ``centered_blocks``:
every byte pattern is a valid block; llama.cpp's quantizer is not needed); hidden and expert widths
are 256, the K-quant super-block, and so is the attention's (4 heads of 64).
"""

from __future__ import annotations

from unittest import mock

import gguf
import numpy as np
import pytest
import torch

from specd.model.gguf import open_gguf
from specd.model.loader import load_model
from specd.model.moe import SparseMoE, _ExpertSlice, mlp_projections
from specd.model.qkernel import kernel
from specd.model.quant import KQuantLinear, QuantLinear, set_act_int8
from specd.model.quant_load import kq_fields
from tests.conftest import private_cache
from tests.test_kquants import _Q8Reference, centered_blocks
from tests.test_model_families import V, assert_speculation_lossless, engine, prompts, specd_rows, the_tree
from tests.test_moe import QWEN3_MOE, moe_gguf

Q = gguf.GGMLQuantizationType
needs_kernel = pytest.mark.skipif(kernel() is None, reason="no CPU kernel here")
WIDE = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64)  # K multiples of 256
KQ_MOE = {
    "qwen3_moe": ("qwen3_moe", dict(QWEN3_MOE, **WIDE, moe_intermediate_size=256, num_experts_per_tok=3)),
    "mixtral": ("mixtral", dict(WIDE, num_local_experts=4, num_experts_per_tok=2, intermediate_size=256)),
}
# per layer the experts' (gate, up, down) types: Q4_K_M's Q4_K / Q6_K, a fused gate/up of two kinds with
# Q5_K, and a Q8_0 expert tensor among K-quants (files of mixed types, as some quantizers write)
EXPERT_TYPES = {
    "qwen3_moe": [(Q.Q4_K, Q.Q4_K, Q.Q6_K), (Q.Q5_K, Q.Q4_K, Q.Q5_K), (Q.Q4_K, Q.Q4_K, Q.Q8_0)],
    "mixtral": [(Q.Q4_K, Q.Q4_K, Q.Q6_K), (Q.Q4_K, Q.Q5_K, Q.Q4_K), (Q.Q8_0, Q.Q8_0, Q.Q6_K)],
}


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    private_cache(tmp_path, monkeypatch)


def _types(name: str) -> dict:
    """llama.cpp's Q4_K_M mix on the tiny mixture: embeddings, q, k, o Q4_K, v Q6_K, the output Q6_K,
    the experts as ``EXPERT_TYPES``; the router and the norms stay F32 (llama.cpp never quantizes
    ``ffn_gate_inp``)."""
    t = {"model.embed_tokens.weight": Q.Q4_K, "lm_head.weight": Q.Q6_K}
    for i, kinds in enumerate(EXPERT_TYPES[name]):
        p = f"model.layers.{i}."
        for n, kind in (("q_proj", Q.Q4_K), ("k_proj", Q.Q4_K), ("v_proj", Q.Q6_K), ("o_proj", Q.Q4_K)):
            t[f"{p}self_attn.{n}.weight"] = kind
        for n, kind in zip(("gate_exps", "up_exps", "down_exps"), kinds):
            t[f"{p}mlp.experts.{n}"] = kind
    return t


def _blocks(w: np.ndarray, qtype, rng) -> np.ndarray:
    """``centered_blocks`` for a 2-D weight or a 3-D stack of experts [E, N, K] (-> [E, N, bytes])."""
    return centered_blocks(w.reshape(-1, w.shape[-1]), qtype, rng).reshape(*w.shape[:-1], -1)


def kquant_moe(tmp_path, name: str, types: dict | None = None):
    """A tiny mixture's GGUF file with K-quant experts (``types``, else ``_types(name)``)."""
    import tests.test_gguf as tg

    with mock.patch.object(tg, "k_quant_bytes", _blocks):
        path, _ = moe_gguf(tmp_path, name, Q.F32, families=KQ_MOE, types=types or _types(name))
    return path


@pytest.fixture(scope="module", params=list(KQ_MOE))
def moe_file(request, tmp_path_factory):
    return request.param, kquant_moe(tmp_path_factory.mktemp(request.param), request.param)


def _q8_model(lm):
    """``lm`` (the dequantized float model) with every projection, each expert's included, and the
    head through tests/test_kquants.py's ``_Q8Reference`` (int8 activations in fp64)."""
    for blk in lm.model.layers:
        for parent, name in ((blk.attn, "qkv"), (blk.attn, "o"), *mlp_projections(blk.mlp)):
            setattr(parent, name, _Q8Reference(getattr(parent, name).weight))
    lm.model.lm_head = _Q8Reference(lm.model.lm_head.weight)
    lm.model._flat = None
    return lm


def _routed(lm, ids, tree, tree_ids, monkeypatch) -> tuple:
    """(``specd_rows`` on the CPU attention, every mixture's chosen experts in call order)."""
    chosen, route = [], SparseMoE.route

    def spy(self, h, ops=None):
        w, idx = route(self, h) if ops is None else route(self, h, ops)
        chosen.append(idx)
        return w, idx

    monkeypatch.setattr(SparseMoE, "route", spy)
    rows = specd_rows(lm, ids, 20, tree, tree_ids, "cpu")
    monkeypatch.setattr(SparseMoE, "route", route)
    return rows, chosen


@needs_kernel
@pytest.mark.parametrize("mode", ["gguf", "auto"])
def test_k_quant_experts_keep_their_blocks(moe_file, mode):
    """Each expert's gate/up and down hold the file's kinds (a fused gate/up of two kinds too) and
    numbers: the fields unpacked from the kq tiles are the 3-D tensor's expert slice, byte for byte,
    and dequantize to the ``gguf`` package's values bit for bit; a Q8_0 expert tensor keeps its blocks."""
    name, path = moe_file
    lm = load_model(path, "cpu", "float32", with_tokenizer=False, quantization=mode)
    ref = load_model(path, "cpu", "float32", with_tokenizer=False, quantization="none")
    tensors = {t.name: t for t in open_gguf(path).tensors}
    assert lm.config.moe_layers == (0, 1, 2)
    for i, (blk, fblk) in enumerate(zip(lm.model.layers, ref.model.layers)):
        assert isinstance(blk.mlp.router, torch.nn.Linear)  # (routing in floats, as transformers')
        assert torch.equal(blk.mlp.router.weight, fblk.mlp.router.weight)
        gate, up, down = (tensors[f"blk.{i}.ffn_{n}_exps.weight"] for n in ("gate", "up", "down"))
        for e, (ex, fex) in enumerate(zip(blk.mlp.experts, fblk.mlp.experts)):
            for op, parts in ((ex.gate_up, (gate, up)), (ex.down, (down,))):
                kinds = [t.tensor_type.name for t in parts]
                assert isinstance(op, QuantLinear)
                if kinds[0] == "Q8_0":
                    assert type(op) is QuantLinear and (op.fmt, op.group) == ("int8", 32)
                    continue
                assert isinstance(op, KQuantLinear) and [k for k, _ in op.parts] == kinds
                for (_, got), t in zip(op.fields(), parts):
                    want = kq_fields(_ExpertSlice(t, e))
                    for a in ("u", "s1", "s2", "d", "dmin"):
                        assert torch.equal(getattr(got, a), getattr(want, a)), (i, e, a)
            for op, w in ((ex.gate_up, fex.gate_up.weight), (ex.down, fex.down.weight)):
                assert torch.equal(op.dequantize().view(torch.int32), w.view(torch.int32)), (i, e)


@needs_kernel
def test_k_quant_experts_logits_equal_the_dequantized_model(moe_file, monkeypatch):
    """Prefill (two chunks), decode and a draft tree's rows: the file's blocks through the CPU kernel
    (int8 activations) == the dequantized weights with the same int8 activations computed in torch,
    within tests/test_kquants.py's tolerance (a tenth of the int8 activations' own difference from
    fp32 activations, the same greedy tokens), every token routed to the same experts; a token's
    mixture output has the same bits alone as grouped with 12 others."""
    _assert_logits_equal_the_dequantized_model(moe_file[1], monkeypatch)


def _assert_logits_equal_the_dequantized_model(path, monkeypatch) -> None:
    lm = load_model(path, "cpu", "float32", with_tokenizer=False, quantization="gguf")
    set_act_int8(lm.model, True)  # (the Q8_0 experts' too: the K-quants' always are)
    ref = load_model(path, "cpu", "float32", with_tokenizer=False, quantization="none")
    ids = torch.randint(0, V, (30,), generator=torch.Generator().manual_seed(1)).tolist()
    tree, tree_ids = the_tree()
    fp32 = torch.cat(specd_rows(ref, ids, 20, tree, tree_ids, "cpu"))
    want, want_chosen = _routed(_q8_model(ref), ids, tree, tree_ids, monkeypatch)
    got, got_chosen = _routed(lm, ids, tree, tree_ids, monkeypatch)
    want, got = torch.cat(want), torch.cat(got)
    noise = (want - fp32).abs().mean()  # the int8 activations' own difference
    assert fp32.abs().max() > 1.0 and noise > 0
    assert len(got_chosen) == len(want_chosen) == 3 * (3 + len(ids) - 20)  # 3 layers x (2 chunks, 10 decodes, tree)
    assert all(torch.equal(a, b) for a, b in zip(got_chosen, want_chosen))
    assert (got - want).abs().mean() <= 0.1 * noise, (float((got - want).abs().mean()), float(noise))
    assert (got.argmax(-1) == want.argmax(-1)).all()
    moe = lm.model.layers[1].mlp  # (experts of two kinds fused in gate/up)
    h = torch.randn(13, lm.config.hidden_size, generator=torch.Generator().manual_seed(2))
    assert torch.equal(moe(h), torch.cat([moe(h[i : i + 1]) for i in range(13)]))


@needs_kernel
def test_greedy_speculation_is_lossless_on_k_quant_experts(moe_file):
    """The file as its own draft (and prompt lookup): chain, tree and n-gram speculation == plain
    greedy, token for token, with the experts on the file's K-quant blocks."""
    _, path = moe_file
    eng = engine(path, quantization="gguf", act_quant="int8")
    assert isinstance(eng.target.model.layers[0].mlp.experts[0].gate_up, KQuantLinear)
    assert_speculation_lossless(eng, prompts())


@needs_kernel
def test_an_eight_expert_q4_k_m_file_keeps_its_attention_blocks(tmp_path, monkeypatch):
    """llama.cpp's quantizer writes attn_k and attn_v of a model with exactly 8 experts (Mixtral-8x7B)
    in Q8_0 whatever the file type (llama-quant.cpp: "for the 8-expert model, bumping this to Q8_0"),
    so a Q4_K_M file's q is Q4_K and its k / v Q8_0. Under ``gguf`` and ``auto`` alike the fused
    q/k/v holds Q4_K and Q8_0 tiles (nothing refused, nothing requantized): v's fields are the
    file's bytes, the whole projection dequantizes to the ``gguf`` package's numbers bit for bit,
    and the logits equal the dequantized model's with int8 activations (as the other files')."""
    types = _types("mixtral")
    for i in range(3):
        for n in ("k_proj", "v_proj"):
            types[f"model.layers.{i}.self_attn.{n}.weight"] = Q.Q8_0
    path = kquant_moe(tmp_path, "mixtral", types)
    tensors = {t.name: t for t in open_gguf(path).tensors}
    ref = load_model(path, "cpu", "float32", with_tokenizer=False, quantization="none")
    for mode in ("auto", "gguf"):
        lm = load_model(path, "cpu", "float32", with_tokenizer=False, quantization=mode)
        assert isinstance(lm.model.layers[0].mlp.experts[0].gate_up, KQuantLinear)
        for i, (blk, fblk) in enumerate(zip(lm.model.layers, ref.model.layers)):
            qkv = blk.attn.qkv
            assert isinstance(qkv, KQuantLinear) and [k for k, _ in qkv.parts] == ["Q4_K", "Q8_0", "Q8_0"]
            (_, got), want = qkv.fields()[2], kq_fields(tensors[f"blk.{i}.attn_v.weight"])
            assert all(torch.equal(getattr(got, a), getattr(want, a)) for a in ("u", "s1", "s2", "d", "dmin"))
            assert torch.equal(qkv.dequantize().view(torch.int32), fblk.attn.qkv.weight.view(torch.int32)), i
    _assert_logits_equal_the_dequantized_model(path, monkeypatch)
