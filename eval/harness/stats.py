"""Figures: percentiles and timing medians (one definition everywhere), and speculation statistics.

Vocabulary (as in docs/architecture.md): a *step* is one target forward; per step the verifier keeps
``a`` draft tokens (*accepted*) and emits ``a + 1`` tokens (the +1 is the correction or bonus token).

- mean accepted length (tokens per step) = 1 + accepted / steps   (counts the bonus/correction token)
- acceptance rate                       = accepted / drafted       (over every drafted node)
- acceptance per depth d                = P(accepted path reaches depth d | the tree had depth d)
- conditional acceptance at depth d     = P(reaches d | reached d - 1): alpha_d in the product form
- accepted-length histogram             = steps that accepted exactly 0, 1, 2, ... draft tokens
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable


# percentiles ------------------------------------------------------------------------------------
def percentile(xs: Iterable, q: float) -> float | None:
    """The ``q``-th percentile (0 <= q <= 100) of the samples ``xs`` (``None`` entries ignored),
    interpolating linearly between the two nearest ranks: with the n samples sorted, rank
    ``k = (n - 1) q / 100`` and the value ``s[floor k] + (s[floor k + 1] - s[floor k]) * frac(k)``
    (numpy's default method, Hyndman & Fan type 7). ``None`` when there is no sample.

    >>> percentile([1, 2, 3, 4], 50), percentile([10], 99), percentile([], 50)
    (2.5, 10, None)
    """
    s = sorted(x for x in xs if x is not None)
    if not s:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} outside [0, 100]")
    k = (len(s) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def median(xs: Iterable, empty: float | None = None) -> float | None:
    """The 50th :func:`percentile` (the usual median); ``empty`` when there is no sample."""
    m = percentile(xs, 50)
    return empty if m is None else m


def p50_p99(xs: list) -> dict:
    """:func:`percentile` 50 and 99, rounded to 0.1 (None without samples)."""
    return {f"p{q}": None if (v := percentile(xs, q)) is None else round(v, 1) for q in (50, 99)}


def median_ms(f, reps: int, cold=None) -> float:
    """Median ms of ``f()`` over ``reps`` timed calls, after ``max(2, reps // 20)`` untimed ones;
    ``cold``: a tensor larger than the caches, read (untimed, so no dirty lines are left to write
    back during ``f``) before each timed call, so that ``f``'s weights come from memory, not from a
    cache the previous call warmed. (On a Xeon whose L3 holds the whole model, the engine's steps
    find most weights in L3: the warm figures are the engine's there.)"""
    for _ in range(max(2, reps // 20)):
        f()
    xs = []
    for _ in range(reps):
        if cold is not None:
            cold.sum()
        t = time.perf_counter()
        f()
        xs.append(time.perf_counter() - t)
    return round(statistics.median(xs) * 1e3, 4)


# speculation statistics -------------------------------------------------------------------------
def stats_difference(now, before):
    """``now - before`` for two ``SpecStats`` (counters and per-depth lists; trailing zeros dropped,
    as a ``SpecStats`` that counted only the steps in between would have them)."""
    from specd.engine.sequence import SpecStats

    def sub(a: list, b: list) -> list:
        out = [x - (b[i] if i < len(b) else 0) for i, x in enumerate(a)]
        while out and out[-1] == 0:
            out.pop()
        return out

    return SpecStats(
        steps=now.steps - before.steps,
        draft_tokens=now.draft_tokens - before.draft_tokens,
        accepted_tokens=now.accepted_tokens - before.accepted_tokens,
        emitted_tokens=now.emitted_tokens - before.emitted_tokens,
        accepted_per_depth=sub(now.accepted_per_depth, before.accepted_per_depth),
        drafted_per_depth=sub(now.drafted_per_depth, before.drafted_per_depth),
        accept_len_hist=sub(now.accept_len_hist, before.accept_len_hist),
        by_proposer={
            name: diff
            for name, row in now.by_proposer.items()
            if any(diff := [x - y for x, y in zip(row, before.by_proposer.get(name, [0, 0, 0]))])
        },
    )


def stats_from_dicts(ds: list):
    """Merge per-request ``SpecStats`` (as objects or ``as_dict()``-style dicts) into one SpecStats."""
    from specd.engine.sequence import SpecStats

    tot = SpecStats()
    for d in ds:
        if isinstance(d, SpecStats):
            tot.merge(d)
            continue
        s = SpecStats(
            steps=d["steps"],
            draft_tokens=d["draft_tokens"],
            accepted_tokens=d["accepted_tokens"],
            emitted_tokens=d.get("emitted_tokens", 0),
            accepted_per_depth=list(d["accepted_per_depth"]),
            drafted_per_depth=list(d["drafted_per_depth"]),
            accept_len_hist=list(d["accept_len_hist"]),
        )
        tot.merge(s)
    return tot


def tried_per_depth(steps: list) -> list:
    """[d-1] = steps that verified a draft at depth d: the tree had depth >= d and the accepted path
    reached d-1 (a step of depth D that accepted a tried depths 1..min(D, a + 1))."""
    out = []
    for depth, a in steps:
        n = min(depth, a + 1)
        while len(out) < n:
            out.append(0)
        for d in range(n):
            out[d] += 1
    return out


def add_lists(a: list, b: list) -> list:
    out = list(a) + [0] * max(0, len(b) - len(a))
    for i, v in enumerate(b):
        out[i] += v
    return out


def stats_dict(st, tried: list | None = None) -> dict:
    """``SpecStats.as_dict()`` plus raw per-depth counts, the normalised accepted-length histogram and,
    given ``tried`` (see :func:`tried_per_depth`), the conditional per-position acceptance alpha_d and
    the i.i.d. alpha (accepted / positions tried; Leviathan et al.'s alpha)."""
    d = st.as_dict()
    d["emitted_tokens"] = st.emitted_tokens
    d["drafted_per_depth"] = list(st.drafted_per_depth)
    h = st.accept_len_hist
    tot = sum(h)
    d["accept_len_dist"] = [round(x / tot, 4) for x in h] if tot else []
    if tried is not None:
        d["tried_per_depth"] = list(tried)
        acc = st.accepted_per_depth
        d["conditional_acceptance_per_depth"] = [
            round((acc[i] if i < len(acc) else 0) / t, 4) if t else 0.0 for i, t in enumerate(tried)
        ]
        d["alpha_iid"] = round(sum(acc) / sum(tried), 4) if sum(tried) else 0.0
    return d


def expected_tokens_iid(alpha: float, k: int) -> float:
    """Leviathan et al. (2023), eq. 1: E[tokens per step] = (1 - alpha^(k+1)) / (1 - alpha)."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1 - alpha ** (k + 1)) / (1 - alpha)


def expected_tokens_product(alphas: list) -> float:
    """Product form with per-position alphas: 1 + sum_d prod_{j<=d} alpha_j."""
    e, p = 1.0, 1.0
    for a in alphas:
        p *= a
        e += p
    return e


def leviathan_speedup(expected: float, k: int, c: float) -> float:
    """Predicted walltime improvement E / (k c + 1), c = draft forward time / target step time."""
    return expected / (k * c + 1)
