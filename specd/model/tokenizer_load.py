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
# AutoTokenizer loads as that class (``TokenizersBackend``) from tokenizer.json, as it is; others (qwen2)
# it maps to a class of the model type's own (tests/test_tokenizer_load.py checks both against AutoTokenizer)
FAST_AS_IS = ("llama", "mistral", "mixtral", "qwen3", "qwen3_moe", "gemma2", "gemma3_text", "phi3")


def _fast_as_is(folder: Path) -> bool:
    """True where ``AutoTokenizer`` would load the folder as ``PreTrainedTokenizerFast`` itself (a
    converted GGUF file's folder, specd's own models): that class then loads it directly."""
    try:
        tok_cfg = json.loads((folder / "tokenizer_config.json").read_text())
        model_type = json.loads((folder / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return False
    return (
        isinstance(tok_cfg, dict)
        and tok_cfg.get("tokenizer_class") in ("PreTrainedTokenizerFast", "TokenizersBackend")
        and "auto_map" not in tok_cfg
        and model_type in FAST_AS_IS
        and (folder / "tokenizer.json").is_file()
    )


def load_tokenizer(path: Path):
    """The tokenizer of a checkpoint folder or GGUF file (``tokenizer_folder``); LoadError if none loads.

    ``AutoTokenizer`` picks the class; where it would pick ``PreTrainedTokenizerFast`` (``_fast_as_is``)
    that class loads the folder directly: the same tokenizer without what ``AutoTokenizer`` imports on
    the way (torch, torch.distributed, sympy: ~1.7 s of CPU, twice per ``specd serve`` start)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    path = tokenizer_folder(path)
    if not any((path / f).exists() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        raise LoadError(f"{path}: no tokenizer files (tokenizer.json / tokenizer.model)")
    try:
        if _fast_as_is(path):
            from transformers import PreTrainedTokenizerFast

            return PreTrainedTokenizerFast.from_pretrained(str(path), local_files_only=True)
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - turn any tokenizer failure into one line
        raise LoadError(f"{path}: tokenizer failed to load: {str(e).splitlines()[0]}") from None
