"""Llama-family decoder over a flat token batch and a paged KV cache: Llama, Qwen2, Mistral, Qwen3,
Gemma 2 / 3, Phi-3 and the mixtures of experts Qwen3-MoE and Mixtral (what their layers add to
Llama's: ``specd.config.ModelConfig``; a mixture's MLP: ``specd.model.moe``).

``forward(input_ids [T], positions [T], kv [L,2,NB,BS,KVH,D], meta) -> hidden [T, d]``: tokens of
many requests at once (prefill chunks, decode tokens, draft trees); attention goes through the
backend chosen in ``specd.model.attention``. q/k/v and gate/up projections are fused at load time.
``forward(..., capture={i: None, ...})`` also hands back the hidden state entering each layer i
(the residual stream, Hugging Face's ``hidden_states[i]``) [T, d]: a feature head's input.
``forward(..., ops=invariant.ON)`` / ``compute_logits(hidden, ops=...)``: the GEMMs, RMSNorms and
attention through ``specd.model.invariant`` (batch-invariant kernels on CUDA, ``--batch-invariant``);
the default ``invariant.OFF`` is the ordinary path, bit for bit.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from specd.config import ModelConfig
from specd.model import invariant
from specd.model.attention import AttentionMetadata, TorchAttention
from specd.model.fused import fused_layers
from specd.model.moe import SparseMoE
from specd.model.quant import QuantLinear, embedding


def base_inv_freq(theta: float, dim: int) -> torch.Tensor:
    """Unscaled RoPE frequencies of ``dim`` rotated dims [dim/2] (float64)."""
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """The (global layers') RoPE frequencies [rotary_dim/2] with ``rope_scaling`` applied (linear,
    llama3; for LongRoPE the short factors', see ``longrope``)."""
    inv = base_inv_freq(cfg.rope_theta, cfg.rotary_dim)  # [D/2]
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
    if kind == "longrope":
        return longrope(cfg)[0]
    raise ValueError(f"unsupported rope scaling {kind!r}; supported: default, linear, llama3, longrope")


def longrope(cfg: ModelConfig) -> tuple:
    """Phi-3's LongRoPE: (frequencies with the short factors, with the long factors, the cos/sin
    scale) as transformers computes them. transformers picks one set per forward by the sequence's
    length (long past ``original_max_position_embeddings``); specd picks per position, so a token's
    encoding does not depend on the batch: equal to transformers up to that length."""
    sc = cfg.rope_scaling or {}
    inv = base_inv_freq(cfg.rope_theta, cfg.rotary_dim)
    short = inv / torch.tensor(sc["short_factor"], dtype=torch.float64)
    long = inv / torch.tensor(sc["long_factor"], dtype=torch.float64)
    orig = int(sc["original_max_position_embeddings"])
    factor = sc.get("factor") or sc.get("max_position_embeddings", cfg.max_position_embeddings) / orig
    scale = sc.get("attention_factor")
    if scale is None:
        scale = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    return short, long, float(scale)


class Rotary(nn.Module):
    """cos/sin tables [positions, head_dim] (rotate_half convention, as HF Llama): ``cos`` / ``sin``
    for the global layers, ``cos_local`` / ``sin_local`` for Gemma 3's sliding layers (their own
    base, unscaled). Partial rotary (Phi-4-mini): the dims past ``rotary_dim`` get cos 1, sin 0."""

    def __init__(self, cfg: ModelConfig, max_positions: int):
        super().__init__()
        if torch.get_default_device().type == "meta":  # a skeleton (a GGUF load puts real tables in):
            # shapes only; computing them on the meta device imports torch._dynamo (~1.5 s of CPU)
            for suffix in ("", "_local") if cfg.rope_local_theta is not None else ("",):
                for kind in ("cos", "sin"):
                    self.register_buffer(kind + suffix, torch.empty(max_positions, cfg.head_dim), persistent=False)
            return
        t = torch.arange(max_positions, dtype=torch.float64)
        sc = cfg.rope_scaling or {}
        if sc.get("rope_type", sc.get("type")) == "longrope":
            short, long, scale = longrope(cfg)
            orig = int(sc["original_max_position_embeddings"])
            freqs = torch.where((t < orig).unsqueeze(1), torch.outer(t, short), torch.outer(t, long))
        else:
            freqs, scale = torch.outer(t, rope_inv_freq(cfg)), 1.0  # [P, r/2]
        self._tables("", freqs, scale, cfg.head_dim)
        if cfg.rope_local_theta is not None:
            self._tables(
                "_local", torch.outer(t, base_inv_freq(cfg.rope_local_theta, cfg.rotary_dim)), 1.0, cfg.head_dim
            )

    def _tables(self, suffix: str, freqs: torch.Tensor, scale: float, D: int) -> None:
        emb = torch.cat([freqs, freqs], dim=-1)  # [P, r]
        cos, sin = emb.cos() * scale, emb.sin() * scale
        if emb.shape[1] < D:  # partial rotary: the rest of each head passes through
            P, rest = emb.shape[0], D - emb.shape[1]
            cos = torch.cat([cos, torch.ones(P, rest, dtype=cos.dtype)], 1)
            sin = torch.cat([sin, torch.zeros(P, rest, dtype=sin.dtype)], 1)
        self.register_buffer("cos" + suffix, cos.float(), persistent=False)
        self.register_buffer("sin" + suffix, sin.float(), persistent=False)


def rot_matrix(D: int, r: int, dtype: torch.dtype, device) -> torch.Tensor:
    """[D, D] with rotate_half(x) = x @ rot over the first ``r`` dims (the rest: 0):
    out[:h] = -x[h:r], out[h:r] = x[:h], h = r / 2."""
    rot = torch.zeros((D, D), dtype=dtype, device=device)
    h = r // 2
    idx = torch.arange(h)
    rot[idx + h, idx] = -1.0
    rot[idx, idx + h] = 1.0
    return rot


def _rms(x, w, eps):
    return F.rms_norm(x.float(), (x.shape[-1],), w.float(), eps).to(x.dtype)


class RMSNorm(nn.Module):
    """An RMSNorm weight (applied in ``LlamaModel.forward``; Gemma's 1 + w is stored as such at load)."""

    def __init__(self, d: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps


class Attention(nn.Module):
    """Parameters of one attention layer (q/k/v fused; Qwen3 / Gemma 3: per-head q and k norms);
    ``LlamaModel.forward`` computes with them."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.H, self.KVH, self.D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden_size, (self.H + 2 * self.KVH) * self.D, bias=cfg.attention_bias)
        self.o = nn.Linear(self.H * self.D, cfg.hidden_size, bias=cfg.o_bias)
        self.scale = cfg.attn_scale or self.D**-0.5
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.D, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.D, cfg.rms_norm_eps)


class MLP(nn.Module):
    """Parameters of one gated MLP (gate/up fused; SwiGLU, or GeGLU for Gemma)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)


class Block(nn.Module):
    """One decoder layer's parameters: the modules hold weights for loading; the one forward path is
    ``LlamaModel.forward``. Gemma's layer also norms the attention's and the MLP's outputs before
    their residual adds (``attn_out_norm``, ``mlp_out_norm``); its pre-MLP norm is ``post_norm``.
    A mixture of experts' layer ``i`` (``ModelConfig.moe_layers``) has a ``SparseMoE`` for its MLP."""

    def __init__(self, cfg: ModelConfig, i: int = 0):
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg)
        self.post_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SparseMoE(cfg) if cfg.is_moe(i) else MLP(cfg)
        if cfg.gemma_norms:
            self.attn_out_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.mlp_out_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LayerExtras(NamedTuple):
    """What one layer adds to Llama's, for the op-by-op forward (``LlamaModel._family_layers``)."""

    qk_norm: torch.Tensor | None  # [H + KVH, D] fp32: q heads' norm weights, then k heads'
    o_bias: torch.Tensor | None  # [d] (a quantized o adds its own)
    attn_out_norm: torch.Tensor | None  # [d] fp32 (Gemma)
    mlp_out_norm: torch.Tensor | None  # [d] fp32 (Gemma)
    local_rope: bool  # Gemma 3's sliding layers: their own RoPE tables


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int | None = None):
        super().__init__()
        self.cfg = cfg
        # built on the meta device (a GGUF load: every tensor comes from the file), the table gets no
        # random init: nn.Embedding's normal_ there imports torch._dynamo (~2 s of a load)
        meta = torch.get_default_device().type == "meta"
        table = torch.empty(cfg.vocab_size, cfg.hidden_size) if meta else None
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=table)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_layers))
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

        Small fp32 models (hidden size <= FOLD_MAX_HIDDEN) with Llama's layer (windows and q/k/v
        biases allowed) get folded copies: the RMSNorm weights are multiplied into the projection
        that follows, and the q/k projection is extended with its RoPE-rotated copy
        (rotate_half(x W^T) = x (R^T W)^T), so RoPE needs no extra matmul.
        """
        table = self.embed_table()
        w = getattr(self, "_flat", None)
        if w is not None and w[0] is table:
            return w
        cfg = self.cfg
        d, wt = cfg.hidden_size, self.norm.weight
        rot = rot_matrix(cfg.head_dim, cfg.rotary_dim, wt.dtype, wt.device)
        # fp32 RMSNorm as mean(x^2) + eps = addmm(eps, x*x, 1/d): one GEMV instead of a reduction chain
        mean_col = torch.full((d, 1), 1.0 / d, dtype=wt.dtype, device=wt.device)
        eps_col = torch.full((1, 1), cfg.rms_norm_eps, dtype=wt.dtype, device=wt.device)
        folded = (
            wt.dtype == torch.float32
            and wt.device.type == "cpu"  # (the folded path calls torch.mm / addmm: no invariant ops)
            and d <= self.FOLD_MAX_HIDDEN
            and not self.quantized()
            and not cfg.o_bias
            and not cfg.beyond_kernel()
        )
        with torch.no_grad():
            layers = [self._folded_layer(blk, rot) if folded else _plain_layer(blk) for blk in self.layers]
            self._extras = [self._layer_extras(i, blk) for i, blk in enumerate(self.layers)]
        w = (table, folded, layers, self.norm.weight, rot, mean_col, eps_col)
        self._flat = w
        return w

    def _folded_layer(self, blk, rot: torch.Tensor) -> tuple:
        """(qkv + RoPE-rotated q/k rows with the input norm folded in, W^T; their bias; W_o^T;
        gate/up with the post norm folded in, W^T; W_down^T)."""
        cfg = self.cfg
        D, d, H, KVH = cfg.head_dim, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads
        w_qkv, b_qkv = blk.attn.qkv.weight, blk.attn.qkv.bias
        nqk = (H + KVH) * D
        w_rot = torch.einsum("ji,hjd->hid", rot, w_qkv[:nqk].view(H + KVH, D, d)).reshape(nqk, d)
        w_ext = torch.cat([w_qkv, w_rot]) * blk.input_norm.weight  # [(2H + 3KVH) D, d]
        b_ext = None
        if b_qkv is not None:
            b_ext = torch.cat([b_qkv, (b_qkv[:nqk].view(H + KVH, D) @ rot).reshape(nqk)])
        w_gu = blk.mlp.gate_up.weight * blk.post_norm.weight
        return (w_ext.t(), b_ext, blk.attn.o.weight.t(), w_gu.t(), blk.mlp.down.weight.t())

    def _layer_extras(self, i: int, blk) -> LayerExtras:
        cfg = self.cfg
        qk = None
        if cfg.qk_norm:
            H, KVH, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
            q_w, k_w = blk.attn.q_norm.weight.float(), blk.attn.k_norm.weight.float()
            qk = torch.cat([q_w.expand(H, D), k_w.expand(KVH, D)])  # [H + KVH, D]
        o_bias = blk.attn.o.bias if isinstance(blk.attn.o, nn.Linear) else None
        gemma = cfg.gemma_norms
        return LayerExtras(
            qk,
            o_bias,
            blk.attn_out_norm.weight.float() if gemma else None,
            blk.mlp_out_norm.weight.float() if gemma else None,
            cfg.rope_local_theta is not None and self.windows[i] is not None,
        )

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv: torch.Tensor, meta: AttentionMetadata, backend=None,
        capture: dict | None = None, ops: invariant.InvariantOps = invariant.OFF) -> torch.Tensor:  # fmt: skip
        """Lean functional forward over the same weights as the modules (fewer dispatched ops).
        ``ops``: the GEMMs, norms and attention of the op-by-op paths (``specd.model.invariant``).

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
        if cfg.embed_scale != 1.0:  # Gemma: sqrt(d), rounded to the activations' dtype as transformers does
            x = x * torch.tensor(cfg.embed_scale, dtype=x.dtype)
        T = x.shape[0]
        cos, sin = self._rope(positions, x.dtype)
        if not folded:
            return self._unfolded(x, positions, kv, meta, backend, capture, cos, sin, ops)
        nq = H * D
        nqk = (H + KVH) * D
        nqkv = nqk + KVH * D
        scale = D**-0.5
        windows = self.windows
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

    def _rope(self, positions: torch.Tensor, dt: torch.dtype) -> tuple:
        """(cos, sin) [T, 1, D] of ``positions`` in dtype ``dt``; with Gemma 3's local tables, pairs
        (global, local) of them."""
        r = self.rotary
        cos, sin = r.cos[positions].unsqueeze(1), r.sin[positions].unsqueeze(1)  # [T, 1, D]
        if cos.dtype != dt:
            cos, sin = cos.to(dt), sin.to(dt)
        if not hasattr(r, "cos_local"):
            return cos, sin
        cl, sl = r.cos_local[positions].unsqueeze(1).to(dt), r.sin_local[positions].unsqueeze(1).to(dt)
        return (cos, cl), (sin, sl)

    def _norm_fn(self, x_dtype: torch.dtype, ops: invariant.InvariantOps = invariant.OFF):
        eps = self.cfg.rms_norm_eps

        def norm(x, w):
            if ops.applies(x):  # the batch-invariant kernel (w [D] or per head [heads, D])
                return ops.rms_norm(x, w, eps)
            if x_dtype == torch.float32:  # a row-wise mean, not a GEMV: BLAS picks its kernel (and sum order)
                # by batch shape, and a quantized model's rows are otherwise computed independently of each other
                return x * (x * x).mean(-1, keepdim=True).add_(eps).rsqrt_() * w
            if w.dim() == 1:
                return _rms(x, w, eps)
            xf = x.float()  # q/k norms: [.., heads, D] by [heads, D] weights, in fp32 as transformers does
            return (xf * (xf * xf).mean(-1, keepdim=True).add_(eps).rsqrt_() * w.float()).to(x.dtype)

        return norm

    def _unfolded(self, x, positions, kv, meta, backend, capture, cos, sin, ops=invariant.OFF) -> torch.Tensor:
        """The layers op by op (bf16 / fp16, bigger models, quantized projections), or for a quantized
        model on a CPU all layers in one C call (``specd.model.fused``)."""
        cfg = self.cfg
        H, KVH, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        _, _, layers, norm_w, rot, _, _ = self._flat_weights()
        T, inter = x.shape[0], cfg.intermediate_size
        nq, nqk = H * D, (H + KVH) * D
        norm = self._norm_fn(x.dtype, ops)
        fused = fused_layers(self, backend, kv, x)
        if fused is not None:  # a quantized model on a CPU: every layer in one C call (specd.model.fused)
            fused.run(x, positions, kv, meta, backend, capture)
            return norm(x, norm_w)
        if cfg.beyond_kernel():
            return self._family_layers(x, kv, meta, backend, capture, cos, sin, ops)
        for i, (w_in, w_qkv, b_qkv, w_o_t, w_post, w_gu, w_down_t) in enumerate(layers):
            qkv = ops.linear(norm(_capture(capture, i, x), w_in), w_qkv, b_qkv)  # [T, (H + 2 KVH) D]
            qk = qkv[:, :nqk].reshape(T, H + KVH, D)
            qk = torch.addcmul(qk * cos, qk @ rot, sin)  # RoPE on q and k heads at once
            v = qkv[:, nqk:].view(T, KVH, D)
            kvl = kv[i]
            backend.write_kv(kvl, qk[:, H:], v, meta.slot_mapping)
            o = ops.attention(backend, qk[:, :H], kvl, meta, D**-0.5, self.windows[i])  # [T, H, D]
            x = ops.addmm(x, o.reshape(T, nq), w_o_t)  # x + o @ W_o^T
            if self._extras[i].o_bias is not None:  # (a QuantLinear adds its own)
                x = x + self._extras[i].o_bias
            gu = ops.linear(norm(x, w_post), w_gu)
            x = ops.addmm(x, F.silu(gu[:, :inter]) * gu[:, inter:], w_down_t)
        return norm(x, norm_w)

    def _family_layers(self, x, kv, meta, backend, capture, cos, sin, ops=invariant.OFF) -> torch.Tensor:
        """The layers of architectures beyond Llama's (``ModelConfig.beyond_kernel``), op by op:
        q/k norms before RoPE, Gemma's output norms, GeGLU, its attention scale and soft-capping,
        Gemma 3's local RoPE tables, partial rotary (the rotation matrix covers the rotated dims), a
        mixture of experts' MLP (``w_gu`` the layer's ``SparseMoE``)."""
        cfg = self.cfg
        H, KVH, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        _, _, layers, norm_w, rot, _, _ = self._flat_weights()
        T, inter = x.shape[0], cfg.intermediate_size
        nq, nqk = H * D, (H + KVH) * D
        norm = self._norm_fn(x.dtype, ops)
        act = F.silu if cfg.hidden_act == "silu" else lambda g: F.gelu(g, approximate="tanh")
        scale = cfg.attn_scale or D**-0.5
        for i, (w_in, w_qkv, b_qkv, w_o_t, w_post, w_gu, w_down_t) in enumerate(layers):
            ex = self._extras[i]
            qkv = ops.linear(norm(_capture(capture, i, x), w_in), w_qkv, b_qkv)  # [T, (H + 2 KVH) D]
            qk = qkv[:, :nqk].reshape(T, H + KVH, D)
            if ex.qk_norm is not None:
                qk = norm(qk, ex.qk_norm)  # each head over its D dims
            c, s = (cos[ex.local_rope], sin[ex.local_rope]) if isinstance(cos, tuple) else (cos, sin)
            qk = torch.addcmul(qk * c, qk @ rot, s)  # RoPE on q and k heads at once
            backend.write_kv(kv[i], qk[:, H:], qkv[:, nqk:].view(T, KVH, D), meta.slot_mapping)
            if cfg.attn_softcap is None:
                o = ops.attention(backend, qk[:, :H], kv[i], meta, scale, self.windows[i])  # [T, H, D]
            else:  # (soft-capped scores: the torch attention, also with the invariant ops)
                o = softcap_attention(qk[:, :H], kv[i], meta, scale, self.windows[i], cfg.attn_softcap)
            x = _residual(x, o.reshape(T, nq), w_o_t, ex.o_bias, ex.attn_out_norm, norm, ops)
            if isinstance(w_gu, SparseMoE):
                x = x + w_gu(norm(x, w_post), ops)  # only each token's chosen experts run
                continue
            gu = ops.linear(norm(x, w_post), w_gu)
            x = _residual(x, act(gu[:, :inter]) * gu[:, inter:], w_down_t, None, ex.mlp_out_norm, norm, ops)
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
    def compute_logits(self, hidden: torch.Tensor, ops: invariant.InvariantOps = invariant.OFF) -> torch.Tensor:
        """``hidden [N, d]`` -> fp32 logits [N, vocab]; ``ops``: the head's GEMM (``specd.model.invariant``)."""
        cap = self.cfg.final_softcap
        if self.d2t is None:
            head = self.lm_head.weight if isinstance(self.lm_head, nn.Linear) else self.lm_head
            out = (
                ops.linear(hidden, head) if ops.applies(hidden, head) else self.lm_head(hidden)
            ).float()  # [N, vocab]
            return out if cap is None else torch.tanh(out / cap) * cap  # (Gemma 2's soft-capping)
        small = ops.linear(hidden, self.head_rows).float()  # [N, draft vocab]
        if cap is not None:
            small = torch.tanh(small / cap) * cap
        out = torch.full((hidden.shape[0], self.cfg.vocab_size), float("-inf"), device=hidden.device)
        out.index_copy_(1, self.d2t, small)  # [N, vocab]
        return out


