"""Verification of a draft tree against the target model: pure functions, no cache bookkeeping.

Vocabulary (one decode step of one request; see also ``docs/architecture.md``)
-------------------------------------------------------------------------------
- **root**: node 0 of the :class:`~specd.sampling.tree.DraftTree`, the request's pending token.
- **draft tokens**: every other node, proposed by the drafter.
- **accepted tokens**: the draft tokens the verifier keeps; always a root-to-node path.
- **correction (recovered) token**: the token the target emits where the walk stops at a node that
  has children, all of them rejected.
- **bonus token**: the token the target emits after the accepted path when the walk stops at a
  leaf (every draft on the path accepted, nothing below it to check).
- A step emits ``accepted + [next_token]``: ``len(accepted) + 1`` tokens, the last being a
  correction or a bonus token.

Row ``i`` of the target's output belongs to node ``i``: it is the target's distribution (or its
argmax) for the token that follows the path root..i.

Greedy verification, worked example
-----------------------------------
::

    node:          0    1    2    3    4            tree:        5 (0)
    token:         5    7    9    3    8                        /     \\
    parent:       -1    0    0    1    1                     7 (1)   9 (2)
                                                            /   \\
                                                         3 (3)  8 (4)

    target argmax per node  [9, 2, 4, 6, 1]
      root: the target says 9; child node 2 has token 9 -> accept node 2
      node 2: the target says 4; node 2 is a leaf       -> stop, bonus token 4
      => accepted = [2], tokens = [9, 4], next_token = 4, bonus = True

    target argmax per node  [7, 6, 4, 6, 1]
      root: the target says 7 -> accept node 1
      node 1: the target says 6; its children carry 3 and 8 -> stop, correction token 6
      => accepted = [1], tokens = [7, 6], next_token = 6, bonus = False

The emitted tokens are exactly what greedy decoding with the target alone produces.

Sampling verification: lossless tree rejection sampling
-------------------------------------------------------
Recursive rejection sampling over the children of a node (SpecInfer's multi-draft verification;
Jeon et al. 2024 for drafts drawn without replacement). At the current node let ``p`` be the target
distribution (``target_probs[node]``, already processed by temperature/top-k/top-p) and ``q`` the
draft distribution (``draft_probs[node]``) its children ``x_1 .. x_M`` (in creation order) came
from. The proposal of the m-th child is

- ``draft_mode="sampled"`` (children drawn from ``q`` without replacement, in this order):
  ``q_m = q`` with ``x_1 .. x_{m-1}`` zeroed, renormalised;
- ``draft_mode="deterministic"`` (children chosen deterministically, e.g. draft top-k):
  ``q_m = onehot(x_m)``.

Then, starting from ``p_1 = p``::

    for m = 1 .. M:
        accept x_m with probability  min(1, p_m(x_m) / q_m(x_m))
        if accepted: emit x_m, move to that child, restart with its p and q
        else:        p_{m+1} = max(p_m - q_m, 0) / sum(max(p_m - q_m, 0))
    all rejected: emit the correction token ~ p_{M+1}; stop
    at a leaf (M = 0): emit the bonus token ~ p; stop

Worked example (vocabulary {0, 1, 2}, "sampled", the drafter drew x_1 = 1 then x_2 = 2)::

    p = [0.5, 0.3, 0.2]      q = [0.2, 0.6, 0.2]
    m = 1: q_1 = q;               accept 1 w.p. min(1, 0.3 / 0.6) = 0.5
           rejected: p_2 = normalise(max(p - q_1, 0)) = normalise([0.3, 0, 0]) = [1, 0, 0]
    m = 2: q_2 = [0.5, 0, 0.5];   accept 2 w.p. min(1, 0 / 0.5) = 0
           rejected: p_3 = normalise(max(p_2 - q_2, 0)) = [1, 0, 0]
    correction token ~ p_3: 0.   (Emits 1 w.p. 0.5, else 0; averaged over the drafter's draws
    the emitted token is distributed exactly as p.)

Why it is lossless: one round is ordinary rejection sampling. If ``x ~ q_m`` and it is accepted
w.p. ``min(1, p_m/q_m)`` with ``p_{m+1}`` used on rejection, then
``P(emit y) = min(p_m(y), q_m(y)) + (1 - sum_x min(p_m, q_m)) * p_{m+1}(y) = p_m(y)``, because
``1 - sum min(p_m, q_m) = sum max(p_m - q_m, 0)``. Given the earlier rejections, ``x_m`` is
distributed as ``q_m`` (that is what drawing without replacement means; for deterministic
children it is a point mass), so by induction from the last round backwards the token emitted at a
node is distributed as ``p``. The children of an accepted node were drawn independently of the
acceptance test above it, so the same holds at the next node with ``p = target_probs[child]``, and
by the chain rule the emitted sequence follows the target. A rejection implies
``p_m(x_m) < q_m(x_m)``, hence ``p_{m+1}(x_m) = 0``: a rejected token never comes back as the
correction. In deterministic mode ``q_m`` is a point mass, so ``x_m`` is accepted w.p.
``p_m(x_m)`` and the residual is ``p_m`` with ``x_m`` removed.

Edge cases: ``q_m(x_m) = 0`` (a draft the drafter claims it could not have drawn) is accepted iff
``p_m(x_m) > 0`` (the ratio is infinite); if the draft mass left for ``q_m`` is 0 the child is
treated as deterministic; a sibling repeating an earlier sibling's token is never accepted and
leaves ``p_m`` unchanged; when the residual mass is ~0 (``p_m == q_m`` up to rounding, where a
rejection has probability ~0) the next ``p`` is ``p_m`` without ``x_m``.

Implementation: all arithmetic in float64. The per-node tables (acceptance probability of every
child, the residual after all children) are computed for all internal nodes of all requests at
once, looping only over the sibling rank; the acceptance tests run there too, and one host
transfer brings back, per internal node, the rank of its accepted child (or -1). The walks then
run on the host over those small ints, and a second transfer returns the sampled
correction/bonus tokens. Each request draws ``num_nodes`` uniforms from its own generator per
step: the first samples the final token by inverse CDF, the others decide the ``num_nodes - 1``
children's acceptance tests (each child is tested at most once), taken in (parent, sibling rank)
order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain

import torch

from specd.sampling.probs import draw_uniforms, sample_from_uniform
from specd.sampling.tree import DraftTree

__all__ = ["AcceptResult", "greedy_verify", "sample_verify", "verify_batch", "DRAFT_MODES"]

DRAFT_MODES = ("sampled", "deterministic")

_TINY = torch.finfo(torch.float64).tiny
# Residual mass below this is treated as 0 (p_m == q_m up to rounding of float32 inputs).
_RESIDUAL_EPS = 1e-9
# Cap on the elements of one [rows, vocab] float64 working tensor (chunks over rows beyond it).
_CHUNK_ELEMS = 1 << 24
_PAD = -2  # padding in the [internal nodes, max children] layout (-1 marks a repeated token)


@dataclass(slots=True)
class AcceptResult:
    """Outcome of verifying one request's tree.

    accepted    tree node indices of the accepted drafts, root to deepest (root excluded)
    tokens      what the step emits: the accepted draft tokens, then ``next_token``
    next_token  the correction token, or the bonus token when ``bonus``
    bonus       True when the walk ended at a leaf (every draft on the path was accepted)
    """

    accepted: list[int]
    tokens: list[int]
    next_token: int
    bonus: bool

    @property
    def num_accepted(self) -> int:
        return len(self.accepted)


# ---------------------------------------------------------------------------------------- greedy
def greedy_verify(tree: DraftTree, target_argmax: Sequence[int] | torch.Tensor) -> AcceptResult:
    """Walk the tree along the target's argmax tokens (see the module docstring's example).

    tree: n nodes; target_argmax: [n] ints, the target's argmax token after each node (list, or a
    tensor, transferred with one ``tolist()``). Pure Python over small lists.
    """
    if isinstance(target_argmax, torch.Tensor):
        target_argmax = target_argmax.tolist()
    return _greedy_walk(tree.token_list, tree.children, target_argmax, 0)


def _greedy_walk(tok: list[int], children: list[list[int]], am: Sequence[int], off: int) -> AcceptResult:
    node = 0
    accepted: list[int] = []
    while True:
        want = am[off + node]
        kids = children[node]
        for c in kids:
            if tok[c] == want:
                accepted.append(c)
                node = c
                break
        else:
            return AcceptResult(accepted, [tok[c] for c in accepted] + [want], want, not kids)


# -------------------------------------------------------------------------------------- sampling
def _node_tables(
    p: torch.Tensor, q: torch.Tensor | None, kid_tok: torch.Tensor, kid_ok: torch.Tensor, det: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Recursive rejection sampling tables for a set of tree nodes (one row per node).

    Args:
      p        [I, V] float64  target distribution at each node (rows normalised)
      q        [I, V] float64  draft distribution the node's children were drawn from (rows
                               normalised), or None when every row is deterministic
      kid_tok  [I, K] int64    token of the node's k-th child (any valid id where absent)
      kid_ok   [I, K] bool     child k exists and is not a repeat of an earlier sibling's token
      det      [I]    bool     deterministic children: q_m = onehot(x_m)
    Returns:
      accept   [I, K] float64  P(accept child k | children < k rejected); 0 where not kid_ok
      residual [I, V] float64  p_{M+1}: the correction distribution once every child is rejected
    """
    num, k_max = kid_tok.shape
    accept = p.new_zeros((num, k_max))  # [I, K]
    r = p  # [I, V] current p_m
    qc = q  # [I, V] draft mass not yet drawn (un-normalised), sampled rows
    det_col = det[:, None]  # [I, 1]
    for k in range(k_max):
        x = kid_tok[:, k : k + 1]  # [I, 1]
        ok = kid_ok[:, k : k + 1]  # [I, 1]
        hit = torch.zeros_like(r, dtype=torch.bool).scatter_(1, x, True)  # [I, V] onehot(x_m)
        onehot = hit.to(r.dtype)
        if qc is None:
            qk = onehot
        else:
            s = qc.sum(dim=1, keepdim=True)  # [I, 1]
            qk = torch.where(det_col | (s <= 0), onehot, qc / s.clamp_min(_TINY))  # [I, V] q_m
        px = r.gather(1, x)  # [I, 1] p_m(x_m)
        qx = qk.gather(1, x)  # [I, 1] q_m(x_m)
        a = torch.where(qx > 0, (px / qx.clamp_min(_TINY)).clamp(max=1.0), (px > 0).to(r.dtype))
        accept[:, k : k + 1] = torch.where(ok, a, 0.0)
        res = (r - qk).clamp_min(0.0)  # [I, V]
        z = res.sum(dim=1, keepdim=True)  # [I, 1]
        r_wo = r.masked_fill(hit, 0.0)  # fallback when z ~ 0: p_m without x_m
        z_wo = r_wo.sum(dim=1, keepdim=True)
        fallback = torch.where(z_wo > 0, r_wo / z_wo.clamp_min(_TINY), r)
        r_next = torch.where(z > _RESIDUAL_EPS, res / z.clamp_min(_TINY), fallback)
        r = torch.where(ok, r_next, r)
        if qc is not None:
            qc = torch.where(ok, qc.masked_fill(hit, 0.0), qc)
    return accept, r


