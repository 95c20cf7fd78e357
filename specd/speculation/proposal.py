"""The proposer seam: what a proposer hands the verifier (``Proposal``), what it is asked for
(``DraftRequest``) and what every proposer implements (``Proposer``).

Adding a proposer is one new file implementing ``Proposer`` plus one line in
``specd.speculation.registry`` (model-free proposers; see ``FREE_PROPOSERS`` there): ``ngram``
mode and ``auto`` then draft with it, ``SpecPolicy`` prices it at its own acceptance, and its
statistics appear under its name in ``SpecStats.by_proposer``.

Vocabulary: a *model* proposer (the draft model, the feature head) draws its children from a
distribution it computes (``draft_probs``; verified by rejection sampling against it); a *chosen*
(model-free) proposer picks them (prompt lookup, the suffix store, grammar-forced tokens): its draft
distribution is a point mass and verification uses the deterministic draft mode, exact for any
fixed set of children.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from specd.sampling.tree import DraftTree
from specd.speculation.request import SpecRequest

__all__ = ["DraftRequest", "Proposal", "Proposer"]


@dataclass
class Proposal:
    """A draft tree below the request's root, with how it was made.

    ``draft_probs`` [n, V]: row i is the distribution node i's children were drawn from (sampled
    proposals of the draft model for sampling requests); None for greedy requests and for chosen
    proposals, whose children are picked, not drawn."""

    tree: DraftTree
    draft_probs: torch.Tensor | None
    depth: int
    # who proposed it: a Proposer.name (draft, head, ngram, suffix, ...) or hybrid (several of them
    # in one tree: ``node_proposers`` says who proposed each node)
    proposer: str = "draft"
    node_proposers: list | None = None
    # prompt lookup: how long its match (within the step's budget) let the draft be before the
    # policy's ``choose`` cut it (None: not known)
    available: int | None = None
    chosen: bool = False  # children picked, not drawn (model-free proposers and hybrid trees)

    @property
    def deterministic(self) -> bool:
        """Verified as a chosen tree (the verifier's deterministic draft mode)."""
        return self.chosen


@dataclass
class DraftRequest:
    """One request's share of a step for one proposer: at most ``budget`` draft tokens; a model
    proposer's tree ``shape`` (``specd.speculation.drafter.Shape``); for a model-free proposer,
    ``choose(available)``: how many of the ``available`` tokens its match allows to draft (the
    policy's length once the match is known; None: as many as the budget allows)."""

    seq: SpecRequest
    budget: int
    shape: Any = None
    choose: Callable[[int], int] | None = None


class Proposer(Protocol):
    """What every proposer implements.

    ``name``: its key in ``SpecStats.by_proposer`` and ``Proposal.proposer``; ``chosen``: whether
    its children are picked (model-free) rather than drawn; ``prior``: the per-token acceptance
    ``auto`` assumes for a request before it has measured any (model-free proposers)."""

    name: str
    chosen: bool
    prior: float

    def propose(self, reqs: list[DraftRequest]) -> dict[str, Proposal]:
        """Proposals by request id for the requests it has something for (others: absent)."""
        ...

    def observe(self, seq: SpecRequest, proposal: Proposal, accepted_nodes: list[int]) -> None:
        """What verification kept of its proposal (node indices of the accepted path)."""
        ...

    def forget(self, seq: SpecRequest) -> None:
        """The request finished: drop (or keep, e.g. as drafting material) what it held of it."""
        ...
