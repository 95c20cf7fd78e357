"""Draft-model proposer: chain, static tree and dynamic (EAGLE-2 style) tree, batched over requests.

Each step, per speculating request, the draft model first *catches up*: it runs the committed tokens
its cache lacks (the tokens accepted last step plus the pending token, or a prompt chunk), which
also yields the distribution after the pending token (the root). The tree then grows one level per
draft forward, all requests together:

- chain(k): one child per node, k levels.
- static(choices): Medusa/SpecInfer choice paths; rank r = the r-th best (greedy) or r-th sampled
  (sampling) child.
- dynamic(N, K, D): the root gets K children; at every level the K highest-scoring new nodes
  (score = cumulative draft log-probability) are expanded with K children each, up to depth D;
  finally the N best nodes are kept (ancestor-closed, since a child never scores above its parent).

Greedy requests take the top-ranked draft tokens. Sampling requests (temperature > 0) draw children
WITHOUT replacement from the draft distribution processed with the request's temperature/top-k/top-p
(Gumbel-top-k), in draw order; any pruning keeps a prefix of each node's children so the verifier's
without-replacement residuals stay exact. Sampled trees are never pruned after drawing (keeping a
child because of its own draft probability would bias the verifier's proposal): they meet the node
budget by construction, drawing children only while budget is left. ``draft_probs[i]`` is the
distribution node i's children were drawn from.

Draft tree nodes are written to the draft cache past the committed tokens (node i at logical
position L-1+i, L = committed length); after verification the draft cache is truncated back to the
committed prefix and the accepted tokens are caught up next step (one small extra row per token).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from specd.config import SpecMode, TreeChoices, static_tree_choices
from specd.model.attention import build_metadata
from specd.model.graphs import StepInputs
from specd.sampling.penalties import penalize_rows_
from specd.sampling.probs import logits_to_probs
from specd.sampling.tree import DraftTree
from specd.speculation.proposal import DraftRequest, Proposal
from specd.speculation.request import SpecRequest

SAMPLED_WIDTH = 2  # children per expanded node in sampled dynamic trees (see _num_children)


@dataclass
class Shape:
    kind: str  # chain | tree | static
    budget: int  # max draft nodes
    topk: int = 1
    depth: int = 1
    choices: TreeChoices | None = None  # for static

    def max_nodes(self) -> int:
        if self.kind == "chain":
            return self.budget
        if self.kind == "static":
            assert self.choices is not None
            return len(self.choices.parents) - 1
        return self.topk + (self.depth - 1) * self.topk * self.topk


class _Build:
    """One request's tree under construction."""

    __slots__ = (
        "seq",
        "shape",
        "L",
        "tokens",
        "parents",
        "depths",
        "scores",
        "anc",
        "q",
        "children",
        "sampled",
        "fed_max",
    )

    def __init__(self, seq: SpecRequest, shape: Shape, sampled: bool):
        self.seq, self.shape, self.sampled = seq, shape, sampled
        self.L = len(seq.tokens)
        self.tokens = [seq.tokens[-1]]
        self.parents = [-1]
        self.depths = [0]
        self.scores = [0.0]
        self.anc = [[0]]
        self.q: dict[int, torch.Tensor] = {}
        self.children: list[list[int]] = [[]]
        self.fed_max = 0

    def add(self, parent: int, token: int, logp: float) -> int:
        i = len(self.tokens)
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(self.depths[parent] + 1)
        self.scores.append(self.scores[parent] + logp)
        self.anc.append(self.anc[parent] + [i])
        self.children.append([])
        self.children[parent].append(i)
        return i


