"""The compute stages of an engine step, as functions with typed inputs and outputs:

- ``target_pass(scheduled, proposals, ...) -> TargetPass``: one forward of the target over every
  scheduled request's tokens (prefill chunks, plain decode roots, draft trees with their ancestor
  masks) and the logits rows verification needs;
- ``verify(target_pass) -> [AcceptResult | None]``: per request, the accepted path and the next
  token (greedy: argmax walk; sampled: the rejection sampler, one vectorised pass for the batch).

Vocabulary: a request's *root* is its pending token (the last committed one); its *tree* holds
the root (node 0) and the draft tokens; the target verifies every node at position
``context + depth``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specd.engine.scheduler import Scheduled
from specd.model import invariant
from specd.model.attention import build_metadata
from specd.model.graphs import GraphedModel, invariant_tiles
from specd.model.llama import LlamaModel
from specd.sampling.probs import logits_to_probs, sampling_tensors
from specd.sampling.tree import DraftTree
from specd.sampling.verify import AcceptResult, greedy_verify, verify_batch
from specd.speculation.proposal import Proposal


@dataclass
class WorkItem:
    """One scheduled request in the target pass: its tree (None for a prefill chunk that does not
    reach the pending token), its proposal (None without drafts) and its first logits row."""

    sc: Scheduled
    tree: DraftTree | None
    proposal: Proposal | None
    row0: int
    tok0: int = 0  # its first row in the flat token batch
    feats: torch.Tensor | None = None  # feature head: the target features of its rows [rows, F]


@dataclass
class TargetPass:
    work: list[WorkItem]
    logits: torch.Tensor | None  # [rows, vocab]; None when no request reached its pending token


@dataclass
class _Batch:
    """The flat token batch of a target forward."""

    ids: list = field(default_factory=list)
    pos: list = field(default_factory=list)
    slots: list = field(default_factory=list)
    qlens: list = field(default_factory=list)
    ctxs: list = field(default_factory=list)
    tables: list = field(default_factory=list)
    masks: list = field(default_factory=list)
    logit_rows: list = field(default_factory=list)
    work: list = field(default_factory=list)
    n: int = 0  # tokens so far


def _add_chunk(b: _Batch, sc: Scheduled) -> None:
    """A prefill chunk that does not reach the pending token: no logits."""
    seq = sc.seq
    assert seq.blocks is not None
    c0 = seq.num_computed
    c1 = c0 + sc.num_tokens
    b.ids += seq.tokens[c0:c1]
    b.pos += range(c0, c1)
    b.slots += seq.blocks.slots(c0, c1)
    b.qlens.append(c1 - c0)
    b.masks.append(None)
    b.work.append(WorkItem(sc, None, None, 0, b.n))


def _add_tree(b: _Batch, sc: Scheduled, tree: DraftTree, prop: Proposal | None) -> None:
    """The committed tokens not yet computed (a final prefill chunk, possibly none) and the tree at
    its root's position: every node at ``root position + depth``, masked to its ancestors."""
    seq = sc.seq
    assert seq.blocks is not None
    c0, L = seq.num_computed, len(seq.tokens)
    m, nt = L - 1 - c0, tree.num_nodes  # committed tokens before the root; tree nodes
    b.ids += seq.tokens[c0 : L - 1]
    b.ids += tree.token_list
    b.pos += range(c0, L - 1)
    b.pos += [L - 1 + d for d in tree.depth_list]
    b.slots += seq.blocks.slots(c0, L - 1 + nt)
    b.qlens.append(m + nt)
    mask = None
    if nt > 1 and tree.max_depth < nt - 1:  # a chain is plain causal: no mask needed
        mask = torch.zeros((m + nt, m + nt), dtype=torch.bool)
        mask[:m, :m] = torch.ones((m, m), dtype=torch.bool).tril_()
        mask[m:, :m] = True
        mask[m:, m:] = tree.ancestor_mask()
    b.masks.append(mask)
    b.work.append(WorkItem(sc, tree, prop, len(b.logit_rows), b.n))
    b.logit_rows += range(b.n + m, b.n + m + nt)


def _assemble(scheduled: list, proposals: dict) -> _Batch:
    b = _Batch()
    for sc in scheduled:
        seq = sc.seq
        if not sc.final:
            _add_chunk(b, sc)
        else:
            prop = proposals.get(seq.request_id)
            tree = prop.tree if prop is not None else DraftTree([seq.tokens[-1]], [-1], validate=False)
            if seq.blocks is None or seq.blocks.capacity < len(seq.tokens) - 1 + tree.num_nodes:
                raise RuntimeError("KV reservation lost")  # the scheduler reserves every step's tree
            _add_tree(b, sc, tree, prop)
        b.ctxs.append(seq.num_computed)
        b.tables.append(seq.blocks.blocks)
        b.n += b.qlens[-1]
    return b


def step_ops_kwargs(model, device: torch.device, batch_invariant: str, any_greedy: bool) -> dict:
    """``{"ops": ...}`` when this step runs the batch-invariant kernels (``invariant.step_ops``: mode
    ``on``, or ``auto`` with a greedy row) on a device that has them (CUDA) and the target takes
    them (a ``LlamaModel``); else ``{}``: the ordinary path (every CPU step; the tensor-parallel
    ``ShardedTarget``, whose shards keep cuBLAS)."""
    ops = invariant.step_ops(batch_invariant, any_greedy)
    inner = model.model if isinstance(model, GraphedModel) else model  # (a target captured as graphs)
    if not ops.enabled or device.type not in ops.devices or not isinstance(inner, LlamaModel):
        return {}
    return {"ops": ops}


