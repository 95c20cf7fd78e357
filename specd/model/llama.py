"""Llama-family decoder (Llama, Qwen2, Mistral) over a flat token batch and a paged KV cache.

``forward(input_ids [T], positions [T], kv [L,2,NB,BS,KVH,D], meta) -> hidden [T, d]``: tokens of
many requests at once (prefill chunks, decode tokens, draft trees); attention goes through the
backend chosen in ``specd.model.attention``. q/k/v and gate/up projections are fused at load time.
``forward(..., capture={i: None, ...})`` also hands back the hidden state entering each layer i
(the residual stream, Hugging Face's ``hidden_states[i]``) [T, d]: a feature head's input.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from specd.config import ModelConfig
from specd.model.attention import AttentionMetadata, TorchAttention
from specd.model.fused import fused_layers
from specd.model.quant import QuantLinear, addmm, embedding, linear


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    D = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D))  # [D/2]
    sc = cfg.rope_scaling
    if not sc:
        return inv
    kind = sc.get("rope_type", sc.get("type"))
    factor = float(sc.get("factor", 1.0))
    if kind == "linear":
        return inv / factor
    if kind == "llama3":
        low, high = float(sc.get("low_freq_factor", 1.0)), float(sc.get("high_freq_factor", 4.0))
        old = float(sc.get("original_max_position_embeddings", 8192))
        wavelen = 2 * math.pi / inv
        out = torch.where(wavelen > old / low, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * out / factor + smooth * out
        medium = (wavelen >= old / high) & (wavelen <= old / low)
        return torch.where(medium, smoothed, out)
    raise ValueError(f"unsupported rope scaling {kind!r}; supported: default, linear, llama3")


class Rotary(nn.Module):
    """cos/sin tables [positions, head_dim] (rotate_half convention, as HF Llama)."""

    def __init__(self, cfg: ModelConfig, max_positions: int):
        super().__init__()
        inv = rope_inv_freq(cfg)
        t = torch.arange(max_positions, dtype=torch.float64)
        freqs = torch.outer(t, inv)  # [P, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [P, D]
        self.register_buffer("cos", emb.cos().float(), persistent=False)
        self.register_buffer("sin", emb.sin().float(), persistent=False)


def _rms(x, w, eps):
    return F.rms_norm(x.float(), (x.shape[-1],), w.float(), eps).to(x.dtype)


class RMSNorm(nn.Module):
    """An RMSNorm weight (applied in ``LlamaModel.forward``)."""

    def __init__(self, d: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps


class Attention(nn.Module):
    """Parameters of one attention layer (q/k/v fused); ``LlamaModel.forward`` computes with them."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.H, self.KVH, self.D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden_size, (self.H + 2 * self.KVH) * self.D, bias=cfg.attention_bias)
        self.o = nn.Linear(self.H * self.D, cfg.hidden_size, bias=cfg.o_bias)
        self.scale = self.D**-0.5


