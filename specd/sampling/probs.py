"""Logits -> probabilities, and per-request seeded sampling.

Pipeline for one step (rows are requests, or tree nodes of requests, each with its own params)::

    logits   [N, V]  --logits_to_probs(temperature, top_k, top_p)-->  probs [N, V] float32
    probs    [N, V]  --sample(generators)-->                         tokens [N] int64

``logits_to_probs`` is also what the speculative verifier needs: the target distribution the
rejection sampler must reproduce is the *processed* one (after temperature, top-k, top-p).

Randomness is per request: every request owns a ``torch.Generator`` (:func:`make_generator`,
seeded from ``SamplingParams.seed``) and each of its draws comes from that generator alone, so a
seeded request reproduces its output whatever else shares the batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specd.sampling.params import SamplingParams

__all__ = [
    "logits_to_probs",
    "sample",
    "sample_from_uniform",
    "make_generator",
    "draw_uniforms",
    "sampling_tensors",
    "add_logit_bias_",
]


def sampling_tensors(params: Sequence[SamplingParams]) -> tuple[list[float], list[int], list[float], list[float]]:
    """(temperature, top_k, top_p, min_p) lists for :func:`logits_to_probs`, one entry per row."""
    return (
        [p.temperature for p in params],
        [p.top_k for p in params],
        [p.top_p for p in params],
        [p.min_p for p in params],
    )


def _on_host(x) -> bool:
    return not isinstance(x, torch.Tensor) or x.device.type == "cpu"


def logits_to_probs(logits: torch.Tensor, temperature, top_k, top_p, min_p=None) -> torch.Tensor:
    """Per-row temperature, min-p, top-k and top-p, vectorised over rows.

    Args:
      logits       [N, V] float
      temperature  [N] float (tensor or sequence); 0 = greedy row
      top_k        [N] int; 0 / -1 (any value <= 0) or >= V = off
      top_p        [N] float in (0, 1]; 1 = off
      min_p        [N] float in [0, 1]; 0 = off (None: off for every row)
    Returns:
      probs        [N, V] float32, rows sum to 1

    Order: logits / temperature, then min-p (tokens whose probability is below min_p times the
    likeliest token's are dropped, as vLLM's), then top-k, then top-p on the top-k-renormalised
    distribution, then renormalise. Top-k keeps exactly k tokens and top-p the smallest set of most likely
    tokens whose mass is >= top_p (always at least one); both rank tokens by a stable descending
    sort, so ties at a boundary go to the lower token id. A greedy row is the one-hot of
    ``torch.argmax`` of its logits (ties -> lowest index).

    Pass the parameters as Python lists or CPU tensors: choosing the fast path (no row uses top-k
    or top-p: a plain softmax, no sort) is then decided on the host without a device sync.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [N, V], got shape {tuple(logits.shape)}")
    n, v = logits.shape
    dev = logits.device
    t_h, temp = _row_param(temperature, torch.float32, dev)  # [N]
    k_h, k = _row_param(top_k, torch.int64, dev)  # [N]
    p_h, p = _row_param(top_p, torch.float32, dev)  # [N]
    if not temp.shape[0] == k.shape[0] == p.shape[0] == n:
        raise ValueError(
            f"need one temperature/top_k/top_p per row ({n}), got {temp.shape[0]}/{k.shape[0]}/{p.shape[0]}"
        )
    greedy = temp <= 0  # [N]
    all_greedy = n > 0 and not _any(t_h, temp, lambda x: x > 0)
    logits = logits.float()
    onehot = None
    if all_greedy or _any(t_h, temp, lambda x: x <= 0):
        onehot = torch.zeros((n, v), dtype=torch.float32, device=dev)
        onehot.scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)  # [N, V]
        if all_greedy:
            return onehot
    scaled = logits / torch.where(greedy, 1.0, temp)[:, None]  # [N, V]
    if min_p is not None:
        scaled = _min_p(scaled, min_p)
    use_k = _any(k_h, k, lambda x: (x > 0) & (x < v))
    use_p = _any(p_h, p, lambda x: x < 1)
    if use_k or use_p:
        probs = _top_k_top_p(scaled, k if use_k else None, p if use_p else None)
    else:
        probs = torch.softmax(scaled, dim=-1)  # fast path: [N, V]
    if onehot is not None:
        probs = torch.where(greedy[:, None], onehot, probs)
    return probs


def _min_p(scaled: torch.Tensor, min_p) -> torch.Tensor:
    """``scaled`` logits [N, V] with the tokens less likely than ``min_p`` [N] times their row's likeliest
    at -inf (rows with min_p 0 untouched)."""
    m_h, m = _row_param(min_p, torch.float32, scaled.device)  # [N]
    if m.shape[0] != scaled.shape[0]:
        raise ValueError(f"need one min_p per row ({scaled.shape[0]}), got {m.shape[0]}")
    if not _any(m_h, m, lambda x: x > 0):
        return scaled
    probs = torch.softmax(scaled, dim=-1)  # [N, V]
    low = probs < m[:, None] * probs.max(dim=-1, keepdim=True).values
    return scaled.masked_fill(low, float("-inf"))


def _row_param(x, dtype: torch.dtype, dev: torch.device) -> tuple[torch.Tensor | None, torch.Tensor]:
    """A per-row parameter as (host copy or None, [N] tensor on ``dev``)."""
    if _on_host(x):
        h = torch.as_tensor(x, dtype=dtype).reshape(-1)
        return h, h.to(dev, non_blocking=True)
    return None, x.to(dev, dtype).reshape(-1)


