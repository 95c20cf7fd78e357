"""Draft trees: the token tree one decode step feeds to the target model.

Node 0 is the *root*: the request's pending token (the last committed token, whose KV is not in the
cache yet). Every other node is a *draft token* proposed by the drafter; ``parents[i] < i``, so
nodes are numbered in the order they were created and a parent always precedes its children.
Children of a node keep their creation order; for sampled trees that is the without-replacement
sampling order, and the rejection sampler in :mod:`specd.sampling.verify` relies on it.

Example (root = pending token 5, drafts 7, 9 below it, 3 below 7)::

    node:     0   1   2   3
    token:    5   7   9   3            tree:      5 (0)
    parent:  -1   0   0   1                      /     \\
    depth:    0   1   1   2                   7 (1)   9 (2)
                                                |
                                              3 (3)

    positions(context_len=10) = [10, 11, 11, 12]
    ancestor_mask() (row i: which nodes node i may attend to, itself included):
        [[1, 0, 0, 0],
         [1, 1, 0, 0],
         [1, 0, 1, 0],
         [1, 1, 0, 1]]

A ``DraftTree`` is built every engine step for every request, so it is cheap: it is built from
Python lists, keeps them (the verifier walks the tree in pure Python) and derives everything else
lazily, caching the result.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

__all__ = ["DraftTree", "SiblingTable", "top1_run"]


class DraftTree:
    """A token tree rooted at the pending token (a light, slotted dataclass-like container).

    Attributes (tensors on the CPU, created on first access and cached; treat them as read-only):
      tokens   [n] int64   token id of each node; tokens[0] is the pending (root) token
      parents  [n] int64   parent node index; parents[0] == -1, 0 <= parents[i] < i for i >= 1

    ``DraftTree(tokens, parents)`` takes tensors or Python sequences of ints and validates the
    parents unless ``validate=False`` (for callers that build them correctly by construction, e.g.
    :meth:`chain`). The tree keeps Python lists (:attr:`token_list`, :attr:`parent_list`) and
    derives everything else lazily, so building one from lists costs a few microseconds.
    """

    __slots__ = (
        "_tok",
        "_par",
        "_tokens_t",
        "_parents_t",
        "_children",
        "_depths",
        "_depths_t",
        "_mask",
        "_paths",
        "_siblings",
    )

    def __init__(
        self, tokens: Sequence[int] | torch.Tensor, parents: Sequence[int] | torch.Tensor, validate: bool = True
    ):
        self._tokens_t: torch.Tensor | None = None
        self._parents_t: torch.Tensor | None = None
        if isinstance(tokens, torch.Tensor):
            if tokens.dim() != 1:
                raise ValueError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
            self._tokens_t = tokens.to(dtype=torch.int64, device="cpu")
            tokens = tokens.tolist()
        elif validate:
            tokens = [int(t) for t in tokens]
        if isinstance(parents, torch.Tensor):
            if parents.dim() != 1:
                raise ValueError(f"parents must be 1-D, got shape {tuple(parents.shape)}")
            self._parents_t = parents.to(dtype=torch.int64, device="cpu")
            parents = parents.tolist()
        elif validate:
            parents = [int(p) for p in parents]
        self._tok: list[int] = list(tokens)
        self._par: list[int] = list(parents)
        self._children: list[list[int]] | None = None  # derived, cached on first use
        self._depths: list[int] | None = None
        self._depths_t: torch.Tensor | None = None
        self._mask: torch.Tensor | None = None
        self._paths: list[list[int]] | None = None
        self._siblings: SiblingTable | None = None
        if validate:
            _check_parents(self._par, len(self._tok))

    def __repr__(self) -> str:
        return f"DraftTree(tokens={self._tok}, parents={self._par})"

    @property
    def tokens(self) -> torch.Tensor:
        """[n] int64 token ids (cached)."""
        if self._tokens_t is None:
            self._tokens_t = torch.tensor(self._tok, dtype=torch.int64)
        return self._tokens_t

    @property
    def parents(self) -> torch.Tensor:
        """[n] int64 parent indices, parents[0] = -1 (cached)."""
        if self._parents_t is None:
            self._parents_t = torch.tensor(self._par, dtype=torch.int64)
        return self._parents_t

    # ------------------------------------------------------------------ constructors
    @classmethod
    def chain(cls, root_token: int, draft_tokens: Sequence[int] | torch.Tensor = ()) -> DraftTree:
        """A linear tree: root -> draft_tokens[0] -> draft_tokens[1] -> ..."""
        if isinstance(draft_tokens, torch.Tensor):
            draft_tokens = draft_tokens.tolist()
        toks = [int(root_token), *map(int, draft_tokens)]
        return cls(toks, list(range(-1, len(toks) - 1)), validate=False)

    @classmethod
    def from_parents(cls, tokens: Sequence[int] | torch.Tensor, parents: Sequence[int] | torch.Tensor) -> DraftTree:
        """Build a tree from token and parent arrays, checking ``parents[0] == -1`` and
        ``0 <= parents[i] < i`` (parents precede children)."""
        return cls(tokens, parents, validate=True)

    @classmethod
    def breadth_first(cls, tokens: list, parents: list) -> tuple[DraftTree, list[int]]:
        """A tree from nodes numbered in any parents-first order, renumbered breadth-first (by depth,
        then by the given order), and ``order``: the given index of each new node."""
        depth = [0] * len(tokens)
        for i in range(1, len(tokens)):
            depth[i] = depth[parents[i]] + 1
        order = sorted(range(len(tokens)), key=lambda i: (depth[i], i))
        new = {old: k for k, old in enumerate(order)}
        tree = cls([tokens[i] for i in order], [-1] + [new[parents[i]] for i in order[1:]], validate=False)
        return tree, order

    # ------------------------------------------------------------------ python views
    @property
    def num_nodes(self) -> int:
        return len(self._tok)

    def __len__(self) -> int:
        return len(self._tok)

    @property
    def token_list(self) -> list[int]:
        """``tokens`` as a Python list (do not mutate)."""
        return self._tok

    @property
    def parent_list(self) -> list[int]:
        """``parents`` as a Python list (do not mutate)."""
        return self._par

    @property
    def children(self) -> list[list[int]]:
        """``children[i]``: node indices of i's children, in order of creation (do not mutate)."""
        if self._children is None:
            ch: list[list[int]] = [[] for _ in self._tok]
            par = self._par
            for i in range(1, len(par)):
                ch[par[i]].append(i)
            self._children = ch
        return self._children

    @property
    def depth_list(self) -> list[int]:
        """Depth of every node as a Python list (root = 0)."""
        if self._depths is None:
            par = self._par
            d = [0] * len(par)
            for i in range(1, len(par)):
                d[i] = d[par[i]] + 1
            self._depths = d
        return self._depths

    @property
    def depths(self) -> torch.Tensor:
        """[n] int64 depth of every node (root = 0)."""
        if self._depths_t is None:
            self._depths_t = torch.tensor(self.depth_list, dtype=torch.int64)
        return self._depths_t

    @property
    def max_depth(self) -> int:
        return max(self.depth_list)

    def is_leaf(self, i: int) -> bool:
        return not self.children[i]

    def sibling_table(self) -> SiblingTable:
        """Internal nodes and their children's tokens, for the rejection sampler (cached)."""
        if self._siblings is None:
            tok = self._tok
            internal: list[int] = []
            kid_tokens: list[list[int]] = []
            index = [-1] * len(tok)
            lo, hi = len(tok), 0
            for i, kids in enumerate(self.children):
                if kids:
                    index[i] = len(internal)
                    internal.append(i)
                    kt = [tok[c] for c in kids]
                    m = len(kt)
                    if m > 1 and len(set(kt)) != m:
                        kt = _blank_repeats(kt)
                    kid_tokens.append(kt)
                    lo, hi = min(lo, m), max(hi, m)
            self._siblings = SiblingTable(internal, kid_tokens, index, hi, min(lo, hi))
        return self._siblings

    # ------------------------------------------------------------------ derived tensors
    def positions(self, context_len: int) -> torch.Tensor:
        """[n] int64 RoPE positions: ``context_len + depth`` (the root sits at ``context_len``)."""
        return self.depths + int(context_len)

    def _all_paths(self) -> list[list[int]]:
        if self._paths is None:
            par = self._par
            paths: list[list[int]] = [[0]]
            for i in range(1, len(par)):
                paths.append(paths[par[i]] + [i])
            self._paths = paths
        return self._paths

    def path_to(self, i: int) -> list[int]:
        """Node indices from the root to node ``i``, both included: ``[0, ..., parent(i), i]``."""
        n = len(self._tok)
        if not -n <= i < n:
            raise IndexError(f"node {i} out of range for a tree of {n} nodes")
        return list(self._all_paths()[i % n])

    def ancestor_mask(self) -> torch.Tensor:
        """[n, n] bool: ``mask[i, j]`` iff j is i or an ancestor of i (cached; do not mutate)."""
        if self._mask is None:
            n = len(self._tok)
            flat = [i * n + j for i, path in enumerate(self._all_paths()) for j in path]
            m = torch.zeros(n * n, dtype=torch.bool)
            m[torch.tensor(flat, dtype=torch.int64)] = True
            self._mask = m.view(n, n)
        return self._mask