class Drafter:
    """The draft model's ``Proposer`` (its own paged KV cache ``cache``, a ``KVCache``, moved only
    through the engine's ``ledger``)."""

    name = "draft"
    chosen = False
    prior = 0.6  # (SpecState.recent_accept's start)

    def __init__(self, model, cache, spec_cfg, device: torch.device, vocab_size: int, backend, ledger):
        self.model = model
        self.ledger = ledger  # the draft side of each request's KV state moves only through it
        self.backend = backend
        self.cache = cache
        self.cfg = spec_cfg
        self.device = device
        self.vocab = vocab_size
        # the target ids of the proposer's logits columns (a feature head's reduced vocabulary: its
        # levels skip the -inf columns of the rest); None: the columns are the whole vocabulary
        self.d2t: torch.Tensor | None = None
        self.static = static_tree_choices(spec_cfg.static_tree) if spec_cfg.static_tree else None
        self.forwards = 0  # draft forwards so far, and their wall and CPU seconds (benchmarks read them)
        self.forward_wall = 0.0
        self.forward_cpu = 0.0
        self.levels = 0  # tree-level draft forwards of the last propose()
        # seconds of the last propose()'s forwards after the first (which also catches the draft
        # cache up, a cost that varies with how far it lags): the per-level cost the policy models
        self.level_time = 0.0
        self.clock = time.perf_counter  # the engine sets its policy clock (thread CPU time on CPU)
        self.graphs = None  # a GraphRunner over graph_step (CUDA graphs; the builder captures it), or None
        self._cols: tuple | None = None  # (logits width, target id -> column) for penalties (_columns)

    def observe(self, seq, proposal: Proposal, accepted_nodes: list[int]) -> None:
        """(The policy learns its acceptance: ``SpecPolicy.observe``.)"""

    def forget(self, seq) -> None:
        """(Its cache blocks are the ledger's to free.)"""

    def shape_for(self, mode: str, budget: int, depth: int = 0) -> Shape | None:
        if budget <= 0 or mode == SpecMode.OFF:
            return None
        if mode == SpecMode.CHAIN:
            return Shape("chain", budget, 1, budget)
        if mode == SpecMode.STATIC and self.static is not None:
            ch = self.static
            if len(ch.parents) - 1 > budget:  # keep the first `budget` nodes in BFS order (parent-closed)
                ch = type(ch)(ch.parents[: budget + 1], ch.ranks[: budget + 1], ch.paths[: budget + 1])
            return Shape("static", budget, choices=ch, depth=max(len(p) for p in ch.paths))
        topk = min(self.cfg.tree_topk, budget)
        depth = min(depth or self.cfg.tree_depth, budget)
        if topk <= 1:
            return Shape("chain", budget, 1, budget)
        return Shape("tree", budget, topk, depth)

    # forward helpers ----------------------------------------------------------------------------
    def graph_step(self, inp: StepInputs) -> torch.Tensor:
        """One draft forward over a step's inputs (``specd.model.graphs``: what a graph captures)."""
        meta = inp.to_metadata(self.cache.block_size)
        return self.model(inp.input_ids, inp.positions, self.cache.kv, meta, self.backend)

    def _rows(self, ids: torch.Tensor, pos: torch.Tensor, meta, x: torch.Tensor | None = None) -> torch.Tensor:
        """The model's output rows [T, d] for one forward: through ``graphs`` (a ``GraphRunner`` over
        :meth:`graph_step`, set by the engine's builder on CUDA; a view of its static output, valid
        until any graph of the pool replays) or eagerly."""
        if self.graphs is not None:
            return self.graphs.run(StepInputs.of(ids, pos, meta, x))
        if x is None:
            return self.model(ids, pos, self.cache.kv, meta, self.backend)
        return self.model(ids, pos, x, self.cache.kv, meta, self.backend)

    def _forward(self, rows, need_logits):
        """rows: list of (seq, tokens, positions, slots, ctx, seqlen, mask|None). Returns logits rows."""
        ids, pos, slots, qlens, ctxs, slens, masks, tables = [], [], [], [], [], [], [], []
        for seq, toks, p, s, ctx, slen, m in rows:
            ids.extend(toks)
            pos.extend(p)
            slots.extend(s)
            qlens.append(len(toks))
            ctxs.append(ctx)
            slens.append(slen)
            masks.append(m)
            tables.append(seq.draft_blocks.blocks)
        meta = build_metadata(
            qlens,
            ctxs,
            tables,
            slots,
            self.cache.block_size,
            self.device,
            tree_masks=masks if any(m is not None for m in masks) else None,
            seq_lens=slens,
        )
        dev = self.device
        t0, c0 = time.perf_counter(), time.thread_time()
        hidden = self._rows(torch.tensor(ids, device=dev), torch.tensor(pos, device=dev), meta)
        self.forwards += 1
        self.forward_wall += time.perf_counter() - t0
        self.forward_cpu += time.thread_time() - c0
        if not need_logits:
            return None
        return self.model.compute_logits(hidden[torch.tensor(need_logits, device=dev)])

    # the step ------------------------------------------------------------------------------------
    def catch_up(self, seqs_ends: list) -> None:  # (seq, committed end) pairs
        """Prefill-only draft work: bring each seq's draft cache to ``end`` committed tokens."""
        rows = []
        for seq, end in seqs_ends:
            d0 = seq.draft_computed
            if end <= d0 or not self.ledger.draft_reserve(seq, end):
                continue
            toks = seq.tokens[d0:end]
            rows.append((seq, toks, list(range(d0, end)), seq.draft_blocks.slots(d0, end), d0, end, None))
        if rows:
            self._forward(rows, None)
            for seq, _, _, _, _, end, _ in rows:
                self.ledger.draft_advance(seq, end)

    def propose(self, reqs: list[DraftRequest]) -> dict[str, Proposal]:
        """One tree per request of ``reqs`` (each with its ``shape``): {request_id: Proposal}; requests
        that cannot draft (no draft cache room) are left out."""
        builds: list[_Build] = []
        rows, need = [], []
        n_rows = 0
        for r in reqs:
            seq, shape = r.seq, r.shape
            L = len(seq.tokens)
            d0 = seq.draft_computed
            if not self.ledger.draft_reserve(seq, L + shape.max_nodes()):
                self.ledger.draft_release(seq)
                continue
            toks = seq.tokens[d0:L]
            rows.append((seq, toks, list(range(d0, L)), seq.draft_blocks.slots(d0, L), d0, L, None))
            n_rows += len(toks)
            need.append(n_rows - 1)
            builds.append(_Build(seq, shape, not seq.params.greedy))
        if not builds:
            return {}
        logits = self._forward(rows, need)  # [B, V]
        self.levels = 1
        t_levels = self.clock()
        for b in builds:
            self.ledger.draft_advance(b.seq, b.L)
        frontier = [(b, 0, logits[i]) for i, b in enumerate(builds)]
        while frontier:
            feed = self._expand(frontier)
            if not feed:
                break
            rows, flat = self._level_rows(feed)
            logits = self._forward(rows, list(range(len(flat))))
            self.levels += 1
            frontier = [(b, i, logits[k]) for k, (b, i) in enumerate(flat)]
        self.level_time = self.clock() - t_levels  # expansions + forwards of levels 2..
        return {b.seq.request_id: self._finish(b) for b in builds}

    @staticmethod
    def _level_rows(feed: list) -> tuple[list, list]:
        """The draft forward rows of one tree level: the fed nodes grouped by request (one row
        group each, with its ancestor mask over the nodes fed so far), and the (build, node) of
        each logits row in order."""
        groups: dict[int, list] = {}
        order: list[_Build] = []
        for b, i in feed:
            if id(b) not in groups:
                groups[id(b)] = []
                order.append(b)
            groups[id(b)].append(i)
        rows: list = []
        flat: list = []
        for b in order:
            nodes = groups[id(b)]
            b.fed_max = max(b.fed_max, max(nodes))
            region = b.fed_max  # node j (>= 1) sits at region column j - 1
            m = None  # a chain's region is all ancestors: causal
            if b.shape.kind != "chain":
                m = torch.zeros((len(nodes), region), dtype=torch.bool)
                for r, i in enumerate(nodes):
                    cols = [j - 1 for j in b.anc[i] if j > 0]
                    m[r, cols] = True
            Lb = b.L
            toks = [b.tokens[i] for i in nodes]
            pos = [Lb - 1 + b.depths[i] for i in nodes]
            blocks = b.seq.draft_blocks
            assert blocks is not None
            slots = [blocks.slot(Lb - 1 + i) for i in nodes]
            rows.append((b.seq, toks, pos, slots, Lb, Lb + region, m))
            flat.extend((b, i) for i in nodes)
        return rows, flat

    def _expand(self, frontier) -> list:
        """Create children for every frontier node; return the (build, node) pairs to feed next."""
        seqs = [b.seq for b, _, _ in frontier]
        logits = torch.stack([lg for _, _, lg in frontier])  # [F, V]
        self._penalize(frontier, logits)
        all_greedy = not any(b.sampled for b, _, _ in frontier)
        if all_greedy:  # fast path: confidence = softmax at temperature 1, children = top-k
            probs = None
            logq = torch.log_softmax(logits.float(), dim=-1)
        else:
            temp = torch.tensor([1.0 if s.params.greedy else s.params.temperature for s in seqs])
            topk = torch.tensor([0 if s.params.greedy else s.params.top_k for s in seqs])
            topp = torch.tensor([1.0 if s.params.greedy else s.params.top_p for s in seqs])
            dev = logits.device
            probs = logits_to_probs(logits, temp.to(dev), topk.to(dev), topp.to(dev))
            logq = torch.log(probs)
        kmax = max(self._num_children(b, i) for b, i, _ in frontier)
        if kmax == 0:
            return []
        keys = logq
        if not all_greedy:
            keys = logq.clone()
            for r, (b, _, _) in enumerate(frontier):
                if b.sampled:
                    u = torch.rand(logq.shape[1], generator=b.seq.generator, device="cpu").to(logq.device)
                    keys[r] = keys[r] - torch.log(-torch.log(u.clamp_min(1e-20)))  # Gumbel-top-k
        top = torch.topk(keys, kmax, dim=-1)
        cand = (top.indices if self.d2t is None else self.d2t[top.indices]).tolist()
        logp = logq.gather(1, top.indices).tolist()
        fed_next = []
        new_by_build: dict[int, tuple] = {}
        for r, (b, i, _) in enumerate(frontier):
            k = self._num_children(b, i)
            if k == 0:
                continue
            if probs is not None and b.sampled:
                b.q[i] = probs[r]
            for c in range(k):
                if not math.isfinite(logp[r][c]):
                    break  # zero-probability tokens are never drafted
                j = b.add(i, cand[r][c], logp[r][c])
                new_by_build.setdefault(id(b), (b, []))[1].append(j)
        for b, new in new_by_build.values():
            sh = b.shape
            if sh.kind == "chain":
                fed_next += [(b, j) for j in new if b.depths[j] < sh.depth]
            elif sh.kind == "static":
                fed_next += [(b, j) for j in new if self._num_children(b, j) > 0]
            else:
                new = [j for j in new if b.depths[j] < sh.depth]
                new.sort(key=lambda j: -b.scores[j])
                fed_next += [(b, j) for j in new[: sh.topk]]
        return fed_next

    def _penalize(self, frontier, logits: torch.Tensor) -> None:
        """Each penalized request's frontier rows penalized as the target will penalize the rows
        verifying them (the reply as far as the node: ``specd.sampling.penalties``), so the drafts
        follow the penalized target. Any draft distribution keeps the output exact; this one is
        accepted more often."""
        groups: dict[int, tuple] = {}
        for r, (b, i, _) in enumerate(frontier):
            if b.seq.params.penalized:
                g = groups.setdefault(id(b), (b, [], []))
                g[1].append(r)
                g[2].append([b.tokens[j] for j in b.anc[i][1:]])
        for b, rows, paths in groups.values():
            seq = b.seq
            output = seq.tokens[len(seq.prompt_ids) :]
            penalize_rows_(logits, rows, paths, seq.params, seq.prompt_ids, output, self._columns(logits.shape[1]))

    def _columns(self, width: int) -> torch.Tensor | None:
        """Target token id -> this drafter's logits column (-1: none) when they differ, else None."""
        if self.d2t is None and width >= self.vocab:
            return None
        if self._cols is None or self._cols[0] != width:
            cols = torch.full((self.vocab,), -1, dtype=torch.int64)
            if self.d2t is None:
                cols[:width] = torch.arange(width)
            else:
                d2t = self.d2t.cpu()
                cols[d2t] = torch.arange(len(d2t))
            self._cols = (width, cols)
        return self._cols[1]

    def _num_children(self, b: _Build, i: int) -> int:
        sh = b.shape
        if sh.kind == "chain":
            return 1 if b.depths[i] < sh.depth else 0
        if sh.kind == "tree":
            if b.depths[i] >= sh.depth:
                return 0
            if b.sampled:  # sampled trees meet the budget by construction: drawn children are never pruned,
                # so they are kept narrow enough to reach depth (full width would stop at depth 2)
                width = max(1, min(sh.topk, SAMPLED_WIDTH))
                return max(0, min(width, sh.budget - (len(b.tokens) - 1)))
            return sh.topk
        # static: count child choices under node i's path
        path = self._static_path(b, i)
        assert sh.choices is not None
        return sum(1 for p in sh.choices.paths if len(p) == len(path) + 1 and tuple(p[:-1]) == path)

    @staticmethod
    def _static_path(b: _Build, i: int) -> tuple:
        path = []
        while i > 0:
            par = b.parents[i]
            path.append(b.children[par].index(i))
            i = par
        return tuple(reversed(path))

    def _finish(self, b: _Build) -> Proposal:
        n = len(b.tokens)
        keep = list(range(n))
        sh = b.shape
        if n - 1 > sh.budget and not b.sampled:  # greedy trees: keep the N best (verification is exact)
            best = sorted(range(1, n), key=lambda j: (-b.scores[j], j))[: sh.budget]
            keep_set = {0} | set(best)
        else:
            keep_set = set(keep)
        # ancestor- and sibling-prefix-closed: keep a node only if its parent and its earlier
        # siblings are kept (without-replacement order must be preserved for the verifier)
        kept = [False] * n
        kept[0] = True
        for i in range(1, n):
            p = b.parents[i]
            if i in keep_set and kept[p]:
                sib = b.children[p]
                kept[i] = all(kept[s] for s in sib[: sib.index(i)])
        order = sorted((i for i in range(n) if kept[i]), key=lambda i: (b.depths[i], i))
        new_index = {old: k for k, old in enumerate(order)}
        tokens = [b.tokens[i] for i in order]
        parents = [-1] + [new_index[b.parents[i]] for i in order[1:]]
        tree = DraftTree(tokens, parents, validate=False)
        probs = None
        if b.sampled:
            probs = torch.zeros((len(order), self.vocab), dtype=torch.float32, device=self.device)
            for old, q in b.q.items():
                if old in new_index:
                    if self.d2t is None:
                        probs[new_index[old]] = q
                    else:  # (zero outside the reduced vocabulary: those tokens are never drafted)
                        probs[new_index[old], self.d2t] = q
        return Proposal(tree, probs, max(b.depths[i] for i in order))