def _any(host: torch.Tensor | None, on_dev: torch.Tensor, pred) -> bool:
    """``pred(x).any()``, on the host copy when there is one (no device sync)."""
    return bool(pred(host if host is not None else on_dev).any())


def _top_k_top_p(scaled: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None) -> torch.Tensor:
    """[N, V] probabilities of ``scaled`` logits [N, V] after top-k (``k`` [N]; <= 0 or >= V = off)
    then top-p (``p`` [N]; 1 = off) on the top-k-renormalised distribution, renormalised. Ranks
    by a stable descending sort: ties at a boundary go to the lower token id."""
    n, v = scaled.shape
    sorted_logits, order = scaled.sort(dim=-1, descending=True, stable=True)  # [N, V] each
    if k is not None:
        k_eff = torch.where((k > 0) & (k < v), k, v)  # [N]
        rank = torch.arange(v, device=scaled.device)
        sorted_logits = sorted_logits.masked_fill(rank[None, :] >= k_eff[:, None], float("-inf"))
    sorted_probs = torch.softmax(sorted_logits, dim=-1)  # [N, V]
    if p is not None:
        cum = sorted_probs.double().cumsum(dim=-1)  # [N, V]
        before = torch.cat([cum.new_zeros((n, 1)), cum[:, :-1]], dim=1)  # mass ranked above
        drop = (before >= p.double()[:, None]) & (p < 1)[:, None]  # p == 1: keep all
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        sorted_probs = sorted_probs / sorted_probs.sum(dim=-1, keepdim=True)
    return torch.empty_like(sorted_probs).scatter_(1, order, sorted_probs)  # [N, V]


def make_generator(seed: int | None = None, device: str | torch.device = "cpu") -> torch.Generator:
    """A request's own generator: seeded with ``seed``, or from OS entropy when ``seed`` is None.

    CPU generators (the default) keep a seeded request's output identical across devices, and the
    draws they make are a few scalars per step, moved to the device in one small copy.
    """
    g = torch.Generator(device=device)
    if seed is None:
        g.seed()
    else:
        g.manual_seed(int(seed) & 0xFFFF_FFFF_FFFF_FFFF)
    return g


def draw_uniforms(
    counts: Sequence[int], generators: Sequence[torch.Generator | None], device: str | torch.device = "cpu"
) -> torch.Tensor:
    """Concatenated float64 uniforms in [0, 1): ``counts[b]`` from ``generators[b]``.

    Each generator draws on its own device; rows without one share a single draw from the global
    CPU RNG. The parts are joined on the host and moved to ``device`` in one copy (a CUDA
    generator costs a sync here: prefer CPU generators). Returns [sum(counts)] float64.
    """
    if len(counts) != len(generators):
        raise ValueError(f"{len(counts)} counts but {len(generators)} generators")
    if all(g is None for g in generators):
        return torch.rand(sum(counts), dtype=torch.float64).to(device, non_blocking=True)
    parts: list[torch.Tensor | None] = []
    none_idx: list[int] = []
    for b, (c, g) in enumerate(zip(counts, generators)):
        if g is None:
            none_idx.append(b)
            parts.append(None)
        else:
            parts.append(torch.rand(c, dtype=torch.float64, generator=g, device=g.device).cpu())
    if none_idx:
        shared = torch.rand(sum(counts[b] for b in none_idx), dtype=torch.float64)
        off = 0
        for b in none_idx:
            parts[b] = shared[off : off + counts[b]]
            off += counts[b]
    return torch.cat(parts).to(device, non_blocking=True)  # type: ignore[arg-type]


def sample_from_uniform(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: row i gets the first token whose cumulative mass exceeds
    ``u[i] * row_sum`` (rows need not be normalised; the chosen token always has mass > 0).

    probs [N, V] (non-negative, every row with positive mass), u [N] in [0, 1) -> [N] int64.
    Accumulates in float64.
    """
    cdf = probs.double().cumsum(dim=-1)  # [N, V]
    total = cdf[:, -1:]  # [N, 1]
    t = u.to(device=probs.device, dtype=torch.float64)[:, None] * total
    t = torch.minimum(t, torch.nextafter(total, torch.zeros_like(total)))  # t < total always
    idx = torch.searchsorted(cdf, t, right=True)  # first index with cdf > t
    return idx.squeeze(1).clamp_(max=probs.shape[-1] - 1)


def sample(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """Draw one token per row, row i from its own ``generators[i]`` (None = the global RNG).

    probs [N, V] -> [N] int64 on ``probs.device``. Each row consumes exactly one uniform from its
    generator, so a seeded request's draws do not depend on the rest of the batch. A one-hot row
    (greedy) always gives its argmax.
    """
    if probs.dim() != 2 or len(generators) != probs.shape[0]:
        raise ValueError(f"need probs [N, V] and N generators, got {tuple(probs.shape)} and {len(generators)}")
    u = draw_uniforms([1] * len(generators), generators, probs.device)  # [N]
    return sample_from_uniform(probs, u)


def add_logit_bias_(logits: torch.Tensor, rows: range, bias: Sequence) -> None:
    """``logits[rows, token] += b`` for each ``(token, b)`` of ``bias`` (``SamplingParams.logit_bias``),
    in place: [N, V] float logits, ``rows`` one request's rows."""
    if not bias:
        return
    dev = logits.device
    cols = torch.tensor([t for t, _ in bias], device=dev)
    vals = torch.tensor([b for _, b in bias], dtype=logits.dtype, device=dev)
    block = logits[rows.start : rows.stop]  # [n, V] (a view)
    block[:, cols] += vals
