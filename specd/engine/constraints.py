"""Constrained decoding in the engine: each constrained request's grammar is compiled off the
engine thread, and every row the target verifies gets the mask of its own path.

Vocabulary (``specd.structured``): a request's *matcher* has consumed every committed token of its
reply, the pending (root) token included; a draft tree node's *mask* is the grammar state after its
path (its ancestors below the root and itself); a node whose token the grammar forbids is *dead*.

Per step, for each constrained request reaching its root (``constrain``, after drafting, before the
target forward): the tree's masks are computed depth-first with the request's one matcher (advance,
fill, roll back: the matcher ends where it started), dead nodes are pruned from the proposal (the
target never verifies a token the grammar forbids), and the masks travel with the step. After the
forward (``apply``) forbidden logits become -inf in exactly the request's rows, so greedy takes the
argmax of the masked logits and the rejection sampler verifies against the masked, renormalised
distribution: output is lossless with respect to "the target under the grammar".

A *drawn* tree (a sampling request's draft-model tree, children drawn from the unmasked draft
distribution ``q``) is always verified as a chosen one under a grammar (the deterministic draft
mode, exact for any set of children drawn independently of the target's acceptance draws), pruned
or not: the rejection sampler assumes child m is distributed as ``q_m``, which no longer holds once
the tree was kept or cut *because* of its children's tokens (keeping the sampled mode for trees
whose children all happened to be allowed biased the output: a chi-square test caught it,
tests/test_constrained.py). Drawing the children from the masked draft distribution instead would
keep the sampled mode's higher acceptance; the drafter does not mask yet.

The matcher advances along what the step emitted inside the KV ledger's ``accept`` and is rolled
back by ``restore`` (``Checkpoint.grammar_tokens``): no second rollback path.

**Masks off the critical path** (``overlap``): the masks are needed only once the forward's logits
exist, so with ``overlap`` on, ``constrain`` walks each tree without filling masks (which nodes are
alive: ~1 us a node, against ~9 us with the fill), prunes, and hands the fills of the pruned trees
to one worker thread that runs while the target's forward does; ``apply`` waits for them. The
engine thread touches no matcher while the worker holds them (drafting is over, the ledger's
``accept`` comes after ``apply``), and a step that fails waits for the worker (``settle``) before
the ledger rolls the matchers back. The engine overlaps by default (``--mask-overlap on``): on a
2-core CPU whose forward uses both cores it still measured faster (docs/benchmarks.md, session 23).
"""

from __future__ import annotations

import logging
import threading
from concurrent import futures
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from specd.sampling.penalties import penalize_
from specd.sampling.probs import add_logit_bias_
from specd.sampling.tree import DraftTree
from specd.speculation.proposal import Proposal

log = logging.getLogger("specd.engine")

__all__ = ["Constraints", "StepMasks"]


@dataclass
class StepMasks:
    """The step's masks: request id -> bitmask [tree nodes, ceil(V/32)] int32 (row i: node i's);
    ``pending``: masks still being filled on the worker thread (a Future of such a dict)."""

    rows: dict = field(default_factory=dict)
    pending: Future | None = None

    def resolve(self) -> dict:
        """Every mask of the step (waits for the worker's fills)."""
        if self.pending is not None:
            self.rows.update(self.pending.result())
            self.pending = None
        return self.rows


