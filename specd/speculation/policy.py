"""How to speculate: per request and per step, which mode and how many draft tokens (the scheduler
decides who runs and how many tokens; this decides how they speculate).

Adaptive requests (``speculation: auto``): each step picks the draft depth D (0..max) that
maximises the expected tokens per second of the whole step, ``sum_i E(a_i, D) / T(D)`` with
``E(a, D) = (1 - a^(D+1)) / (1 - a)`` (Leviathan et al. 2023) and a_i each request's per-position
acceptance (EMA of accepted / drafted depth; new requests start from the engine-wide EMA). Costs
are measured by the engine and kept by ``specd.speculation.costs.CostModel`` (``SpecPolicy.costs``):
T(0), a plain step at the batch size, and T(D>0) = V(B * (1 + nodes(D))) + D * t_draft, the
verification of the step's tokens plus the draft levels (see there). A request's first model draft
is a ``FIRST_MODEL_DRAFT``-node chain whatever D is (the engine-wide acceptance it was priced at
came from other requests).

Shape: a tree-drafting mode (``tree``, ``head``, ``hybrid``) also weighs, per depth D, a *narrow*
draft of D nodes (a dynamic tree whose budget equals its depth: in practice the draft's top-1
chain) against the configured width ``min(tree_budget, D * tree_topk)``, each at its own
acceptance: the wide tree at the request's tree acceptance, the narrow one at its *chain*
acceptance (how many leading nodes of each verified path were their parent's first, i.e. top-1,
child: what a chain of the same depth would have had accepted, measured from every model draft).
Where each verification row costs compute (a CPU: 5 rows ~2x one row) the narrow draft wins; where
rows are nearly free (a GPU) the wide tree does.

Prompt lookup alone (an adaptive request's step while the model does not pay): the full lookup
budget is reserved and each request's length is chosen once its match is known (``lookup_len``:
the length maximising expected tokens per second as if every request drafted as much, from the
outcomes of lookups whose match allowed as many tokens; ``ngram_budget`` prices ``ngram`` mode's
lengths, and lookup-only steps before the costs at a batch size are measured); at a batch size
(>= 2; judged per power-of-two bucket of sizes) where such steps have delivered fewer tokens per
second than plain steps (``lookups_lose``: an EMA of the realized ratio over 8+ of them), lookups
are a staggered 2-token probe only until the ratio recovers: at 16 requests on a CPU only a few
requests match, and the few rows they add cost ~1 ms each against ~1.5 ms per plain token.

D = 0 turns speculation off: at high batch the target step grows and D shrinks; when the batch
drains it grows back. While D = 0, a probe step drafts one token for ONE request (the least
recently probed) so acceptance estimates stay current; the probe interval doubles (16 -> 256
steps) while D stays 0 (every 4096 steps when not even perfect acceptance would make drafting pay
at this batch size: probing acceptance cannot change that answer; the rare probe refreshes the
costs). Decisions are reused for up to 8 steps while the batch's acceptance estimates are
unchanged. Chains use k = D; trees keep ``min(tree_budget, D * tree_topk)`` nodes up to depth D.
Requests that name a mode (chain/tree) get that fixed size (capped by their max_draft_tokens);
the step's draft tokens are also capped at ``max_verify_tokens - batch``.

Worked example: B = 1, a = 0.8, T(0) = 10 ms, t_fixed = 10 ms, t_per_token = 0, t_draft = 1 ms.
D = 4 gives E = (1 - 0.8^5) / 0.2 = 3.36 tokens per 14 ms = 240 tokens/s against 100 for D = 0.
"""

from __future__ import annotations

import collections
import zlib
from dataclasses import dataclass

from specd.config import MODEL_MODES, SpecConfig, SpecMode
from specd.sampling.tree import top1_run
from specd.speculation.costs import CostModel
from specd.speculation.request import SpecRequest

