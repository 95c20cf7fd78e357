"""What speculation knows of a request: its settings (``SpecParams``), its statistics
(``SpecStats``), the per-request state the policy and proposers keep (``SpecState``, one object on
the sequence), and the attributes they read (``SpecRequest``, which the engine's ``Sequence``
satisfies: speculation never imports the engine)."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from specd.config import REQUEST_MODES, SpecMode
from specd.sampling.params import SamplingParams

if TYPE_CHECKING:
    import torch

__all__ = ["SpecParams", "SpecStats", "SpecState", "SpecRequest"]


@dataclass(frozen=True)
class SpecParams:
    """Per-request speculation: ``auto`` lets the scheduler decide; ``max_draft_tokens`` caps the tree."""

    mode: SpecMode | str = SpecMode.AUTO  # one of REQUEST_MODES (a string is converted to its SpecMode)
    max_draft_tokens: int | None = None

    def __post_init__(self):
        if self.mode not in REQUEST_MODES:
            raise ValueError(f"speculation.mode must be {'|'.join(REQUEST_MODES)}, got {self.mode!r}")
        object.__setattr__(self, "mode", SpecMode(self.mode))
        m = self.max_draft_tokens
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 0 or m > 256):
            raise ValueError(f"speculation.max_draft_tokens must be an integer in 0..256, got {m!r}")


@dataclass
class SpecStats:
    steps: int = 0  # verification steps that emitted tokens
    draft_tokens: int = 0  # draft nodes proposed (excluding roots)
    accepted_tokens: int = 0  # draft tokens accepted
    emitted_tokens: int = 0
    accepted_per_depth: list = field(default_factory=list)  # [d] accepted draft tokens at depth d+1
    drafted_per_depth: list = field(default_factory=list)  # [d] steps that drafted at depth d+1
    accept_len_hist: list = field(default_factory=list)  # [a] steps that accepted exactly a drafts
    by_proposer: dict = field(default_factory=dict)  # proposer -> [steps, draft tokens, accepted tokens]

    def record(self, num_drafted: int, depth: int, accepted: int, proposer: str | dict | None = None) -> None:
        """One verification step. ``proposer``: who drafted its tree, or for a hybrid tree a dict
        (proposer -> [draft nodes, accepted tokens, ...]) splitting the step between them."""
        self.steps += 1
        parts = {proposer: [num_drafted, accepted]} if isinstance(proposer, str) else proposer or {}
        for name, (nodes, acc, *_) in parts.items():
            row = self.by_proposer.setdefault(name, [0, 0, 0])
            row[0] += 1
            row[1] += nodes
            row[2] += acc
        if not depth and not accepted and self.accept_len_hist:  # a plain decode step (the common case)
            self.draft_tokens += num_drafted
            self.accept_len_hist[0] += 1
            return
        self.draft_tokens += num_drafted
        self.accepted_tokens += accepted
        for lst, n in ((self.drafted_per_depth, depth), (self.accepted_per_depth, accepted)):
            while len(lst) < n:
                lst.append(0)
            for d in range(n):
                lst[d] += 1
        while len(self.accept_len_hist) <= accepted:
            self.accept_len_hist.append(0)
        self.accept_len_hist[accepted] += 1

    def merge(self, o: SpecStats) -> None:
        self.steps += o.steps
        self.draft_tokens += o.draft_tokens
        self.accepted_tokens += o.accepted_tokens
        self.emitted_tokens += o.emitted_tokens
        for name, (s, d, a) in o.by_proposer.items():
            row = self.by_proposer.setdefault(name, [0, 0, 0])
            row[0] += s
            row[1] += d
            row[2] += a
        for name in ("accepted_per_depth", "drafted_per_depth", "accept_len_hist"):
            a, b = getattr(self, name), getattr(o, name)
            while len(a) < len(b):
                a.append(0)
            for i, v in enumerate(b):
                a[i] += v

    @property
    def mean_accepted_length(self) -> float:
        """1 + accepted / steps: tokens per target forward, counting the bonus (vLLM's definition)."""
        return 1.0 + self.accepted_tokens / self.steps if self.steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    def as_dict(self) -> dict:
        return {
            "steps": self.steps,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "mean_accepted_length": round(self.mean_accepted_length, 4),
            "acceptance_rate": round(self.acceptance_rate, 4),
            "acceptance_per_depth": [
                round(a / d, 4) if d else 0.0 for a, d in zip(self.accepted_per_depth, self.drafted_per_depth)
            ],
            "accepted_per_depth": list(self.accepted_per_depth),
            "accept_len_hist": list(self.accept_len_hist),
            "by_proposer": {
                name: {
                    "steps": s,
                    "draft_tokens": d,
                    "accepted_tokens": a,
                    "mean_accepted_length": round(1.0 + a / s, 4) if s else 0.0,
                }
                for name, (s, d, a) in sorted(self.by_proposer.items())
            },
        }


@dataclass
class SpecState:
    """A request's speculation state, kept by ``SpecPolicy`` and the proposers (nothing else writes
    it). Acceptances are EMAs of accepted / drafted depth per step (``SpecPolicy.observe``)."""

    recent_accept: float = 0.6  # the model proposer's trees (the adaptive depth's prior)
    chain_accept: float = 0.6  # the same for its top-1 chains (the narrow shape: SpecPolicy)
    ngram_accept: float = 0.5  # prompt lookup's drafts
    # other model-free proposers (by Proposer.name): their EMA, from their declared prior
    accept: dict = field(default_factory=dict)
    # recent prompt-lookup outcomes (accepted, drafted) (SpecPolicy.lookup_expected) and the
    # policy's lookup_expected by length from them (cleared on a new outcome)
    lookup_outcomes: collections.deque = field(default_factory=lambda: collections.deque(maxlen=16))
    lookup_cache: dict = field(default_factory=dict)
    last_probe: int = -1  # scheduler step of its last adaptive-speculation probe
    ngram_index: Any = None  # prompt lookup's index over its tokens (specd.speculation.ngram), built on first use
    # proposers' own per-request state (by Proposer.name), dropped by Proposer.forget
    proposer_state: dict = field(default_factory=dict)


class SpecRequest(Protocol):
    """The attributes of a request that speculation reads (``specd.engine.sequence.Sequence``)."""

    request_id: str
    tokens: list[int]
    prompt_ids: list[int]
    params: SamplingParams
    spec: SpecParams
    stats: SpecStats
    spec_state: SpecState
    tenant: str | None
    generator: torch.Generator | None
    num_computed: int
    draft_computed: int
    draft_blocks: Any  # its block table in the draft cache (a SeqBlocks; the ledger's)
    matcher: Any  # its grammar state (a specd.structured.Matcher), None when unconstrained