class MLP(nn.Module):
    """Parameters of one SwiGLU MLP (gate/up fused)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)


class Block(nn.Module):
    """One decoder layer's parameters: the modules hold weights for loading; the one forward path is
    ``LlamaModel.forward``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg)
        self.post_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int | None = None):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        self.rotary = Rotary(cfg, max_positions or cfg.max_position_embeddings)
        self.backend = TorchAttention()  # default backend when forward() is not given one
        self.windows = tuple(cfg.window(i) for i in range(cfg.num_layers))  # each layer's sliding window (or None)

    # Up to this width a forward is dominated by per-op dispatch, not arithmetic: the fp32 path then
    # uses private pre-folded weight copies (see _flat_weights), which cost memory on bigger models.
    FOLD_MAX_HIDDEN = 1024

    def _flat_weights(self):
        """Plain tuples of weights for the lean forward (no nn.Module dispatch per op), built once.

        Small fp32 models (hidden size <= FOLD_MAX_HIDDEN) get folded copies: the RMSNorm weights
        are multiplied into the projection that follows, and the q/k projection is extended with
        its RoPE-rotated copy (rotate_half(x W^T) = x (R^T W)^T), so RoPE needs no extra matmul.
        """
        table = self.embed_table()
        w = getattr(self, "_flat", None)
        if w is not None and w[0] is table:
            return w
        cfg = self.cfg
        D, d, H, KVH = cfg.head_dim, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads
        wt = self.norm.weight
        rot = torch.zeros((D, D), dtype=wt.dtype, device=wt.device)
        h = D // 2
        idx = torch.arange(h)
        rot[idx + h, idx] = -1.0  # rotate_half(x) = x @ rot: out[:h] = -x[h:], out[h:] = x[:h]
        rot[idx, idx + h] = 1.0
        # fp32 RMSNorm as mean(x^2) + eps = addmm(eps, x*x, 1/d): one GEMV instead of a reduction chain
        mean_col = torch.full((d, 1), 1.0 / d, dtype=wt.dtype, device=wt.device)
        eps_col = torch.full((1, 1), cfg.rms_norm_eps, dtype=wt.dtype, device=wt.device)
        folded = wt.dtype == torch.float32 and d <= self.FOLD_MAX_HIDDEN and not self.quantized() and not cfg.o_bias
        layers = []
        with torch.no_grad():
            for blk in self.layers:
                w_qkv, b_qkv = _op(blk.attn.qkv), blk.attn.qkv.bias
                if not folded:
                    # o and down are used through addmm (residual + x @ W^T in one op): keep W^T views
                    # (a QuantLinear is its own op: the forward dispatches in quant.linear / addmm)
                    b_qkv = b_qkv if isinstance(w_qkv, torch.Tensor) else None
                    # norm weights in fp32 once (a bf16 RMSNorm computes in fp32: no cast per call)
                    layers.append(
                        (
                            blk.input_norm.weight.float(),
                            w_qkv,
                            b_qkv,
                            _op(blk.attn.o, t=True),
                            blk.post_norm.weight.float(),
                            _op(blk.mlp.gate_up),
                            _op(blk.mlp.down, t=True),
                        )
                    )
                    continue
                nqk = (H + KVH) * D
                w_rot = torch.einsum("ji,hjd->hid", rot, w_qkv[:nqk].view(H + KVH, D, d)).reshape(nqk, d)
                w_ext = torch.cat([w_qkv, w_rot]) * blk.input_norm.weight  # [(2H + 3KVH) D, d]
                b_ext = None
                if b_qkv is not None:
                    b_ext = torch.cat([b_qkv, (b_qkv[:nqk].view(H + KVH, D) @ rot).reshape(nqk)])
                w_gu = blk.mlp.gate_up.weight * blk.post_norm.weight
                layers.append((w_ext.t(), b_ext, blk.attn.o.weight.t(), w_gu.t(), blk.mlp.down.weight.t()))
        w = (table, folded, layers, self.norm.weight, rot, mean_col, eps_col)
        self._flat = w
        return w

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv: torch.Tensor, meta: AttentionMetadata, backend=None,
        capture: dict | None = None) -> torch.Tensor:  # fmt: skip
        """Lean functional forward over the same weights as the modules (fewer dispatched ops).

        On a small model every dispatched op costs more than its arithmetic, so the fp32 path
        counts ops: RMSNorm is x * rsqrt(addmm(eps, x*x, 1/d)) (* w, or w folded into the next
        projection), RoPE on q and k heads at once is one addcmul, and each residual add rides in an
        addmm.
        """
        backend = backend if backend is not None else self.backend
        cfg = self.cfg
        H, KVH, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        inter = cfg.intermediate_size
        emb, folded, layers, norm_w, rot, mean_col, eps_col = self._flat_weights()
        x = embedding(input_ids, emb).to(norm_w.dtype)  # [T, d] (a quantized table gives fp32)
        T = x.shape[0]
        dt = x.dtype
        cos = self.rotary.cos[positions].unsqueeze(1)  # [T, 1, D]
        sin = self.rotary.sin[positions].unsqueeze(1)
        if cos.dtype != dt:
            cos, sin = cos.to(dt), sin.to(dt)
        nq = H * D
        nqk = (H + KVH) * D
        nqkv = nqk + KVH * D
        scale = D**-0.5
        windows = self.windows
        if folded:
            for i, (w_ext_t, b_ext, w_o_t, w_gu_t, w_down_t) in enumerate(layers):
                _capture(capture, i, x)
                h = x * torch.addmm(eps_col, x * x, mean_col).rsqrt_()
                qkv = torch.mm(h, w_ext_t) if b_ext is None else torch.addmm(b_ext, h, w_ext_t)
                qk = torch.addcmul(qkv[:, :nqk].view(T, H + KVH, D) * cos, qkv[:, nqkv:].view(T, H + KVH, D), sin)
                kvl = kv[i]
                backend.write_kv(kvl, qk[:, H:], qkv[:, nqk:nqkv].view(T, KVH, D), meta.slot_mapping)
                o = backend.attention(qk[:, :H], kvl, meta, scale, windows[i])  # [T, H, D]
                x = torch.addmm(x, o.reshape(T, nq), w_o_t)  # x + o @ W_o^T
                h = x * torch.addmm(eps_col, x * x, mean_col).rsqrt_()
                gu = torch.mm(h, w_gu_t)
                x = torch.addmm(x, F.silu(gu[:, :inter]) * gu[:, inter:], w_down_t)
            return x * torch.addmm(eps_col, x * x, mean_col).rsqrt_() * norm_w
        return self._unfolded(x, positions, kv, meta, backend, capture, cos, sin)

    def _unfolded(self, x, positions, kv, meta, backend, capture, cos, sin) -> torch.Tensor:
        """The layers op by op (bf16 / fp16, bigger models, quantized projections), or for a quantized
        model on a CPU all layers in one C call (``specd.model.fused``)."""
        cfg = self.cfg
        H, KVH, D, eps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps
        _, _, layers, norm_w, rot, _, _ = self._flat_weights()
        T, inter = x.shape[0], cfg.intermediate_size
        nq, nqk = H * D, (H + KVH) * D
        fp32 = x.dtype == torch.float32

        def norm(x, w):
            if fp32:  # a row-wise mean, not a GEMV: BLAS picks its kernel (and sum order) by batch shape,
                # and a quantized model's rows are otherwise computed independently of each other
                return x * (x * x).mean(-1, keepdim=True).add_(eps).rsqrt_() * w
            return _rms(x, w, eps)

        fused = fused_layers(self, backend, kv, x)
        if fused is not None:  # a quantized model on a CPU: every layer in one C call (specd.model.fused)
            fused.run(x, positions, kv, meta, backend, capture)
            return norm(x, norm_w)
        o_bias = [blk.attn.o.bias if isinstance(blk.attn.o, nn.Linear) else None for blk in self.layers]
        for i, (w_in, w_qkv, b_qkv, w_o_t, w_post, w_gu, w_down_t) in enumerate(layers):
            qkv = linear(norm(_capture(capture, i, x), w_in), w_qkv, b_qkv)  # [T, (H + 2 KVH) D]
            qk = qkv[:, :nqk].reshape(T, H + KVH, D)
            qk = torch.addcmul(qk * cos, qk @ rot, sin)  # RoPE on q and k heads at once
            v = qkv[:, nqk:].view(T, KVH, D)
            kvl = kv[i]
            backend.write_kv(kvl, qk[:, H:], v, meta.slot_mapping)
            o = backend.attention(qk[:, :H], kvl, meta, D**-0.5, self.windows[i])  # [T, H, D]
            x = addmm(x, o.reshape(T, nq), w_o_t)  # x + o @ W_o^T
            if o_bias[i] is not None:  # (a QuantLinear adds its own)
                x = x + o_bias[i]
            gu = linear(norm(x, w_post), w_gu)
            x = addmm(x, F.silu(gu[:, :inter]) * gu[:, inter:], w_down_t)
        return norm(x, norm_w)

    def embed_table(self):
        """The token embedding table: ``embed.weight`` [V, d], or with tied embeddings in a quantized
        model the quantized head itself (``QuantLinear``, whose ``rows`` a lookup dequantizes)."""
        return self.embed if isinstance(self.embed, QuantLinear) else self.embed.weight

    def quantized(self) -> bool:
        """True when any projection is a ``QuantLinear``."""
        return any(isinstance(m, QuantLinear) for m in self.modules())

    d2t = None  # reduced-vocabulary draft: [N] target ids of its N head rows (see set_draft_vocab)

    def set_draft_vocab(self, d2t: torch.Tensor, head_rows: torch.Tensor) -> None:
        """Predict over N of the vocabulary's tokens only: ``head_rows`` [N, d] (the target's head
        rows of those tokens) and ``d2t`` [N] their ids. ``compute_logits`` still returns the whole
        vocabulary, -inf outside the N tokens, so a token outside them is simply never drafted."""
        self.d2t, self.head_rows = d2t, head_rows

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.d2t is None:
            return self.lm_head(hidden).float()  # [N, vocab]
        small = linear(hidden, self.head_rows).float()  # [N, draft vocab]
        out = torch.full((hidden.shape[0], self.cfg.vocab_size), float("-inf"), device=hidden.device)
        out.index_copy_(1, self.d2t, small)  # [N, vocab]
        return out


def _capture(capture: dict | None, i: int, x: torch.Tensor) -> torch.Tensor:
    """Feature heads: ``capture`` (layer index -> None) gets the hidden state entering layer i; x."""
    if capture is not None and i in capture:
        capture[i] = x
    return x


def _op(mod, t: bool = False):
    """A projection for the lean forward: a ``QuantLinear`` as is, else its weight (``t``: W^T for addmm)."""
    if isinstance(mod, QuantLinear):
        return mod
    return mod.weight.t() if t else mod.weight


# HF parameter names -> ours. Fused projections are assembled in load_state_dict_hf.
def hf_layer_names(i: int) -> dict:
    p = f"model.layers.{i}."
    return {
        "input_norm.weight": p + "input_layernorm.weight",
        "post_norm.weight": p + "post_attention_layernorm.weight",
        "attn.o.weight": p + "self_attn.o_proj.weight",
        "mlp.down.weight": p + "mlp.down_proj.weight",
    }
