"""Model-free drafting by prompt lookup: propose what followed an earlier occurrence of the
context's most recent n-gram.

Vocabulary (as in ``verify.py``): the *root* is the request's pending token (the last committed
one); the proposal is a tree of *draft tokens* below it. Here every draft token is a copy of the
context, so the draft distribution is a point mass: verification uses the ``deterministic`` draft
mode (``verify.py``), which keeps sampling lossless.

Matching: for n from ``max_n`` down to ``min_n``, the last n committed tokens are looked up among
the earlier n-grams of the request's own context (prompt and output so far); the first n with a
match wins (longer matches predict better). Each earlier occurrence offers the tokens that followed
it: as many as the occurrence's *match length* m (how many tokens before it equal the context's last
ones, n or more) plus ``extend``, at most ``max_tokens`` (``extend`` None: always ``max_tokens``).
A copied span matches on for about as long as it already has: offline, on the built-in model's
greedy Spec-Bench replies (48, 256 tokens), drafting up to m + 1 tokens instead of 8 verified 28%
fewer rows per step for 3% fewer tokens per step. Occurrences are taken longest match first, then
most recent; up to ``branches`` distinct continuations are merged into a trie below the root (a
chain when ``branches`` is 1). No match: no proposal, the step decodes plainly at no extra cost.

Worked example (``max_n`` 2, ``min_n`` 1, ``max_tokens`` 3, ``extend`` 1, ``branches`` 2): context
``a b c d a b x a b`` ends with the bigram ``a b``, seen ending at positions 1 and 5 (0-based),
each with match length 2; the most recent, at 5, was followed by ``x a b``, the earlier one by
``c d a`` (3 = 2 + 1 tokens each). The tree is ``root -> x -> a -> b`` and ``root -> c -> d -> a``
(the root is the last ``b``).

The index of a request (``NgramIndex``) lives on its ``Sequence`` and grows with it: O(new tokens
x n sizes) per step, memory O(context x n sizes) per request, freed with the request.
"""

from __future__ import annotations

from dataclasses import dataclass

from specd.sampling.tree import DraftTree
from specd.speculation.proposal import DraftRequest, Proposal
from specd.speculation.suffix import SuffixStore

MAX_OCCURRENCES = 64  # most recent occurrences of an n-gram scanned for distinct continuations
MATCH_SCAN = 16  # most recent occurrences whose match length is measured (the rest count as n)


@dataclass(frozen=True)
class NgramConfig:
    max_n: int = 4  # longest n-gram matched
    min_n: int = 2  # shortest n-gram matched
    max_tokens: int = 8  # draft tokens per continuation (the tree's depth)
    branches: int = 1  # distinct continuations merged into the tree (1 = a chain)
    extend: int | None = 1  # draft at most the match length + this many tokens (None: max_tokens)

    def __post_init__(self):
        if not 1 <= self.min_n <= self.max_n <= 16:
            raise ValueError(f"n-gram sizes need 1 <= min_n <= max_n <= 16, got {self.min_n}..{self.max_n}")
        if not 1 <= self.max_tokens <= 256 or not 1 <= self.branches <= 8:
            raise ValueError("n-gram max_tokens must be in 1..256 and branches in 1..8")
        if self.extend is not None and self.extend < 0:
            raise ValueError(f"n-gram extend must be >= 0 or None, got {self.extend}")


class NgramIndex:
    """Where each n-gram (n in ``sizes``) of a token list ends: ``{n: {ngram: [end positions]}}``,
    an end position being the index of the token that followed it. Updated incrementally."""

    def __init__(self, sizes: range):
        self.sizes = sizes
        self.table: dict[int, dict[tuple, list[int]]] = {n: {} for n in sizes}
        self.indexed = 0  # tokens[:indexed] are indexed

    def update(self, tokens: list) -> None:
        """Index every n-gram ending before ``len(tokens) - 1`` (the newest n-gram is the query)."""
        upto = len(tokens) - 1
        for end in range(max(self.indexed, 1), upto + 1):
            for n in self.sizes:
                if end >= n:
                    self.table[n].setdefault(tuple(tokens[end - n : end]), []).append(end)
        self.indexed = max(self.indexed, upto + 1)

    def continuations(self, tokens: list, max_tokens: int, branches: int, extend: int | None = None) -> list:
        """Up to ``branches`` distinct continuations of the longest matching n-gram that ends the
        context, each at most ``max_tokens`` long; ``extend`` None: most recent occurrence first;
        else longest match first (then most recent), each cut to its match length + ``extend``."""
        self.update(tokens)
        L = len(tokens)
        for n in reversed(self.sizes):
            if L < n:
                continue
            ends = self.table[n].get(tuple(tokens[L - n :]))
            if not ends:
                continue
            recent = ends[: -MAX_OCCURRENCES - 1 : -1]
            if extend is None:
                lengths = [max_tokens] * len(recent)
            else:  # (sorted is stable: among equal matches the most recent stays first)
                cap = max_tokens - extend
                m = [match_length(tokens, e, n, cap) if i < MATCH_SCAN else n for i, e in enumerate(recent)]
                order = sorted(range(len(recent)), key=lambda i: -m[i])
                recent, lengths = [recent[i] for i in order], [min(max_tokens, m[i] + extend) for i in order]
            out: list[list[int]] = []
            for end, k in zip(recent, lengths):
                cont = tokens[end : min(end + k, L)]
                if cont and cont not in out:
                    out.append(cont)
                    if len(out) == branches:
                        break
            if out:
                return out
        return []