def target_pass(
    scheduled: list, proposals: dict, model, kv: torch.Tensor, block_size: int, backend, capture: tuple | None = None,
    batch_invariant: str = "off", any_greedy: bool = False,
) -> TargetPass:  # fmt: skip
    """One target forward over ``scheduled`` (with ``proposals``: request id -> Proposal).
    ``capture`` (a feature head's target layers): each work item also gets the features of its
    rows (the hidden states entering those layers, concatenated) in ``feats``. ``batch_invariant``
    (``EngineConfig.batch_invariant``) and ``any_greedy`` (a scheduled request is greedy): whether
    the forward and the logits run the batch-invariant kernels (:func:`step_ops_kwargs`)."""
    b = _assemble(scheduled, proposals)
    dev = kv.device
    masks = b.masks if any(x is not None for x in b.masks) else None
    meta = build_metadata(b.qlens, b.ctxs, b.tables, b.slots, block_size, dev, tree_masks=masks)
    ids, pos = torch.tensor(b.ids, device=dev), torch.tensor(b.pos, device=dev)
    caps: dict | None = dict.fromkeys(capture) if capture else None
    ops_kw = step_ops_kwargs(model, dev, batch_invariant, any_greedy)
    with invariant_tiles(ops_kw.get("ops")):  # (quantized GEMMs: M-independent tiles in an invariant step)
        hidden = model(ids, pos, kv, meta, backend, **ops_kw, **({} if caps is None else {"capture": caps}))
    if caps is not None and capture is not None:
        feats = torch.cat([caps[i] for i in capture], dim=-1)  # [tokens, F]
        for w, n in zip(b.work, b.qlens):
            w.feats = feats[w.tok0 : w.tok0 + n]
    if not b.logit_rows:
        return TargetPass(b.work, None)
    if len(b.logit_rows) < b.n:  # prefill rows carry no logits
        hidden = hidden[torch.tensor(b.logit_rows, device=dev)]
    with invariant_tiles(ops_kw.get("ops")):
        return TargetPass(b.work, model.compute_logits(hidden, **ops_kw))


def kept_hidden(w: WorkItem, res: AcceptResult | None) -> torch.Tensor | None:
    """The features a feature head keeps from ``w``'s rows: a prefill chunk's, else those of the
    committed tokens before the root, the root and the accepted path (in order), [rows, F]."""
    if w.feats is None or res is None or w.tree is None:
        return w.feats
    m = w.feats.shape[0] - w.tree.num_nodes  # committed tokens before the root
    if res.accepted == list(range(1, len(res.accepted) + 1)):  # no draft, or a leading run of it: a view
        return w.feats[: m + 1 + len(res.accepted)]
    rows = list(range(m + 1)) + [m + node for node in res.accepted]
    return w.feats[torch.tensor(rows, device=w.feats.device)]


def greedy_tokens(logits: torch.Tensor) -> list:
    """Each row's argmax (the first of equal maxima, as ``torch.argmax``): on a CPU through numpy,
    whose vectorised argmax takes a 17 x 49152 batch in 0.11 ms against torch's 0.59 (2 threads),
    ~3% of a verification step of the built-in model."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return logits.detach().numpy().argmax(-1).tolist()
    return logits.argmax(dim=-1).tolist()


def verify(tp: TargetPass) -> list:
    """Per work item: its ``AcceptResult``, or None for a prefill chunk."""
    results: list = [None] * len(tp.work)
    if tp.logits is None:
        return results
    greedy = [k for k, w in enumerate(tp.work) if w.tree is not None and w.sc.seq.params.greedy]
    sampled = [k for k, w in enumerate(tp.work) if w.tree is not None and not w.sc.seq.params.greedy]
    if greedy:
        argmax = greedy_tokens(tp.logits)  # one host transfer for the whole batch
        for k in greedy:
            w = tp.work[k]
            assert w.tree is not None
            if w.tree.num_nodes == 1:  # root only: the target's token is the bonus token
                t = argmax[w.row0]
                results[k] = AcceptResult([], [t], t, True)
            else:
                results[k] = greedy_verify(w.tree, argmax[w.row0 : w.row0 + w.tree.num_nodes])
    if sampled:
        for k, res in zip(sampled, _verify_sampled([tp.work[k] for k in sampled], tp.logits)):
            results[k] = res
    return results


def _draft_mode(w: WorkItem) -> str:
    """How the verifier treats ``w``'s children: drawn from the draft model, or chosen (a point mass)."""
    return "deterministic" if w.proposal is not None and w.proposal.deterministic else "sampled"


def _verify_sampled(work: list, logits: torch.Tensor) -> list:
    """The rejection sampler over the sampled requests in one vectorised pass (two host
    transfers), each request drawing only from its own generator."""
    rows = [r for w in work for r in range(w.row0, w.row0 + w.tree.num_nodes)]
    params = [w.sc.seq.params for w in work for _ in range(w.tree.num_nodes)]
    dev = logits.device
    # params stay on the host: logits_to_probs picks its fast path without a device sync
    probs = logits_to_probs(logits[torch.tensor(rows, device=dev)], *map(torch.tensor, sampling_tensors(params)))
    dps = []
    for w in work:
        dp = w.proposal.draft_probs if w.proposal is not None else None
        if dp is None:
            dp = torch.zeros((w.tree.num_nodes, probs.shape[1]), dtype=probs.dtype, device=dev)
        dps.append(dp)
    return verify_batch(
        [w.tree for w in work],
        probs,
        greedy=False,
        draft_probs=torch.cat(dps),
        generators=[w.sc.seq.generator for w in work],
        draft_mode=[_draft_mode(w) for w in work],
    )
