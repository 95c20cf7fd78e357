"""Perplexity of a loaded model on token ids, through the model's own forward and paged KV cache:
how much a quantization costs in quality (tests bound it; docs/benchmarks.md has the figures)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


@torch.inference_mode()
def nll(lm, ids: list, window: int = 256, chunk: int = 128, kv_dtype=None) -> tuple[float, int]:
    """(summed negative log-likelihood in nats, tokens scored) of ``ids`` cut into independent
    windows of ``window`` tokens (each prefilled in ``chunk``-token steps; its first token is
    context only), over a KV cache of ``kv_dtype`` (default: the model's dtype)."""
    from specd.engine.kv_cache import KVCache
    from specd.model.attention import build_metadata, get_backend

    m, c = lm.model, lm.config
    dev = next(iter(m.buffers())).device
    m.backend = get_backend("torch", dev)
    bs = 16
    window = min(window, c.max_position_embeddings)
    total, count = 0.0, 0
    for s in range(0, len(ids) - 1, window):
        w = ids[s : s + window]
        if len(w) < 2:
            break
        cache = KVCache(c.num_layers, c.num_kv_heads, c.head_dim, -(-len(w) // bs) + 1, bs, kv_dtype or lm.dtype, dev)
        seq = cache.new_seq()
        seq.reserve(len(w))
        logits = []
        for p in range(0, len(w), chunk):
            n = min(chunk, len(w) - p)
            meta = build_metadata([n], [p], [seq.blocks], seq.slots(p, p + n), bs, dev)
            h = m(torch.tensor(w[p : p + n], device=dev), torch.arange(p, p + n, device=dev), cache.kv, meta)
            logits.append(m.compute_logits(h).float())
        lg = torch.cat(logits)[:-1]  # [len(w) - 1, V]
        total += float(F.cross_entropy(lg, torch.tensor(w[1:], device=dev), reduction="sum"))
        count += len(w) - 1
    return total, count


def perplexity(lm, ids: list, window: int = 256, kv_dtype=None) -> float:
    """exp(mean NLL) of ``ids`` (see ``nll``)."""
    total, count = nll(lm, ids, window, kv_dtype=kv_dtype)
    return math.exp(total / max(count, 1))
