"""A toy model-free proposer, the whole of it in one file (tests/test_proposer_seam.py registers it
with one line): it drafts from a table of known continuations, as a retrieval store or a grammar's
forced tokens would, or, as a ``liar``, drafts tokens the target never picks."""

from __future__ import annotations

from specd.sampling.tree import DraftTree
from specd.speculation.proposal import DraftRequest, Proposal


class TableProposer:
    name = "table"
    chosen = True  # children picked, not drawn
    prior = 0.9

    def __init__(self, table: dict, liar: bool = False, name: str = "table"):
        self.table = table  # prompt token ids (tuple) -> the continuation it drafts from
        self.liar = liar
        self.name = name
        self.observed = 0  # accepted tokens it was told about
        self.forgotten: list = []

    def propose(self, reqs: list[DraftRequest]) -> dict[str, Proposal]:
        out = {}
        for r in reqs:
            seq = r.seq
            ref = self.table.get(tuple(seq.prompt_ids))
            if ref is None:
                continue
            pos = len(seq.tokens) - len(seq.prompt_ids)
            cont = list(ref[pos : pos + r.budget])
            if self.liar:
                cont = [(t + 1) % 500 for t in cont]
            if r.choose is not None:
                cont = cont[: max(r.choose(len(cont)), 0)]
            if cont:
                tree = DraftTree.chain(seq.tokens[-1], cont)
                out[seq.request_id] = Proposal(tree, None, len(cont), proposer=self.name, chosen=True)
        return out

    def observe(self, seq, proposal: Proposal, accepted_nodes: list[int]) -> None:
        self.observed += len(accepted_nodes)

    def forget(self, seq) -> None:
        self.forgotten.append(seq.request_id)
