"""Perplexity of a loaded model on token ids, through the model's own forward and paged KV cache:
how much a quantization costs in quality (tests bound it; docs/benchmarks.md has the figures).

Two conventions: ``nll`` scores every token of independent windows but each window's first;
``llamacpp_nll`` scores as llama.cpp's ``llama-perplexity`` does (its ``perplexity()``): the ids (the
whole text, tokenized once, with BOS in front when the vocabulary adds one) are cut into
``len(ids) // n_ctx`` chunks of ``n_ctx`` (the rest dropped), each evaluated from an empty cache with
its first token replaced by BOS when the vocabulary adds one, and only the second half is scored:
the logits at positions ``n_ctx // 2 .. n_ctx - 2`` predict the tokens after them, so a chunk scores
``n_ctx - n_ctx // 2 - 1`` tokens (log-softmax in double precision, summed).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def _window_logits(lm, w: list, chunk: int, kv_dtype=None, backend=None) -> torch.Tensor:
    """[len(w), V] float logits of the token window ``w`` evaluated from an empty paged KV cache of
    ``kv_dtype`` (default: the model's dtype) in ``chunk``-token steps; ``backend``: the attention
    backend (default: the pure-torch one)."""
    from specd.engine.kv_cache import KVCache
    from specd.model.attention import build_metadata, get_backend

    m, c = lm.model, lm.config
    dev = next(iter(m.buffers())).device
    backend = backend or get_backend("torch", dev)
    bs = 16
    cache = KVCache(c.num_layers, c.num_kv_heads, c.head_dim, -(-len(w) // bs) + 1, bs, kv_dtype or lm.dtype, dev)
    seq = cache.new_seq()
    seq.reserve(len(w))
    logits = []
    for p in range(0, len(w), chunk):
        n = min(chunk, len(w) - p)
        meta = build_metadata([n], [p], [seq.blocks], seq.slots(p, p + n), bs, dev)
        h = m(torch.tensor(w[p : p + n], device=dev), torch.arange(p, p + n, device=dev), cache.kv, meta, backend)
        logits.append(m.compute_logits(h).float())
    return torch.cat(logits)


@torch.inference_mode()
def nll(lm, ids: list, window: int = 256, chunk: int = 128, kv_dtype=None) -> tuple[float, int]:
    """(summed negative log-likelihood in nats, tokens scored) of ``ids`` cut into independent
    windows of ``window`` tokens (each prefilled in ``chunk``-token steps; its first token is
    context only), over a KV cache of ``kv_dtype`` (default: the model's dtype)."""
    window = min(window, lm.config.max_position_embeddings)
    dev = next(iter(lm.model.buffers())).device
    total, count = 0.0, 0
    for s in range(0, len(ids) - 1, window):
        w = ids[s : s + window]
        if len(w) < 2:
            break
        lg = _window_logits(lm, w, chunk, kv_dtype)[:-1]  # [len(w) - 1, V]
        total += float(F.cross_entropy(lg, torch.tensor(w[1:], device=dev), reduction="sum"))
        count += len(w) - 1
    return total, count


@torch.inference_mode()
def llamacpp_nll(
    lm, ids: list, n_ctx: int, bos: int | None = None, chunks: int | None = None, chunk: int = 512, kv_dtype=None,
    backend=None,
) -> tuple[float, int, list]:  # fmt: skip
    """(summed NLL in nats, tokens scored, each chunk's NLL) of ``ids`` as ``llama-perplexity -c
    n_ctx`` scores them (the module doc): ``bos``: the BOS id when the vocabulary adds one (each
    chunk's first token is replaced by it), else None; ``chunks``: at most this many chunks
    (``--chunks``). ValueError when ``ids`` hold fewer than 2 * ``n_ctx`` tokens (llama-perplexity
    refuses them too)."""
    if n_ctx < 4 or len(ids) < 2 * n_ctx:
        raise ValueError(f"perplexity needs at least 2 x ctx = {2 * n_ctx} tokens (ctx >= 4), got {len(ids)}")
    n_chunk = len(ids) // n_ctx if chunks is None else min(chunks, len(ids) // n_ctx)
    first = n_ctx // 2
    per_chunk = []
    for i in range(n_chunk):
        w = list(ids[i * n_ctx : (i + 1) * n_ctx])
        if bos is not None:
            w[0] = bos
        lg = _window_logits(lm, w, chunk, kv_dtype, backend)[first : n_ctx - 1].double()  # [n_ctx - first - 1, V]
        tgt = torch.tensor(w[first + 1 :], device=lg.device)
        per_chunk.append(-float(torch.log_softmax(lg, -1).gather(1, tgt[:, None]).sum()))
    return sum(per_chunk), n_chunk * (n_ctx - first - 1), per_chunk


def perplexity(lm, ids: list, window: int = 256, kv_dtype=None) -> float:
    """exp(mean NLL) of ``ids`` (see ``nll``)."""
    total, count = nll(lm, ids, window, kv_dtype=kv_dtype)
    return math.exp(total / max(count, 1))
