"""Every model family specd loads == transformers (fp32, 1e-4), from HF folders and GGUF files.

Each family is a tiny random-weight model built with transformers' own config and model classes
(a few layers, a small hidden size, the ~300-token byte-level vocabulary of tests/test_gguf.py),
saved as an HF folder (and written as a GGUF file the way llama.cpp lays it out). specd's logits
equal transformers' on a prefill, on decode steps through the paged cache and on the rows of a
draft tree (each node's reference: transformers on the prompt + the node's root path), with the
torch attention and with specd's CPU attention kernel; greedy speculative output (prompt lookup,
and a draft model = the same tiny model) equals plain greedy output token for token.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from specd.config import CacheConfig, EngineConfig, SpecConfig
from specd.engine.engine import Engine
from specd.engine.kv_cache import KVCache
from specd.engine.sequence import SpecParams
from specd.model import gguf as sg
from specd.model.attention import build_metadata, get_backend
from specd.model.loader import LoadError, load_model
from specd.sampling.params import SamplingParams
from tests.conftest import private_cache
from tests.test_cpu_attention import _tree_mask
from tests.test_gguf import MERGES, TOKEN_TYPES, TOKENS
from tests.test_gguf import gguf_name as GGUF_NAME

TOL = 1e-4
CPU = torch.device("cpu")
V = len(TOKENS)
BASE = dict(
    vocab_size=V,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)


def hf_classes(family: str):
    import transformers as tf

    return {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
        "gemma2": (tf.Gemma2Config, tf.Gemma2ForCausalLM),
        "gemma3": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM),
        "phi3": (tf.Phi3Config, tf.Phi3ForCausalLM),
    }[family]


LONGROPE = {  # Phi-3's LongRoPE: factors for the 6 frequencies of a rotary part of 12 dims (16 x 0.75)
    "rope_type": "longrope",
    "rope_theta": 10000.0,
    "short_factor": [1.0 + 0.1 * i for i in range(6)],
    "long_factor": [2.0 + 0.5 * i for i in range(6)],
}
# each family with what its real checkpoints use (windows small enough to mask keys in 30 tokens)
FAMILIES = {
    "qwen3": dict(head_dim=24),
    "qwen3-tied-windowed": dict(
        head_dim=16, tie_word_embeddings=True, use_sliding_window=True, sliding_window=9, max_window_layers=1
    ),  # fmt: skip
    "llama3-rope": dict(
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },  # fmt: skip
        tie_word_embeddings=True,
    ),
    "gemma2": dict(
        head_dim=24, query_pre_attn_scalar=20, sliding_window=7, attn_logit_softcapping=2.0, final_logit_softcapping=5.0
    ),  # fmt: skip
    "gemma3": dict(
        head_dim=16,
        query_pre_attn_scalar=24,
        sliding_window=7,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 100000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
        },
    ),  # fmt: skip
    "phi3": dict(
        partial_rotary_factor=0.75,
        max_position_embeddings=256,
        original_max_position_embeddings=64,
        rope_parameters=LONGROPE,
        pad_token_id=0,
        eos_token_id=1,
    ),  # fmt: skip
    "phi3-full-rotary": dict(sliding_window=11, pad_token_id=0, eos_token_id=1),
}


def family_of(name: str) -> str:
    return "llama" if name.startswith("llama") else name.split("-")[0]


def hf_model(family: str, seed: int = 0, **over):
    """A random transformers model of ``family`` whose logits span a few units (norm weights near 1,
    projections scaled by 1/sqrt(fan-in), biases non-trivial)."""
    cfg_cls, model_cls = hf_classes(family)
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**{**BASE, **over})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.5 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    return model


def save_tokenizer(folder: Path) -> None:
    """tests/test_gguf.py's byte-level vocabulary as tokenizer files (built as specd builds a GGUF's)."""
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": TOKENS,
        "tokenizer.ggml.token_type": TOKEN_TYPES,
        "tokenizer.ggml.merges": MERGES,
        "tokenizer.ggml.eos_token_id": TOKENS.index("<|im_end|>"),
    }
    tok, config, special = sg.build_tokenizer(meta, folder)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "special_tokens_map.json").write_text(json.dumps(special))


def hf_folder(tmp_path: Path, family: str, **over) -> tuple[Path, object]:
    """(an HF folder saved with ``save_pretrained`` + tokenizer files, the transformers model)."""
    model = hf_model(family, **over)
    if family.startswith("gemma"):
        model.config._attn_implementation = "eager"  # (soft-capping: transformers' reference attention)
    folder = tmp_path / family
    model.save_pretrained(str(folder))
    save_tokenizer(folder)
    return folder, model


# specd's rows ----------------------------------------------------------------------------------------
def specd_rows(lm, ids: list, prompt: int, tree: torch.Tensor, tree_ids: list, backend: str = "torch") -> tuple:
    """Prefill ``ids[:prompt]`` (two chunks), decode the rest one token at a time, then verify a
    draft tree (``tree`` [n, n] ancestor mask, node 0 the root = the last token fed again at the next
    position) over that cache: (logits of every token of ``ids`` [len(ids), V], of the tree's nodes [n, V])."""
    m, c = lm.model, lm.config
    be = get_backend(backend, CPU)
    cache = KVCache(c.num_layers, c.num_kv_heads, c.head_dim, 64, 4, torch.float32, CPU)
    junk, seq = cache.new_seq(), cache.new_seq()
    junk.reserve(9)  # physical blocks out of order
    seq.reserve(len(ids) + len(tree_ids))
    junk.free()
    half = prompt // 2
    chunks = [half, prompt - half] + [1] * (len(ids) - prompt)
    out, pos = [], 0
    for n in chunks:
        meta = build_metadata([n], [pos], [seq.blocks], seq.slots(pos, pos + n), 4, CPU)
        h = m(torch.tensor(ids[pos : pos + n]), torch.arange(pos, pos + n), cache.kv, meta, be)
        out.append(m.compute_logits(h))
        pos += n
    n = len(tree_ids)
    meta = build_metadata([n], [pos], [seq.blocks], seq.slots(pos, pos + n), 4, CPU, tree_masks=[tree])
    positions = pos + tree.sum(1) - 1  # context + depth
    rows = m.compute_logits(m(torch.tensor(tree_ids), positions, cache.kv, meta, be))
    return torch.cat(out), rows


def hf_rows(model, ids: list, tree: torch.Tensor, tree_ids: list) -> tuple:
    """transformers' logits of every token of ``ids``, and of each tree node on its root path."""
    with torch.no_grad():
        full = model(torch.tensor([ids])).logits[0]
        rows = []
        for i in range(len(tree_ids)):
            path = [t for t, on in zip(tree_ids, tree[i].tolist()) if on]
            rows.append(model(torch.tensor([ids + path])).logits[0, -1])
    return full, torch.stack(rows)


def the_tree(n: int = 7, seed: int = 3) -> tuple[torch.Tensor, list]:
    mask = _tree_mask(n, random.Random(seed))
    return mask, torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def assert_rows_match(lm, model, n: int = 30, prompt: int = 20, backends=("torch", "cpu")) -> None:
    """specd == transformers on prefill, decode and tree rows, for each attention backend."""
    ids = torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(1)).tolist()
    tree, tree_ids = the_tree()
    ref, ref_tree = hf_rows(model, ids, tree, tree_ids)
    assert ref.abs().max() > 1.0  # not a degenerate model
    for backend in backends:
        got, got_tree = specd_rows(lm, ids, prompt, tree, tree_ids, backend)
        assert (got - ref).abs().max().item() < TOL, backend
        assert (got_tree - ref_tree).abs().max().item() < TOL, backend


