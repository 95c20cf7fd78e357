"""EAGLE-style feature head: a one-layer draft that reads the target's hidden states.

Vocabulary: the target's *features* at position p are the hidden states entering three of its
layers (a low, a middle and a high one; EAGLE-3's choice is layers 2, n/2 and n-3 of n),
concatenated: ``[3 d_target]``. A head *row* at position p takes the fused features of p (or, for
deeper draft steps, the head's own output hidden state of the row before it in the tree) and the
embedding of the token at p + 1, and predicts the token at p + 2:

    x  = fc(features_p)                       [d]   (own output hidden state: used as is)
    h  = concat(rms(embed(token_{p+1})), rms(x))   [2d]
    x  = x + attention(h)                     (one Llama layer, its own KV cache, RoPE at p)
    x  = x + mlp(rms(x))                      -> the row's output hidden state (fed to its children)
    logits = rms(x) @ head_rows^T             [N] over a reduced vocabulary (``d2t``: target ids)

This is EAGLE-3's midlayer exactly (``docs/architecture.md``, "Feature heads", maps its published
checkpoint keys onto these parameters). The token embeddings are the target's (by reference); the
head rows are the target's LM-head rows of the N draft tokens (by reference) unless a checkpoint
carries its own (EAGLE-3's ``lm_head``).

``forward`` computes rows over the paged KV cache (drafting); ``unroll`` is the training-time
test: the same layer unrolled over k steps on dense tensors, step j feeding step j-1's outputs.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F

from specd.config import ModelConfig
from specd.model.attention import AttentionMetadata
from specd.model.fused import takes
from specd.model.llama import RMSNorm, Rotary
from specd.model.quant import QuantLinear, embedding, linear, quantize_int8


def default_layers(num_layers: int) -> tuple:
    """EAGLE-3's feature layers (2, n/2, n-3); for very shallow targets (1, n/2, n-1)."""
    if num_layers >= 8:
        return (2, num_layers // 2, num_layers - 3)
    return (min(1, num_layers - 1), num_layers // 2, num_layers - 1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], dim=-1)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x.float(), (x.shape[-1],), w.float(), eps).to(x.dtype)


class EagleHead(nn.Module):
    """The head's parameters and its two forwards (see the module docstring). ``cfg`` describes
    the decoder layer (``num_layers`` 1, the target's vocabulary and RoPE); ``layers`` the target
    layers whose input hidden states are the features; ``target_hidden`` their width."""

    def __init__(self, cfg: ModelConfig, layers: tuple, target_hidden: int, max_positions: int | None = None):
        super().__init__()
        d, H, KVH, D = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.cfg, self.layers, self.target_hidden = cfg, tuple(int(i) for i in layers), target_hidden
        self.fc = nn.Linear(len(self.layers) * target_hidden, d, bias=False)
        self.input_norm = RMSNorm(d, cfg.rms_norm_eps)  # on the token embedding
        self.hidden_norm = RMSNorm(d, cfg.rms_norm_eps)  # on the fused / own hidden state
        self.qkv = nn.Linear(2 * d, (H + 2 * KVH) * D, bias=False)
        self.o = nn.Linear(H * D, d, bias=False)
        self.post_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.gate_up = nn.Linear(d, 2 * cfg.intermediate_size, bias=False)
        self.down = nn.Linear(cfg.intermediate_size, d, bias=False)
        self.norm = RMSNorm(d, cfg.rms_norm_eps)
        self.rotary = Rotary(cfg, max_positions or cfg.max_position_embeddings)
        self.embed_table: torch.Tensor | QuantLinear | None = None  # the target's (attach)
        self.d2t: torch.Tensor | None = None  # [N] target ids of the head rows
        self.head_rows: torch.Tensor | QuantLinear | None = None  # [N, d]
        self.ops: dict = {}  # drafting through the CPU kernel: int8 projections (use_kernel)
        self.fused = None  # ... and the layer as one C call (specd.model.fused.HeadLayer)

    @property
    def draft_vocab_size(self) -> int:
        return int(self.d2t.numel()) if self.d2t is not None else 0

    def attach(self, target, d2t: torch.Tensor, own_rows: torch.Tensor | None = None) -> None:
        """Use ``target``'s (a ``LlamaModel``) embeddings, and its LM-head rows of ``d2t`` unless
        the checkpoint has ``own_rows`` [N, d]."""
        # by reference, never registered: not the head's parameters, never moved or saved with it
        object.__setattr__(self, "embed_table", target.embed_table())
        self.d2t = d2t.to(device=self.fc.weight.device, dtype=torch.long)
        rows = own_rows
        if rows is None:
            head = target.lm_head
            rows = head.select(self.d2t) if isinstance(head, QuantLinear) else head.weight.detach()[self.d2t]
        object.__setattr__(self, "head_rows", rows)

    def use_kernel(self, act_int8: bool) -> None:
        """Draft through the CPU kernel, as a quantized target runs: int8 copies (per output channel)
        of the layer's projections and, with ``act_int8``, int8 activations in them and in the head
        rows (an int8 head layer costs a quarter of the fp32 one's weight bytes; a head level is a
        draft step, so this decides whether a short head chain pays). Only drafting uses them:
        training (``unroll``) and the saved files keep the float weights, and verification by the
        target keeps the output lossless whatever the head computes."""
        ops = {}
        for name in ("fc", "qkv", "o", "gate_up", "down"):
            op = quantize_int8(getattr(self, name).weight.detach().float())
            op.act_int8 = act_int8
            ops[name] = op
        self.ops = ops
        if isinstance(self.head_rows, QuantLinear):  # (the head's own copy of the target's rows)
            self.head_rows.act_int8 = act_int8
        from specd.model.fused import HeadLayer
        from specd.model.qkernel import kernel

        lib = kernel()  # the layer as one C call (norms, RoPE, KV write, attention, MLP), as the target's
        self.fused = HeadLayer(lib, self) if lib is not None else None

    def _w(self, name: str):
        """A projection for ``linear``: its int8 drafting copy (``use_kernel``) or its float weight."""
        op = self.ops.get(name)
        return op if op is not None else getattr(self, name).weight

    # the layer, shared by both forwards -----------------------------------------------------------
    def _qkv(self, e: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple:
        """(q [.., H, D], k [.., KVH, D], v [.., KVH, D]) of rows with embeddings ``e`` and hidden ``x``."""
        c = self.cfg
        H, KVH, D, eps = c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps
        h = torch.cat([_rms(e, self.input_norm.weight, eps), _rms(x, self.hidden_norm.weight, eps)], dim=-1)
        qkv = linear(h, self._w("qkv"))  # [.., (H + 2 KVH) D]
        qk = qkv[..., : (H + KVH) * D].unflatten(-1, (H + KVH, D))
        qk = qk * cos + _rotate_half(qk) * sin
        v = qkv[..., (H + KVH) * D :].unflatten(-1, (KVH, D))
        return qk[..., :H, :], qk[..., H:, :], v

    def _finish_layer(self, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """Residual + attention output ``o`` [.., H D], then the MLP: the rows' output hidden state."""
        x = x + linear(o, self._w("o"))
        gu = linear(_rms(x, self.post_norm.weight, self.cfg.rms_norm_eps), self._w("gate_up"))
        inter = self.cfg.intermediate_size
        return x + linear(F.silu(gu[..., :inter]) * gu[..., inter:], self._w("down"))

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        assert self.embed_table is not None, "attach() the head to its target first"
        e = embedding(ids.reshape(-1), self.embed_table)  # [n, d] (a quantized table wants flat ids)
        return e.reshape(*ids.shape, -1).to(self.fc.weight.dtype)

    def fuse(self, feats: torch.Tensor) -> torch.Tensor:
        """Target features [.., 3 d_target] -> the head's hidden input [.., d]."""
        return linear(feats.to(self.fc.weight.dtype), self._w("fc"))

    # drafting -------------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(
        self, ids: torch.Tensor, positions: torch.Tensor, x: torch.Tensor, kv: torch.Tensor, meta: AttentionMetadata,
        backend,
    ) -> torch.Tensor:  # fmt: skip
        """Head rows over the paged cache ``kv`` [1, 2, NB, BS, KVH, D]: tokens ``ids`` [T] (the
        token after each row's position), hidden inputs ``x`` [T, d] -> output hidden states [T, d]."""
        fused = self.fused
        if fused is not None and takes(backend, kv, x):
            if int(positions.max()) >= self.rotary.cos.shape[0] or int(positions.min()) < 0:
                raise IndexError("head position outside its RoPE table")
            return fused.run(x, self.embed(ids), positions, kv[0], meta, backend)
        cos = self.rotary.cos[positions].unsqueeze(1).to(x.dtype)  # [T, 1, D]
        sin = self.rotary.sin[positions].unsqueeze(1).to(x.dtype)
        q, k, v = self._qkv(self.embed(ids), x, cos, sin)
        backend.write_kv(kv[0], k, v, meta.slot_mapping)
        o = backend.attention(q.contiguous(), kv[0], meta, self.cfg.head_dim**-0.5)  # [T, H, D]
        return self._finish_layer(x, o.reshape(x.shape[0], -1))

    @torch.inference_mode()
    def compute_logits(self, x: torch.Tensor, reduced: bool = False) -> torch.Tensor:
        """Output hidden states [T, d] -> logits over the whole vocabulary [T, V], -inf outside the
        draft vocabulary (so a token outside it is never drafted); ``reduced``: over the draft
        vocabulary only [T, N] (column j is target token ``d2t[j]``)."""
        assert self.head_rows is not None and self.d2t is not None
        small = linear(_rms(x, self.norm.weight, self.cfg.rms_norm_eps), self.head_rows).float()  # [T, N]
        if reduced:
            return small
        out = torch.full((x.shape[0], self.cfg.vocab_size), float("-inf"), device=x.device)
        out.index_copy_(1, self.d2t, small)
        return out

    # training: the training-time test ------------------------------------------------------------
    def unroll(self, feats: torch.Tensor, toks: torch.Tensor, steps: int) -> list:
        """EAGLE-3's training-time test on dense tensors: ``feats`` [B, T, 3 d_target] (features of
        positions 0..T-1), ``toks`` [B, T + steps - 1] (``toks[:, p]`` = the token at p + 1).
        Step j's row p sits at position p + j, takes token p + 1 + j and step j-1's output hidden
        state of row p (step 0: the fused features), and attends to step-0 rows 0..p and to its own
        rows of steps 1..j (exactly what a depth-(j+1) tree node sees when drafting). Returns every
        step's output hidden states [B, T, d] (step j predicts the token at p + 2 + j: ``logits``)."""
        c = self.cfg
        B, T = feats.shape[:2]
        rep = c.num_heads // c.num_kv_heads
        x = self.fuse(feats)  # [B, T, d]
        causal = torch.ones((T, T), dtype=torch.bool, device=x.device).tril()
        keys: list = []  # per step: (k, v) [B, H, T, D]
        outs = []
        for j in range(steps):
            pos = torch.arange(j, T + j, device=x.device)
            cos, sin = self.rotary.cos[pos].unsqueeze(1), self.rotary.sin[pos].unsqueeze(1)  # [T, 1, D]
            q, k, v = self._qkv(self.embed(toks[:, j : j + T]), x, cos.to(x.dtype), sin.to(x.dtype))
            q = q.transpose(1, 2) * c.head_dim**-0.5  # [B, H, T, D]
            keys.append(
                (k.repeat_interleave(rep, dim=2).transpose(1, 2), v.repeat_interleave(rep, dim=2).transpose(1, 2))
            )
            s0 = (q @ keys[0][0].transpose(-1, -2)).masked_fill(~causal, float("-inf"))  # [B, H, T, T]
            diag = [(q * ki).sum(-1, keepdim=True) for ki, _ in keys[1:]]  # [B, H, T, 1] each
            p = torch.softmax(torch.cat([s0, *diag], dim=-1).float(), dim=-1).to(q.dtype)
            o = p[..., :T] @ keys[0][1]
            for i, (_, vi) in enumerate(keys[1:]):
                o = o + p[..., T + i : T + i + 1] * vi
            x = self._finish_layer(x, o.transpose(1, 2).reshape(B, T, -1))
            outs.append(x)
        return outs

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Output hidden states [.., d] -> draft-vocabulary logits [.., N] (differentiable)."""
        return F.linear(_rms(x, self.norm.weight, self.cfg.rms_norm_eps), self._dense_rows())

    def _dense_rows(self) -> torch.Tensor:
        rows = self.head_rows
        assert rows is not None
        return rows if isinstance(rows, torch.Tensor) else rows.dequantize().to(self.fc.weight.dtype)


# files -------------------------------------------------------------------------------------------
NATIVE_KEYS = ("fc", "input_norm", "hidden_norm", "qkv", "o", "post_norm", "gate_up", "down", "norm")


def head_config(target_cfg: ModelConfig, **over) -> ModelConfig:
    """The head layer's config: the target's (width, heads, RoPE, vocabulary), one layer with a dense
    MLP (also for a mixture-of-experts target)."""
    return dataclasses.replace(target_cfg, num_layers=1, **{"moe_layers": (), **over})
