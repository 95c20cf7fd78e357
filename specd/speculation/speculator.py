"""One step's drafting, and what the step's verification taught: the proposers run here, the
policy decides (``SpecPolicy``), the engine calls two methods (``draft`` and ``record``).

Per request granted draft tokens this step (``Scheduled.spec_budget`` > 0), by its effective mode
(``SpecPolicy.mode_of``):

- ``ngram``, or an adaptive request's lookup-only step (the model proposer does not pay now): the
  model-free proposers (``free``: prompt lookup and whatever ``specd.speculation.registry`` lists)
  each propose, the policy keeps the proposal worth most (``SpecPolicy.best_free``);
- a model mode (``chain``, ``tree``, ``static``, ``head``): the model proposer (draft model or
  feature head) grows the request's tree, all requests in one batched forward per level;
- ``hybrid``, and ``auto`` where the policy expects it to pay: a model-free proposal laid over the
  model's tree (``specd.speculation.hybrid.merge``), or the model-free proposal alone where it
  promises more tokens per second than the model (``SpecPolicy.prefer_ngram``).

Requests still in prefill only catch the draft model's cache up (skipped for adaptive requests
while speculation is off: they catch up in one draft forward when they next draft).
"""

from __future__ import annotations

from collections.abc import Callable

from specd.config import MODEL_MODES, SpecMode
from specd.speculation.hybrid import credit, merge
from specd.speculation.policy import LOOKUP_ONLY, SpecPolicy
from specd.speculation.proposal import DraftRequest, Proposal, Proposer
from specd.speculation.request import SpecRequest, SpecStats

__all__ = ["Speculator"]


