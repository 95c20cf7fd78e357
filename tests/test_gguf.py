"""GGUF checkpoints: dequantization, un-permuting, config, tokenizer, chat template, conversion, errors.

Small synthetic GGUF files are written here with ``gguf.GGUFWriter`` the way llama.cpp's converter
lays them out (q/k rows permuted for Llama, norms in F32, ggml dims innermost first), so the tests
need no download. The real SmolLM2 file is only used by the opt-in slow test (SPECD_SMOLLM2_GGUF).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from tokenizers.pre_tokenizers import ByteLevel

from specd.model import gguf as sg
from specd.model.builtin import builtin_gguf
from specd.model.loader import LoadError, load_model, load_tokenizer
from tests.conftest import private_cache
from tests.test_model import _our_logits

Q = gguf.GGMLQuantizationType
ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-4
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|fim|>"]  # control tokens (type 3)
USER_DEFINED = "<think>"  # type 4: an added token that is not special
WORDS = ["Hello", "Ġworld", "Ġthe", "Ġcapital", "Ġof", "ĠFrance", "Ġis", "ĠParis", "user", "assistant", "Ċ"]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# hidden and intermediate sizes are multiples of 256, the K-quant block
SIZES = dict(
    hidden_size=256,
    intermediate_size=512,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
)


# a tiny byte-level BPE vocabulary ---------------------------------------------------------------------
def byte_level_vocab() -> tuple[list, list, list]:
    """(tokens, token types, merges): control tokens, the 256-symbol byte alphabet, a user-defined
    token, then each word of WORDS built left to right by one merge per symbol."""
    tokens = SPECIALS + sorted(ByteLevel.alphabet()) + [USER_DEFINED]
    merges = []
    for word in WORDS:
        cur = word[0]
        for ch in word[1:]:
            if cur + ch not in tokens:
                tokens.append(cur + ch)
                merges.append(f"{cur} {ch}")
            cur += ch
    types = [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS))
    types[tokens.index(USER_DEFINED)] = 4
    return tokens, types, merges


TOKENS, TOKEN_TYPES, MERGES = byte_level_vocab()


# writing GGUF files the way llama.cpp does -----------------------------------------------------------
def llamacpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter: each head's rows [x.., y..] (rotate_half halves) -> [x0, y0, x1, y1, ...]."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf: str) -> str:
    fixed = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf in fixed:
        return fixed[hf]
    _, _, i, *rest = hf.split(".")
    part = {
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }[".".join(rest[:-1])]
    return f"blk.{i}.{part}.{rest[-1]}"


def k_quant_bytes(w: np.ndarray, qtype, rng) -> np.ndarray:
    """gguf-py cannot quantize K-quants: random blocks with their fp16 scale fields set small."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (w.shape[0], w.shape[1] // block, size), dtype=np.uint8)
    fields = {
        Q.Q2_K: [(size - 4, 3e-3), (size - 2, 3e-3)],
        Q.Q3_K: [(size - 2, 3e-3)],
        Q.Q4_K: [(0, 2e-4), (2, 2e-4)],
        Q.Q5_K: [(0, 1e-4), (2, 1e-4)],
        Q.Q6_K: [(size - 2, 2e-4)],
        Q.IQ2_XXS: [(0, 1e-3)],
    }[qtype]
    for at, scale in fields:
        raw[..., at : at + 2] = np.frombuffer(np.float16(scale).tobytes(), np.uint8)
    return raw.reshape(w.shape[0], -1)


def encode(w: np.ndarray, qtype, rng):
    """(array to write, raw_dtype) for one 2-D weight; 1-D tensors (norms, biases) stay F32."""
    if w.ndim == 1 or qtype == Q.F32:
        return w.astype(np.float32), None
    if qtype == Q.F16:
        return w.astype(np.float16), None
    try:
        return gguf.quants.quantize(w.astype(np.float32), qtype), qtype
    except NotImplementedError:
        return k_quant_bytes(w, qtype, rng), qtype


