"""Head folders: the native layout (``save_head``) and loading either it or an EAGLE-3 checkpoint
(``load_head``; the EAGLE-3 mapping is in ``specd.model.eagle3``)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from specd.config import ModelConfig
from specd.model.eagle3 import from_eagle3
from specd.model.errors import LoadError
from specd.model.head import NATIVE_KEYS, EagleHead, head_config


def save_head(head: EagleHead, out: Path, meta: dict | None = None, dtype=torch.float16) -> None:
    """The native layout: config.json (``specd_head``) + model.safetensors (our parameter names
    and ``specd.d2t``); no embeddings and no head rows (the target's, by reference)."""
    from safetensors.torch import save_file

    assert head.d2t is not None
    out.mkdir(parents=True, exist_ok=True)
    sd = {f"{m}.weight": getattr(head, m).weight.detach().to(dtype).contiguous() for m in NATIVE_KEYS}
    sd["specd.d2t"] = head.d2t.cpu().contiguous()
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    c = head.cfg
    spec = {
        "format": 1,
        "target_layers": list(head.layers),
        "target_hidden_size": head.target_hidden,
        "draft_vocab_size": head.draft_vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "rms_norm_eps": c.rms_norm_eps,
        **(meta or {}),
    }
    (out / "config.json").write_text(json.dumps({"specd_head": spec}, indent=1) + "\n")


def _read(folder: Path) -> tuple:
    """(config dict, tensors) of a head folder (safetensors, or EAGLE's pytorch_model.bin)."""
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise LoadError(f"{folder}: not a head folder (config.json: {e})") from None
    files = sorted(folder.glob("*.safetensors"))
    if files:
        from safetensors.torch import load_file

        tensors: dict = {}
        for f in files:
            tensors.update(load_file(str(f)))
    elif (folder / "pytorch_model.bin").exists():
        tensors = torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise LoadError(f"{folder}: no model.safetensors or pytorch_model.bin")
    return cfg, {k.removeprefix("model."): v for k, v in tensors.items()}


def load_head(path, target, device=None, dtype=None) -> EagleHead:
    """A head folder, native (``specd_head`` in config.json) or EAGLE-3's published layout, bound
    to ``target`` (a ``LoadedModel``): its embeddings, and its head rows unless the file has its own."""
    folder = Path(path)
    cfg, t = _read(folder)
    tc = target.config
    dev, dt = device or target.device, dtype or target.dtype
    if "specd_head" in cfg:
        head, d2t, rows = _native(cfg["specd_head"], t, tc, folder)
    else:
        head, d2t, rows = from_eagle3(cfg, t, tc, folder)
    if head.target_hidden != tc.hidden_size or max(head.layers) >= tc.num_layers:
        raise LoadError(
            f"{folder}: made for a target with hidden size {head.target_hidden} reading layers "
            f"{list(head.layers)}, not {tc.hidden_size} / {tc.num_layers} layers ({target.path})"
        )
    if int(d2t.max()) >= tc.vocab_size or int(d2t.min()) < 0:
        raise LoadError(f"{folder}: draft-to-target id map out of the target's vocabulary")
    head.to(device=dev, dtype=dt)
    head.attach(target.model, d2t, rows.to(device=dev, dtype=dt) if rows is not None else None)
    return head.eval()


def _native(spec: dict, t: dict, tc: ModelConfig, folder: Path) -> tuple:
    cfg = head_config(
        tc,
        hidden_size=int(spec["hidden_size"]),
        intermediate_size=int(spec["intermediate_size"]),
        num_heads=int(spec["num_attention_heads"]),
        num_kv_heads=int(spec["num_key_value_heads"]),
        head_dim=int(spec["head_dim"]),
        rms_norm_eps=float(spec["rms_norm_eps"]),
    )
    head = EagleHead(cfg, tuple(spec["target_layers"]), int(spec["target_hidden_size"]))
    sd = {k: v.float() for k, v in t.items() if k != "specd.d2t"}
    missing = sorted(set(head.state_dict()) - set(sd))
    if missing or "specd.d2t" not in t:
        raise LoadError(f"{folder}: missing {(missing or ['specd.d2t'])[0]}")
    head.load_state_dict(sd, strict=False)
    return head, t["specd.d2t"].long(), None
