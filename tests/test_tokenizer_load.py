"""Loading a checkpoint's tokenizer fast (issue #42: ready to serve a 1.7B file in under 10 s, first load
included), without changing which tokenizer loads:

- a GGUF file's tokenizer, built from its vocabulary and merges (``specd.model.gguf.build_tokenizer``),
  equals transformers' own GGUF conversion on every token of a sample text and on the special tokens,
  for the built-in model's file and for GGUF files of the shipped tokenizers (GPT-2's byte-level BPE,
  Mistral-7B's sentencepiece BPE), and equals the original tokenizers;
- ``load_tokenizer`` loads a folder as ``PreTrainedTokenizerFast`` directly exactly where transformers'
  ``AutoTokenizer`` would load that class (``loader.FAST_AS_IS``; the same tokenizer) and leaves the
  rest (qwen2's ``Qwen2Tokenizer``) to ``AutoTokenizer``; the direct path never imports
  ``AutoTokenizer``'s module (what made the server's tokenizer cost ~1.7 s of CPU);
- a GGUF file's tokenizer comes from the config + tokenizer folder: the weights are never converted
  (the full conversion wrote the whole model in fp32, 7 GB at 1.7B, on every file's first start).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from specd.model import gguf as sg
from specd.model.builtin import builtin_gguf
from specd.model.loader import FAST_AS_IS, load_tokenizer
from specd.model.tokenizer_load import OWN_CLASS
from tests.test_gguf import model_gguf

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT.parent / "shared" / "tokenizers"
BUILTIN_GGUF = builtin_gguf()  # (read before the fixture points SPECD_CACHE_DIR at a temporary folder)
SAMPLE = (ROOT / "README.md").read_text()[
    :6000
] + "\n  two  spaces\t\ttabs, ünïcode 🙂, digits 12345 and 3.14159, 日本語のテキスト, CamelCaseWords\r\n"


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECD_CACHE_DIR", str(tmp_path / "cache"))


def tokenizer_gguf(path: Path, src: Path) -> Path:
    """A GGUF file (a 1-layer Llama's metadata, its token embeddings the only tensor) holding the
    tokenizer of the Hugging Face folder ``src`` as llama.cpp's converter stores one: tokens by id,
    token types (control for special added tokens, byte for ``<0xNN>``, unknown), merges; a
    sentencepiece BPE (byte fallback) as tokenizer model "llama", a byte-level BPE as "gpt2"."""
    d = json.loads((src / "tokenizer.json").read_text())
    model = d["model"]
    added = {a["id"]: a for a in d["added_tokens"]}
    tokens = [""] * max(len(model["vocab"]), max(added, default=0) + 1)
    for t, i in model["vocab"].items():
        tokens[i] = t
    for i, a in added.items():
        tokens[i] = a["content"]
    sentencepiece = bool(model.get("byte_fallback"))
    types = []
    for i, t in enumerate(tokens):
        if i in added:
            types.append(3 if added[i]["special"] else 4)
        elif sentencepiece and len(t) == 6 and t.startswith("<0x") and t.endswith(">"):
            types.append(6)
        else:
            types.append(1)
    w = gguf.GGUFWriter(str(path), "llama")
    for key, val in {"block_count": 1, "context_length": 64, "embedding_length": 16, "feed_forward_length": 32,
                     "attention.head_count": 2, "attention.head_count_kv": 2}.items():  # fmt: skip
        w.add_uint32(f"llama.{key}", val)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_string("tokenizer.ggml.model", "llama" if sentencepiece else "gpt2")
    w.add_array("tokenizer.ggml.tokens", tokens)
    w.add_array("tokenizer.ggml.token_type", types)
    w.add_array("tokenizer.ggml.merges", [m if isinstance(m, str) else " ".join(m) for m in model["merges"]])
    if sentencepiece:
        types[tokens.index("<unk>")] = 2
        w.add_string("tokenizer.ggml.pre", "default")
        w.add_array("tokenizer.ggml.scores", [-float(i) for i in range(len(tokens))])
        specials = {"bos": "<s>", "eos": "</s>", "unknown": "<unk>"}
    else:
        w.add_string("tokenizer.ggml.pre", "gpt2")
        specials = {"bos": "<|endoftext|>", "eos": "<|endoftext|>", "unknown": "<|endoftext|>"}
    for key, tok in specials.items():
        w.add_uint32(f"tokenizer.ggml.{key}_token_id", tokens.index(tok))
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 16), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _same(ours, ref, text: str = SAMPLE) -> None:
    """Every token of ``text`` and of the special tokens, the vocabulary, and the decoding agree."""
    ids = ours(text)["input_ids"]
    assert len(ids) > 1000 and ids == ref(text)["input_ids"]
    assert ours.all_special_tokens == ref.all_special_tokens and ours.all_special_tokens
    specials = "".join(ours.all_special_tokens)
    assert ours(specials)["input_ids"] == ref(specials)["input_ids"]
    assert ours.get_vocab() == ref.get_vocab()
    assert ours.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)


def test_builtin_gguf_tokenizer_equals_transformers_conversion():
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(str(BUILTIN_GGUF.parent), gguf_file=BUILTIN_GGUF.name)
    ours = load_tokenizer(BUILTIN_GGUF)
    _same(ours, ref)
    assert ours.decode(ours(SAMPLE)["input_ids"]) == SAMPLE  # (byte-level: every text comes back)


@pytest.mark.parametrize("name", ["gpt2", "mistral7b"])
def test_shipped_tokenizers_as_gguf_equal_transformers_conversion_and_the_original(tmp_path, name):
    from transformers import AutoTokenizer

    path = tokenizer_gguf(tmp_path / f"{name}.gguf", SHIPPED / name)
    ours = load_tokenizer(path)
    _same(ours, AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name))
    original = AutoTokenizer.from_pretrained(str(SHIPPED / name))
    assert ours(SAMPLE)["input_ids"] == original(SAMPLE)["input_ids"]


def _folder(tmp_path: Path, model_type: str) -> Path:
    """The built-in GGUF's converted config + tokenizer folder, as a model of ``model_type``."""
    src = sg.cached_folder(BUILTIN_GGUF, weights=False)
    out = tmp_path / model_type
    shutil.copytree(src, out)
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(dict(cfg, model_type=model_type)))
    return out