def write_gguf(
    path: Path,
    arch: str,
    cfg: dict,
    weights: dict,
    qtype=Q.F32,
    *,
    tokenizer: bool = True,
    meta: dict | None = None,
    types: dict | None = None,
    name: str = "tiny",
    extra: dict | None = None,
) -> Path:
    """A GGUF file of HF-named ``weights`` (float32 numpy) laid out as llama.cpp does; ``types``
    overrides ``qtype`` per weight, ``extra`` adds F32 tensors under their GGUF names."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_string("general.name", name)
    for key, val in {
        "block_count": cfg["num_hidden_layers"],
        "context_length": cfg["max_position_embeddings"],
        "embedding_length": cfg["hidden_size"],
        "feed_forward_length": cfg["intermediate_size"],
        "attention.head_count": cfg["num_attention_heads"],
        "attention.head_count_kv": cfg["num_key_value_heads"],
    }.items():
        w.add_uint32(f"{arch}.{key}", val)
    w.add_float32(f"{arch}.rope.freq_base", cfg.get("rope_theta", 10000.0))
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"])
    if tokenizer:
        w.add_string("tokenizer.ggml.model", "gpt2")
        w.add_string("tokenizer.ggml.pre", "default")
        w.add_array("tokenizer.ggml.tokens", TOKENS)
        w.add_array("tokenizer.ggml.token_type", TOKEN_TYPES)
        w.add_array("tokenizer.ggml.merges", MERGES)
        for key, tok in (
            ("bos", "<|im_start|>"),
            ("eos", "<|im_end|>"),
            ("padding", "<|im_end|>"),
            ("unknown", "<|endoftext|>"),
        ):
            w.add_uint32(f"tokenizer.ggml.{key}_token_id", TOKENS.index(tok))
        w.add_string("tokenizer.chat_template", CHATML)
    for key, val in (meta or {}).items():
        (
            w.add_string
            if isinstance(val, str)
            else w.add_bool
            if isinstance(val, bool)
            else w.add_float32
            if isinstance(val, float)
            else w.add_uint32
        )(key, val)
    rng = np.random.default_rng(0)
    for hf, t in weights.items():
        if arch == "llama" and (".q_proj." in hf or ".k_proj." in hf):
            t = llamacpp_permute(t, cfg["num_attention_heads" if ".q_proj." in hf else "num_key_value_heads"])
        data, raw = encode(t, (types or {}).get(hf, qtype), rng)
        w.add_tensor(gguf_name(hf), data, raw_dtype=raw)
    for gname, t in (extra or {}).items():
        w.add_tensor(gname, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def hf_model(arch: str, layers: int = 2, **over):
    """A random transformers model with weights big enough to give logits of a few units."""
    import transformers

    cls_cfg, cls_model = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[arch]
    kw = dict(SIZES, vocab_size=len(TOKENS), num_hidden_layers=layers, tie_word_embeddings=False)
    kw.update(over)
    torch.manual_seed(0)
    model = cls_model(cls_cfg(**kw)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else torch.randn_like(p) / p.shape[-1] ** 0.5)
    return model


def model_gguf(tmp_path: Path, arch: str, qtype=Q.F32, layers: int = 2, **over) -> tuple[Path, object]:
    """(GGUF path, the transformers model it was written from); Mistral is written as "llama"."""
    model = hf_model(arch, layers, **over)
    weights = {
        k: v.detach().numpy()
        for k, v in model.state_dict().items()
        if not (k == "lm_head.weight" and model.config.tie_word_embeddings)
    }
    cfg = model.config.to_dict()
    cfg["rope_theta"] = model.config.rope_parameters["rope_theta"]
    gguf_arch = "llama" if arch == "mistral" else arch
    path = write_gguf(
        tmp_path / f"{arch}-{qtype.name}.gguf",
        gguf_arch,
        cfg,
        weights,
        qtype,
        name="Tiny-Mistral" if arch == "mistral" else "tiny",
    )
    return path, model


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    private_cache(tmp_path, monkeypatch)


def _hf_logits(model_or_path, ids):
    from transformers import AutoModelForCausalLM

    m = model_or_path
    if isinstance(m, (str, Path)):
        m = AutoModelForCausalLM.from_pretrained(str(m), dtype=torch.float32).eval()
    with torch.no_grad():
        return m(torch.tensor([ids])).logits[0]


def _ids(n: int = 23) -> list:
    return torch.randint(0, len(TOKENS), (n,), generator=torch.Generator().manual_seed(1)).tolist()


# dequantization ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("qtype", [getattr(Q, n) for n in sg.SUPPORTED_TYPES], ids=list(sg.SUPPORTED_TYPES))
def test_weights_equal_gguf_dequantization(tmp_path, qtype):
    """Every converted weight is gguf's own dequantization of the stored tensor (q/k un-permuted)."""
    from safetensors.torch import load_file

    path, model = model_gguf(tmp_path, "llama", qtype, layers=1)
    sg.convert(path, tmp_path / "out")
    ours = load_file(str(tmp_path / "out" / "model.safetensors"))
    reader = gguf.GGUFReader(path)
    assert len(ours) == len(reader.tensors) == len(model.state_dict())
    for t in reader.tensors:
        ref = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        if ".attn_q." in t.name or ".attn_k." in t.name:  # undo llamacpp_permute: (head, pair, j) order back
            n = 4 if ".attn_q." in t.name else 2
            ref = ref.reshape(n, -1, 2, ref.shape[-1]).swapaxes(1, 2).reshape(ref.shape)
        got = ours[sg.hf_name(t.name)]
        assert got.dtype == torch.float32 and tuple(got.shape) == ref.shape
        assert torch.equal(got, torch.from_numpy(ref)), t.name
        real_quantizer = qtype in (Q.F32, Q.F16, Q.BF16, Q.Q8_0)  # not random K-quant blocks: near the original
        if t.tensor_type.name == qtype.name and real_quantizer:
            orig = model.state_dict()[sg.hf_name(t.name)]
            assert (got - orig).abs().max() <= {Q.F32: 0, Q.F16: 2e-3, Q.BF16: 2e-2, Q.Q8_0: 2e-2}[qtype]