def _host_tensor(data, dtype: torch.dtype, dev: torch.device) -> torch.Tensor:
    """A small tensor built on the host and copied without waiting for the device queue."""
    return torch.tensor(data, dtype=dtype).to(dev, non_blocking=True)


def _normalised_rows(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    out = x.index_select(0, rows).to(torch.float64)  # [I, V]
    return out / out.sum(dim=1, keepdim=True).clamp_min(_TINY)


def _tables(
    target: torch.Tensor,
    draft: torch.Tensor | None,
    rows: torch.Tensor,
    kid_tok: torch.Tensor,
    kid_ok: torch.Tensor,
    det: torch.Tensor,
    with_accept: bool,
) -> torch.Tensor:
    """Run :func:`_node_tables` over the given rows in memory-bounded chunks; return the accept
    table [I, K] (``with_accept``) or the residuals [I, V]."""
    vocab = target.shape[1]
    step = max(1, _CHUNK_ELEMS // max(1, vocab))
    outs = []
    for s in range(0, rows.shape[0], step):
        sl = slice(s, s + step)
        rr = rows[sl]
        dm = det[sl]
        p = _normalised_rows(target, rr)
        q = _normalised_rows(draft, rr) if draft is not None else None
        acc, res = _node_tables(p, q, kid_tok[sl], kid_ok[sl], dm)
        outs.append(acc if with_accept else res)
    return torch.cat(outs) if len(outs) != 1 else outs[0]


def sample_verify(
    tree: DraftTree,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    generator: torch.Generator | None,
    draft_mode: str = "sampled",
) -> AcceptResult:
    """Lossless tree rejection sampling for one request (algorithm in the module docstring).

    tree          n nodes; children in the order they were drawn
    target_probs  [n, V] target distribution of the token after each node (processed by
                  temperature/top-k/top-p, e.g. by :func:`specd.sampling.logits_to_probs`)
    draft_probs   [n, V] distribution node i's children were drawn from (row i); may be None in
                  "deterministic" mode, where it is not used
    generator     the request's generator (None = the global CPU RNG); n uniforms are drawn from it
    draft_mode    "sampled" (children drawn without replacement from draft_probs[i], in order) or
                  "deterministic" (children chosen deterministically, e.g. draft top-k)
    """
    return verify_batch(
        [tree], target_probs, greedy=False, draft_probs=draft_probs, generators=[generator], draft_mode=draft_mode
    )[0]


# ----------------------------------------------------------------------------------------- batch
def verify_batch(
    trees: Sequence[DraftTree],
    target: torch.Tensor,
    offsets: Sequence[int] | None = None,
    *,
    greedy: bool | Sequence[bool] = True,
    draft_probs: torch.Tensor | None = None,
    generators: Sequence[torch.Generator | None] | None = None,
    draft_mode: str | Sequence[str] = "sampled",
) -> list[AcceptResult]:
    """Verify a batch of requests whose per-node rows are concatenated.

    Args:
      trees        B draft trees
      target       [T, V] rows of all requests: request b owns rows ``offsets[b]:offsets[b+1]``,
                   row ``offsets[b] + i`` for its node i. Target probabilities for sampling
                   requests; for greedy requests only the argmax is used (logits work too).
      offsets      [B+1] row offsets (Python ints); default: the trees back to back
      greedy       one flag for all requests or one per request
      draft_probs  [T, V] rows aligned with ``target`` (needed by "sampled" requests)
      generators   B per-request generators (None entries / None = the global CPU RNG); a
                   sampling request with n nodes draws n uniforms from its generator
      draft_mode   "sampled" / "deterministic", for all requests or one per request
    Returns:
      B AcceptResults, in order.

    Greedy requests: one argmax over all rows and one ``tolist()``, then pure-Python walks.
    Sampling requests: one vectorised pass over all their internal nodes, one host transfer for
    the walks, one batched inverse-CDF draw (and transfer) for the correction/bonus tokens.
    """
    nb = len(trees)
    offsets = _checked_offsets(trees, target, offsets)
    greedy_flags = [bool(greedy)] * nb if isinstance(greedy, bool) else [bool(g) for g in greedy]
    if len(greedy_flags) != nb:
        raise ValueError(f"{len(greedy_flags)} greedy flags for {nb} requests")

    results: list[AcceptResult | None] = [None] * nb
    if any(greedy_flags):
        am = target.argmax(dim=-1).tolist()  # one host transfer for all rows
        for b, t in enumerate(trees):
            if greedy_flags[b]:
                results[b] = _greedy_walk(t.token_list, t.children, am, offsets[b])
    samp = [b for b in range(nb) if not greedy_flags[b]]
    if samp:
        modes = [draft_mode] * nb if isinstance(draft_mode, str) else list(draft_mode)
        if len(modes) != nb:
            raise ValueError(f"{len(modes)} draft modes for {nb} requests")
        gens = list(generators) if generators is not None else [None] * nb
        if len(gens) != nb:
            raise ValueError(f"{len(gens)} generators for {nb} requests")
        _sample_batch(trees, target, offsets, samp, draft_probs, gens, modes, results)
    return results  # type: ignore[return-value]


def _checked_offsets(trees, target: torch.Tensor, offsets) -> list[int]:
    """The [B+1] row offsets (default: the trees back to back), checked against the trees and target."""
    nb = len(trees)
    if offsets is None:
        offsets = [0]
        for t in trees:
            offsets.append(offsets[-1] + t.num_nodes)
    else:
        offsets = [int(o) for o in offsets]
    if len(offsets) != nb + 1:
        raise ValueError(f"need B+1 = {nb + 1} offsets, got {len(offsets)}")
    for b, t in enumerate(trees):
        if offsets[b + 1] - offsets[b] != t.num_nodes:
            raise ValueError(
                f"request {b}: offsets give {offsets[b + 1] - offsets[b]} rows but its tree has {t.num_nodes} nodes"
            )
    if target.dim() != 2 or target.shape[0] < offsets[-1]:
        raise ValueError(f"target must be [T >= {offsets[-1]}, V], got {tuple(target.shape)}")
    return offsets


@dataclass
class _Layout:
    """Every internal node of the sampling requests, one row each."""

    rows: list = field(default_factory=list)  # target row of the node
    kid_lists: list = field(default_factory=list)  # children's tokens (a repeated token -> -1, never accepted)
    det_rows: list = field(default_factory=list)  # the node's children were chosen deterministically
    int_start: list = field(default_factory=list)  # per sampling request: its first internal row
    node_index: list = field(default_factory=list)  # per sampling request: node -> internal position or -1
    sizes: list = field(default_factory=list)  # per sampling request: number of nodes
    any_sampled: bool = False
    k_max: int = 0  # most children of any internal node
    k_min: int = 1 << 30  # fewest


def _layout(trees, offsets, samp, modes) -> _Layout:
    lay = _Layout()
    for b in samp:
        mode = modes[b]
        if mode not in DRAFT_MODES:
            raise ValueError(f"draft_mode must be one of {DRAFT_MODES}, got {mode!r}")
        det = mode == "deterministic"
        lay.any_sampled |= not det
        internal, kid_tokens, index, most, fewest = trees[b].sibling_table()
        if internal:
            lay.k_max, lay.k_min = max(lay.k_max, most), min(lay.k_min, fewest)
        lay.int_start.append(len(lay.rows))
        lay.node_index.append(index)
        lay.sizes.append(len(index))
        lay.rows.extend([offsets[b] + i for i in internal])
        lay.kid_lists.extend(kid_tokens)
        lay.det_rows.extend([det] * len(internal))
    return lay


@dataclass
class _Kids:
    """The internal nodes' children as tensors on the target's device."""

    host: torch.Tensor  # [I, K] children's tokens, _PAD past the last child (host)
    tok: torch.Tensor  # [I, K] clamped to valid ids
    ok: torch.Tensor  # [I, K] a child that may be accepted
    det: torch.Tensor  # [I] deterministic node
    rows: torch.Tensor  # [I] target row


def _kids(lay: _Layout, dev) -> _Kids:
    if lay.k_min == lay.k_max:  # no padding needed
        flat = list(chain.from_iterable(lay.kid_lists))
    else:
        flat = list(chain.from_iterable(k + [_PAD] * (lay.k_max - len(k)) for k in lay.kid_lists))
    host = torch.tensor(flat, dtype=torch.int64).view(-1, lay.k_max)  # [I, K]
    return _Kids(
        host,
        host.clamp(min=0).to(dev, non_blocking=True),
        (host >= 0).to(dev, non_blocking=True),
        _host_tensor(lay.det_rows, torch.bool, dev),
        _host_tensor(lay.rows, torch.int64, dev),
    )


def _first_accepted(lay: _Layout, kids: _Kids, target, draft, u_kids: torch.Tensor) -> list[int]:
    """One vectorised pass over every internal node: the sibling rank of its accepted child, -1 if
    none. ``u_kids``: one uniform per child, in layout order (host)."""
    dev = target.device
    accept = _tables(target, draft, kids.rows, kids.tok, kids.ok, kids.det, True)  # [I, K]
    u_kid = torch.ones(kids.host.shape, dtype=torch.float64)  # [I, K]
    u_kid[kids.host != _PAD] = u_kids
    hit = (u_kid.to(dev, non_blocking=True) < accept) & kids.ok  # [I, K]
    rank = torch.arange(lay.k_max, device=dev).expand_as(hit)
    first = torch.where(hit, rank, lay.k_max).amin(dim=1)  # [I] first accepted rank, K if none
    return torch.where(first < lay.k_max, first, -1).tolist()


def _walks(trees, offsets, samp, lay: _Layout, first_acc: list) -> tuple[list, list, list]:
    """Host walks down each tree along accepted children: (target row of the node where each walk
    stopped, its internal-row index or -1 for a leaf (bonus), the accepted path)."""
    stop_rows: list[int] = []
    stop_int: list[int] = []
    paths: list[list[int]] = []
    for j, b in enumerate(samp):
        ch = trees[b].children
        idx, start = lay.node_index[j], lay.int_start[j]
        node = 0
        path: list[int] = []
        while True:
            kids = ch[node]
            if not kids:
                stop_int.append(-1)
                break
            r = first_acc[start + idx[node]]
            if r < 0:
                stop_int.append(start + idx[node])
                break
            node = kids[r]
            path.append(node)
        stop_rows.append(offsets[b] + node)
        paths.append(path)
    return stop_rows, stop_int, paths


def _final_dists(target, draft, kids: _Kids | None, stop_rows: list, stop_int: list) -> torch.Tensor:
    """[S, V] float64: the bonus distribution (the leaf's target row) or the correction (the
    residual at the node where the walk stopped)."""
    dev = target.device
    dist = target.index_select(0, _host_tensor(stop_rows, torch.int64, dev)).to(torch.float64)  # [S, V]
    corr = [j for j, s in enumerate(stop_int) if s >= 0]
    if corr:
        assert kids is not None
        sel = _host_tensor([stop_int[j] for j in corr], torch.int64, dev)
        res = _tables(
            target,
            draft,
            kids.rows.index_select(0, sel),
            kids.tok.index_select(0, sel),
            kids.ok.index_select(0, sel),
            kids.det.index_select(0, sel),
            False,
        )  # [C, V]
        dist.index_copy_(0, _host_tensor(corr, torch.int64, dev), res)
    return dist


def _sample_batch(trees, target, offsets, samp, draft_probs, gens, modes, results) -> None:
    """Rejection-sample every sampling request of the batch (``samp``: their indices) into ``results``."""
    dev = target.device
    lay = _layout(trees, offsets, samp, modes)
    if lay.any_sampled and draft_probs is None:
        raise ValueError('draft_mode "sampled" needs draft_probs')
    draft = draft_probs if lay.any_sampled else None
    # Uniforms: per request n_b (= n_b - 1 children + 1) from its own generator. The first decides
    # the final token; the others the children, in (internal node, sibling rank) order.
    # Split on the host (boolean indexing on a device would sync), then copy.
    u_all = draw_uniforms(lay.sizes, [gens[b] for b in samp], "cpu")  # [sum(n_b)]
    first_of = torch.zeros(u_all.shape[0], dtype=torch.bool)
    first_of[torch.tensor([0] + lay.sizes[:-1], dtype=torch.int64).cumsum(0)] = True
    u_final = u_all[first_of].to(dev, non_blocking=True)  # [S]
    kids = _kids(lay, dev) if lay.rows else None
    first_acc = _first_accepted(lay, kids, target, draft, u_all[~first_of]) if kids is not None else []
    stop_rows, stop_int, paths = _walks(trees, offsets, samp, lay, first_acc)
    nxt = sample_from_uniform(_final_dists(target, draft, kids, stop_rows, stop_int), u_final).tolist()
    for j, b in enumerate(samp):
        tok = trees[b].token_list
        path = paths[j]
        results[b] = AcceptResult(path, [tok[c] for c in path] + [nxt[j]], nxt[j], stop_int[j] < 0)