LOOKUP_ONLY = -1  # a budget's depth: this step, prompt lookup only (the model proposer does not pay now)
DECISION_REUSE_STEPS = 8  # a decision is reused while the batch's estimates are unchanged
HOPELESS_REUSE_STEPS = 64  # "drafting cannot pay at this batch size" is trusted this long
LOOKUP_PROBE = 2  # draft tokens of a prompt-lookup probe while lookup does not pay for a request
FIRST_MODEL_DRAFT = 2  # nodes (a top-1 chain) of a request's first model draft: its own acceptance is unknown
MODEL_PROPOSERS = ("draft", "head")  # SpecStats.by_proposer names of the model proposers
LOOKUP_PROPOSERS = ("ngram", "suffix")  # prompt lookup's names (its outcomes priced by match length)
EMA = 0.3  # weight of a step's acceptance in a request's per-proposer EMA
LOOKUP_WINDOW = 256  # prompt-lookup outcomes kept engine-wide (per request: SpecState.lookup_outcomes)
LOOKUP_MIN_OWN = 4  # a request's own outcomes used once it has this many (else the engine's)
MARGIN = 1.02  # a draft must promise this much more than plain decoding (a clear win only)
LOOKUP_BY_LEN_WINDOW = 64  # outcomes kept per length a match allows (SpecPolicy.lookup_len)
LOOKUP_BY_LEN_MIN = 8  # outcomes of a match length before its own figures are used


@dataclass
class StepPlan:
    """One step's speculation decision: ``depth`` for adaptive requests (None: no adaptive policy
    this step), the one request a probe step drafts for, and the per-request draft-token cap."""

    depth: int | None
    probe: SpecRequest | None
    cap: int
    batch: int = 1  # requests expected in the step
    nodes: int | None = None  # draft nodes per adaptive request at ``depth`` (None: the mode's width)


def _expected(a: float, d: int) -> float:
    """Expected tokens of a step drafting a chain of ``d`` at per-token acceptance ``a``."""
    a = min(max(a, 0.0), 0.999)
    return (1 - a ** (d + 1)) / (1 - a)


def expected_tokens(groups: collections.Counter, batch: int, dmax: int) -> list[float]:
    """``tot[d] = sum_i E(a_i, d)`` for d in 0..dmax, over acceptance ``groups`` (rounded estimate ->
    count), so the cost is O(distinct * dmax), not O(batch * dmax)."""
    tot = [float(batch)] * (dmax + 1)
    for a, n in groups.items():
        p, acc = 1.0, 1.0
        for d in range(1, dmax + 1):
            p *= a
            acc += p
            tot[d] += n * (acc - 1.0)
    return tot