def match_length(tokens: list, end: int, n: int, cap: int) -> int:
    """How many tokens before ``end`` equal the last ones of ``tokens`` (at least ``n``: the matched
    n-gram), counted up to ``cap`` (or ``n`` if that is more)."""
    L, m = len(tokens), n
    while m < cap and end - 1 - m >= 0 and tokens[end - 1 - m] == tokens[L - 1 - m]:
        m += 1
    return m


def trie(root: int, continuations: list, budget: int) -> DraftTree:
    """The continuations merged below ``root`` (shared prefixes once), at most ``budget`` draft
    nodes, in breadth-first order (parents before children, siblings in continuation order)."""
    children: list[dict[int, int]] = [{}]  # node -> {token: child node} (tentative numbering)
    tokens, parents = [root], [-1]
    for cont in continuations:
        node = 0
        for t in cont:
            nxt = children[node].get(t)
            if nxt is None:
                if len(tokens) - 1 >= budget:
                    break
                nxt = len(tokens)
                children[node][t] = nxt
                children.append({})
                tokens.append(t)
                parents.append(node)
            node = nxt
    return DraftTree.breadth_first(tokens, parents)[0]


class NgramProposer:
    """Model-free proposals (a ``Proposer``; no model, no KV cache): prompt lookup in the request's
    own context first, else (with a ``SuffixStore``) the tenant's earlier requests."""

    name = "ngram"
    chosen = True
    prior = 0.5  # SpecState.ngram_accept's start

    def __init__(self, cfg: NgramConfig | None = None, store: SuffixStore | None = None):
        self.cfg = cfg or NgramConfig()
        self.store = store

    def propose(self, reqs: list[DraftRequest]) -> dict[str, Proposal]:
        out = {}
        for r in reqs:
            prop = self.propose_one(r.seq, r.budget, r.choose)
            if prop is not None:
                out[r.seq.request_id] = prop
        return out

    def propose_one(self, seq, budget: int, choose=None) -> Proposal | None:
        """A proposal of at most ``budget`` draft tokens for ``seq``, or None without a match;
        ``choose(available)`` (the longest continuation's length): how many tokens of it to draft
        (0: none), once the match is known (``SpecPolicy.lookup_len``)."""
        if budget <= 0:
            return None
        state = seq.spec_state
        if state.ngram_index is None:
            state.ngram_index = NgramIndex(range(self.cfg.min_n, self.cfg.max_n + 1))
        k = min(self.cfg.max_tokens, budget)
        conts, name = state.ngram_index.continuations(seq.tokens, k, self.cfg.branches, self.cfg.extend), "ngram"
        if not conts and self.store is not None:
            cont = self.store.continuation(seq.tenant, seq.tokens, k)
            conts, name = ([cont] if cont else []), "suffix"
        if not conts:
            return None
        available = max(map(len, conts))
        if choose is not None:
            d = min(choose(available), available)
            if d <= 0:
                return None
            conts = [list(c) for c in dict.fromkeys(tuple(c[:d]) for c in conts)]
        tree = trie(seq.tokens[-1], conts, budget)
        return Proposal(tree, None, tree.max_depth, proposer=name, available=available, chosen=True)

    def observe(self, seq, proposal: Proposal, accepted_nodes: list[int]) -> None:
        """(Its outcomes are the policy's: ``SpecPolicy.observe`` keeps them per match length.)"""

    def forget(self, seq) -> None:
        """A request completed: its tokens join its tenant's store."""
        if self.store is not None:
            self.store.add(seq.tenant, seq.tokens)


def from_context(ctx) -> NgramProposer:
    """The server's prompt lookup (``specd.speculation.registry``): its settings from ``SpecConfig``."""
    spec = ctx.spec
    cfg = NgramConfig(
        max_tokens=spec.ngram_tokens,
        branches=spec.ngram_branches,
        extend=None if spec.ngram_extend < 0 else spec.ngram_extend,
    )
    return NgramProposer(cfg, SuffixStore() if spec.suffix_store else None)
