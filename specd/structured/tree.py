"""Masks for every node of a draft tree, and pruning the drafts the grammar forbids.

The tree is given as plain lists in :class:`specd.sampling.tree.DraftTree`'s layout: node 0 is the
root (the pending token: already consumed by the matcher), ``parents[i] < i`` for ``i >= 1``,
``tokens[i]`` node i's token. The target's logits row of node i predicts the token after node i, so
**row i's mask is the grammar state after node i's path** (its ancestors' tokens below the root and
its own). A node is *alive* when its token is allowed after its parent's path (the root always is);
every descendant of a dead node is dead too. Dead rows are all-forbidden: they must be pruned
before verification (:func:`prune_tree`).

Example (the grammar allows only ``"ab"`` then the stop token; root = the last committed token)::

    node:     0     1     2     3                 masks:  row 0: {a, ab}
    token:    r     a     x     b                         row 1: {b}
    parent:  -1     0     0     1                         row 2: {}   (dead: x not allowed)
    alive:    T     T     F     T                         row 3: {stop}

Computed depth-first with one matcher: advance into a node, fill its row, visit its children, roll
back; the matcher ends in the state it started in. :func:`tree_alive` walks the same way without
filling (~1 us a node against ~9 with the fill): the engine prunes with it first and fills the
pruned tree's masks on another thread while the target's forward runs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specd.structured.masks import words
from specd.structured.matcher import Matcher

__all__ = ["prune_tree", "tree_alive", "tree_masks"]


def _children(parents: Sequence[int], n: int) -> list:
    if n == 0 or parents[0] != -1:
        raise ValueError("node 0 must be the root (parents[0] == -1)")
    kids: list = [[] for _ in range(n)]
    for i in range(1, n):
        p = parents[i]
        if not 0 <= p < i:
            raise ValueError(f"parents[{i}] = {p}: a parent must precede its child")
        kids[p].append(i)
    return kids


def tree_masks(
    matcher: Matcher, parents: Sequence[int], tokens: Sequence[int], out: torch.Tensor | None = None
) -> tuple:
    """``(bitmask [n, ceil(V/32)] int32, alive [n] list of bool)`` for the tree (module docstring).

    ``out``: a preallocated ``[>= n, W]`` int32 tensor to fill (its first n rows). The matcher is
    left as it was (also when this raises)."""
    n = len(tokens)
    bm = torch.empty((n, words(matcher.vocab.size)), dtype=torch.int32) if out is None else out
    bm[:n] = 0
    alive = _walk(matcher, parents, tokens, lambda i: matcher.fill(bm, i))
    return bm[:n], alive


def tree_alive(matcher: Matcher, parents: Sequence[int], tokens: Sequence[int]) -> list:
    """``alive`` [n] list of bool, as :func:`tree_masks` gives it, without computing a mask."""
    return _walk(matcher, parents, tokens, None)


def _walk(matcher: Matcher, parents: Sequence[int], tokens: Sequence[int], visit) -> list:
    """Depth-first over the tree with ``matcher`` (advance, ``visit(i)`` at each alive node, roll
    back); which nodes are alive. The matcher ends as it started (also when this raises)."""
    n = len(tokens)
    if len(parents) != n:
        raise ValueError(f"{len(parents)} parents for {n} tokens")
    kids = _children(parents, n)
    alive = [False] * n
    alive[0] = True
    if visit is not None:
        visit(0)
    depth = [0] * n
    consumed = 0  # tokens the matcher holds beyond the root's state
    stack = list(reversed(kids[0]))
    try:
        while stack:
            i = stack.pop()
            depth[i] = depth[parents[i]] + 1
            matcher.rollback(consumed - (depth[i] - 1))  # back to the parent's state
            consumed = depth[i] - 1
            if matcher.advance(tokens[i]):
                consumed += 1
                alive[i] = True
                if visit is not None:
                    visit(i)
                stack.extend(reversed(kids[i]))
    finally:
        matcher.rollback(consumed)
    return alive


def prune_tree(parents: Sequence[int], tokens: Sequence[int], alive: Sequence[bool]) -> tuple:
    """The tree without its dead nodes: ``(parents', tokens', kept)`` where ``kept[j]`` is the old index
    of new node j (order kept, so parents still precede children and the root stays node 0)."""
    if not alive or not alive[0]:
        raise ValueError("the root is always alive")
    kept = [i for i, a in enumerate(alive) if a]
    new = {old: j for j, old in enumerate(kept)}
    for i in kept[1:]:
        if not alive[parents[i]]:
            raise ValueError(f"node {i} is alive under dead parent {parents[i]}")
    return [-1] + [new[parents[i]] for i in kept[1:]], [tokens[i] for i in kept], kept
