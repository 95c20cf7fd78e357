"""The draft model: its configuration and initial weights.

- :func:`build_draft`: a ``LlamaForCausalLM`` for a Llama / Qwen2 / Mistral target (the target's width
  by default), copying what fits from the target (embeddings, LM head, final norm, first decoder
  layers) and freezing the copied embeddings / head.
- Reduced-vocabulary drafts: :class:`DraftNet` (the target's embeddings by reference, decoder layers,
  norm, head rows of N tokens), :func:`reduced_config`, :func:`init_from_target`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F

__all__ = ["make_draft_config", "build_draft", "DraftNet", "reduced_config", "init_from_target"]


def _target_head_dim(cfg) -> int:
    hd = getattr(cfg, "head_dim", None)
    return int(hd) if hd else cfg.hidden_size // cfg.num_attention_heads


def _rope_parameters(cfg) -> dict:
    rp = getattr(cfg, "rope_parameters", None)
    if isinstance(rp, dict) and rp:
        return dict(rp)
    rs = getattr(cfg, "rope_scaling", None)
    out = dict(rs) if isinstance(rs, dict) else {"rope_type": "default"}
    out.setdefault("rope_type", out.pop("type", "default"))
    out["rope_theta"] = float(getattr(cfg, "rope_theta", 10000.0) or 10000.0)
    return out


def make_draft_config(
    target_config, *, layers: int = 1, hidden_size: int | None = None, max_position_embeddings: int | None = None
):
    """A ``LlamaConfig`` for a draft of ``target_config`` (a Llama, Qwen2 or Mistral config)."""
    from transformers import LlamaConfig

    tc = target_config
    H = int(hidden_size or tc.hidden_size)
    t_hd = _target_head_dim(tc)
    if H == tc.hidden_size:
        n_heads, n_kv, head_dim = tc.num_attention_heads, (tc.num_key_value_heads or tc.num_attention_heads), t_hd
        inter = tc.intermediate_size
    else:
        head_dim = t_hd if H % t_hd == 0 else 64 if H % 64 == 0 else H // max(1, H // 64) if H >= 64 else H
        n_heads = max(1, H // head_dim)
        head_dim = H // n_heads
        ratio = max(1, tc.num_attention_heads // (tc.num_key_value_heads or tc.num_attention_heads))
        n_kv = n_heads // ratio if n_heads % ratio == 0 and n_heads >= ratio else n_heads
        inter = int(round(tc.intermediate_size * H / tc.hidden_size / 8.0)) * 8 or 8
    # Qwen2 has q/k/v biases: give the draft biases too so target layers can be copied.
    attn_bias = bool(getattr(tc, "attention_bias", False)) or getattr(tc, "model_type", "") == "qwen2"
    eos = getattr(tc, "eos_token_id", None)
    cfg = LlamaConfig(
        vocab_size=tc.vocab_size,
        hidden_size=H,
        intermediate_size=inter,
        num_hidden_layers=int(layers),
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv,
        head_dim=head_dim,
        hidden_act=getattr(tc, "hidden_act", "silu"),
        max_position_embeddings=int(max_position_embeddings or tc.max_position_embeddings),
        rms_norm_eps=float(getattr(tc, "rms_norm_eps", 1e-6)),
        rope_parameters=_rope_parameters(tc),
        attention_bias=attn_bias,
        mlp_bias=False,
        tie_word_embeddings=bool(getattr(tc, "tie_word_embeddings", False)),
        bos_token_id=getattr(tc, "bos_token_id", None),
        eos_token_id=eos,
        pad_token_id=getattr(tc, "pad_token_id", None),
    )
    cfg.architectures = ["LlamaForCausalLM"]
    return cfg


def _inner(model):
    return getattr(model, "model", model)


def build_draft(
    target,
    *,
    layers: int = 1,
    hidden_size: int | None = None,
    copy_embeddings: bool = True,
    freeze_embeddings: bool = True,
    copy_layers: bool = True,
    seed: int | None = None,
):
    """Create a ``LlamaForCausalLM`` draft for ``target``: embeddings, LM head and final norm copied
    when ``copy_embeddings`` and the shapes allow, the first decoder layers when ``copy_layers`` (both
    only at the target's width), the copied embeddings / head frozen when ``freeze_embeddings``.

    Returns ``(draft, info)`` where ``info`` says what was copied/frozen.
    """
    from transformers import LlamaForCausalLM

    if seed is not None:
        torch.manual_seed(seed)
    cfg = make_draft_config(target.config, layers=layers, hidden_size=hidden_size)
    draft = LlamaForCausalLM(cfg).float()
    info: dict = {
        "copied_embeddings": False,
        "copied_lm_head": False,
        "copied_norm": False,
        "copied_layers": [],
        "frozen": [],
    }
    same_h = cfg.hidden_size == target.config.hidden_size
    with torch.no_grad():
        if copy_embeddings and same_h:
            _copy_embeddings(target, draft, info)
        if copy_layers and same_h:
            _copy_layers(_inner(target), _inner(draft), layers, info)
    if freeze_embeddings and info["copied_embeddings"]:
        _inner(draft).embed_tokens.weight.requires_grad_(False)
        info["frozen"].append("embed_tokens")
        if info["copied_lm_head"]:
            draft.get_output_embeddings().weight.requires_grad_(False)
            info["frozen"].append("lm_head")
    return draft, info


def _copy_embeddings(target, draft, info: dict) -> None:
    """Token embeddings, LM head (or its tie) and final norm, where the shapes match."""
    tin, din = _inner(target), _inner(draft)
    te = tin.embed_tokens.weight
    if te.shape == din.embed_tokens.weight.shape:
        din.embed_tokens.weight.copy_(te.float())
        info["copied_embeddings"] = True
    th = target.get_output_embeddings().weight
    dh = draft.get_output_embeddings().weight
    if th.shape == dh.shape and dh is not din.embed_tokens.weight:
        dh.copy_(th.float())
        info["copied_lm_head"] = True
    elif dh is din.embed_tokens.weight:
        info["copied_lm_head"] = info["copied_embeddings"]
    if hasattr(tin, "norm") and tin.norm.weight.shape == din.norm.weight.shape:
        din.norm.weight.copy_(tin.norm.weight.float())
        info["copied_norm"] = True


def _copy_layers(tin, din, layers: int, info: dict) -> None:
    """The target's first decoder layers into the draft's, where every tensor fits (a bias the
    target lacks starts at zero)."""
    for i in range(min(layers, len(tin.layers))):
        src = {k: v.float() for k, v in tin.layers[i].state_dict().items()}
        dst = din.layers[i].state_dict()
        if all(k in dst and dst[k].shape == v.shape for k, v in src.items()):
            missing = [k for k in dst if k not in src]
            if all(k.endswith("bias") for k in missing):
                for k in missing:
                    src[k] = torch.zeros_like(dst[k])
                din.layers[i].load_state_dict(src)
                info["copied_layers"].append(i)


# reduced-vocabulary drafts ----------------------------------------------------------------------
class DraftNet(torch.nn.Module):
    """Training-time draft: target embeddings (frozen, shared) -> decoder layers -> norm -> head rows."""

    def __init__(self, hf_cfg, embed: torch.Tensor, head_rows: torch.Tensor):
        super().__init__()
        from transformers import LlamaModel

        self.body = LlamaModel(hf_cfg)
        self.body.embed_tokens.weight = torch.nn.Parameter(embed, requires_grad=False)
        self.register_buffer("head_rows", head_rows, persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.body(input_ids=ids).last_hidden_state  # [B, T, d]
        return F.linear(h, self.head_rows)  # [B, T, N]


def reduced_config(target_dir: Path, layers: int):
    """The draft's ``LlamaConfig``: the target's, with ``layers`` decoder layers and a tied head."""
    from transformers import LlamaConfig

    cfg = json.loads((target_dir / "config.json").read_text())
    cfg.update(
        num_hidden_layers=layers, tie_word_embeddings=True, architectures=["LlamaForCausalLM"], model_type="llama"
    )
    return LlamaConfig(**{k: v for k, v in cfg.items() if k not in ("transformers_version",)})


def init_from_target(net: DraftNet, target_dir: Path, layers: int) -> None:
    """Copy the target's first ``layers`` decoder layers and its final norm into the draft."""
    from safetensors.torch import load_file

    w = {}
    for f in sorted(target_dir.glob("*.safetensors")):
        w.update(load_file(str(f)))
    own = net.body.state_dict()
    with torch.no_grad():
        for name, t in own.items():
            src = f"model.{name}"
            if name.startswith("layers.") and int(name.split(".")[1]) < layers and src in w:
                t.copy_(w[src])
            elif name == "norm.weight":
                t.copy_(w["model.norm.weight"])
