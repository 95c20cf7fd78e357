"""Speculation settings under test: ``off``, ``chain:K``, ``tree:N[:TOPK[:DEPTH]]``, ``static:N``,
``ngram:K``, ``auto``, each a fixed-size ``SpecConfig`` (``adaptive=False``) but ``auto``.

A ``static:N`` tree is the best N-node tree when the draft's rank-r token is right with probability
p_r, i.i.d. over depths (Sequoia's model); p_r = :data:`DEFAULT_RANK_PROBS` unless given.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

# P(the target's token is the draft's rank-r token), used to shape static trees when nothing
# measured is given; close to the shared stories260K pair (top-1 agreement ~0.55).
DEFAULT_RANK_PROBS = (0.55, 0.13, 0.06, 0.035, 0.02, 0.015, 0.01, 0.008)


def static_choices(n: int, rank_probs=DEFAULT_RANK_PROBS, max_depth: int = 12) -> tuple:
    """The ``n``-node static tree that maximises expected accepted length when the draft's rank-r
    token is right with probability ``rank_probs[r]`` independently at every depth (Sequoia's model).

    Best-first over paths: a path's value is the product of its ranks' probabilities, so a child is
    never worth more than its parent or its earlier sibling, and the first ``n`` popped paths form a
    valid (prefix-closed) Medusa choice list.

    >>> static_choices(4, (0.5, 0.2))
    ((0,), (0, 0), (1,), (0, 0, 0))
    """
    probs = [p for p in rank_probs if p > 0]
    heap = [(-probs[0], (0,))]
    out = []
    while heap and len(out) < n:
        negv, path = heapq.heappop(heap)
        out.append(path)
        if len(path) < max_depth:
            heapq.heappush(heap, (negv * probs[0], path + (0,)))  # first child
        r = path[-1] + 1
        if r < len(probs):  # next sibling
            heapq.heappush(heap, (negv / probs[r - 1] * probs[r], path[:-1] + (r,)))
    return tuple(out)


@dataclass(frozen=True)
class Mode:
    """One speculation setting under test, e.g. ``off``, ``chain:4``, ``tree:16``, ``tree:32:4:8``, ``static:16``,
    ``ngram:8`` (prompt lookup, K tokens, no draft model used), ``auto`` (the adaptive policy)."""

    name: str
    kind: str  # off | chain | tree | static | ngram | auto
    size: int = 0  # chain: k; tree/static: node budget (draft tokens, excluding the root)
    topk: int = 4
    depth: int = 6
    choices: tuple | None = None

    @classmethod
    def parse(cls, s: str, tree_topk: int = 4, tree_depth: int = 6, rank_probs=DEFAULT_RANK_PROBS) -> Mode:
        s = s.strip()
        parts = s.split(":")
        kind = parts[0]
        try:
            if kind in ("off", "auto"):
                return cls(kind, kind)
            if kind == "ngram":
                return cls(s, "ngram", int(parts[1]) if len(parts) > 1 else 8)
            if kind == "chain":
                return cls(s, "chain", int(parts[1]) if len(parts) > 1 else 4)
            if kind == "tree":
                n = int(parts[1]) if len(parts) > 1 else 16
                k = int(parts[2]) if len(parts) > 2 else tree_topk
                d = int(parts[3]) if len(parts) > 3 else tree_depth
                return cls(s, "tree", n, k, d)
            if kind == "static":
                n = int(parts[1]) if len(parts) > 1 else 16
                ch = static_choices(n, rank_probs)
                return cls(s, "static", n, depth=max(len(c) for c in ch), choices=ch)
        except (ValueError, IndexError):
            pass
        raise ValueError(f"bad mode {s!r}: use off | chain:K | tree:N[:TOPK[:DEPTH]] | static:N | ngram:K | auto")

    def spec_config(self):
        from specd.config import SpecConfig

        if self.kind == "off":
            return SpecConfig(mode="off", adaptive=False)
        if self.kind == "auto":
            return SpecConfig(adaptive=True, suffix_store=False)
        if self.kind == "ngram":
            return SpecConfig(mode="ngram", ngram_tokens=self.size, adaptive=False, suffix_store=False)
        if self.kind == "chain":
            return SpecConfig(mode="chain", num_draft_tokens=self.size, adaptive=False)
        if self.kind == "tree":
            return SpecConfig(
                mode="tree", tree_budget=self.size, tree_topk=self.topk, tree_depth=self.depth, adaptive=False
            )
        return SpecConfig(mode="static", tree_budget=self.size, static_tree=self.choices, adaptive=False)

    def spec_params(self):
        from specd.engine.sequence import SpecParams

        return SpecParams(mode="off") if self.kind == "off" else SpecParams(mode="auto")

    def describe(self) -> dict:
        d = {"name": self.name, "kind": self.kind}
        if self.kind in ("chain", "ngram"):
            d["k"] = self.size
        elif self.kind == "tree":
            d.update(budget=self.size, topk=self.topk, depth=self.depth)
        elif self.kind == "static":
            d.update(budget=self.size, depth=self.depth, choices=[list(c) for c in self.choices])
        return d


def parse_modes(spec: str, **kw) -> list:
    modes = [Mode.parse(s, **kw) for s in spec.split(",") if s.strip()]
    names = [m.name for m in modes]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate modes in {spec!r}")
    return modes