class Constraints:
    """The engine's grammar side for one target vocabulary (built on the first constrained request:
    importing the grammar library costs ~1 s, which unconstrained servers never pay)."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids, compile_timeout_s: float = 10.0, overlap: bool = False):
        self.tokenizer = tokenizer
        self.overlap = overlap  # fill masks on a worker thread during the forward (module docstring)
        self._worker: futures.ThreadPoolExecutor | None = None
        self._inflight: Future | None = None
        self.vocab_size = vocab_size
        self.stop_ids = sorted(stop_ids)
        self.compile_timeout_s = compile_timeout_s
        self._building: Future | None = None  # the GrammarCompiler, built on first use (off the caller's thread)
        self._build_lock = threading.Lock()
        self.waiting: list = []  # (seq, Future[Grammar]) not compiled yet

    @property
    def compiler(self):
        """The ``GrammarCompiler`` (blocks while its vocabulary is built: ~1 s, once)."""
        return self._compiler_future().result()

    def _compiler_future(self) -> Future:
        """The compiler, built once on a thread of its own (any thread may ask first)."""
        with self._build_lock:
            if self._building is None:
                self._building = Future()
                self._building.set_running_or_notify_cancel()
                threading.Thread(target=self._build, args=(self._building,), name="grammar-vocab", daemon=True).start()
            return self._building

    def _build(self, out: Future) -> None:
        from specd.structured import CompilerConfig, GrammarCompiler, Vocabulary

        try:
            if self.tokenizer is None:
                raise ValueError("constrained decoding needs the model's tokenizer")
            vocab = Vocabulary.from_tokenizer(self.tokenizer, self.vocab_size, self.stop_ids)
            out.set_result(GrammarCompiler(vocab, CompilerConfig(compile_timeout_s=self.compile_timeout_s)))
        except Exception as e:  # noqa: BLE001 - every grammar waiting on it fails with this
            out.set_exception(e)

    # compiling -----------------------------------------------------------------------------------
    def compile(self, spec) -> Future:
        """A future of ``spec``'s compiled grammar (any thread, never blocks: the first call starts
        building the vocabulary on a thread, so the engine loop keeps stepping meanwhile)."""
        built = self._compiler_future()
        if built.done() and built.exception() is None:
            return built.result().submit(spec)
        out: Future = Future()
        out.set_running_or_notify_cancel()

        def compiled(b: Future) -> None:
            if b.exception() is not None:
                out.set_exception(b.exception())
                return
            inner = b.result().submit(spec)
            inner.add_done_callback(lambda f: _copy(f, out))

        built.add_done_callback(compiled)
        return out

    def submit(self, seq, spec) -> Future:
        """Start compiling ``seq``'s grammar (any thread; a cached grammar is ready at once)."""
        fut = self.compile(spec)
        self.waiting.append((seq, fut))
        return fut

    def wait(self, timeout: float) -> None:
        """Block until some waiting grammar is compiled, or ``timeout`` seconds."""
        futures.wait([f for _, f in self.waiting], timeout=timeout, return_when=futures.FIRST_COMPLETED)

    def ready(self) -> tuple[list, list]:
        """``(ready, failed)``: requests whose grammar compiled (each now holds its matcher) and
        ``(seq, GrammarError)`` for those whose grammar was refused; the others keep waiting."""
        ready, failed, keep = [], [], []
        for seq, fut in self.waiting:
            if seq.finished:
                continue  # cancelled while compiling
            if not fut.done():
                keep.append((seq, fut))
                continue
            err = fut.exception()
            if err is not None:
                failed.append((seq, err))
            else:
                seq.matcher = fut.result().matcher()
                ready.append(seq)
        self.waiting = keep
        return ready, failed

    # masks ---------------------------------------------------------------------------------------
    def constrain(self, scheduled: list, proposals: dict) -> StepMasks:
        """Masks for every constrained request reaching its root this step; prunes ``proposals``
        (request id -> Proposal) of the tokens the grammar forbids, in place. With ``overlap`` the
        masks are filled on the worker thread (``StepMasks.pending``) after pruning."""
        out = StepMasks()
        jobs = []
        for sc in scheduled:
            seq = sc.seq
            if not sc.final or getattr(seq, "matcher", None) is None:
                continue
            # (imported once a request has a grammar: xgrammar's import is ~0.3 s a server need not pay)
            from specd.structured import tree_alive, tree_masks

            prop = proposals.get(seq.request_id)
            tree = prop.tree if prop is not None else DraftTree([seq.tokens[-1]], [-1], validate=False)
            if self.overlap:
                alive, bm = tree_alive(seq.matcher, tree.parent_list, tree.token_list), None
            else:
                bm, alive = tree_masks(seq.matcher, tree.parent_list, tree.token_list)
            if prop is not None and (not all(alive) or prop.draft_probs is not None):
                prop, kept = _pruned(prop, alive)
                if prop is None:
                    del proposals[seq.request_id]
                    tree = DraftTree([seq.tokens[-1]], [-1], validate=False)
                else:
                    proposals[seq.request_id], tree = prop, prop.tree
                bm = bm[torch.tensor(kept)] if bm is not None else None
            if bm is None:
                jobs.append((seq.request_id, seq.matcher, tree.parent_list, tree.token_list))
            else:
                out.rows[seq.request_id] = bm
        if jobs:
            if self._worker is None:
                self._worker = futures.ThreadPoolExecutor(1, thread_name_prefix="specd-masks")
            out.pending = self._inflight = self._worker.submit(_fill_masks, jobs)
        return out

    def settle(self) -> None:
        """Wait for the worker's fills of the step in flight (before anything rolls a matcher back)."""
        if self._inflight is not None:
            futures.wait([self._inflight])
            self._inflight = None

    def close(self) -> None:
        """Wait for fills in flight and stop the worker thread (idempotent)."""
        self.settle()
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None

    def apply(self, tp, masks: StepMasks) -> None:
        """Each request's ``logit_bias`` added to its rows of the step's logits, its penalties applied
        to them (each row with the reply as far as its draft path: ``specd.sampling.penalties``), then
        forbidden logits := -inf in each constrained request's rows (all before verification: greedy
        and the rejection sampler see the target as biased, penalized and constrained)."""
        rows = masks.resolve()
        self._inflight = None
        if tp.logits is None:
            return
        with torch.inference_mode():  # (the forward's logits are inference tensors)
            for w in tp.work:
                if w.tree is None:
                    continue
                seq = w.sc.seq
                if seq.params.logit_bias:
                    add_logit_bias_(tp.logits, range(w.row0, w.row0 + w.tree.num_nodes), seq.params.logit_bias)
                if seq.params.penalized:
                    penalize_(tp.logits, w.row0, w.tree, seq.params, seq.prompt_ids, seq.output_ids)
            if not rows:
                return
            from specd.structured import apply_bitmask_

            for w in tp.work:
                bm = rows.get(w.sc.seq.request_id)
                if bm is None or w.tree is None:
                    continue
                at = torch.arange(w.row0, w.row0 + w.tree.num_nodes, device=tp.logits.device)
                apply_bitmask_(tp.logits, bm.to(tp.logits.device), at)


def _copy(src: Future, dst: Future) -> None:
    """``src``'s outcome into ``dst``."""
    if src.exception() is not None:
        dst.set_exception(src.exception())
    else:
        dst.set_result(src.result())


def _fill_masks(jobs: list) -> dict:
    """The worker's part: request id -> its pruned tree's masks (every node is alive)."""
    from specd.structured import tree_masks

    return {rid: tree_masks(matcher, parents, tokens)[0] for rid, matcher, parents, tokens in jobs}


def _pruned(prop: Proposal, alive: list) -> tuple:
    """``prop`` without its dead nodes (None when only the root is left) and the old index of each
    kept node, as a chosen proposal (see the module docstring)."""
    from specd.structured import prune_tree

    parents, tokens, kept = prune_tree(prop.tree.parent_list, prop.tree.token_list, alive)
    if len(kept) == 1:
        return None, kept
    tree = DraftTree(tokens, parents)
    owners = [prop.node_proposers[i] for i in kept] if prop.node_proposers is not None else None
    out = Proposal(tree, None, tree.max_depth, prop.proposer, owners, prop.available, chosen=True)
    return out, kept
