"""Our model == transformers (fp32, 1e-4) on the shared checkpoint and random tiny Llama/Qwen2/Mistral."""

import json

import pytest
import torch

from specd.engine.kv_cache import KVCache
from specd.model.attention import build_metadata, get_backend
from specd.model.loader import LoadError, load_model
from tests.conftest import TARGET

TOL = 1e-4


def _our_logits(lm, ids, chunks):
    """Prefill ``ids`` in the given chunk sizes through the paged cache; return logits of every token."""
    m = lm.model
    m.backend = get_backend("torch", torch.device("cpu"))
    c = lm.config
    cache = KVCache(c.num_layers, c.num_kv_heads, c.head_dim, 64, 4, torch.float32, torch.device("cpu"))
    seq = cache.new_seq()
    # shuffle physical blocks: allocate and free some first so the table is not contiguous
    junk = cache.new_seq()
    junk.reserve(12)
    seq.reserve(len(ids))
    junk.free()
    out, pos = [], 0
    for n in chunks:
        meta = build_metadata([n], [pos], [seq.blocks], seq.slots(pos, pos + n), 4, torch.device("cpu"))
        h = m(torch.tensor(ids[pos : pos + n]), torch.arange(pos, pos + n), cache.kv, meta)
        out.append(m.compute_logits(h))
        pos += n
    return torch.cat(out)


def _hf_logits(path, ids):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("folded", [True, False], ids=["folded", "unfolded"])
def test_stories260k_prefill_and_decode_match_transformers(folded):
    lm = load_model(TARGET, "cpu", "float32")
    if not folded:  # the path bigger (or non-fp32) models take: norm weights and RoPE applied per step
        lm.model.FOLD_MAX_HIDDEN = 0
    assert lm.model._flat_weights()[1] is folded
    ids = lm.tokenizer("Once upon a time, there was a little girl who")["input_ids"]
    ref = _hf_logits(TARGET, ids)
    prefill = _our_logits(lm, ids, [len(ids)])
    decode = _our_logits(lm, ids, [1] * len(ids))  # token by token through the cache
    mixed = _our_logits(lm, ids, [3, 1, len(ids) - 4])
    for got in (prefill, decode, mixed):
        assert (got - ref).abs().max().item() < TOL


def _tiny_checkpoint(tmp_path, arch, **over):
    import transformers

    cls_cfg, cls_model = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[arch]
    kw = dict(
        vocab_size=97,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )
    kw.update(over)
    torch.manual_seed(0)
    model = cls_model(cls_cfg(**kw)).eval()
    if arch == "qwen2":  # make the q/k/v biases non-trivial
        with torch.no_grad():
            for layer in model.model.layers:
                for p in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    p.bias.normal_(0, 0.5)
    d = tmp_path / arch
    model.save_pretrained(str(d), max_shard_size="60KB")  # sharded, with an index file
    return d


@pytest.mark.parametrize(
    "arch,over",
    [
        ("llama", {}),
        ("llama", {"tie_word_embeddings": True, "num_key_value_heads": 6}),
        (
            "llama",
            {
                "rope_scaling": {
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 16,
                },
                "rope_theta": 500000.0,
            },
        ),
        ("qwen2", {}),
        ("mistral", {"sliding_window": None}),
    ],
)
def test_random_tiny_models_match_transformers(tmp_path, arch, over):
    d = _tiny_checkpoint(tmp_path, arch, **over)
    assert (d / "model.safetensors.index.json").exists()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 97, (37,), generator=g).tolist()
    ref = _hf_logits(d, ids)
    for folded in (True, False):  # pre-folded weights (small fp32 models) and the general path
        lm = load_model(d, "cpu", "float32", with_tokenizer=False)
        if not folded:
            lm.model.FOLD_MAX_HIDDEN = 0
        assert lm.model._flat_weights()[1] is folded
        assert (_our_logits(lm, ids, [37]) - ref).abs().max().item() < TOL
        assert (_our_logits(lm, ids, [5, 1, 1, 30]) - ref).abs().max().item() < TOL


def test_load_errors_are_one_line(tmp_path):
    d = _tiny_checkpoint(tmp_path, "llama")
    cfg = json.loads((d / "config.json").read_text())
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in d.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    (bad / "config.json").write_text(json.dumps({**cfg, "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(LoadError, match="unsupported architecture 'GPT2LMHeadModel'.*supported: LlamaForCausalLM"):
        load_model(bad, "cpu", "float32", with_tokenizer=False)
    (bad / "config.json").write_text(json.dumps({**cfg, "hidden_size": 60, "num_attention_heads": 6}))
    with pytest.raises(LoadError, match="shape mismatch"):
        load_model(bad, "cpu", "float32", with_tokenizer=False)
    with pytest.raises(LoadError, match="not a directory"):
        load_model(tmp_path / "nope", "cpu", "float32")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(LoadError, match="config.json: missing"):
        load_model(empty, "cpu", "float32")
    (bad / "config.json").write_text(json.dumps(cfg))
    shard = sorted(bad.glob("model-*.safetensors"))[0]
    shard.unlink()
    with pytest.raises(LoadError, match="shard .* is missing"):
        load_model(bad, "cpu", "float32", with_tokenizer=False)
    for e in (LoadError("x"),):
        assert "\n" not in str(e)


def test_dtype_and_device_resolution():
    from specd.model.loader import resolve_device, resolve_dtype

    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("float16", torch.device("cpu")) == torch.float16
    with pytest.raises(LoadError):
        resolve_dtype("int8", torch.device("cpu"))
    if not torch.cuda.is_available():
        with pytest.raises(LoadError, match="CUDA is not available"):
            resolve_device("cuda")
    lm = load_model(TARGET, "cpu", "bfloat16")
    assert next(lm.model.parameters()).dtype == torch.bfloat16
