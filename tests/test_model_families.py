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

import pytest
import torch

from specd.engine.kv_cache import KVCache
from specd.model import gguf as sg
from specd.model.attention import build_metadata, get_backend
from specd.model.loader import LoadError, load_model
from tests.test_cpu_attention import _tree_mask
from tests.test_gguf import MERGES, TOKEN_TYPES, TOKENS

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
    }[family]


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
