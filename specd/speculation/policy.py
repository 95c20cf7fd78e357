"""How to speculate: per request and per step, which mode and how many draft tokens (the scheduler
decides who runs and how many tokens; this decides how they speculate).

Adaptive requests (``speculation: auto``): each step picks the draft depth D (0..max) that
maximises the expected tokens per second of the whole step, ``sum_i E(a_i, D) / T(D)`` with
``E(a, D) = (1 - a^(D+1)) / (1 - a)`` (Leviathan et al. 2023) and a_i each request's per-position
acceptance (EMA of accepted / drafted depth; new requests start from the engine-wide EMA). Costs
are measured by the engine in its thread's CPU time on a CPU (waits for the GIL or other load do
not distort them; wall time on a GPU):

- T(0) = the measured cost of a draft-free decode step at this batch size (a batch size not yet
  seen gets one plain step first, prompt lookup included);
- T(D>0) = V(B * (1 + nodes(D))) + D * t_draft, t_draft = one draft level after the first (which
  also catches the draft cache up), V(n) = a speculative step of n tokens but its model-proposer
  forwards (so prompt lookup's matching and the per-request work of speculating are priced, as
  they are in T(0)): the measured EMA at exactly n tokens over B requests once seen twice (the
  cost of a forward is not linear in its rows on a CPU: one row reads the weights, memory-bound;
  a few more ride on the same reads, then each
  costs compute: SmolLM2 on AVX2 with int8 activations, 2 rows 1.14x one row, 3 rows 1.35x, 5 rows
  1.95x), else ``max(t_fixed + t_per_token * n, T(0) + t_per_token * (n - B))`` with t_fixed and
  t_per_token fitted (least squares over the last 64 speculative decode steps; the floor: a fit
  from far wider steps must not make a narrow verification look cheaper than a plain step plus its
  extra tokens; before the fit exists, the line through each measured step and the plain step at
  its batch size). n is always the tokens the target verified, never the budget reserved (a lookup
  without a match verifies none of it). The fit is trusted up to twice the widest step measured at
  this batch size; rows beyond cost a plain step's average row until measured (widths are explored
  by doubling), and a request's first model draft is a ``FIRST_MODEL_DRAFT``-node chain (the
  engine-wide acceptance it was priced at came from other requests).

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

from specd.config import SpecConfig
from specd.engine.sequence import Sequence

MODEL_MODES = ("chain", "tree", "static", "head", "hybrid")  # modes that draft with the draft model or feature head
LOOKUP_ONLY = -1  # a budget's depth: this step, prompt lookup only (the model proposer does not pay now)
DECISION_REUSE_STEPS = 8  # a decision is reused while the batch's estimates are unchanged
HOPELESS_REUSE_STEPS = 64  # "drafting cannot pay at this batch size" is trusted this long
LOOKUP_PROBE = 2  # draft tokens of a prompt-lookup probe while lookup does not pay for a request
FIRST_MODEL_DRAFT = 2  # nodes (a top-1 chain) of a request's first model draft: its own acceptance is unknown
MODEL_PROPOSERS = ("draft", "head")  # SpecStats.by_proposer names of the model proposers
FIT_WINDOW = 64  # speculative steps in the least-squares cost fit
LOOKUP_WINDOW = 256  # prompt-lookup outcomes kept engine-wide (per request: Sequence.lookup_outcomes)
LOOKUP_MIN_OWN = 4  # a request's own outcomes used once it has this many (else the engine's)
MARGIN = 1.02  # a draft must promise this much more than plain decoding (a clear win only)
LOOKUP_GUARD_MIN = 8  # lookup-only steps measured at a batch size before their realized rate is trusted
LOOKUP_BY_LEN_WINDOW = 64  # outcomes kept per length a match allows (SpecPolicy.lookup_len)
LOOKUP_BY_LEN_MIN = 8  # outcomes of a match length before its own figures are used


@dataclass
class StepPlan:
    """One step's speculation decision: ``depth`` for adaptive requests (None: no adaptive policy
    this step), the one request a probe step drafts for, and the per-request draft-token cap."""

    depth: int | None
    probe: Sequence | None
    cap: int
    batch: int = 1  # requests expected in the step
    nodes: int | None = None  # draft nodes per adaptive request at ``depth`` (None: the mode's width)


class CostFit:
    """Least squares ``seconds = fixed + per_token * tokens`` over a sliding window, from running
    sums (O(1) per step; re-summed exactly every window so float drift never accumulates)."""

    def __init__(self, window: int = FIT_WINDOW):
        self.window = window
        self.obs: collections.deque = collections.deque()  # recent (tokens, seconds)
        self.sums = [0, 0.0, 0, 0.0]  # sum x, sum y, sum x^2, sum x*y over obs
        self.count = 0

    def add(self, tokens: int, seconds: float) -> tuple[float, float] | None:
        """Record one step; the fitted (fixed, per_token) once at least 8 steps with varying token
        counts are in the window, else None."""
        obs = self.obs
        obs.append((tokens, seconds))
        self.sums = [s + d for s, d in zip(self.sums, (tokens, seconds, tokens * tokens, tokens * seconds))]
        if len(obs) > self.window:
            x0, y0 = obs.popleft()
            self.sums = [s - d for s, d in zip(self.sums, (x0, y0, x0 * x0, x0 * y0))]
        self.count += 1
        if self.count % self.window == 0:
            self.sums = [
                sum(x for x, _ in obs),
                sum(y for _, y in obs),
                sum(x * x for x, _ in obs),
                sum(x * y for x, y in obs),
            ]
        n = len(obs)
        sx, sy, sxx, sxy = self.sums
        nvx = n * sxx - sx * sx  # n * variance of x: exact for integer token counts
        if n < 8 or nvx <= 0:
            return None
        b = max(0.0, (n * sxy - sx * sy) / nvx)
        return max(sy / n - b * sx / n, 1e-6), b


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
        # per context bucket (``t_target`` / ``t_per_token``, see below): [fixed seconds of a target
        # step (forward + verify + commit) or None, marginal seconds per target token, anchored]
        # (anchored: the marginal cost came from steps anchored at plain ones, no fit yet)
        self._line_by_ctx: dict = {}
        self._fit_by_ctx: dict = {}  # bucket -> CostFit
        self.t_draft: float | None = None  # EMA seconds of one draft forward (one tree level)
        # costs are kept per context bucket (the batch's total context: <512, <1k, <2k, ... tokens):
        # at 2k tokens of context a row costs ~2.7x what it does at 32 (attention over the context),
        # so costs measured on short prompts must not price a long one's steps
        self.ctx_bucket = 0  # of the step being planned (set by ``plan``)
        self._plain_by_ctx: dict = {}  # bucket -> {batch size -> EMA seconds of a step without drafts}
        self._width_by_ctx: dict = {}  # bucket -> t_width
        self._widest_by_ctx: dict = {}  # bucket -> {batch size -> most target tokens a measured step verified}
        # batch size -> [EMA of a lookup-only step's realized tokens/s over a plain step's, steps]
        self._lookup_gain: dict = {}
        self._vcost: dict = {}  # _verify_cost's answers since the last measurement or plan
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

    def _line(self) -> list | None:
        """This context bucket's cost line, else the nearest measured bucket's (shorter first)."""
        own = self._line_by_ctx.get(self.ctx_bucket)
        if own is not None and own[0] is not None:
            return own
        near = [b for b, ln in self._line_by_ctx.items() if ln[0] is not None]
        if not near:
            return own
        return self._line_by_ctx[min(near, key=lambda b: (abs(b - self.ctx_bucket), b > self.ctx_bucket))]

    @property
    def t_target(self) -> float | None:
        """Seconds of a speculative step's fixed part in this context bucket (the fitted line's
        intercept; a bucket not measured yet borrows the nearest one's line); None: no speculative
        step measured anywhere."""
        line = self._line()
        return None if line is None else line[0]

    @t_target.setter
    def t_target(self, v: float | None) -> None:
        self._line_by_ctx.setdefault(self.ctx_bucket, [None, 0.0, False])[0] = v
        self._vcost.clear()

    @property
    def t_per_token(self) -> float:
        """Marginal seconds per verified token in this context bucket (each row attends over the
        context: at 16 x 1.5k tokens a row costs ~4x one at 150)."""
        line = self._line()
        return 0.0 if line is None else line[1]

    @t_per_token.setter
    def t_per_token(self, v: float) -> None:
        self._line_by_ctx.setdefault(self.ctx_bucket, [None, 0.0, False])[1] = v
        self._vcost.clear()

    @property
    def t_plain(self) -> dict:
        """batch size -> EMA seconds of a decode step without drafts, in this step's context bucket."""
        return self._plain_by_ctx.setdefault(self.ctx_bucket, {})

    @t_plain.setter
    def t_plain(self, v: dict) -> None:
        self._plain_by_ctx[self.ctx_bucket] = v
        self._vcost.clear()

    def plain_cost(self, batch: int) -> float | None:
        """T(0) at ``batch``: measured in this context bucket, else in the nearest shorter one (a
        context that just crossed a bucket keeps its last measurement until a plain step updates
        it; it can only underprice T(0), which turns speculation off and so measures it); None when
        this batch size never ran a plain step."""
        for b in range(self.ctx_bucket, -1, -1):
            t = self._plain_by_ctx.get(b, {}).get(batch)
            if t is not None:
                return t
        return None

    @property
    def t_width(self) -> dict:
        """(requests, target tokens) of a speculative step -> [EMA seconds, observations], in this
        step's context bucket: the same tokens cost more over more requests (attention contexts,
        per-request work) and over longer contexts."""
        return self._width_by_ctx.setdefault(self.ctx_bucket, {})

    @t_width.setter
    def t_width(self, v: dict) -> None:
        self._width_by_ctx[self.ctx_bucket] = v
        self._vcost.clear()

    # per request --------------------------------------------------------------------------------
    def mode_of(self, seq: Sequence) -> str:
        """The request's effective mode: ``auto`` means the configured one; a draft-model mode
        (chain, tree, static) is ``off`` without a draft model; ``ngram`` needs none."""
        m = seq.spec.mode
        if m == "auto":
            m = self.spec.mode
        if m == "hybrid" and not self.has_draft:
            return "ngram"  # no model proposer: prompt lookup alone
        if m in MODEL_MODES and not self.has_draft or m == "head" and not self.has_head:
            return "off"
        return m

    def desired_budget(self, seq: Sequence) -> int:
        """Draft tokens the request's mode asks for (before the adaptive depth and step caps)."""
        mode = self.mode_of(seq)
        if mode == "off":
            return 0
        if mode == "ngram":
            base = self.spec.ngram_tokens * self.spec.ngram_branches
        else:
            base = self.spec.num_draft_tokens if mode == "chain" else self.spec.tree_budget
            base += self.spec.ngram_tokens if mode == "hybrid" else 0  # room for the lookup's branch
        if seq.spec.max_draft_tokens is not None:
            base = min(base, seq.spec.max_draft_tokens)
        return max(base, 0)

    def start(self, seq: Sequence) -> None:
        """A new request starts from the engine-wide acceptance estimates (model and prompt lookup)."""
        if seq.stats.steps != 0:
            return
        if self.accept_ema is not None:
            seq.recent_accept = self.accept_ema
        if self.ngram_ema is not None:
            seq.ngram_accept = self.ngram_ema
        if self.chain_ema is not None:
            seq.chain_accept = self.chain_ema

    def nodes_for_depth(self, d: int) -> int:
        return d if self.spec.mode == "chain" else min(self.spec.tree_budget, d * self.spec.tree_topk)

    def step_spec_cap(self, batch: int) -> int:
        """Per-sequence cap on draft tokens so the step's verification tokens stay bounded."""
        if batch <= 0:
            return 0
        return max(0, (self.max_verify_tokens - batch) // batch)

    # measurements -------------------------------------------------------------------------------
    def observe(self, t_target: float, t_draft_level: float | None, tokens: int = 0, batch: int = 0) -> None:
        """Measured costs of a speculative decode step: its target part (forward + verify + commit)
        with ``tokens`` target tokens over ``batch`` requests, and one draft level (None: not
        measured this step)."""
        a = 0.2
        self._vcost.clear()
        if t_draft_level is not None:
            self.t_draft = t_draft_level if self.t_draft is None else (1 - a) * self.t_draft + a * t_draft_level
        if tokens > 0:
            self.note_width(batch, tokens)
            w = self.t_width.get((batch, tokens))
            if w is None:
                self.t_width[(batch, tokens)] = [t_target, 1]
            else:
                w[0] = (1 - a) * w[0] + a * t_target
                w[1] += 1
        fit = self._fit_by_ctx.setdefault(self.ctx_bucket, CostFit()).add(tokens, t_target)
        if fit is not None:
            self.t_target, self.t_per_token = fit
            return
        line = self._line_by_ctx.setdefault(self.ctx_bucket, [None, 0.0, False])
        t0 = self.plain_cost(batch) if tokens > batch else None
        if t0 is not None:  # no fit yet (8 steps of varied widths): the line through this step and
            # the plain step at its batch size gives the marginal cost (a flat 0 priced a fresh
            # engine's 16 x 6-node drafts at ~60% of their cost)
            m = max(0.0, (t_target - t0) / (tokens - batch))
            line[1] = (1 - a) * line[1] + a * m if line[2] else m
            line[2] = True
            t_target = max(1e-6, t_target - line[1] * tokens)  # the line's intercept
        line[0] = t_target if line[0] is None else (1 - a) * line[0] + a * t_target

    def note_width(self, batch: int, tokens: int) -> None:
        """A step verifying ``tokens`` target tokens over ``batch`` requests was measured (in this
        context bucket): the cost fit is trusted up to twice the widest such step (``_verify_cost``)."""
        widest = self._widest_by_ctx.setdefault(self.ctx_bucket, {})
        widest[batch] = max(widest.get(batch, 0), tokens)
        self._vcost.clear()

    def observe_plain(self, batch: int, seconds: float) -> None:
        """A decode step with no drafts at all, ``batch`` requests, took ``seconds``: the cost of
        depth 0 at this batch size, measured rather than extrapolated from speculative steps (plain
        decoding takes a cheaper attention path)."""
        old = self.t_plain.get(batch)
        self.t_plain[batch] = seconds if old is None else 0.8 * old + 0.2 * seconds
        self._vcost.clear()

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

    def note_lookup(self, seq: Sequence, accepted: int, drafted: int, available: int | None = None) -> None:
        """One prompt-lookup draft of ``drafted`` tokens had ``accepted`` of them accepted;
        ``available``: how long its match allowed it to be (``Proposal.available``; None: not known)."""
        seq.lookup_outcomes.append((accepted, drafted))
        seq.lookup_cache.clear()
        self.lookup_outcomes.append((accepted, drafted))
        self._lookup_cache.clear()
        if available is not None:
            obs = self.lookup_by_len.setdefault(available, collections.deque(maxlen=LOOKUP_BY_LEN_WINDOW))
            obs.append((accepted, drafted))
            self._by_len_cache.pop(available, None)

    def lookup_len(self, seq: Sequence, available: int, batch: int) -> int:
        """Draft tokens (0..``available``) for an adaptive request's lookup-only step, asked once its
        match is known: ``available`` is how long the match lets the draft be (its match length +
        ``NgramConfig.extend``, within the step's budget). The length that maximises expected
        tokens per second, from the outcomes of earlier lookups whose match allowed as many tokens
        (``_by_len_expected``): a long match predicts a long accepted run. (Priced before the match
        was known, from all lookups alike, ``auto`` cut copied spans into pieces and skipped
        matches that paid: 5% more steps than ``--spec ngram`` at batch 1.)"""
        t_plain = self.plain_cost(batch)
        if not self.spec.adaptive or available <= 0:
            return max(available, 0)
        if t_plain is None or self.t_target is None:
            return min(available, LOOKUP_PROBE)
        return self._best_lookup(seq, available, batch, t_plain, by_len=available)

    def _by_len_expected(self, seq: Sequence, available: int, d: int) -> float:
        """``lookup_expected`` from the outcomes of lookups whose match allowed ``available``
        tokens once there are ``LOOKUP_BY_LEN_MIN`` of them, else from all the request's lookups."""
        obs = self.lookup_by_len.get(available)
        if obs is None or len(obs) < LOOKUP_BY_LEN_MIN:
            return self.lookup_expected(seq, d)
        return _cached_cut(self._by_len_cache.setdefault(available, {}), obs, d)

    def lookup_expected(self, seq: Sequence, d: int) -> float:
        """Expected tokens of a step whose prompt-lookup draft is cut to ``d`` tokens: 1 + the mean
        over recent lookup outcomes (the request's own once it has a few, else the engine's) of what
        the cut draft would have had accepted, ``min(accepted, d)`` (acceptance is a prefix), a
        fully accepted shorter draft extended by the outcomes' per-token acceptance. Lookup hits
        are bimodal (a copied span matches on, or the first token fails), so the geometric
        ``E(a, d)`` of one acceptance rate overrates long drafts after a lucky match; with no
        outcomes yet it is still used, at the request's ``ngram_accept``."""
        own = seq.lookup_outcomes
        if len(own) >= LOOKUP_MIN_OWN:  # its own outcomes, else the engine's: every d at once, once
            return _cached_cut(seq.lookup_cache, own, d)  # until the next outcome
        if not self.lookup_outcomes:
            return _expected(seq.ngram_accept, d)
        return _cached_cut(self._lookup_cache, self.lookup_outcomes, d)

    def forget(self) -> None:
        """Drop the cached decision and priced widths: the next ``choose_depth`` recomputes from the
        current costs."""
        self._decision = None
        self._vcost.clear()

    # the decision -------------------------------------------------------------------------------
    def plan(self, candidates: list, batch: int) -> StepPlan:
        """Advance the step counter and decide this step's adaptive depth and probe among
        ``candidates`` (the requests that may run this step, in rank order)."""
        cap = self.step_spec_cap(batch) if self.spec.adaptive else 1 << 30
        self.step += 1
        self._vcost.clear()
        self.ctx_bucket = ctx_bucket(sum(s.num_computed for s in candidates[:batch]))
        if not (self.spec.adaptive and self.has_draft) or self.spec.mode not in MODEL_MODES:
            return StepPlan(None, None, cap, batch)
        autos = [s for s in candidates if s.spec.mode == "auto"]
        self.last_nodes = None
        if autos and self._hopeless_now(len(autos)):
            depth = 0
        else:
            narrow = [s.chain_accept for s in autos] if self._weighs_shapes() else None
            depth = self.choose_depth([s.recent_accept for s in autos], narrow=narrow)
        self.last_depth = depth
        probe = None
        if self.probing and autos:
            probe = min(autos, key=lambda s: s.last_probe)
            probe.last_probe = self.step
        return StepPlan(depth, probe, cap, batch, self.last_nodes if depth else None)

    def _weighs_shapes(self) -> bool:
        """Whether the configured mode drafts trees wider than their depth (then the narrow shape
        is weighed too)."""
        return self.spec.mode in ("tree", "head", "hybrid") and self.spec.tree_topk > 1

    def budget(self, seq: Sequence, plan: StepPlan) -> tuple[int, int]:
        """(draft tokens wanted, tree depth allowed; 0 = the configured depth) for ``seq`` this step."""
        if self.mode_of(seq) == "ngram":
            return self.ngram_budget(seq, plan.batch), 0
        auto = seq.spec.mode == "auto"
        if plan.depth == 0 and not self.probing and auto:  # the model does not pay this step: free lookup only
            full = self.spec.ngram_tokens * self.spec.ngram_branches
            if self.lookups_lose(plan.batch):  # what they delivered says no: a staggered probe only
                n = self._lookup_probe(seq, LOOKUP_PROBE, plan.batch)
            elif self.plain_cost(plan.batch) is not None and self.t_target is not None:
                # reserved in full: ``lookup_len`` cuts it once the match is known
                n = min(full, seq.spec.max_draft_tokens if seq.spec.max_draft_tokens is not None else full)
            else:
                n = self.ngram_budget(seq, plan.batch, full)
            return (n, LOOKUP_ONLY) if n > 0 else (0, 0)
        want = self.desired_budget(seq)
        if plan.depth is None or not auto or want <= 0:
            return want, 0
        depth = plan.depth
        mode = self.mode_of(seq)
        want = depth if mode == "chain" else min(self.spec.tree_budget, depth * self.spec.tree_topk)
        if plan.nodes is not None and mode != "chain":
            want = plan.nodes  # the narrow shape (a budget equal to the depth: the top-1 chain)
        want += self.spec.ngram_tokens if mode == "hybrid" else 0
        if self.probing:
            want = 1 if seq is plan.probe else 0  # a probe drafts a single token for one request
        elif not any(p in seq.stats.by_proposer for p in MODEL_PROPOSERS):
            # the decision priced this request at the engine-wide acceptance, which the previous
            # requests' last drafts set: its first model draft is a short chain until its own is
            # measured (a fresh 16-request group started at a stale 0.96 drafted 16-node trees for
            # all of them, ~150 ms steps, three times per group)
            depth = min(depth, FIRST_MODEL_DRAFT)
            want = min(want, FIRST_MODEL_DRAFT + (self.spec.ngram_tokens if mode == "hybrid" else 0))
        if seq.spec.max_draft_tokens is not None:
            want = min(want, seq.spec.max_draft_tokens)
        return want, depth

    def ngram_budget(self, seq: Sequence, batch: int, want: int | None = None) -> int:
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
        t_plain = self.plain_cost(batch)
        if not self.spec.adaptive or want <= 0:
            return want
        if t_plain is None:  # a batch size not seen yet: one plain step first measures it
            return 0
        if self.t_target is None:  # no speculative step measured yet: a short draft measures one
            return min(want, LOOKUP_PROBE)
        return self._best_lookup(seq, want, batch, t_plain)

    def _best_lookup(self, seq: Sequence, limit: int, batch: int, t_plain: float, by_len: int | None = None) -> int:
        """The lookup length (1..``limit``) that maximises expected tokens per second, by a clear
        margin over plain decoding, else a staggered probe at most (``_lookup_probe``); expected
        tokens from the request's lookups, or (``by_len``) from lookups whose match allowed that
        many tokens (``_by_len_expected``)."""
        best, best_d = 1.0 / t_plain, 0
        for d in range(1, limit + 1):
            e = self.lookup_expected(seq, d) if by_len is None else self._by_len_expected(seq, by_len, d)
            rate = e / self._verify_cost(d, batch, t_plain)
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

    def _lookup_probe(self, seq: Sequence, want: int, batch: int) -> int:
        """``LOOKUP_PROBE`` tokens (at most ``want``) on every ``lookup_probe_every(batch)``-th
        step of ``seq`` (staggered by request, so a batch never probes all at once), else 0."""
        every = self.lookup_probe_every(batch)
        return min(want, LOOKUP_PROBE) if (self.step + _offset(seq)) % every == 0 else 0

    def note_lookup_step(self, batch: int, tokens: int, seconds: float) -> None:
        """A decode step of ``batch`` (>= 2) requests whose drafts were all prompt lookups emitted
        ``tokens`` in ``seconds``: its realized rate against a plain step's at that batch size,
        pooled per power-of-two bucket of batch sizes (a group draining from 16 requests spends
        only a few steps at each size, too few to judge one size alone)."""
        t0 = self.plain_cost(batch)
        if batch < 2 or t0 is None or seconds <= 0:
            return
        g = tokens / seconds / (batch / t0)
        k = batch.bit_length()
        e = self._lookup_gain.get(k)
        self._lookup_gain[k] = [g, 1] if e is None else [0.9 * e[0] + 0.1 * g, e[1] + 1]

    def lookups_lose(self, batch: int) -> bool:
        """Whether adaptive requests' lookup-only steps at ``batch`` (its power-of-two bucket of
        batch sizes) have delivered fewer tokens per second than plain steps (an EMA over at least
        ``LOOKUP_GUARD_MIN`` of them). The per-request
        pricing (``ngram_budget``) assumes every request drafts as much, while at 16 requests on a
        CPU a few matches verify a few rows at ~1 ms each (the target's rows and the step's own
        work) against ~1.5 ms per plain token, so sparse lookups accepted ~60% of the time lose;
        what they delivered is the check."""
        e = self._lookup_gain.get(batch.bit_length()) if batch >= 2 else None
        return e is not None and e[1] >= LOOKUP_GUARD_MIN and e[0] < 1.0

    def _verify_cost(self, nodes: int, batch: int, t_plain: float) -> float:
        """Seconds of a target step verifying ``nodes`` draft tokens per request at ``batch``: what
        steps of exactly that many tokens measured (seen at least twice; never below a plain step),
        else the cost fit, never below the measured plain step plus the extra tokens."""
        key = (nodes, batch, t_plain, self.ctx_bucket)  # (cleared whenever a cost changes)
        c = self._vcost.get(key)
        if c is None:  # (asked per request and draft length every step: once per step and shape)
            c = self._vcost[key] = self._verify_cost_now(batch * (1 + nodes), batch, t_plain)
        return c

    def _verify_cost_now(self, n: int, batch: int, t_plain: float) -> float:
        assert self.t_target is not None
        w = self.t_width.get((batch, n))
        if w is not None and w[1] >= 2:
            return max(w[0], t_plain)
        tpt = self.t_per_token
        fit = max(self.t_target + tpt * n, t_plain + tpt * (n - batch))
        # trusted up to twice the widest step measured at this batch size (in this context bucket);
        # rows beyond it cost what a plain step's rows do on average until a step that wide is
        # measured: a fit from narrow steps priced a fresh engine's 16 x 16-node trees at a third
        # of their ~150 ms, and the width to explore grows by doubling as it is measured instead
        lim = 2 * max(self._widest_by_ctx.get(self.ctx_bucket, {}).get(batch, batch), batch)
        if n <= lim:
            return fit
        at_lim = max(self.t_target + tpt * lim, t_plain + tpt * (lim - batch))
        return max(fit, at_lim + (n - lim) * t_plain / batch)

    def _model_accept(self, seq: Sequence, nodes: int, depth: int) -> float:
        """The request's acceptance for a model draft of ``nodes`` nodes up to ``depth``: its chain
        acceptance for a narrow draft (nodes == depth), else its tree acceptance."""
        return seq.chain_accept if nodes <= depth and self._weighs_shapes() else seq.recent_accept

    def prefer_ngram(
        self, seq: Sequence, ngram_tokens: int, model_depth: int, batch: int, nodes: int | None = None
    ) -> bool:
        """For an adaptive request that could draft with either proposer this step: is the prompt
        lookup match (``ngram_tokens`` long) worth more tokens per second than the draft model at
        ``model_depth``? Expected tokens from each one's own acceptance of this request; costs:
        verification of the proposal's tokens (measured), plus the draft levels for the model."""
        if self.t_target is None or self.t_draft is None or model_depth <= 0:
            return True  # nothing measured yet (or the model would not draft): the free proposal
        t_plain = self.plain_cost(batch) or self.t_target
        ngram_rate = self.lookup_expected(seq, ngram_tokens) / self._verify_cost(ngram_tokens, batch, t_plain)
        nodes = self.nodes_for_depth(model_depth) if nodes is None else nodes
        model_cost = self._verify_cost(nodes, batch, t_plain) + model_depth * self.t_draft
        return ngram_rate >= _expected(self._model_accept(seq, nodes, model_depth), model_depth) / model_cost

    def hybrid_pays(
        self, seq: Sequence, lookup_tokens: int, model_depth: int, batch: int, nodes: int | None = None
    ) -> bool:
        """For an adaptive request drafting with the model this step: is laying a prompt-lookup
        branch (``lookup_tokens`` long) over the model's tree worth its verification? Expected
        extra tokens assume the two are independent: the lookup branch adds what it would accept
        alone whenever the model's first token is rejected."""
        if self.t_target is None or self.t_draft is None or model_depth <= 0:
            return False
        nodes = self.nodes_for_depth(model_depth) if nodes is None else nodes
        t_plain = self.plain_cost(batch) or self.t_target
        t_levels = model_depth * self.t_draft

        def cost(n: int) -> float:
            return self._verify_cost(n, batch, t_plain) + t_levels

        a_m = min(max(self._model_accept(seq, nodes, model_depth), 0.0), 0.999)
        e_model = _expected(a_m, model_depth)
        e_hybrid = e_model + (self.lookup_expected(seq, lookup_tokens) - 1) * (1 - a_m)
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
        if self.plain_cost(len(alphas)) is None:
            return 0  # first time at this batch size: one plain step measures the cost of depth 0
        if self.t_target is None or self.t_draft is None:
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
        key = (self.spec.mode, dmax, self.ctx_bucket)
        ests = (list(alphas), None if narrow is None else list(narrow))
        if c is not None and c[0] == ests and self.step - c[1] < DECISION_REUSE_STEPS and c[2] == key:
            self.last_nodes = c[5]
            return c[3], c[4]
        best_d, self.last_nodes = self._best_depth(alphas, dmax, narrow)
        perfect = [0.999] * len(alphas)
        hopeless = best_d == 0 and self._best_depth(perfect, dmax, None if narrow is None else perfect)[0] == 0
        if self.plain_cost(len(alphas)) is not None:  # (an unmeasured batch size is re-asked next step)
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
            or self.t_target is None
        ):
            return False
        self.probing = False
        return True

    def _best_depth(self, alphas: list, dmax: int, narrow: list | None = None) -> tuple[int, int | None]:
        """(depth, nodes: the narrow shape's count, or None for the mode's width) of the best
        expected tokens per second; the narrow shape is weighed when ``narrow`` acceptances are given."""
        B = len(alphas)
        t_plain = self.plain_cost(B)
        if t_plain is None:
            return 0, None  # first time at this batch size: one plain step measures the cost of depth 0
        td = self.t_draft
        assert self.t_target is not None and td is not None
        shapes = [(expected_tokens(_groups(alphas), B, dmax), self.nodes_for_depth, False)]
        if narrow is not None:
            shapes.append((expected_tokens(_groups(narrow), B, dmax), lambda d: d, True))
        best, best_d, best_nodes = B / t_plain, 0, None
        for d in range(1, dmax + 1):
            for tot, nodes_of, is_narrow in shapes:
                nodes = nodes_of(d)
                rate = tot[d] / (self._verify_cost(nodes, B, t_plain) + d * td)
                if rate > best * MARGIN:  # a clear win only
                    best, best_d, best_nodes = rate, d, nodes if is_narrow else None
        return best_d, best_nodes


def ctx_bucket(tokens: int) -> int:
    """The cost model's context bucket of a batch holding ``tokens`` tokens of context in all:
    0 below 512, then one per doubling (512-1023: 1, 1024-2047: 2, ...)."""
    return max(0, int(tokens).bit_length() - 9)


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


def _offset(seq: Sequence) -> int:
    """A request's fixed probe phase (the same for every run of the same request id)."""
    return zlib.crc32(seq.request_id.encode())
