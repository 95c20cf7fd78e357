"""The model-free proposers a server builds, by name: one line each.

A factory takes a ``ProposerContext`` and returns a ``Proposer`` (or None where it does not apply
to this server's settings). The model proposers (draft model, feature head) are not listed: they
come from loaded weights (``specd.engine.builder``). ``ngram`` mode and ``auto`` consult every
built model-free proposer, in this order, and the policy picks the proposal worth most
(``SpecPolicy.best_free``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from specd.config import SpecConfig
from specd.speculation.grammar_forced import from_context as grammar_forced
from specd.speculation.ngram import from_context as ngram_proposer
from specd.speculation.proposal import Proposer

__all__ = ["ProposerContext", "FREE_PROPOSERS", "register", "unregister", "build_free"]


@dataclass(frozen=True)
class ProposerContext:
    """What a proposer factory may read: the speculation settings, the target's vocabulary size
    and tokenizer (None where the model has none)."""

    spec: SpecConfig
    vocab_size: int
    tokenizer: Any = None


Factory = Callable[[ProposerContext], "Proposer | None"]

FREE_PROPOSERS: dict[str, Factory] = {
    "ngram": ngram_proposer,  # prompt lookup, then the tenant's earlier requests (the suffix store)
    "grammar": grammar_forced,  # constrained requests: the text their grammar forces (jump-forward)
}


def register(name: str, factory: Factory) -> None:
    """Add a model-free proposer (tests and plugins; the built-in ones are listed above)."""
    if name in FREE_PROPOSERS:
        raise ValueError(f"a proposer named {name!r} is registered already")
    FREE_PROPOSERS[name] = factory


def unregister(name: str) -> None:
    FREE_PROPOSERS.pop(name, None)


def build_free(ctx: ProposerContext) -> list[Proposer]:
    """The model-free proposers for a server, in registry order."""
    out = []
    for factory in FREE_PROPOSERS.values():
        p = factory(ctx)
        if p is not None:
            out.append(p)
    return out