class SpecPolicy:
    """The speculation cost model and per-step decision (see the module docstring). ``step`` counts
    planned steps: the scheduler advances it through ``plan``; tests may set it directly."""

    def __init__(self, spec: SpecConfig, has_draft: bool, max_verify_tokens: int = 256, has_head: bool = False):
        self.spec = spec
        self.has_draft = has_draft  # a model proposer: a draft model or a feature head
        self.has_head = has_head
        self.max_verify_tokens = max_verify_tokens
        self.step = 0
        self.costs = CostModel()  # what steps cost on this device (measured by the engine)
        self.accept_ema: float | None = None  # engine-wide per-position acceptance (prior for new requests)
        self.ngram_ema: float | None = None  # the same for prompt lookup's drafts
        self.chain_ema: float | None = None  # the same for the model's top-1 chain (the narrow shape)
        self.lookup_outcomes: collections.deque = collections.deque(maxlen=LOOKUP_WINDOW)  # (accepted, drafted)
        self._lookup_cache: dict = {}  # "E": lookup_expected by d from the engine's outcomes
        # length a match allowed -> its lookups' outcomes (accepted, drafted), and their cache
        self.lookup_by_len: dict = {}
        self._by_len_cache: dict = {}
        self.last_nodes: int | None = None  # draft nodes of the last adaptive decision (None: the mode's)
        self.probe_every = 16  # current probe interval (steps) while speculation is off
        self.probe_min, self.probe_max = 16, 256
        self.probe_hopeless = 4096  # probe interval while even perfect acceptance would not pay
        self.probing = False
        self.last_depth = 0
        self._decision: tuple | None = None  # (alphas, step, config, depth, hopeless) of the last decision
        self.hopeless_batch: tuple | None = None  # (batch, step, mode) of the last "drafting cannot pay"
        # other model-free proposers (by name): acceptance prior (Proposer.prior) and engine-wide EMA
        self.priors: dict = {}
        self.free_ema: dict = {}

    # per request --------------------------------------------------------------------------------
    def mode_of(self, seq: SpecRequest) -> SpecMode:
        """The request's effective mode: ``auto`` means the configured one; a draft-model mode
        (chain, tree, static) is ``off`` without a draft model; ``ngram`` needs none."""
        m = SpecMode(seq.spec.mode)
        if m == SpecMode.AUTO:
            m = SpecMode(self.spec.mode)
        if m == SpecMode.HYBRID and not self.has_draft:
            return SpecMode.NGRAM  # no model proposer: prompt lookup alone
        if m in MODEL_MODES and not self.has_draft or m == SpecMode.HEAD and not self.has_head:
            return SpecMode.OFF
        return m

    def desired_budget(self, seq: SpecRequest) -> int:
        """Draft tokens the request's mode asks for (before the adaptive depth and step caps)."""
        mode = self.mode_of(seq)
        if mode == SpecMode.OFF:
            return 0
        if mode == SpecMode.NGRAM:
            base = self.spec.ngram_tokens * self.spec.ngram_branches
        else:
            base = self.spec.num_draft_tokens if mode == SpecMode.CHAIN else self.spec.tree_budget
            base += self.spec.ngram_tokens if mode == SpecMode.HYBRID else 0  # room for the lookup's branch
        if seq.spec.max_draft_tokens is not None:
            base = min(base, seq.spec.max_draft_tokens)
        return max(base, 0)

    def start(self, seq: SpecRequest) -> None:
        """A new request starts from the engine-wide acceptance estimates (model and prompt lookup)."""
        if seq.stats.steps != 0:
            return
        if self.accept_ema is not None:
            seq.spec_state.recent_accept = self.accept_ema
        if self.ngram_ema is not None:
            seq.spec_state.ngram_accept = self.ngram_ema
        if self.chain_ema is not None:
            seq.spec_state.chain_accept = self.chain_ema

    def nodes_for_depth(self, d: int) -> int:
        return d if self.spec.mode == SpecMode.CHAIN else min(self.spec.tree_budget, d * self.spec.tree_topk)

    def step_spec_cap(self, batch: int) -> int:
        """Per-sequence cap on draft tokens so the step's verification tokens stay bounded."""
        if batch <= 0:
            return 0
        return max(0, (self.max_verify_tokens - batch) // batch)

    def note_accept(self, rate: float, lookup: bool = False, chain: bool = False) -> None:
        """Per-position acceptance of a speculating step (``lookup``: of prompt lookup's draft;
        ``chain``: of the model draft's top-1 chain); new requests start from its EMA."""
        if lookup:
            self.ngram_ema = rate if self.ngram_ema is None else 0.9 * self.ngram_ema + 0.1 * rate
            return
        if chain:
            self.chain_ema = rate if self.chain_ema is None else 0.9 * self.chain_ema + 0.1 * rate
            return
        self.accept_ema = rate if self.accept_ema is None else 0.9 * self.accept_ema + 0.1 * rate

    def note_lookup(self, seq: SpecRequest, accepted: int, drafted: int, available: int | None = None) -> None:
        """One prompt-lookup draft of ``drafted`` tokens had ``accepted`` of them accepted;
        ``available``: how long its match allowed it to be (``Proposal.available``; None: not known)."""
        seq.spec_state.lookup_outcomes.append((accepted, drafted))
        seq.spec_state.lookup_cache.clear()
        self.lookup_outcomes.append((accepted, drafted))
        self._lookup_cache.clear()
        if available is not None:
            obs = self.lookup_by_len.setdefault(available, collections.deque(maxlen=LOOKUP_BY_LEN_WINDOW))
            obs.append((accepted, drafted))
            self._by_len_cache.pop(available, None)

    def observe(self, seq: SpecRequest, prop, accepted_nodes: list, parts: dict) -> None:
        """What one verified step's proposal (``prop``, a ``Proposal``) had accepted, split by
        proposer (``parts``: name -> [draft nodes, accepted, deepest node], ``hybrid.credit``):
        each proposer's per-position acceptance (accepted / deepest) updates the request's EMA and
        the engine-wide one; prompt lookup's outcomes are kept by match length too; a model
        proposal's top-1 chain, what a chain would have had accepted (the narrow shape)."""
        st = seq.spec_state
        for name, (_, acc, deepest) in parts.items():
            rate = acc / deepest
            if name in LOOKUP_PROPOSERS:
                st.ngram_accept = (1 - EMA) * st.ngram_accept + EMA * rate
                self.note_accept(rate, lookup=True)
                avail = prop.available if prop.proposer == name else None  # (not a hybrid's)
                self.note_lookup(seq, acc, deepest, avail)
            elif name in MODEL_PROPOSERS:
                st.recent_accept = (1 - EMA) * st.recent_accept + EMA * rate
                self.note_accept(rate)
            else:
                st.accept[name] = (1 - EMA) * self.free_accept(seq, name) + EMA * rate
                old = self.free_ema.get(name)
                self.free_ema[name] = rate if old is None else 0.9 * old + 0.1 * rate
        if prop.proposer in MODEL_PROPOSERS:
            rate = top1_run(prop.tree, accepted_nodes) / max(prop.depth, 1)
            st.chain_accept = (1 - EMA) * st.chain_accept + EMA * rate
            self.note_accept(rate, chain=True)

    def free_accept(self, seq: SpecRequest, name: str) -> float:
        """A model-free proposer's per-position acceptance for ``seq`` (other than prompt lookup):
        its own EMA, else the engine's, else the proposer's prior."""
        own = seq.spec_state.accept.get(name)
        if own is not None:
            return own
        return self.free_ema.get(name, self.priors.get(name, 0.5))

    def free_expected(self, seq: SpecRequest, prop) -> float:
        """Expected tokens of a step verifying the model-free proposal ``prop``: prompt lookup's
        from its outcomes (``lookup_expected``), another's from its acceptance along the proposal's
        depth."""
        if prop.proposer in LOOKUP_PROPOSERS:
            return self.lookup_expected(seq, prop.tree.num_nodes - 1)
        return _expected(self.free_accept(seq, prop.proposer), prop.depth)

    def best_free(self, seq: SpecRequest, props: list):
        """Of several model-free proposals for ``seq``, the one with the most expected tokens per
        verified token (rows cost; the first on a tie: registry order)."""
        return max(props, key=lambda p: self.free_expected(seq, p) / max(p.tree.num_nodes, 1))

    def free_len(self, seq: SpecRequest, name: str, available: int, batch: int) -> int:
        """Draft tokens (0..``available``) of model-free proposer ``name`` for a lookup-only step,
        once its match is known: prompt lookup's by ``lookup_len``; another's, the length that
        maximises expected tokens per second at its acceptance (``free_accept``)."""
        if name in LOOKUP_PROPOSERS:
            return self.lookup_len(seq, available, batch)
        t_plain = self.costs.plain_cost(batch)
        if not self.spec.adaptive or available <= 0:
            return max(available, 0)
        if t_plain is None or self.costs.t_target is None:
            return min(available, LOOKUP_PROBE)
        a = self.free_accept(seq, name)
        best, best_d = 1.0 / t_plain, 0
        for d in range(1, available + 1):
            rate = _expected(a, d) / self.costs.verify_cost(d, batch, t_plain)
            if rate > best * MARGIN:
                best, best_d = rate, d
        return best_d or self._lookup_probe(seq, available, batch)

    def lookup_len(self, seq: SpecRequest, available: int, batch: int) -> int:
        """Draft tokens (0..``available``) for an adaptive request's lookup-only step, asked once its
        match is known: ``available`` is how long the match lets the draft be (its match length +
        ``NgramConfig.extend``, within the step's budget). The length that maximises expected
        tokens per second, from the outcomes of earlier lookups whose match allowed as many tokens
        (``_by_len_expected``): a long match predicts a long accepted run. (Priced before the match
        was known, from all lookups alike, ``auto`` cut copied spans into pieces and skipped
        matches that paid: 5% more steps than ``--spec ngram`` at batch 1.)"""
        t_plain = self.costs.plain_cost(batch)
        if not self.spec.adaptive or available <= 0:
            return max(available, 0)
        if t_plain is None or self.costs.t_target is None:
            return min(available, LOOKUP_PROBE)
        return self._best_lookup(seq, available, batch, t_plain, by_len=available)

    def _by_len_expected(self, seq: SpecRequest, available: int, d: int) -> float:
        """``lookup_expected`` from the outcomes of lookups whose match allowed ``available``
        tokens once there are ``LOOKUP_BY_LEN_MIN`` of them, else from all the request's lookups."""
        obs = self.lookup_by_len.get(available)
        if obs is None or len(obs) < LOOKUP_BY_LEN_MIN:
            return self.lookup_expected(seq, d)
        return _cached_cut(self._by_len_cache.setdefault(available, {}), obs, d)

    def lookup_expected(self, seq: SpecRequest, d: int) -> float:
        """Expected tokens of a step whose prompt-lookup draft is cut to ``d`` tokens: 1 + the mean
        over recent lookup outcomes (the request's own once it has a few, else the engine's) of what
        the cut draft would have had accepted, ``min(accepted, d)`` (acceptance is a prefix), a
        fully accepted shorter draft extended by the outcomes' per-token acceptance. Lookup hits
        are bimodal (a copied span matches on, or the first token fails), so the geometric
        ``E(a, d)`` of one acceptance rate overrates long drafts after a lucky match; with no
        outcomes yet it is still used, at the request's ``ngram_accept``."""
        own = seq.spec_state.lookup_outcomes
        if len(own) >= LOOKUP_MIN_OWN:  # its own outcomes, else the engine's: every d at once, once
            return _cached_cut(seq.spec_state.lookup_cache, own, d)  # until the next outcome
        if not self.lookup_outcomes:
            return _expected(seq.spec_state.ngram_accept, d)
        return _cached_cut(self._lookup_cache, self.lookup_outcomes, d)

    def forget(self) -> None:
        """Drop the cached decision and priced widths: the next ``choose_depth`` recomputes from the
        current costs."""
        self._decision = None
        self.costs.forget()

    # the decision -------------------------------------------------------------------------------
    def plan(self, candidates: list, batch: int) -> StepPlan:
        """Advance the step counter and decide this step's adaptive depth and probe among
        ``candidates`` (the requests that may run this step, in rank order)."""
        cap = self.step_spec_cap(batch) if self.spec.adaptive else 1 << 30
        self.step += 1
        self.costs.at_context(sum(s.num_computed for s in candidates[:batch]))
        if not (self.spec.adaptive and self.has_draft) or self.spec.mode not in MODEL_MODES:
            return StepPlan(None, None, cap, batch)
        autos = [s for s in candidates if s.spec.mode == SpecMode.AUTO]
        self.last_nodes = None
        if autos and self._hopeless_now(len(autos)):
            depth = 0
        else:
            narrow = [s.spec_state.chain_accept for s in autos] if self._weighs_shapes() else None
            depth = self.choose_depth([s.spec_state.recent_accept for s in autos], narrow=narrow)
        self.last_depth = depth
        probe = None
        if self.probing and autos:
            probe = min(autos, key=lambda s: s.spec_state.last_probe)
            probe.spec_state.last_probe = self.step
        return StepPlan(depth, probe, cap, batch, self.last_nodes if depth else None)

    def _weighs_shapes(self) -> bool:
        """Whether the configured mode drafts trees wider than their depth (then the narrow shape
        is weighed too)."""
        return self.spec.mode in (SpecMode.TREE, SpecMode.HEAD, SpecMode.HYBRID) and self.spec.tree_topk > 1

    def budget(self, seq: SpecRequest, plan: StepPlan) -> tuple[int, int]:
        """(draft tokens wanted, tree depth allowed; 0 = the configured depth) for ``seq`` this step."""
        if self.mode_of(seq) == SpecMode.NGRAM:
            return max(self.ngram_budget(seq, plan.batch), self._forced_budget(seq, plan.batch)), 0
        auto = seq.spec.mode == SpecMode.AUTO
        if plan.depth == 0 and not self.probing and auto:  # the model does not pay this step: free lookup only
            full = self.spec.ngram_tokens * self.spec.ngram_branches
            if self.costs.lookups_lose(plan.batch):  # what they delivered says no: a staggered probe only
                n = self._lookup_probe(seq, LOOKUP_PROBE, plan.batch)
            elif self.costs.plain_cost(plan.batch) is not None and self.costs.t_target is not None:
                # reserved in full: ``lookup_len`` cuts it once the match is known
                n = min(full, seq.spec.max_draft_tokens if seq.spec.max_draft_tokens is not None else full)
            else:
                n = self.ngram_budget(seq, plan.batch, full)
            n = max(n, self._forced_budget(seq, plan.batch))
            return (n, LOOKUP_ONLY) if n > 0 else (0, 0)
        want = self.desired_budget(seq)
        if plan.depth is None or not auto or want <= 0:
            return want, 0
        depth = plan.depth
        mode = self.mode_of(seq)
        want = depth if mode == SpecMode.CHAIN else min(self.spec.tree_budget, depth * self.spec.tree_topk)
        if plan.nodes is not None and mode != SpecMode.CHAIN:
            want = plan.nodes  # the narrow shape (a budget equal to the depth: the top-1 chain)
        want += self.spec.ngram_tokens if mode == SpecMode.HYBRID else 0
        if self.probing:
            want = 1 if seq is plan.probe else 0  # a probe drafts a single token for one request
        elif not any(p in seq.stats.by_proposer for p in MODEL_PROPOSERS):
            # the decision priced this request at the engine-wide acceptance, which the previous
            # requests' last drafts set: its first model draft is a short chain until its own is
            # measured (a fresh 16-request group started at a stale 0.96 drafted 16-node trees for
            # all of them, ~150 ms steps, three times per group)
            depth = min(depth, FIRST_MODEL_DRAFT)
            want = min(want, FIRST_MODEL_DRAFT + (self.spec.ngram_tokens if mode == SpecMode.HYBRID else 0))
        if seq.spec.max_draft_tokens is not None:
            want = min(want, seq.spec.max_draft_tokens)
        return want, depth

    def ngram_budget(self, seq: SpecRequest, batch: int, want: int | None = None) -> int:
        """Prompt-lookup draft tokens for ``seq``: the length that maximises expected tokens per
        second at its acceptance (drafting itself costs nothing; verifying each token does), capped
        by ``want`` (default: its mode's budget). A step with no n-gram match drafts nothing,
        whatever is reserved. With adaptive speculation off the full budget is always kept; at a
        batch size whose plain step is not measured yet, nothing (that step measures it); before any
        speculative step is measured, ``LOOKUP_PROBE`` tokens; while nothing pays, every
        ``lookup_probe_every(batch)``-th step of the request (staggered by request, so a batch never
        probes all at once) keeps ``LOOKUP_PROBE`` tokens so the estimate stays current."""
        if want is None:
            want = self.desired_budget(seq)
        elif seq.spec.max_draft_tokens is not None:
            want = min(want, seq.spec.max_draft_tokens)
        t_plain = self.costs.plain_cost(batch)
        if not self.spec.adaptive or want <= 0:
            return want
        if t_plain is None:  # a batch size not seen yet: one plain step first measures it
            return 0
        if self.costs.t_target is None:  # no speculative step measured yet: a short draft measures one
            return min(want, LOOKUP_PROBE)
        return self._best_lookup(seq, want, batch, t_plain)

    def _best_lookup(self, seq: SpecRequest, limit: int, batch: int, t_plain: float, by_len: int | None = None) -> int:
        """The lookup length (1..``limit``) that maximises expected tokens per second, by a clear
        margin over plain decoding, else a staggered probe at most (``_lookup_probe``); expected
        tokens from the request's lookups, or (``by_len``) from lookups whose match allowed that
        many tokens (``_by_len_expected``)."""
        best, best_d = 1.0 / t_plain, 0
        for d in range(1, limit + 1):
            e = self.lookup_expected(seq, d) if by_len is None else self._by_len_expected(seq, by_len, d)
            rate = e / self.costs.verify_cost(d, batch, t_plain)
            if rate > best * MARGIN:
                best, best_d = rate, d
        return best_d or self._lookup_probe(seq, limit, batch)

    def lookup_probe_every(self, batch: int) -> int:
        """Steps between one request's lookup probes at ``batch`` requests: ``probe_min`` up to 4
        requests, proportionally more above, so a batch averages at most one probing request per 4
        steps. (At 16 requests, each probing every 16th step put a probe, a row or two wider than
        the plain step, in most steps; spacing them was neutral within noise in what was measured
        at batch 16, and keeps the share of probing steps bounded as batches grow.)"""
        return self.probe_min * max(1, -(-batch // 4))

    def _forced_budget(self, seq: SpecRequest, batch: int) -> int:
        """Draft tokens reserved for a constrained request's grammar-forced text (the ``grammar``
        proposer drafts only what its grammar forces, so a reservation it does not fill costs
        nothing): priced at that proposer's own acceptance, never at prompt lookup's, which may not
        pay while forced text nearly always does."""
        if getattr(seq, "matcher", None) is None:
            return 0
        return self.free_len(seq, "grammar", self.desired_budget(seq), batch)

    def _lookup_probe(self, seq: SpecRequest, want: int, batch: int) -> int:
        """``LOOKUP_PROBE`` tokens (at most ``want``) on every ``lookup_probe_every(batch)``-th
        step of ``seq`` (staggered by request, so a batch never probes all at once), else 0."""
        every = self.lookup_probe_every(batch)
        return min(want, LOOKUP_PROBE) if (self.step + _offset(seq)) % every == 0 else 0

    def _model_accept(self, seq: SpecRequest, nodes: int, depth: int) -> float:
        """The request's acceptance for a model draft of ``nodes`` nodes up to ``depth``: its chain
        acceptance for a narrow draft (nodes == depth), else its tree acceptance."""
        return seq.spec_state.chain_accept if nodes <= depth and self._weighs_shapes() else seq.spec_state.recent_accept

    def prefer_ngram(
        self,
        seq: SpecRequest,
        ngram_tokens: int,
        model_depth: int,
        batch: int,
        nodes: int | None = None,
        expected: float | None = None,
    ) -> bool:
        """For an adaptive request that could draft with either proposer this step: is the prompt
        lookup match (``ngram_tokens`` long) worth more tokens per second than the draft model at
        ``model_depth``? Expected tokens from each one's own acceptance of this request; costs:
        verification of the proposal's tokens (measured), plus the draft levels for the model.
        ``expected``: the model-free proposal's expected tokens (``free_expected``; None: prompt
        lookup's, ``lookup_expected``)."""
        if self.costs.t_target is None or self.costs.t_draft is None or model_depth <= 0:
            return True  # nothing measured yet (or the model would not draft): the free proposal
        t_plain = self.costs.plain_cost(batch) or self.costs.t_target
        e_free = self.lookup_expected(seq, ngram_tokens) if expected is None else expected
        ngram_rate = e_free / self.costs.verify_cost(ngram_tokens, batch, t_plain)
        nodes = self.nodes_for_depth(model_depth) if nodes is None else nodes
        model_cost = self.costs.verify_cost(nodes, batch, t_plain) + model_depth * self.costs.t_draft
        return ngram_rate >= _expected(self._model_accept(seq, nodes, model_depth), model_depth) / model_cost

    def hybrid_pays(
        self,
        seq: SpecRequest,
        lookup_tokens: int,
        model_depth: int,
        batch: int,
        nodes: int | None = None,
        expected: float | None = None,
    ) -> bool:
        """For an adaptive request drafting with the model this step: is laying a prompt-lookup
        branch (``lookup_tokens`` long) over the model's tree worth its verification? Expected
        extra tokens assume the two are independent: the lookup branch adds what it would accept
        alone whenever the model's first token is rejected (``expected``: as in ``prefer_ngram``)."""
        if self.costs.t_target is None or self.costs.t_draft is None or model_depth <= 0:
            return False
        nodes = self.nodes_for_depth(model_depth) if nodes is None else nodes
        t_plain = self.costs.plain_cost(batch) or self.costs.t_target
        t_levels = model_depth * self.costs.t_draft

        def cost(n: int) -> float:
            return self.costs.verify_cost(n, batch, t_plain) + t_levels

        a_m = min(max(self._model_accept(seq, nodes, model_depth), 0.0), 0.999)
        e_model = _expected(a_m, model_depth)
        e_free = self.lookup_expected(seq, lookup_tokens) if expected is None else expected
        e_hybrid = e_model + (e_free - 1) * (1 - a_m)
        return e_hybrid / cost(nodes + lookup_tokens) > e_model / cost(nodes)

    def choose_depth(self, alphas: list, narrow: list | None = None) -> int:
        """Draft depth maximising expected tokens/s of the step (0 = no speculation); ``narrow``:
        the requests' chain acceptances, to weigh the narrow shape too (``last_nodes`` then says
        which shape won: its node count, or None for the mode's width). While the answer is 0,
        every ``probe_every`` steps it returns 1 and sets ``probing``."""
        dmax = max(self.spec.tree_depth, self.spec.num_draft_tokens)
        self.probing = False
        self.last_nodes = None
        if not alphas:
            return 0
        if self.costs.plain_cost(len(alphas)) is None:
            return 0  # first time at this batch size: one plain step measures the cost of depth 0
        if self.costs.t_target is None or self.costs.t_draft is None:
            # no speculative step measured yet: a short draft measures one (narrow where shapes are
            # weighed: a 16-request batch's first tree of 4 levels verified 68 rows on 4 requests)
            self.last_nodes = 2 if narrow is not None else None
            return min(dmax, 2)
        best_d, hopeless = self._decide(alphas, dmax, narrow)
        if best_d == 0:
            every = self.probe_hopeless if hopeless else self.probe_every
            if self.step % every == 0:
                self.probing = True  # one draft token keeps the estimates fresh...
                if not hopeless:
                    self.probe_every = min(self.probe_max, self.probe_every * 2)  # ...ever more rarely
                return 1
            return 0
        self.probe_every = self.probe_min
        return best_d

    def _decide(self, alphas: list, dmax: int, narrow: list | None = None) -> tuple[int, bool]:
        """(best depth, hopeless), reusing a recent decision for the same estimates (costs drift
        slowly); sets ``last_nodes``. Hopeless: not even perfect acceptance would make drafting pay
        at this batch size."""
        c = self._decision
        key = (self.spec.mode, dmax, self.costs.ctx_bucket)
        ests = (list(alphas), None if narrow is None else list(narrow))
        if c is not None and c[0] == ests and self.step - c[1] < DECISION_REUSE_STEPS and c[2] == key:
            self.last_nodes = c[5]
            return c[3], c[4]
        best_d, self.last_nodes = self._best_depth(alphas, dmax, narrow)
        perfect = [0.999] * len(alphas)
        hopeless = best_d == 0 and self._best_depth(perfect, dmax, None if narrow is None else perfect)[0] == 0
        if self.costs.plain_cost(len(alphas)) is not None:  # (an unmeasured batch size is re-asked next step)
            self._decision = (ests, self.step, key, best_d, hopeless, self.last_nodes)
            self.hopeless_batch = (len(alphas), self.step, self.spec.mode) if hopeless else None
        return best_d, hopeless

    def _hopeless_now(self, batch: int) -> bool:
        """Depth 0 without looking at acceptance: a recent decision found drafting hopeless at this
        batch size and this is not a probe step (saves building the acceptance list every step)."""
        h = self.hopeless_batch
        if (
            h is None
            or h[0] != batch
            or self.step - h[1] >= HOPELESS_REUSE_STEPS
            or h[2] != self.spec.mode
            or self.step % self.probe_hopeless == 0
            or self.costs.t_target is None
        ):
            return False
        self.probing = False
        return True

    def _best_depth(self, alphas: list, dmax: int, narrow: list | None = None) -> tuple[int, int | None]:
        """(depth, nodes: the narrow shape's count, or None for the mode's width) of the best
        expected tokens per second; the narrow shape is weighed when ``narrow`` acceptances are given."""
        B = len(alphas)
        t_plain = self.costs.plain_cost(B)
        if t_plain is None:
            return 0, None  # first time at this batch size: one plain step measures the cost of depth 0
        td = self.costs.t_draft
        assert self.costs.t_target is not None and td is not None
        shapes = [(expected_tokens(_groups(alphas), B, dmax), self.nodes_for_depth, False)]
        if narrow is not None:
            shapes.append((expected_tokens(_groups(narrow), B, dmax), lambda d: d, True))
        best, best_d, best_nodes = B / t_plain, 0, None
        for d in range(1, dmax + 1):
            for tot, nodes_of, is_narrow in shapes:
                nodes = nodes_of(d)
                rate = tot[d] / (self.costs.verify_cost(nodes, B, t_plain) + d * td)
                if rate > best * MARGIN:  # a clear win only
                    best, best_d, best_nodes = rate, d, nodes if is_narrow else None
        return best_d, best_nodes


def _cut_expected(obs, dmax: int) -> list:
    """[1 + the mean over lookup outcomes ``(accepted, drafted)`` of what a draft cut to ``d``
    tokens would have had accepted, for d in 0..dmax] (see ``SpecPolicy.lookup_expected``); over
    the distinct outcomes (a few dozen of up to 256), every d in one pass."""
    cnt = collections.Counter(obs)
    q = min(sum(a * c for (a, _), c in cnt.items()) / max(1, sum(n * c for (_, n), c in cnt.items())), 0.999)
    out = [1.0] * (dmax + 1)
    for d in range(1, dmax + 1):
        tot = 0.0
        for (a, n), c in cnt.items():
            t = min(a, d)
            if a >= n and d > n:  # all of a shorter draft accepted: how far it might have gone on
                t += q * (1 - q ** (d - n)) / (1 - q)
            tot += c * t
        out[d] = 1.0 + tot / len(obs)
    return out


def _cached_cut(cache: dict, obs, d: int) -> float:
    """``_cut_expected(obs, ...)[d]`` kept in ``cache`` (cleared when an outcome arrives)."""
    e = cache.get("E")
    if e is None or d >= len(e):
        e = cache["E"] = _cut_expected(obs, max(d, 16))
    return e[d]


def _groups(alphas: list) -> collections.Counter:
    """Acceptance estimates rounded to 0.01 -> how many requests have each."""
    return collections.Counter(round(min(max(a, 0.0), 0.999), 2) for a in alphas)


def _offset(seq: SpecRequest) -> int:
    """A request's fixed probe phase (the same for every run of the same request id)."""
    return zlib.crc32(seq.request_id.encode())