def test_unpermute_inverts_llamacpp_permute():
    w = np.arange(8 * 64 * 3, dtype=np.float32).reshape(8 * 64, 3)
    assert np.array_equal(sg.unpermute_qk(llamacpp_permute(w, 8), 8), w)
    assert not np.array_equal(llamacpp_permute(w, 8), w)


# logits -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "arch,over",
    [
        ("llama", {}),
        ("llama", {"tie_word_embeddings": True, "num_key_value_heads": 4}),
        ("qwen2", {}),
        ("mistral", {"sliding_window": None}),
    ],
    ids=["llama", "llama-tied-mha", "qwen2", "mistral"],
)
def test_f32_round_trip_equals_the_original_model(tmp_path, arch, over):
    """HF model -> GGUF (llama.cpp layout) -> specd: the original transformers logits, so the name
    map, the un-permute and the config are right."""
    path, model = model_gguf(tmp_path, arch, Q.F32, **over)
    ids = _ids()
    ref = _hf_logits(model, ids)
    lm = load_model(path, "cpu", "float32")
    assert lm.path == path and lm.config.architecture == type(model).__name__
    assert (_our_logits(lm, ids, [len(ids)]) - ref).abs().max().item() < TOL
    assert (_our_logits(lm, ids, [5, 1, len(ids) - 6]) - ref).abs().max().item() < TOL


@pytest.mark.parametrize(
    "arch,qtypes",
    [
        ("llama", (Q.Q4_1, Q.Q8_0)),
        ("llama", (Q.Q4_K, Q.Q6_K)),
        ("qwen2", (Q.Q5_0, Q.Q5_K)),
        ("qwen2", (Q.BF16, Q.Q3_K)),
    ],
    ids=["llama-Q4_1-Q8_0", "llama-Q4_K-Q6_K", "qwen2-Q5_0-Q5_K", "qwen2-BF16-Q3_K"],
)
def test_converted_folder_in_transformers_equals_specd_on_the_gguf(tmp_path, arch, qtypes):
    """Quantized files (second type for the embedding and down projections): transformers on the
    converted folder and specd on the .gguf give the same fp32 logits."""
    model = hf_model(arch)
    weights = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    types = {k: qtypes[1] for k in weights if "embed" in k or "down_proj" in k}
    cfg = dict(model.config.to_dict(), rope_theta=10000.0)
    path = write_gguf(tmp_path / "m.gguf", arch, cfg, weights, qtypes[0], types=types)
    out = tmp_path / "hf"
    sg.convert(path, out)
    ids = _ids()
    ref = _hf_logits(out, ids)
    assert ref.abs().max() > 1.0  # not a degenerate all-zero model
    lm = load_model(path, "cpu", "float32")
    assert (_our_logits(lm, ids, [len(ids)]) - ref).abs().max().item() < TOL