class Speculator:
    """The proposers of a server and the policy that prices them. ``model``: the draft model's or
    feature head's proposer (None: model-free drafting only); ``free``: the model-free proposers in
    registry order; ``clock``: the policy's clock (``model_draft_s`` is the model proposer's share
    of the last ``draft``, which the engine leaves out of the step cost it reports)."""

    def __init__(self, policy: SpecPolicy, model, free: list[Proposer], clock: Callable[[], float], max_model_len: int):
        self.policy = policy
        self.model = model
        self.free = free
        self.clock = clock
        self.max_model_len = max_model_len
        self.model_draft_s = 0.0
        policy.priors = {f.name: f.prior for f in free}

    @property
    def proposers(self) -> list[Proposer]:
        return ([self.model] if self.model is not None else []) + list(self.free)

    # drafting ------------------------------------------------------------------------------------
    def budget(self, seq: SpecRequest, granted: int) -> int:
        """Draft tokens ``seq`` may use of the ``granted`` ones: none past its context or its
        ``max_tokens`` (the step emits one token beyond the accepted drafts)."""
        room = self.max_model_len - len(seq.tokens) - 1
        remaining = seq.params.max_tokens - (len(seq.tokens) - len(seq.prompt_ids)) - 1
        return max(0, min(granted, room, remaining))

    def draft(self, scheduled: list) -> dict[str, Proposal]:
        """Proposals (request id -> Proposal) for ``scheduled`` (the scheduler's ``Scheduled``
        entries: ``seq``, ``final``, ``num_tokens``, ``spec_budget``, ``spec_depth``)."""
        pol = self.policy
        lazy_auto = pol.spec.adaptive and pol.last_depth == 0
        catch, spec, out, lookups = [], [], {}, {}
        for sc in scheduled:
            seq = sc.seq
            mode = pol.mode_of(seq)
            if not sc.final:
                if mode in MODEL_MODES and not (lazy_auto and seq.spec.mode == SpecMode.AUTO):
                    catch.append((seq, seq.num_computed + sc.num_tokens))
                continue
            b = self.budget(seq, sc.spec_budget) if sc.spec_budget > 0 else 0
            if b <= 0:
                continue
            shape, lookup = self._choose(sc, mode, b, len(scheduled))
            if shape is not None:
                spec.append(DraftRequest(seq, shape.budget, shape))
                if lookup is not None:
                    lookups[seq.request_id] = (lookup, b)
            elif lookup is not None:
                out[seq.request_id] = lookup
        t_model = self.clock()
        if catch and self.model is not None:
            self.model.catch_up(catch)
        if spec and self.model is not None:
            out.update(self.model.propose(spec))
        self.model_draft_s = self.clock() - t_model
        for rid, (lookup, b) in lookups.items():  # hybrid: the lookup's branches over the model's tree
            out[rid] = merge(out[rid], lookup, b) if rid in out else lookup
        return out

    def free_proposal(self, seq: SpecRequest, budget: int, batch: int | None = None) -> Proposal | None:
        """The model-free proposal worth most for ``seq`` (None: no proposer has one); with ``batch``
        (a lookup-only step), each proposer's length is the policy's once its match is known
        (``SpecPolicy.free_len``)."""
        if budget <= 0:
            return None
        props = []
        for f in self.free:
            choose = None if batch is None else self._chooser(seq, f.name, batch)
            prop = f.propose([DraftRequest(seq, budget, choose=choose)]).get(seq.request_id)
            if prop is not None:
                props.append(prop)
        if len(props) <= 1:
            return props[0] if props else None
        return self.policy.best_free(seq, props)

    def _chooser(self, seq: SpecRequest, name: str, batch: int) -> Callable[[int], int]:
        return lambda available: self.policy.free_len(seq, name, available, batch)

    def _choose(self, sc, mode: SpecMode, budget: int, batch: int) -> tuple:
        """(model draft Shape or None, model-free Proposal or None) for one request this step; both
        for a hybrid tree, the model-free one taking up to ``SpecConfig.ngram_tokens`` of the budget."""
        seq, pol = sc.seq, self.policy
        if sc.spec_depth == LOOKUP_ONLY:  # an adaptive request while the model does not pay
            return None, self.free_proposal(seq, budget, batch)
        if mode == SpecMode.NGRAM or self.model is None:
            return None, self.free_proposal(seq, budget) if mode == SpecMode.NGRAM else None
        auto = seq.spec.mode == SpecMode.AUTO and pol.spec.adaptive
        shape = self.model.shape_for(mode, budget, sc.spec_depth)
        if shape is None or mode != SpecMode.HYBRID and not auto:
            return shape, None
        if mode != SpecMode.HYBRID:  # an adaptive request: the model, a model-free proposal, or both
            alone = self.free_proposal(seq, budget)
            if alone is None:
                return shape, None
            if pol.prefer_ngram(
                seq, alone.tree.num_nodes - 1, shape.depth, batch, shape.budget, pol.free_expected(seq, alone)
            ):
                return None, alone
        lookup = self.free_proposal(seq, min(pol.spec.ngram_tokens, budget // 2))
        if lookup is None:
            return shape, None
        n = lookup.tree.num_nodes - 1
        if mode != SpecMode.HYBRID and not pol.hybrid_pays(
            seq, n, shape.depth, batch, shape.budget, pol.free_expected(seq, lookup)
        ):
            return shape, None
        return self.model.shape_for(mode, budget - n, sc.spec_depth), lookup

    # what verification kept ------------------------------------------------------------------
    def record(
        self,
        seq: SpecRequest,
        prop: Proposal | None,
        drafted: int,
        accepted: list,
        emitted: int,
        totals: SpecStats,
    ) -> dict | None:
        """Statistics of one verified step (request and ``totals``, by proposer: a hybrid tree's
        accepted nodes are credited to whoever proposed each); the policy and the proposers learn
        from it (``accepted``: the accepted path's node indices). Returns the per-proposer split
        (``hybrid.credit``), None without a proposal."""
        depth = prop.depth if prop is not None else 0
        parts = credit(prop, accepted) if prop is not None else None
        for st in (seq.stats, totals):
            st.record(drafted, depth, len(accepted), parts)
            st.emitted_tokens += emitted
        if prop is None or not depth or not parts:
            return parts
        self.policy.observe(seq, prop, accepted, parts)
        for p in self.proposers:
            if p.name in parts or p.name == prop.proposer:
                p.observe(seq, prop, accepted)
        return parts

    def forget(self, seq: SpecRequest) -> None:
        """``seq`` finished: every proposer forgets it (prompt lookup's store keeps its tokens)."""
        for p in self.proposers:
            p.forget(seq)