# bug fixes -------------------------------------------------------------------------------------------
def test_qwen2_biases_are_used_whatever_attention_bias_says(tmp_path):
    """transformers' Qwen2 always has q/k/v biases; a config.json that says ``attention_bias: false``
    (Qwen2Config stores the key, its model never reads it) made specd drop them silently: its first
    greedy token on ``def fibonacci(n):`` + newline + 4 spaces was a token 1.1 logits below the top."""
    folder, model = hf_folder(tmp_path, "qwen2", attention_bias=False)
    assert json.loads((folder / "config.json").read_text())["attention_bias"] is False
    lm = load_model(folder, "cpu", "float32", with_tokenizer=False)
    assert lm.config.attention_bias
    assert_rows_match(lm, model)


def test_llama_attention_bias_covers_the_output_projection(tmp_path):
    folder, model = hf_folder(tmp_path, "llama", attention_bias=True)
    lm = load_model(folder, "cpu", "float32", with_tokenizer=False)
    assert lm.config.attention_bias and lm.config.o_bias
    assert_rows_match(lm, model)


def test_a_checkpoint_weight_specd_would_not_use_is_a_load_error(tmp_path):
    """An MLP bias (Llama's mlp_bias) is not read by specd: refused in one line, never dropped."""
    folder, _ = hf_folder(tmp_path, "llama", mlp_bias=True)
    with pytest.raises(LoadError, match=r"mlp\.\w+_proj\.bias. is not used by specd's LlamaForCausalLM"):
        load_model(folder, "cpu", "float32", with_tokenizer=False)