def test_llama3_rope_freqs_become_llama3_rope_scaling(tmp_path):
    """Llama 3.x files keep RoPE scaling only as a rope_freqs.weight tensor of frequency divisors
    (a short original context here, so the scaling changes the logits of a short prompt)."""
    rope = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
        "rope_theta": 10000.0,
    }
    model = hf_model("llama", rope_parameters=rope)
    wavelen = 2 * np.pi * 10000.0 ** (np.arange(0, 64, 2) / 64)
    smooth = np.clip((16 / wavelen - 1) / 3, 0, 1)
    divisors = (1 / ((1 - smooth) / 8.0 + smooth)).astype(np.float32)  # what llama.cpp's converter stores
    assert 1.0 < divisors.mean() < 8.0
    weights = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    cfg = dict(model.config.to_dict(), rope_theta=10000.0)
    meta = {"llama.rope.scaling.original_context_length": 16}
    path = write_gguf(tmp_path / "l3.gguf", "llama", cfg, weights, meta=meta, extra={"rope_freqs.weight": divisors})
    lm = load_model(path, "cpu", "float32")
    assert lm.config.rope_scaling == rope
    ids = _ids(40)
    assert (_our_logits(lm, ids, [len(ids)]) - _hf_logits(model, ids)).abs().max().item() < TOL
    odd = write_gguf(
        tmp_path / "odd.gguf", "llama", cfg, weights, meta=meta, extra={"rope_freqs.weight": divisors[::-1].copy()}
    )
    with pytest.raises(LoadError, match="rope_freqs.weight does not match Llama 3 rope scaling"):
        load_model(odd, "cpu", "float32")


# tokenizer and chat template --------------------------------------------------------------------------
def test_tokenizer_and_chat_template_come_through(tmp_path):
    from transformers import AutoTokenizer

    path, _ = model_gguf(tmp_path, "llama", layers=1)
    sg.convert(path, tmp_path / "hf")
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    assert tok("Hello world")["input_ids"] == [TOKENS.index("Hello"), TOKENS.index("Ġworld")]
    text = "<|im_start|>user\nthe capital of France is Paris?<|im_end|>"
    ids = tok(text)["input_ids"]
    assert ids[0] == TOKENS.index("<|im_start|>") and ids[-1] == TOKENS.index("<|im_end|>")
    assert TOKENS.index("ĠParis") in ids and tok.decode(ids) == text
    for s in ("  two spaces\n\nand ünïcode 🙂", "digits 12345!"):
        assert tok.decode(tok(s)["input_ids"]) == s
    ids = tok("a<|fim|>b<think>c")["input_ids"]  # control and user-defined tokens stay whole
    assert ids[1] == TOKENS.index("<|fim|>") and ids[3] == TOKENS.index(USER_DEFINED) and len(ids) == 5
    assert tok.decode(ids, skip_special_tokens=True) == "ab<think>c"
    assert (tok.bos_token, tok.eos_token, tok.pad_token, tok.unk_token) == (
        "<|im_start|>",
        "<|im_end|>",
        "<|im_end|>",
        "<|endoftext|>",
    )
    msgs = [{"role": "user", "content": "Hello"}]
    assert tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False) == (
        "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"
    )
    lm = load_model(path, "cpu", "float32")  # the engine's view: eos ids and the same tokenizer
    assert lm.config.eos_token_ids == (TOKENS.index("<|im_end|>"),)
    assert load_tokenizer(path).get_vocab() == tok.get_vocab() == lm.tokenizer.get_vocab()


def test_tokenizer_matches_transformers_own_gguf_tokenizer(tmp_path):
    """transformers reads GGUF tokenizers too: same ids on the same file."""
    from transformers import AutoTokenizer

    path, _ = model_gguf(tmp_path, "llama", layers=1)
    ref = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    ours = load_tokenizer(path)
    for s in ("Hello world", "<|im_start|>assistant\nthe capital<|im_end|>", " Paris 2024\n\tok<|fim|>a<think>"):
        assert ours(s)["input_ids"] == ref(s)["input_ids"]


@pytest.mark.parametrize(
    "pre,words",
    [
        ("default", ["abc", "Ġ12345"]),
        ("smollm", ["abc", "Ġ", "1", "2", "3", "4", "5"]),
        ("llama-bpe", ["abc", "Ġ", "123", "45"]),
        ("qwen2", ["abc", "Ġ", "1", "2", "3", "4", "5"]),
    ],
)
def test_pre_tokenizer_follows_tokenizer_ggml_pre(pre, words):
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": TOKENS,
        "tokenizer.ggml.merges": MERGES,
    }
    tk, _, _ = sg.build_tokenizer(meta, Path("x.gguf"))
    assert [w for w, _ in tk.pre_tokenizer.pre_tokenize_str("abc 12345")] == words


