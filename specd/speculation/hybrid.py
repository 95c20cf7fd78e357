"""Hybrid trees: one verification tree with branches from several proposers.

The model proposer (draft model or feature head) and prompt lookup (or the suffix store) each
propose a tree below the same root; ``merge`` lays the second over the first, sharing the nodes they
agree on, and records per node who proposed it (a shared node stays the first proposer's). The merged
tree is verified as a *chosen* tree (the verifier's deterministic draft mode): at every node the
target's token is drawn from its own distribution and accepted when some child carries it, which is
exact for any fixed set of children whoever proposed them. A greedy request verifies it as any tree.
"""

from __future__ import annotations

from specd.sampling.tree import DraftTree
from specd.speculation.proposal import Proposal


def merge(first: Proposal, second: Proposal, budget: int) -> Proposal:
    """``second``'s nodes laid over ``first``'s below the same root, at most ``budget`` draft nodes
    (``first``'s nodes are kept first; ``second``'s are added in their order while room is left).
    Node order is breadth-first (parents before children, each node's children in the order they
    were added: ``first``'s before ``second``'s)."""
    a, b = first.tree, second.tree
    if a.token_list[0] != b.token_list[0]:
        raise ValueError("proposals below different roots cannot be merged")
    tokens, parents = list(a.token_list), list(a.parent_list)
    owners = list(first.node_proposers or [first.proposer] * len(tokens))
    children: list[dict[int, int]] = [{} for _ in tokens]
    for i in range(1, len(tokens)):
        children[parents[i]].setdefault(tokens[i], i)
    where = [0]  # second's node -> merged node
    for j in range(1, b.num_nodes):
        up, tok = where[b.parent_list[j]], b.token_list[j]
        if up < 0:  # its parent did not fit
            where.append(-1)
            continue
        node = children[up].get(tok)
        if node is None:
            if len(tokens) - 1 >= budget:
                where.append(-1)
                continue
            node = len(tokens)
            tokens.append(tok)
            parents.append(up)
            owners.append(second.proposer)
            children.append({})
            children[up][tok] = node
        where.append(node)
    tree, order = DraftTree.breadth_first(tokens, parents)
    nodes = [owners[i] for i in order]
    return Proposal(tree, None, tree.max_depth, proposer="hybrid", node_proposers=nodes, chosen=True)


def credit(prop: Proposal, accepted_nodes: list) -> dict:
    """Per proposer of ``prop``: [draft nodes, accepted tokens, deepest node] this step (the
    accepted path's nodes are credited to whoever proposed each of them)."""
    owners = prop.node_proposers or [prop.proposer] * prop.tree.num_nodes
    depths = prop.tree.depth_list
    out: dict = {}
    for node in range(1, len(owners)):
        row = out.setdefault(owners[node], [0, 0, 0])
        row[0] += 1
        row[2] = max(row[2], depths[node])
    for node in accepted_nodes:
        out[owners[node]][1] += 1
    return out