def engine(folder: Path, draft: bool = True, **kw) -> Engine:
    """An fp32 CPU engine on ``folder`` (draft: the same folder, so drafts are mostly accepted)."""
    cfg = EngineConfig(
        target=str(folder),
        draft=str(folder) if draft else None,
        device="cpu",
        dtype="float32",
        cache=CacheConfig(num_blocks=96),
        spec=SpecConfig(adaptive=False),
        **kw,
    )
    return Engine(cfg)


def assert_speculation_lossless(eng: Engine, prompts: list, max_tokens: int = 24) -> list:
    """Greedy output of every speculation mode == plain greedy output, token for token; the plain output."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    plain = [s.output_ids for s in eng.generate(prompts, params, SpecParams("off"))]
    assert all(len(p) == max_tokens for p in plain)
    modes = ("ngram", "chain", "tree") if eng.draft is not None else ("ngram",)
    for mode in modes:
        got = [s.output_ids for s in eng.generate(prompts, params, SpecParams(mode))]
        assert got == plain, mode
    return plain


def prompts(n: int = 3, length: int = 7) -> list:
    g = torch.Generator().manual_seed(7)
    # a repeated span, so prompt lookup has something to draft
    return [(lambda p: p + p[:4])(torch.randint(0, V, (length,), generator=g).tolist()) for _ in range(n)]


# sliding windows -------------------------------------------------------------------------------------
@pytest.mark.parametrize("window", [16, 3])
def test_mistral_sliding_window_masks_keys_and_does_not_bound_the_context(tmp_path, window):
    """Mistral's ``sliding_window`` (16) was taken as the context length (``too_long: prompt (7) +
    max_tokens (24) > context 16``): the context is ``max_position_embeddings``, and keys ``window``
    or more positions behind a query are masked on prefill, decode and tree rows (window 3: inside
    the tree too), as transformers does."""
    folder, model = hf_folder(tmp_path, "mistral", sliding_window=window)
    lm = load_model(folder, "cpu", "float32", with_tokenizer=False)
    assert lm.config.window(0) == window and lm.config.max_position_embeddings == BASE["max_position_embeddings"]
    assert_rows_match(lm, model)
    eng = engine(folder)
    assert eng.max_model_len == BASE["max_position_embeddings"]
    ps = prompts()
    plain = assert_speculation_lossless(eng, ps)
    with torch.no_grad():  # transformers' greedy continuation of the first prompt
        ref = model.generate(torch.tensor([ps[0]]), max_new_tokens=24, do_sample=False)[0, len(ps[0]) :]
    assert plain[0] == ref.tolist()


def test_qwen2_windowed_layers_from_max_window_layers(tmp_path):
    """Qwen2 slides only in layers >= ``max_window_layers`` (transformers' ``layer_types``)."""
    folder, model = hf_folder(tmp_path, "qwen2", use_sliding_window=True, sliding_window=5, max_window_layers=1)
    lm = load_model(folder, "cpu", "float32", with_tokenizer=False)
    assert [lm.config.window(i) for i in range(3)] == [None, 5, 5]
    assert_rows_match(lm, model)


@pytest.mark.parametrize("act", ["none", "int8"])
def test_a_quantized_windowed_model_runs_its_window_in_the_fused_layers(tmp_path, act):
    """The CPU kernel's fused layers read the window in their attention mask: with fp32 activations
    they equal the op-by-op path (whose torch attention matches transformers above) within 1e-4, and
    with either activations greedy speculation stays lossless."""
    from specd.model.fused import fused_layers

    folder, _ = hf_folder(tmp_path, "mistral", sliding_window=6)
    lm = load_model(folder, "cpu", "float32", with_tokenizer=False, quantization="int8")
    ids = torch.randint(0, V, (30,), generator=torch.Generator().manual_seed(1)).tolist()
    tree, tree_ids = the_tree()
    ref = specd_rows(lm, ids, 20, tree, tree_ids, "torch")
    kv, x = torch.zeros(1, 2, 1, 4, 2, 16), torch.zeros(1, 64)
    assert fused_layers(lm.model, get_backend("cpu", CPU), kv, x) is not None
    got = specd_rows(lm, ids, 20, tree, tree_ids, "cpu")
    for a, b in zip(got, ref):
        assert (a - b).abs().max().item() < TOL
    lm.model.windows, lm.model._fused = (None,) * 3, None  # the same layers without the window differ
    unwindowed = specd_rows(lm, ids, 20, tree, tree_ids, "cpu")
    assert all((a - b).abs().max().item() > 0.1 for a, b in zip(unwindowed, got))
    assert_speculation_lossless(engine(folder, quantization="int8", act_quant=act), prompts())


def test_tensor_parallelism_refuses_layers_beyond_llama(tmp_path):
    """Tensor-parallel ranks compute Llama layers: a windowed model is refused in one line."""
    from specd.model.tp_shard import check_shardable

    folder, _ = hf_folder(tmp_path, "mistral", sliding_window=8)
    cfg = load_model(folder, "cpu", "float32", with_tokenizer=False).config
    check_shardable(cfg, 1)
    with pytest.raises(ValueError, match=r"sliding window \(8\): use --tensor-parallel-size 1"):
        check_shardable(cfg, 2)


# the families ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_matches_transformers_and_speculates_losslessly(tmp_path, name):
    """Prefill, decode and tree rows == transformers (torch and CPU attention; the folded fp32 path
    where the family has Llama's layer); greedy speculation == plain greedy == transformers' greedy."""
    folder, model = hf_folder(tmp_path, family_of(name), **FAMILIES[name])
    lm = load_model(folder, "cpu", "float32", with_tokenizer=False)
    assert lm.config.architecture == type(model).__name__
    assert_rows_match(lm, model)
    if lm.model._flat_weights()[1]:  # the folded path ran: check the general one too
        lm.model.FOLD_MAX_HIDDEN, lm.model._flat = 0, None
        assert_rows_match(lm, model, backends=("cpu",))
    eng = engine(folder)
    ps = prompts()
    plain = assert_speculation_lossless(eng, ps)
    with torch.no_grad():
        ref = model.generate(torch.tensor([ps[1]]), max_new_tokens=24, do_sample=False)[0, len(ps[1]) :]
    assert plain[1] == ref.tolist()


@pytest.mark.parametrize("name", ["qwen3", "gemma3", "phi3", "phi3-full-rotary"])
def test_quantized_families_take_the_path_that_computes_them(tmp_path, name):
    """A quantized model on a CPU runs its layers in the kernel's fused C layer only where that layer
    computes them (Llama's layer: Phi-3 with full rotary); the others fall back to the op-by-op path
    by themselves. Either way the CPU attention's rows equal the torch reference's (1e-4, fp32
    activations) and greedy speculation with int8 activations stays lossless."""
    from specd.model.fused import fused_layers

    folder, _ = hf_folder(tmp_path, family_of(name), **FAMILIES[name])
    lm = load_model(folder, "cpu", "float32", with_tokenizer=False, quantization="int8")
    kv, x = torch.zeros(1, 2, 1, 4, 2, lm.config.head_dim), torch.zeros(1, lm.config.hidden_size)
    fused = fused_layers(lm.model, get_backend("cpu", CPU), kv, x)
    assert (fused is not None) == (name == "phi3-full-rotary")
    ids = torch.randint(0, V, (30,), generator=torch.Generator().manual_seed(1)).tolist()
    tree, tree_ids = the_tree()
    ref = specd_rows(lm, ids, 20, tree, tree_ids, "torch")
    got = specd_rows(lm, ids, 20, tree, tree_ids, "cpu")
    for a, b in zip(got, ref):
        assert (a - b).abs().max().item() < TOL
    assert_speculation_lossless(engine(folder, quantization="int8", act_quant="int8"), prompts())


def test_longrope_switches_to_the_long_factors_past_the_original_context(tmp_path):
    """Phi-3's LongRoPE: positions before ``original_max_position_embeddings`` get transformers' short
    factors' cos/sin, later ones its long factors' (both scaled by its attention factor)."""
    _, model = hf_folder(tmp_path, "phi3", **FAMILIES["phi3"])
    ours = load_model(tmp_path / "phi3", "cpu", "float32", with_tokenizer=False).model.rotary
    rot = model.model.rotary_emb
    x = torch.zeros(1, 1, 16)
    for n in (40, 100):  # transformers' tables for a sequence of n tokens (long factors past 64)
        cos, sin = rot(x, torch.arange(n).unsqueeze(0))
        r = 12  # the rotated dims
        torch.testing.assert_close(ours.cos[n - 1, :r], cos[0, -1, :r], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ours.sin[n - 1, :r], sin[0, -1, :r], rtol=1e-5, atol=1e-5)
        assert torch.equal(ours.cos[n - 1, r:], torch.ones(4)) and torch.equal(ours.sin[n - 1, r:], torch.zeros(4))


# GGUF files ------------------------------------------------------------------------------------------
GGUF_FAMILIES = {  # what a GGUF file can say: llama.cpp's fixed Gemma layer pattern, local base, scale
    "qwen3": dict(head_dim=24),
    "gemma2": dict(
        head_dim=24, query_pre_attn_scalar=24, sliding_window=7, attn_logit_softcapping=2.0, final_logit_softcapping=5.0
    ),  # fmt: skip
    "gemma3": dict(
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=7,
        num_hidden_layers=6,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 100000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
    ),  # fmt: skip
    "phi3": FAMILIES["phi3"],
}
GGUF_NORMS = {  # HF norm modules whose GGUF names tests/test_gguf.py's writer does not know
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
    "input_layernorm": "attn_norm",
}


def _fused_gguf_name(hf: str) -> str:
    """tests/test_gguf.py's GGUF names, plus Phi-3's fused projections (``attn_qkv``, ``ffn_up``)."""
    i = hf.split(".")[2] if hf.startswith("model.layers.") else None
    if ".qkv_proj." in hf:
        return f"blk.{i}.attn_qkv.weight"
    if ".gate_up_proj." in hf:
        return f"blk.{i}.ffn_up.weight"
    return GGUF_NAME(hf)


def family_gguf(tmp_path: Path, name: str, qtype) -> tuple[Path, object]:
    """(a GGUF file laid out as llama.cpp's converter writes ``name``'s model, the transformers model):
    Gemma's norms stored as 1 + w, q/k norms under their own names, Phi-3's fused projections and
    LongRoPE factor tensors, the metadata llama.cpp reads."""
    from unittest import mock

    from tests import test_gguf

    arch = family_of(name)
    model = hf_model(arch, **GGUF_FAMILIES[name])
    model.config._attn_implementation = "eager"
    cfg = model.config.to_dict()
    gemma = arch.startswith("gemma")
    cfg["rope_theta"] = (cfg["rope_parameters"].get("full_attention") or cfg["rope_parameters"])["rope_theta"]
    cfg["head_dim"] = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    weights, extra = {}, {}
    for k, v in model.state_dict().items():
        w = v.detach().numpy()
        mod = k.removesuffix(".weight").split(".", 3)[-1]
        if mod in GGUF_NORMS and (gemma or mod.startswith("self_attn")):
            extra[f"blk.{k.split('.')[2]}.{GGUF_NORMS[mod]}.weight"] = w + 1 if gemma else w
        elif k == "model.norm.weight" and gemma:
            extra["output_norm.weight"] = w + 1
        elif not (k == "lm_head.weight" and model.config.tie_word_embeddings):
            weights[k] = w
    meta = {f"{arch}.attention.key_length": cfg["head_dim"], f"{arch}.attention.value_length": cfg["head_dim"]}
    if gemma:
        meta[f"{arch}.attention.sliding_window"] = cfg["sliding_window"]
    if arch == "gemma2":
        meta.update({f"{arch}.{k}": cfg[k] for k in ("attn_logit_softcapping", "final_logit_softcapping")})
    if arch == "gemma3":
        meta.update({f"{arch}.rope.scaling.type": "linear", f"{arch}.rope.scaling.factor": 4.0})
    if arch == "phi3":
        rope = cfg["rope_parameters"]
        meta.update({"phi3.rope.dimension_count": int(cfg["head_dim"] * cfg["partial_rotary_factor"]),
                     "phi3.rope.scaling.original_context_length": cfg["original_max_position_embeddings"],
                     "phi3.attention.sliding_window": 0})  # fmt: skip
        extra["rope_factors_long.weight"] = np.array(rope["long_factor"], dtype=np.float32)
        extra["rope_factors_short.weight"] = np.array(rope["short_factor"], dtype=np.float32)
    with mock.patch.object(test_gguf, "gguf_name", _fused_gguf_name):
        path = test_gguf.write_gguf(tmp_path / f"{name}.gguf", arch, cfg, weights, qtype, meta=meta, extra=extra)
    return path, model


@pytest.mark.parametrize("name", list(GGUF_FAMILIES))
def test_family_gguf_matches_transformers(tmp_path, name, monkeypatch):
    """F32 file -> specd == the original transformers model (the names, norms and metadata are
    read right); Q8_0 file -> specd on the file's own blocks (fp32 activations) == transformers on
    the converted folder, and greedy speculation on the file stays lossless."""
    import gguf

    private_cache(tmp_path, monkeypatch)
    path, model = family_gguf(tmp_path, name, gguf.GGMLQuantizationType.F32)
    lm = load_model(path, "cpu", "float32", with_tokenizer=False)
    assert lm.config.architecture == type(model).__name__
    assert_rows_match(lm, model, backends=("cpu",))
    (tmp_path / "q8").mkdir()
    q8, _ = family_gguf(tmp_path / "q8", name, gguf.GGMLQuantizationType.Q8_0)
    sg.convert(q8, tmp_path / "q8-folder")
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(str(tmp_path / "q8-folder"), dtype=torch.float32).eval()
    ref.config._attn_implementation = "eager"
    lm = load_model(q8, "cpu", "float32", with_tokenizer=False, quantization="auto")
    assert lm.model.quantized()
    assert_rows_match(lm, ref, backends=("cpu",))
    assert_speculation_lossless(engine(q8), prompts())


def test_unsupported_architectures_are_one_line_load_errors(tmp_path, monkeypatch):
    """A family specd does not run (Falcon here; mixtures of experts: tests/test_moe.py) is refused in
    one line naming what is supported, from a folder and from a GGUF file."""
    import gguf

    from tests.test_gguf import write_gguf

    private_cache(tmp_path, monkeypatch)
    folder, _ = hf_folder(tmp_path, "qwen3")
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "architectures": ["FalconForCausalLM"]}))
    with pytest.raises(LoadError, match=r"unsupported architecture 'FalconForCausalLM'.*Qwen3ForCausalLM, Gemma2") as e:
        load_model(folder, "cpu", "float32")
    assert "\n" not in str(e.value)
    model = hf_model("llama")
    weights = {k: v.numpy() for k, v in model.state_dict().items()}
    path = write_gguf(tmp_path / "falcon.gguf", "falcon", {**model.config.to_dict(), "rope_theta": 1e4}, weights,
                      gguf.GGMLQuantizationType.F32)  # fmt: skip
    with pytest.raises(LoadError, match=r"unsupported architecture 'falcon'.*qwen3, gemma2, gemma3") as e:
        load_model(path, "cpu", "float32")
    assert "\n" not in str(e.value)


def test_phi3_su_scaling_is_longrope():
    """Early Phi-3 128k configs call LongRoPE ``su``: the same tables."""
    from specd.config import ModelConfig
    from specd.model.llama import Rotary

    base = dict(architectures=["Phi3ForCausalLM"], vocab_size=10, hidden_size=64, intermediate_size=32,
                num_hidden_layers=1, num_attention_heads=4, max_position_embeddings=256,
                original_max_position_embeddings=64)  # fmt: skip
    factors = dict(short_factor=[1.0 + i / 8 for i in range(8)], long_factor=[3.0 + i for i in range(8)])
    su = Rotary(ModelConfig.from_hf({**base, "rope_scaling": {"type": "su", **factors}}), 100)
    lr = Rotary(ModelConfig.from_hf({**base, "rope_scaling": {"rope_type": "longrope", **factors}}), 100)
    plain = Rotary(ModelConfig.from_hf(base), 100)
    assert torch.equal(su.cos, lr.cos) and torch.equal(su.sin, lr.sin) and not torch.equal(su.cos, plain.cos)
