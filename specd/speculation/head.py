"""Feature-head proposer (EAGLE-style): the draft trees of ``Drafter``, grown by an ``EagleHead``.

The head reads the target's features (``specd.model.head``): the target pass hands back, for every
row it computes, the hidden states entering the head's chosen layers, and the ledger keeps those of
the committed tokens per request (``seq.hidden``, positions ``seq.hidden_start`` onwards; only the
accepted path's rows, rolled back with the KV cache) until the head has consumed them.

Positions: head row p takes the features of position p and the token at p + 1. With L committed
tokens (the last one pending, its features not computed yet) the head's cache holds rows 0..L-2
once caught up (``seq.draft_computed = L - 1``); row L-2 is the tree's root row: its logits give the
root's children and its output hidden state is their hidden input. Tree node i then sits at head
position L - 2 + depth(i), slot L - 2 + i: the draft model's layout shifted by one, so
``Drafter``'s tree building, pruning and sampling (with draft probabilities, hence lossless
verification) are reused unchanged. A request drafts with the head once the target has computed
all its committed tokens (not in the step that finishes its prompt); feature rows the target never
computed for it (a prefix-cache hit) are zeros, which costs acceptance, never correctness.
"""

from __future__ import annotations

import time

import torch

from specd.config import SpecMode
from specd.model.attention import build_metadata
from specd.model.graphs import StepInputs
from specd.speculation.drafter import Drafter, _Build
from specd.speculation.proposal import Proposal


class _HeadBuild(_Build):
    __slots__ = ("h",)

    def __init__(self, seq, shape, sampled: bool):
        super().__init__(seq, shape, sampled)
        self.L -= 1  # head rows are one position behind the tokens (see the module docstring)
        self.h: dict[int, torch.Tensor] = {}  # node -> its row's output hidden state [d]


