"""Saving a trained draft: :func:`save_draft` (an HF checkpoint with the target's tokenizer files and
generation config) and :func:`export_reduced` (a reduced-vocabulary draft: its layers, norm and
draft-to-target map, no embeddings)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from specd.training.draft import DraftNet

__all__ = ["TOKENIZER_FILES", "save_draft", "target_generation_config", "export_reduced"]

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)


def save_draft(
    draft,
    out_dir: str | os.PathLike,
    *,
    target_dir: str | os.PathLike | None = None,
    tokenizer=None,
    dtype: torch.dtype | None = None,
    generation_config=None,
) -> None:
    """Save ``draft`` as an HF checkpoint; copy tokenizer files (and generation config) from the target."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for p in draft.parameters():
        p.requires_grad_(True)
    m = draft
    if dtype is not None and dtype != torch.float32:
        import copy

        m = copy.deepcopy(draft).to(dtype)
    m.config.dtype = dtype or torch.float32
    m.save_pretrained(out)
    copied = False
    if target_dir is not None:
        for name in TOKENIZER_FILES:
            src = Path(target_dir) / name
            if src.is_file():
                shutil.copyfile(src, out / name)
                copied = True
    if not copied and tokenizer is not None:
        tokenizer.save_pretrained(out)
    if generation_config is not None:
        generation_config.save_pretrained(out)


def target_generation_config(target_dir, cfg):
    """The target's ``GenerationConfig`` (else one from ``cfg``'s special token ids)."""
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(target_dir)
    except Exception:  # noqa: BLE001
        return GenerationConfig(
            bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id, pad_token_id=cfg.pad_token_id
        )


def export_reduced(net: DraftNet, hf_cfg, d2t: torch.Tensor, out: Path, meta: dict) -> None:
    """config.json (+ ``specd_draft``) and model.safetensors: layers, norm, ``specd.d2t``; no embeddings."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    tensors = {
        f"model.{k}": v.detach().to(torch.float16).contiguous()
        for k, v in net.body.state_dict().items()
        if not k.startswith("embed_tokens")
    }
    tensors["specd.d2t"] = d2t.contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = hf_cfg.to_dict()
    cfg["specd_draft"] = {"format": 1, "target_embeddings": True, "draft_vocab_size": int(d2t.numel()), **meta}
    (out / "config.json").write_text(json.dumps(cfg, indent=1) + "\n")
