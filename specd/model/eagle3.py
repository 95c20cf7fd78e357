"""EAGLE-3 checkpoints in their published layout (SafeAILab/EAGLE, Llama targets) <-> ``EagleHead``.

A published EAGLE-3 head is a folder with a Llama-style ``config.json`` (``hidden_size``,
``num_attention_heads``, ``num_key_value_heads``, ``intermediate_size``, ``rms_norm_eps``,
``rope_theta``, ``vocab_size``, ``draft_vocab_size``, optionally ``head_dim``,
``target_hidden_size`` and ``eagle_config.eagle_aux_hidden_state_layer_ids``) and its weights
(``model.safetensors`` or ``pytorch_model.bin``; a ``model.`` prefix is dropped). The mapping:

    fc.weight                                  -> fc.weight            [d, 3 d_target]
    midlayer.input_layernorm.weight            -> input_norm.weight    (on the token embedding)
    midlayer.hidden_norm.weight                -> hidden_norm.weight   (on the hidden input)
    midlayer.self_attn.{q,k,v}_proj.weight     -> qkv.weight           (concatenated q | k | v, [.., 2d])
    midlayer.self_attn.o_proj.weight           -> o.weight
    midlayer.post_attention_layernorm.weight   -> post_norm.weight
    midlayer.mlp.{gate,up}_proj.weight         -> gate_up.weight       (concatenated gate | up)
    midlayer.mlp.down_proj.weight              -> down.weight
    norm.weight                                -> norm.weight
    lm_head.weight                             -> the head rows        [draft_vocab_size, d] (its own)
    d2t                                        -> target ids = arange(N) + d2t (EAGLE stores offsets)
    t2d                                        -> not needed (the inverse map, a [V] bool mask)
    embed_tokens.weight (if present)           -> ignored: the target's embeddings are used

Features are the hidden states entering the target layers (2, n/2, n-3) (EAGLE-3's choice, as in
SGLang and vLLM) unless the config names ``eagle_aux_hidden_state_layer_ids``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from specd.config import ModelConfig
from specd.model.errors import LoadError
from specd.model.head import EagleHead, default_layers, head_config

_SIMPLE = {
    "fc.weight": "fc.weight",
    "midlayer.input_layernorm.weight": "input_norm.weight",
    "midlayer.hidden_norm.weight": "hidden_norm.weight",
    "midlayer.self_attn.o_proj.weight": "o.weight",
    "midlayer.post_attention_layernorm.weight": "post_norm.weight",
    "midlayer.mlp.down_proj.weight": "down.weight",
    "norm.weight": "norm.weight",
}
_QKV = ("midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight")
_GATE_UP = ("midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight")


def from_eagle3(cfg: dict, t: dict, tc: ModelConfig, folder: Path) -> tuple:
    """(``EagleHead``, d2t as target ids [N], own head rows [N, d]) from an EAGLE-3 folder's
    config and tensors, for the target config ``tc``."""
    need = [*_SIMPLE, *_QKV, *_GATE_UP, "lm_head.weight", "d2t"]
    missing = [k for k in need if k not in t]
    if missing:
        raise LoadError(f"{folder}: not a specd head nor an EAGLE-3 checkpoint (missing {missing[0]})")
    d = int(cfg["hidden_size"])
    H = int(cfg["num_attention_heads"])
    hcfg = head_config(
        tc,
        hidden_size=d,
        intermediate_size=int(cfg["intermediate_size"]),
        num_heads=H,
        num_kv_heads=int(cfg.get("num_key_value_heads", H)),
        head_dim=int(cfg.get("head_dim") or d // H),
        rms_norm_eps=float(cfg.get("rms_norm_eps", tc.rms_norm_eps)),
        rope_theta=float(cfg.get("rope_theta", tc.rope_theta)),
        rope_scaling=cfg.get("rope_scaling", tc.rope_scaling),
    )
    layers = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or default_layers(tc.num_layers)
    head = EagleHead(hcfg, tuple(layers), int(cfg.get("target_hidden_size") or tc.hidden_size))
    sd = {ours: t[theirs].float() for theirs, ours in _SIMPLE.items()}
    sd["qkv.weight"] = torch.cat([t[k].float() for k in _QKV])
    sd["gate_up.weight"] = torch.cat([t[k].float() for k in _GATE_UP])
    try:
        head.load_state_dict(sd)
    except RuntimeError as e:
        raise LoadError(f"{folder}: EAGLE-3 weights do not fit its config: {str(e).splitlines()[-1].strip()}") from None
    offsets = t["d2t"].long()
    return head, torch.arange(offsets.numel()) + offsets, t["lm_head.weight"].float()


def save_eagle3(head: EagleHead, out: Path, dtype=torch.float16) -> None:
    """Write ``head`` in EAGLE-3's published layout (its head rows as ``lm_head``; for tests and
    for exporting a specd-trained head to other servers)."""
    from safetensors.torch import save_file

    assert head.d2t is not None
    c = head.cfg
    H, KVH, D, inter = c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size
    sd = {theirs: getattr(head, ours.split(".")[0]).weight for theirs, ours in _SIMPLE.items()}
    qkv = head.qkv.weight
    sd.update(zip(_QKV, (qkv[: H * D], qkv[H * D : (H + KVH) * D], qkv[(H + KVH) * D :])))
    sd.update(zip(_GATE_UP, (head.gate_up.weight[:inter], head.gate_up.weight[inter:])))
    sd["lm_head.weight"] = head._dense_rows()
    tensors = {k: v.detach().to(dtype).contiguous() for k, v in sd.items()}
    d2t = head.d2t.cpu()
    tensors["d2t"] = (d2t - torch.arange(d2t.numel())).contiguous()
    t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
    t2d[d2t] = True
    tensors["t2d"] = t2d
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"))
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": c.hidden_size,
        "intermediate_size": inter,
        "num_attention_heads": H,
        "num_key_value_heads": KVH,
        "head_dim": D,
        "num_hidden_layers": 1,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "vocab_size": c.vocab_size,
        "draft_vocab_size": head.draft_vocab_size,
        "target_hidden_size": head.target_hidden,
        "tie_word_embeddings": False,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(head.layers)},
    }
    (out / "config.json").write_text(json.dumps(config, indent=1) + "\n")
