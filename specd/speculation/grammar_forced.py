"""Grammar-forced tokens as free drafts (jump-forward): where a constrained request's grammar
allows exactly one continuation (a JSON key, its quotes and colon, a closing brace, an enum's
tail), those tokens are proposed as a chain without running any drafter. The target verifies them
with the rest of the step like any draft, so a tokenization the target would not choose is rejected
(and corrected), never emitted: output stays the target's under the grammar.

Example: schema ``{"properties": {"name": ...}, "required": ["name"]}`` right after ``{`` the
grammar forces the text ``"name":"``; its token ids (in the target tokenizer's encoding, the last
token left out where a longer token could absorb what follows) are drafted in one step; the target
accepts them where it would have written them itself.
"""

from __future__ import annotations

from specd.sampling.tree import DraftTree
from specd.speculation.proposal import DraftRequest, Proposal

__all__ = ["GrammarForced"]


class GrammarForced:
    """A model-free ``Proposer`` for constrained requests (others: nothing)."""

    name = "grammar"
    chosen = True
    prior = 0.95  # forced text is nearly always what the target writes under the grammar

    def propose(self, reqs: list[DraftRequest]) -> dict[str, Proposal]:
        out = {}
        for r in reqs:
            m = getattr(r.seq, "matcher", None)
            if m is None or r.budget <= 0:
                continue
            forced = m.forced_tokens(r.budget)
            if r.choose is not None and forced:
                forced = forced[: max(r.choose(len(forced)), 0)]
            if forced:
                tree = DraftTree.chain(r.seq.tokens[-1], forced)
                out[r.seq.request_id] = Proposal(tree, None, len(forced), proposer=self.name, chosen=True)
        return out

    def observe(self, seq, proposal: Proposal, accepted_nodes: list[int]) -> None:
        """(Its acceptance is the policy's: ``SpecPolicy.observe``.)"""

    def forget(self, seq) -> None:
        """(It keeps nothing per request: the matcher is the request's.)"""


def from_context(ctx) -> GrammarForced:
    return GrammarForced()
