"""Static tree shapes (Medusa/SpecInfer-style choice lists) and what an accepted path says about a
chain: the proposers' side of draft trees (the tree itself, :class:`specd.sampling.tree.DraftTree`, lives
below speculation, where verification walks it)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from specd.sampling.tree import DraftTree

__all__ = ["TreeChoices", "static_tree_choices", "top1_run"]


class TreeChoices(NamedTuple):
    """A static tree shape parsed by :func:`static_tree_choices`; index 0 is the root.

    parents  parent node of each node (parents[0] = -1), BFS order
    ranks    rank of each node among its parent's candidates (0 = the draft's top-1 token); -1 for
             the root
    paths    the choice tuple of each node (``()`` for the root)
    """

    parents: list[int]
    ranks: list[int]
    paths: list[tuple[int, ...]]


def static_tree_choices(spec: Sequence[Sequence[int]]) -> TreeChoices:
    """Parse a Medusa/SpecInfer-style list of choices into a parent array.

    Each choice is a path of top-rank indices from the root: ``(0,)`` is the draft's top-1 token
    after the root, ``(0, 1)`` the top-2 token after that, and so on. Every prefix of a choice must
    also be a choice (the empty prefix, the root, is implicit; listing ``()`` is allowed). Nodes
    come out in BFS order (by depth, then lexicographically), so siblings are in rank order and
    ``parents[i] < i``.

    >>> static_tree_choices([(0,), (1,), (0, 0), (0, 1), (1, 0)])
    TreeChoices(parents=[-1, 0, 0, 1, 1, 2], ranks=[-1, 0, 1, 0, 1, 0], paths=[(), (0,), (1,), (0, 0), (0, 1), (1, 0)])
    """
    seen: set[tuple[int, ...]] = set()
    for c in spec:
        try:
            t = tuple(c)
        except TypeError:
            raise ValueError(f"tree choice {c!r} is not a sequence of ranks") from None
        for r in t:
            if isinstance(r, bool) or not isinstance(r, int) or r < 0:
                raise ValueError(f"tree choice {c!r}: ranks must be non-negative ints")
        if t in seen and t:
            raise ValueError(f"duplicate tree choice {t!r}")
        seen.add(t)
    seen.discard(())
    for t in seen:
        if len(t) > 1 and t[:-1] not in seen:
            raise ValueError(
                f"tree choice {t!r} has no parent choice {t[:-1]!r} (every prefix of a choice must also be a choice)"
            )
    paths: list[tuple[int, ...]] = [()] + sorted(seen, key=lambda t: (len(t), t))
    index = {p: i for i, p in enumerate(paths)}
    parents = [-1] + [index[p[:-1]] for p in paths[1:]]
    ranks = [-1] + [p[-1] for p in paths[1:]]
    return TreeChoices(parents, ranks, paths)


def top1_run(tree: DraftTree, accepted: Sequence[int]) -> int:
    """How many leading nodes of an accepted path (node indices, root excluded, in depth order)
    are their parent's first child: in a draft tree whose children come in the draft's order
    (top-1 first; ``Drafter``'s trees are sibling-prefix-closed), what a chain of the draft's
    top-1 tokens would have had accepted."""
    children = tree.children
    n = 0
    for node in accepted:
        if children[tree.parent_list[node]][0] != node:
            break
        n += 1
    return n