def _plain_layer(blk) -> tuple:
    """(input norm fp32, qkv, its bias, W_o^T, post norm fp32, gate/up, W_down^T) for the op-by-op
    forward: o and down are used through addmm (residual + x @ W^T in one op), so W^T views; a
    QuantLinear is its own op (the forward dispatches in quant.linear / addmm) and adds its own bias;
    norm weights in fp32 once (a bf16 RMSNorm computes in fp32: no cast per call). A mixture of
    experts' MLP: (the ``SparseMoE``, None) for gate/up and down."""
    w_qkv, b_qkv = _op(blk.attn.qkv), blk.attn.qkv.bias
    b_qkv = b_qkv if isinstance(w_qkv, torch.Tensor) else None
    return (
        blk.input_norm.weight.float(),
        w_qkv,
        b_qkv,
        _op(blk.attn.o, t=True),
        blk.post_norm.weight.float(),
        *((blk.mlp, None) if isinstance(blk.mlp, SparseMoE) else (_op(blk.mlp.gate_up), _op(blk.mlp.down, t=True))),
    )


def _residual(x, a, w_t, bias, out_norm, norm, ops=invariant.OFF) -> torch.Tensor:
    """x + a @ W^T (+ bias), the projection normed first where the layer says so (Gemma)."""
    if out_norm is None:
        x = ops.addmm(x, a, w_t)
        return x if bias is None else x + bias
    if ops.applies(a, w_t):
        y = ops.linear(a, w_t.t())  # (w_t: the W^T view of a plain weight)
    else:
        y = torch.mm(a, w_t) if isinstance(w_t, torch.Tensor) else w_t.forward(a)
    if bias is not None:
        y = y + bias
    return x + norm(y, out_norm)