class HeadDrafter(Drafter):
    """``Drafter`` with an ``EagleHead`` (``model``) and its one-layer paged cache (``cache``)."""

    name = "head"

    def __init__(self, head, cache, spec_cfg, device: torch.device, vocab_size: int, backend, ledger):
        super().__init__(head, cache, spec_cfg, device, vocab_size, backend, ledger)
        self.capture = head.layers  # the target layers whose input hidden states are the features
        self.d2t = head.d2t  # the head's logits cover its reduced vocabulary only
        self.feat_dim = len(head.layers) * head.target_hidden

    def shape_for(self, mode: str, budget: int, depth: int = 0):
        return super().shape_for(SpecMode.TREE if mode == SpecMode.HEAD else mode, budget, depth)

    def _run(self, rows: list, x: torch.Tensor, need: list) -> tuple:
        """Head rows (``Drafter._forward``'s row tuples) with hidden inputs ``x`` [T, d] ->
        (output hidden states [T, d], logits over the head's vocabulary [len(need), N]: ``d2t``)."""
        ids, pos, slots, qlens, ctxs, slens, masks, tables = [], [], [], [], [], [], [], []
        for seq, toks, p, s, ctx, slen, m in rows:
            ids += toks
            pos += p
            slots += s
            qlens.append(len(toks))
            ctxs.append(ctx)
            slens.append(slen)
            masks.append(m)
            tables.append(seq.draft_blocks.blocks)
        tree_masks = masks if any(m is not None for m in masks) else None
        bs, dev = self.cache.block_size, self.device
        meta = build_metadata(qlens, ctxs, tables, slots, bs, dev, tree_masks=tree_masks, seq_lens=slens)
        t0, c0 = time.perf_counter(), time.thread_time()
        out = self._rows(torch.tensor(ids, device=dev), torch.tensor(pos, device=dev), meta, x)
        if self.graphs is not None:
            out = out.clone()  # (the nodes keep their rows across levels: not views of a static output)
        logits = self.model.compute_logits(out[torch.tensor(need, device=dev)], reduced=True)
        self.forwards += 1
        self.forward_wall += time.perf_counter() - t0
        self.forward_cpu += time.thread_time() - c0
        return out, logits

    def graph_step(self, inp: StepInputs) -> torch.Tensor:
        """One head forward over a step's inputs, its hidden inputs in ``inp.rows`` (what a graph captures)."""
        meta = inp.to_metadata(self.cache.block_size)
        return self.model(inp.input_ids, inp.positions, inp.rows, self.cache.kv, meta, self.backend)

    def _features(self, seq, p0: int, p1: int) -> torch.Tensor:
        """The kept target features of positions [p0, p1) [p1 - p0, F]; zeros where none are kept."""
        out = torch.zeros((p1 - p0, self.feat_dim), dtype=self.model.fc.weight.dtype, device=self.device)
        h = seq.hidden
        if h is not None:
            lo, hi = max(p0, seq.hidden_start), min(p1, seq.hidden_start + h.shape[0])
            if lo < hi:
                out[lo - p0 : hi - p0] = h[lo - seq.hidden_start : hi - seq.hidden_start]
        return out

    def _catch_row(self, seq, d0: int, upto: int) -> tuple:
        """The row tuple of head positions [d0, upto) (tokens d0+1..upto) and its features."""
        blocks = seq.draft_blocks
        row = (seq, seq.tokens[d0 + 1 : upto + 1], list(range(d0, upto)), blocks.slots(d0, upto), d0, upto, None)
        return row, self._features(seq, d0, upto)

    def catch_up(self, seqs_ends: list) -> None:
        """Prefill: head rows for the positions whose features the target has computed."""
        rows, feats = [], []
        for seq, _end in seqs_ends:
            upto = min(seq.num_computed, len(seq.tokens) - 1)
            d0 = seq.draft_computed
            if upto <= d0 or not self.ledger.draft_reserve(seq, upto):
                continue
            row, f = self._catch_row(seq, d0, upto)
            rows.append(row)
            feats.append(f)
        if rows:
            self._run(rows, self.model.fuse(torch.cat(feats)), [0])
            for row in rows:
                self.ledger.draft_advance(row[0], row[5])

    def _start(self, reqs: list) -> tuple:
        """Catch every request up to its root row: (builds, root logits [B, V])."""
        builds, rows, feats, need = [], [], [], []
        n = 0
        for r in reqs:
            seq, shape = r.seq, r.shape
            Lh = len(seq.tokens) - 1
            if Lh < 1 or seq.num_computed < Lh:
                continue  # the target has not computed every committed token's features yet
            if not self.ledger.draft_reserve(seq, Lh + shape.max_nodes()):
                self.ledger.draft_release(seq)
                continue
            row, f = self._catch_row(seq, min(seq.draft_computed, Lh - 1), Lh)
            rows.append(row)
            feats.append(f)
            n += f.shape[0]
            need.append(n - 1)
            builds.append(_HeadBuild(seq, shape, not seq.params.greedy))
        if not builds:
            return [], None
        out, logits = self._run(rows, self.model.fuse(torch.cat(feats)), need)
        for b, k in zip(builds, need):
            self.ledger.draft_advance(b.seq, b.L)
            b.h[0] = out[k]
        return builds, logits

    def propose(self, reqs: list) -> dict:
        """One tree per ``DraftRequest`` -> {request_id: Proposal}; requests that cannot draft are left out."""
        builds, logits = self._start(reqs)
        if not builds:
            return {}
        self.levels = 1
        t_levels = self.clock()
        frontier = [(b, 0, logits[i]) for i, b in enumerate(builds)]
        while frontier:
            feed = self._expand(frontier)
            if not feed:
                break
            rows, flat = self._level_rows(feed)
            x = torch.stack([b.h[b.parents[i]] for b, i in flat])  # each node's parent's output [n, d]
            out, logits = self._run(rows, x, list(range(len(flat))))
            for k, (b, i) in enumerate(flat):
                b.h[i] = out[k]
            self.levels += 1
            frontier = [(b, i, logits[k]) for k, (b, i) in enumerate(flat)]
        self.level_time = self.clock() - t_levels
        return {b.seq.request_id: self._proposal(b) for b in builds}

    def _proposal(self, b: _HeadBuild) -> Proposal:
        prop = self._finish(b)
        prop.proposer = self.name
        return prop