def test_sentencepiece_tokenizer_from_scores(tmp_path):
    """Llama/Mistral sentencepiece vocabularies: merges rebuilt from scores, byte fallback, BOS added."""
    from transformers import PreTrainedTokenizerFast

    pieces = [
        "▁",
        "h",
        "e",
        "l",
        "o",
        "w",
        "r",
        "d",
        "he",
        "ll",
        "llo",
        "▁he",
        "▁hello",
        "▁w",
        "or",
        "▁wor",
        "ld",
        "▁world",
    ]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    meta = {
        "general.architecture": "llama",
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
    }
    tk, config, _ = sg.build_tokenizer(meta, tmp_path / "x.gguf")
    tk.save(str(tmp_path / "tokenizer.json"))
    tok = PreTrainedTokenizerFast(
        tokenizer_file=str(tmp_path / "tokenizer.json"), **{k: v for k, v in config.items() if k.endswith("_token")}
    )
    ids = tok("hello world")["input_ids"]
    assert ids == [1, tokens.index("▁hello"), tokens.index("▁world")]
    ids = tok("hé")["input_ids"]
    assert tokens.index("<0xC3>") in ids and tokens.index("<0xA9>") in ids
    assert tok.decode(ids, skip_special_tokens=True) == "hé"


@pytest.mark.parametrize(
    "meta,expect",
    [
        ({"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": TOKENS}, "unsupported tokenizer model 'bert'"),
        ({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": TOKENS}, "tokenizer.ggml.merges missing"),
        (
            {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b"], "tokenizer.ggml.merges": ["a c"]},
            "invalid tokenizer in the metadata",
        ),
        ({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["a", "b"]}, "tokenizer.ggml.scores missing"),
    ],
    ids=["bert", "no-merges", "bad-merge", "no-scores"],
)
def test_unusable_tokenizer_metadata_is_a_load_error(meta, expect):
    with pytest.raises(LoadError, match=f"^x.gguf: .*{expect}"):
        sg.build_tokenizer(meta, Path("x.gguf"))


# conversion, cache, CLI -------------------------------------------------------------------------------
def test_convert_writes_a_folder_transformers_loads(tmp_path, capsys):
    from specd.cli import main

    path, _ = model_gguf(tmp_path, "qwen2", Q.Q8_0, layers=1)
    out = tmp_path / "out"
    assert main(["convert", str(path), str(out)]) == 0
    assert "wrote" in capsys.readouterr().err
    assert {p.name for p in out.iterdir()} == {
        "model.safetensors",
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
    }
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen2ForCausalLM"] and cfg["num_hidden_layers"] == 1
    assert json.loads((out / "tokenizer_config.json").read_text())["chat_template"] == CHATML
    assert main(["convert", str(path), str(out)]) == 1  # a non-empty folder needs --force
    err = capsys.readouterr().err
    assert err.startswith(f"specd convert: error: {out}: already exists") and err.count("\n") == 1
    assert main(["convert", str(path), str(out), "--force"]) == 0


def test_gguf_is_converted_once_and_again_when_it_changes(tmp_path, monkeypatch):
    path, _ = model_gguf(tmp_path, "llama", layers=1)
    calls = []
    real = sg.convert
    monkeypatch.setattr(sg, "convert", lambda *a, **k: calls.append(a[0]) or real(*a, **k))
    first = load_model(path, "cpu", "float32").model.embed.weight.clone()
    load_model(path, "cpu", "float32")
    load_tokenizer(path)
    assert len(calls) == 1
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert torch.equal(load_model(path, "cpu", "float32").model.embed.weight, first)
    assert len(calls) == 2
    assert len(list((tmp_path / "cache" / "gguf").iterdir())) == 1  # the stale folder went, no temporaries


# bad files --------------------------------------------------------------------------------------------
def _bad_files(tmp_path: Path) -> dict:
    """name -> (file, expected message part)."""
    good, model = model_gguf(tmp_path, "llama", layers=1)
    weights = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    cfg = dict(model.config.to_dict(), rope_theta=10000.0)
    data = good.read_bytes()
    files = {
        "empty": (tmp_path / "empty.gguf", b""),
        "truncated": (tmp_path / "cut.gguf", data[: len(data) * 3 // 5]),
        "truncated-header": (tmp_path / "cut2.gguf", data[:40]),
        "png": (tmp_path / "picture.gguf", b"\x89PNG\r\n\x1a\n" + bytes(range(200))),
        "random": (tmp_path / "noise.bin", np.random.default_rng(0).bytes(4096)),
    }
    for p, content in files.values():
        p.write_bytes(content)
    cases = {
        "empty": (files["empty"][0], "empty file"),
        "truncated": (files["truncated"][0], "truncated or corrupt"),
        "truncated-header": (files["truncated-header"][0], "truncated or corrupt"),
        "png": (files["png"][0], "not a GGUF file"),
        "random": (files["random"][0], "not a GGUF file"),
    }
    for arch in ("gpt2", "mamba"):
        cases[arch] = (write_gguf(tmp_path / f"{arch}.gguf", arch, cfg, weights), f"unsupported architecture '{arch}'")
    cases["tensor-type"] = (
        write_gguf(
            tmp_path / "iq.gguf", "llama", cfg, weights, types={"model.layers.0.self_attn.q_proj.weight": Q.IQ2_XXS}
        ),
        "unsupported tensor type IQ2_XXS for blk.0.attn_q.weight",
    )
    cases["no-tokenizer"] = (
        write_gguf(tmp_path / "notok.gguf", "llama", cfg, weights, tokenizer=False),
        "no tokenizer in the file's metadata",
    )
    cases["missing"] = (tmp_path / "nope.gguf", "cannot read the GGUF file")
    return cases


def test_bad_files_are_one_line_errors(tmp_path, capsys):
    from specd.cli import main

    for name, (path, expect) in _bad_files(tmp_path).items():
        with pytest.raises(LoadError) as e:
            load_model(path, "cpu", "float32")
        msg = str(e.value)
        assert msg.startswith(f"{path}: ") and expect in msg and "\n" not in msg, (name, msg)
        out = tmp_path / f"out-{name}"
        assert main(["convert", str(path), str(out)]) == 1, name
        err = capsys.readouterr().err
        assert err == f"specd convert: error: {msg}\n", name
        assert not out.exists()
    assert not [p for p in (tmp_path / "cache" / "gguf").iterdir()]  # failed conversions leave nothing


def test_cli_convert_exits_non_zero_without_traceback(tmp_path):
    bad = tmp_path / "picture.gguf"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(64))
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1")
    r = subprocess.run(
        [sys.executable, "-m", "specd", "convert", str(bad), str(tmp_path / "out")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.startswith(f"specd convert: error: {bad}: not a GGUF file") and r.stderr.count("\n") == 1


# the real SmolLM2-135M-Instruct Q4_1 file (opt-in) ----------------------------------------------------
BUILTIN_GGUF = builtin_gguf()  # (read before the fixtures point SPECD_CACHE_DIR at a temporary folder)


@pytest.mark.slow
def test_smollm2_gguf_answers_paris(tmp_path):
    """The real SmolLM2 GGUF: $SPECD_SMOLLM2_GGUF, else the built-in copy `specd setup` cached."""
    from specd.config import EngineConfig
    from specd.engine.engine import Engine
    from specd.engine.sequence import SpecParams
    from specd.sampling.params import SamplingParams

    src = os.environ.get("SPECD_SMOLLM2_GGUF") or str(BUILTIN_GGUF)
    assert Path(src).is_file(), f"{src} missing: `make install` (specd setup) fetches it"
    lm = load_model(src, "cpu", "float32")
    assert (lm.config.num_layers, lm.config.hidden_size, lm.config.vocab_size) == (30, 576, 49152)
    eng = Engine(EngineConfig(target=src, device="cpu", dtype="float32"), target=lm)
    ids = lm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    seq = eng.generate([list(ids)], SamplingParams(temperature=0.0, max_tokens=24), SpecParams(mode="off"))[0]
    assert "Paris" in eng.output_text(seq)


def test_quick_metadata_reads_the_header_as_the_reader_does(tmp_path):
    """``quick_metadata`` (for checks before a load): every scalar as ``GGUFReader`` reads it, each
    array's length, each tensor's torch shape."""
    path, _ = model_gguf(tmp_path, "qwen2", Q.Q8_0, layers=1)
    quick = sg.quick_metadata(path)
    reader = gguf.GGUFReader(path)
    meta = sg.read_metadata(reader, path)
    for k, v in meta.items():
        assert quick[k] == (len(v) if isinstance(v, list) else v), k
    for t in reader.tensors:
        assert quick[t.name] == tuple(int(n) for n in reversed(t.shape.tolist()))
    assert quick["tokenizer.ggml.tokens"] == len(TOKENS) and quick["token_embd.weight"] == (len(TOKENS), 256)