@pytest.mark.parametrize("model_type", [*FAST_AS_IS, "qwen2"])
def test_direct_load_is_what_autotokenizer_loads(tmp_path, model_type):
    """Same class, vocabulary, tokens, special tokens and chat template as ``AutoTokenizer``'s; qwen2,
    which ``AutoTokenizer`` maps to a class of its own, loads as that class directly."""
    from transformers import AutoTokenizer

    folder = _folder(tmp_path, model_type)
    ours, ref = load_tokenizer(folder), AutoTokenizer.from_pretrained(str(folder))
    assert type(ours) is type(ref)
    assert (type(ours).__name__ == "TokenizersBackend") == (model_type in FAST_AS_IS)
    assert type(ours).__name__ == OWN_CLASS.get(model_type, "TokenizersBackend")
    _same(ours, ref)
    msgs = [{"role": "user", "content": "Name the capital of France."}]
    assert ours.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False) == ref.apply_chat_template(
        msgs, add_generation_prompt=True, tokenize=False
    )


STORIES = ROOT.parent / "shared" / "models" / "stories260K"  # (a sentencepiece BPE naming LlamaTokenizer)
_SOURCES = {"stories": STORIES, "mistral7b": SHIPPED / "mistral7b"}


def _named_folder(tmp_path: Path, model_type: str, named: str, source: str) -> Path:
    """A config of ``model_type`` with ``source``'s tokenizer.json (``builtin``: the built-in GGUF's
    byte-level one) and a tokenizer_config.json naming ``named``."""
    out = _folder(tmp_path, model_type)
    if source != "builtin":
        shutil.copy(_SOURCES[source] / "tokenizer.json", out / "tokenizer.json")
        (out / "tokenizer_config.json").write_text((_SOURCES[source] / "tokenizer_config.json").read_text())
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps(dict(cfg, tokenizer_class=named)))
    return out