def softcap_attention(q: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata, scale: float,
                      window: int | None, cap: float) -> torch.Tensor:  # fmt: skip
    """Gemma 2's attention: scores ``cap * tanh(q.k * scale / cap)``, then the mask (the torch
    backend's plan: prefix, causal or tree, window), softmax and the weighted sum. q [T, H, D] -> [T, H, D]."""
    T, H, D = q.shape
    KVH = kv_layer.shape[-2]
    G = H // KVH
    plan = TorchAttention._plan(meta, q.device, window)
    if plan[0] == "decode":
        _, blocks, bias = plan  # [B, 1, 1, Lp]
        B, Q, Lp = bias.shape[0], 1, bias.shape[-1]
        q_index = flat_pos = None
        bias_g = bias
    else:
        _, blocks, q_index, flat_pos, bias, _ = plan
        B, Q, Lp = bias.shape
        bias_g = bias.unsqueeze(1).expand(B, G, Q, Lp).reshape(B, 1, G * Q, Lp)
    k, v = TorchAttention._gather_kv(kv_layer, blocks, B, Lp)  # [B, KVH, Lp, D]
    qp = q if q_index is None else q[q_index.view(-1)]
    qg = qp.float().view(B, Q, KVH, G, D).permute(0, 2, 3, 1, 4).reshape(B, KVH, G * Q, D)
    scores = torch.tanh(torch.matmul(qg, k.transpose(-1, -2)) * scale / cap) * cap + bias_g
    o = torch.matmul(torch.softmax(scores, -1), v)  # [B, KVH, G*Q, D]
    o = o.view(B, KVH, G, Q, D).permute(0, 3, 1, 2, 4).reshape(B * Q, H, D).to(q.dtype)
    return o if flat_pos is None else o[flat_pos]


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