def _blank_repeats(tokens: list[int]) -> list[int]:
    """``tokens`` with every repeat of an earlier token replaced by -1."""
    seen: set[int] = set()
    out = []
    for x in tokens:
        out.append(-1 if x in seen else x)
        seen.add(x)
    return out


def _check_parents(par: list[int], n: int) -> None:
    if n == 0:
        raise ValueError("a draft tree needs at least the root node")
    if len(par) != n:
        raise ValueError(f"tokens has {n} nodes but parents has {len(par)}")
    if par[0] != -1:
        raise ValueError(f"parents[0] must be -1 (node 0 is the root), got {par[0]}")
    for i in range(1, n):
        p = par[i]
        if not 0 <= p < i:
            raise ValueError(f"parents[{i}] = {p}: every parent must be an earlier node (0 <= parents[i] < i)")


class SiblingTable(NamedTuple):
    """Per-tree layout for the rejection sampler (see :meth:`DraftTree.sibling_table`).

    internal      nodes that have children, in index order
    kid_tokens    kid_tokens[j]: tokens of internal[j]'s children in creation order; a token that
                  repeats an earlier sibling's is replaced by -1 (it can never be accepted)
    row_of        row_of[i]: position of node i in ``internal``, or -1 for a leaf
    max_children  most children of any node (0 for a root-only tree)
    min_children  fewest children of any internal node (0 for a root-only tree)
    """

    internal: list[int]
    kid_tokens: list[list[int]]
    row_of: list[int]
    max_children: int
    min_children: int


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
