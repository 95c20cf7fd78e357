"""A checkpoint's tokenizer, without torch: ``specd serve``'s server process loads the tokenizer (chat
templates, detokenizing, request checks) and never a model, so this module and what it imports stay off
torch (``tests/test_tokenizer_load.py`` checks it in a fresh process); ``specd.model.loader`` re-exports it."""

from __future__ import annotations

import json
import os
from pathlib import Path

from specd.model.errors import LoadError


def tokenizer_folder(path) -> Path:
    """The folder holding a checkpoint's tokenizer: a folder as is; for a GGUF file its cached
    conversion where there is one already, else its config + tokenizer folder (``cached_folder(
    weights=False)``: the metadata converted, never the weights; the full conversion writes the
    whole model dequantized to fp32, 7 GB for a 1.7B file)."""
    path = Path(path)
    if path.is_dir():
        return path
    from specd.model.gguf import cached_folder, converted_folder, is_gguf_path

    if not is_gguf_path(path):
        return path
    return converted_folder(path) or cached_folder(path, weights=False)


# config.json model types whose folders' ``PreTrainedTokenizerFast`` (tokenizer_config.json) transformers'
# AutoTokenizer loads as that class (``TokenizersBackend``) from tokenizer.json, as it is; others it maps to a
# class of the model type's own, loaded here directly too (OWN_CLASS). A folder naming a class (Llama-2 and
# TinyLlama checkpoints name ``LlamaTokenizer``, Mistral's too, Gemma's ``GemmaTokenizer``) loads directly as
# what AutoTokenizer makes of it for the model type: NAMED[model_type] = (the class named, "Fast" or not; the
# class loaded). tests/test_tokenizer_load.py checks every case against AutoTokenizer.
FAST_AS_IS = ("llama", "mistral", "mixtral", "qwen3", "qwen3_moe", "gemma2", "gemma3_text", "phi3")
OWN_CLASS = {"qwen2": "Qwen2Tokenizer"}
NAMED = {
    "llama": ("LlamaTokenizer", "LlamaTokenizer"),  # (a byte-level tokenizer.json: AutoTokenizer decides)
    "mistral": ("LlamaTokenizer", "PreTrainedTokenizerFast"),
    "mixtral": ("LlamaTokenizer", "PreTrainedTokenizerFast"),
    **dict.fromkeys(("qwen3", "qwen3_moe"), ("Qwen2Tokenizer", "Qwen2Tokenizer")),
    **dict.fromkeys(("gemma", "gemma2", "gemma3", "gemma3_text"), ("GemmaTokenizer", "GemmaTokenizer")),
}
_FAST_NAMES = ("PreTrainedTokenizerFast", "TokenizersBackend")


def _direct_class(folder: Path) -> str | None:
    """The transformers class ``AutoTokenizer`` would load the folder as, where that class can load it
    directly (a converted GGUF file's folder, specd's own models, a checkpoint naming its model type's
    class, or a class as NAMED): ``PreTrainedTokenizerFast`` or that class; None: ``AutoTokenizer``
    decides (among others: a llama folder naming ``LlamaTokenizer`` over a byte-level tokenizer.json)."""
    try:
        tok_cfg = json.loads((folder / "tokenizer_config.json").read_text())
        model_type = json.loads((folder / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(tok_cfg, dict) or "auto_map" in tok_cfg or not (folder / "tokenizer.json").is_file():
        return None
    if (folder / "tekken.json").is_file():  # (with mistral_common installed AutoTokenizer loads it instead)
        return None
    named = tok_cfg.get("tokenizer_class")
    if model_type in FAST_AS_IS and named in _FAST_NAMES:
        return "PreTrainedTokenizerFast"
    own = OWN_CLASS.get(model_type)
    if own is not None and named in (*_FAST_NAMES, own, own + "Fast"):
        return own
    named_as, loaded_as = NAMED.get(model_type, (None, None))
    if not isinstance(named, str) or named.removesuffix("Fast") != named_as:
        return None
    if loaded_as == "LlamaTokenizer":  # (AutoTokenizer's test for a byte-level tokenizer.json, as it is)
        try:
            if '"ByteLevel"' in (folder / "tokenizer.json").read_text(encoding="utf-8"):
                return None
        except (OSError, ValueError):
            return None
    return loaded_as


def load_tokenizer(path: Path):
    """The tokenizer of a checkpoint folder or GGUF file (``tokenizer_folder``); LoadError if none loads.

    ``AutoTokenizer`` picks the class; where the folder says which (``_direct_class``) that class loads it
    directly: the same tokenizer without what ``AutoTokenizer`` imports on the way (torch, torch.distributed,
    sympy: ~1.7 s of CPU, twice per ``specd serve`` start, and torch's ~200 MB in the server process)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    path = tokenizer_folder(path)
    if not any((path / f).exists() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        raise LoadError(f"{path}: no tokenizer files (tokenizer.json / tokenizer.model)")
    try:
        direct = _direct_class(path)
        if direct is not None:
            import transformers

            return getattr(transformers, direct).from_pretrained(str(path), local_files_only=True)
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - turn any tokenizer failure into one line
        raise LoadError(f"{path}: tokenizer failed to load: {str(e).splitlines()[0]}") from None
