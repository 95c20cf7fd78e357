"""What a proposer hands the verifier for one request."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specd.sampling.tree import DraftTree

CHOSEN = ("ngram", "suffix")  # model-free proposers: their children are chosen (a point mass), not drawn


@dataclass
class Proposal:
    """A draft tree below the request's root, with how it was made.

    ``draft_probs`` [n, V]: row i is the distribution node i's children were drawn from (sampled
    proposals of the draft model for sampling requests); None for greedy requests and for
    ``deterministic`` proposers, whose children are chosen, not drawn (prompt lookup): their
    draft distribution is a point mass and verification uses the ``deterministic`` draft mode."""

    tree: DraftTree
    draft_probs: torch.Tensor | None
    depth: int
    # draft (the draft model) | head (feature head) | ngram (prompt lookup) | suffix (earlier requests)
    # | hybrid (several of them in one tree: ``node_proposers`` says who proposed each node)
    proposer: str = "draft"
    node_proposers: list | None = None
    # prompt lookup: how long its match (within the step's budget) let the draft be before the
    # policy's ``choose`` cut it (None: not known)
    available: int | None = None

    @property
    def deterministic(self) -> bool:
        """Verified as a chosen tree: model-free proposals, and hybrid trees (specd.speculation.hybrid)."""
        return self.proposer in CHOSEN or self.proposer == "hybrid"