@pytest.mark.parametrize(
    "model_type, named, source, direct",
    [
        ("llama", "LlamaTokenizer", "stories", "LlamaTokenizer"),
        ("llama", "LlamaTokenizerFast", "mistral7b", "LlamaTokenizer"),
        ("llama", "LlamaTokenizer", "builtin", None),  # byte-level: AutoTokenizer loads TokenizersBackend
        ("mistral", "LlamaTokenizer", "mistral7b", "PreTrainedTokenizerFast"),
        ("mixtral", "LlamaTokenizerFast", "builtin", "PreTrainedTokenizerFast"),
        ("gemma3_text", "GemmaTokenizerFast", "mistral7b", "GemmaTokenizer"),
        ("gemma", "GemmaTokenizer", "builtin", "GemmaTokenizer"),
        ("qwen3", "Qwen2Tokenizer", "builtin", "Qwen2Tokenizer"),
        ("phi3", "LlamaTokenizer", "mistral7b", None),  # (transformers forces phi3 to TokenizersBackend)
        ("qwen3", "LlamaTokenizer", "mistral7b", None),
    ],
)
def test_a_named_class_loads_directly_where_autotokenizer_loads_it(tmp_path, model_type, named, source, direct):
    """A tokenizer_config.json naming its class (Llama-2, Mistral, TinyLlama: ``LlamaTokenizer``; Gemma:
    ``GemmaTokenizer``) loads directly as the class ``AutoTokenizer`` makes of it for the model type (the
    same tokenizer); elsewhere ``AutoTokenizer`` decides."""
    import transformers
    from transformers import AutoTokenizer

    from specd.model.tokenizer_load import _direct_class

    folder = _named_folder(tmp_path, model_type, named, source)
    assert _direct_class(folder) == direct
    (tmp_path / "tekken").mkdir()
    (tmp_path / "tekken" / "tekken.json").write_text("{}")  # Mistral's own format: AutoTokenizer decides
    for f in folder.iterdir():
        shutil.copy(f, tmp_path / "tekken" / f.name)
    assert _direct_class(tmp_path / "tekken") is None
    ours, ref = load_tokenizer(folder), AutoTokenizer.from_pretrained(str(folder))
    assert type(ours) is type(ref) and (direct is None or type(ours) is getattr(transformers, direct))
    _same(ours, ref)


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "stories260K"])
def test_direct_load_skips_autotokenizer_and_its_imports(tmp_path, model_type):
    """A fresh process loading a converted GGUF's tokenizer, or the shipped stories260K folder's
    (sentencepiece, naming ``LlamaTokenizer``), never imports ``AutoTokenizer``'s module (which pulls in
    torch.distributed and sympy: ~1.7 s of CPU per process) nor torch (the server process of ``specd
    serve`` loads a tokenizer and no model)."""
    folder, size = (STORIES, 512) if model_type == "stories260K" else (_folder(tmp_path, model_type), 49152)
    mods = ("transformers.models.auto.tokenization_auto", "sympy", "torch")
    code = (
        "import sys; from specd.model.tokenizer_load import load_tokenizer; "
        f"t = load_tokenizer({str(folder)!r}); assert len(t) == {size}; "
        f"print(sorted(m for m in {mods!r} if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


def test_a_gguf_files_tokenizer_never_converts_its_weights(tmp_path):
    """The tokenizer comes from the config + tokenizer folder (no weights written); where the full
    conversion exists already (a ``--quantization none`` load) it is used as it is."""
    from specd.model.loader import cached_folder_of

    path, _ = model_gguf(tmp_path, "llama", layers=1)
    tok = load_tokenizer(path)
    folders = sg.cached_folders(path)
    assert len(folders) == 1 and f"-{sg._where(path)}-meta-" in folders[0].name
    assert not list((tmp_path / "cache").rglob("*.safetensors")) and len(tok) == len(tok.get_vocab())
    full = sg.cached_folder(path, weights=True)  # as a load without quantization converts it
    assert sg.converted_folder(path) == full and sg.converted_folder(path, weights=False) == folders[0]
    assert load_tokenizer(path).get_vocab() == tok.get_vocab()
    assert sg.cached_folders(path) == sorted([full, folders[0]])  # (nothing converted again)
    assert cached_folder_of(path, False, weights=False) == folders[0]  # a quantized load's folder: the same