NORM_WEIGHTS = ("input_norm", "post_norm", "attn_out_norm", "mlp_out_norm", "attn.q_norm", "attn.k_norm")


def hf_layer_names(i: int, cfg: ModelConfig | None = None) -> dict:
    """Our parameter names of layer i -> the HF checkpoint's (the fused q/k/v and gate/up are
    assembled in ``specd.model.loader``)."""
    p = f"model.layers.{i}."
    names = {
        "input_norm.weight": p + "input_layernorm.weight",
        "post_norm.weight": p + "post_attention_layernorm.weight",
        "attn.o.weight": p + "self_attn.o_proj.weight",
    }
    if cfg is None or not cfg.is_moe(i):  # (a mixture's experts: specd.model.moe.expert_tensors)
        names["mlp.down.weight"] = p + "mlp.down_proj.weight"
    if cfg is not None and cfg.qk_norm:
        names.update(
            {"attn.q_norm.weight": p + "self_attn.q_norm.weight", "attn.k_norm.weight": p + "self_attn.k_norm.weight"}
        )
    if cfg is not None and cfg.gemma_norms:  # Gemma's pre-MLP norm is its pre_feedforward_layernorm
        names.update(
            {
                "post_norm.weight": p + "pre_feedforward_layernorm.weight",
                "attn_out_norm.weight": p + "post_attention_layernorm.weight",
                "mlp_out_norm.weight": p + "post_feedforward_layernorm.weight",
            }
        )
    return names
