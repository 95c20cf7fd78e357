"""What speculating costs on this device, as the speculation policy prices it (``SpecPolicy.costs``).

Costs are measured by the engine in its thread's CPU time on a CPU (waits for the GIL or other load do
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
  by doubling).

Before serving, the warm-up measures a target step of 1, 2, 4, ... 32 rows on this machine
(``specd.engine.warmup.seed_costs``) and ``seed`` takes them as if steps that wide had been measured
twice at batch 1 (the line and the widths trusted): where rows are cheap (a 1-8B model on a CPU is
memory-bound: 8 rows ~1.4x one) ``auto`` drafts deep from the first request instead of exploring widths
by doubling. Steps the engine measures then move the same EMAs and fit as ever.

Costs are kept per context bucket (``ctx_bucket``: the batch's total context, <512, <1k, <2k, ...
tokens): at 2k tokens of context a row costs ~2.7x what it does at 32 (attention over the context),
so costs measured on short prompts must not price a long one's steps. Lookup-only steps at a batch
size also keep their realized rate against plain steps (``lookups_lose``).
"""

from __future__ import annotations

import collections

FIT_WINDOW = 64  # speculative steps in the least-squares cost fit
LOOKUP_GUARD_MIN = 8  # lookup-only steps measured at a batch size before their realized rate is trusted


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
        return None if len(obs) < 8 else _solve(len(obs), *self.sums)


def _solve(n: int, sx: float, sy: float, sxx: float, sxy: float) -> tuple[float, float] | None:
    """Least squares (fixed >= 1e-6, per_token >= 0) from the sums of n points; None when x never varies."""
    nvx = n * sxx - sx * sx  # n * variance of x: exact for integer token counts
    if nvx <= 0:
        return None
    b = max(0.0, (n * sxy - sx * sy) / nvx)
    return max(sy / n - b * sx / n, 1e-6), b


def ctx_bucket(tokens: int) -> int:
    """The cost model's context bucket of a batch holding ``tokens`` tokens of context in all:
    0 below 512, then one per doubling (512-1023: 1, 1024-2047: 2, ...)."""
    return max(0, int(tokens).bit_length() - 9)


class CostModel:
    """The measured costs (see the module doc). ``ctx_bucket`` is the bucket of the step being
    planned (``SpecPolicy.plan`` sets it through ``at_context``); every read and observation is in
    that bucket."""

    def __init__(self) -> None:
        # per context bucket (``t_target`` / ``t_per_token``, see below): [fixed seconds of a target
        # step (forward + verify + commit) or None, marginal seconds per target token, anchored]
        # (anchored: the marginal cost came from steps anchored at plain ones, no fit yet)
        self._line_by_ctx: dict = {}
        self._fit_by_ctx: dict = {}  # bucket -> CostFit
        self.t_draft: float | None = None  # EMA seconds of one draft forward (one tree level)
        self.ctx_bucket = 0  # of the step being planned
        self._plain_by_ctx: dict = {}  # bucket -> {batch size -> EMA seconds of a step without drafts}
        self._width_by_ctx: dict = {}  # bucket -> t_width
        self._widest_by_ctx: dict = {}  # bucket -> {batch size -> most target tokens a measured step verified}
        # batch size -> [EMA of a lookup-only step's realized tokens/s over a plain step's, steps]
        self._lookup_gain: dict = {}
        self._vcost: dict = {}  # verify_cost's answers since the last measurement or plan

    def at_context(self, tokens: int) -> None:
        """The step being planned runs over ``tokens`` of context in all (its bucket's costs apply)."""
        self.ctx_bucket = ctx_bucket(tokens)
        self._vcost.clear()

    def forget(self) -> None:
        """Drop the priced widths (``verify_cost`` recomputes them from the current costs)."""
        self._vcost.clear()

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

    def seed(self, batch: int, costs: dict) -> None:
        """Costs measured before serving (``costs``: target tokens -> seconds of a step verifying
        that many over ``batch`` requests, the plain step's tokens == ``batch`` included), in context
        bucket 0 (short contexts; longer ones borrow its line until measured): each width counts as
        seen twice, the line is their least-squares fit, and a plain step's cost is kept where one
        was measured already. ValueError for fewer than two widths above ``batch``."""
        wide = sorted((n, s) for n, s in costs.items() if n > batch)
        if len(wide) < 2 or any(s <= 0 for _, s in costs.items()):
            raise ValueError(f"seed needs positive costs of 2+ widths above batch {batch}, got {costs}")
        bucket, self.ctx_bucket = self.ctx_bucket, 0
        if batch in costs and batch not in self.t_plain:
            self.t_plain[batch] = costs[batch]
        for n, s in wide:
            self.t_width[(batch, n)] = [s, 2]
            self.note_width(batch, n)
        line = _solve(len(wide), *(sum(v) for v in zip(*((n, s, n * n, n * s) for n, s in wide))))
        assert line is not None  # (2+ distinct widths)
        self._line_by_ctx[0] = [line[0], line[1], True]
        self.ctx_bucket = bucket
        self._vcost.clear()

    def note_width(self, batch: int, tokens: int) -> None:
        """A step verifying ``tokens`` target tokens over ``batch`` requests was measured (in this
        context bucket): the cost fit is trusted up to twice the widest such step (``verify_cost``)."""
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

    def verify_cost(self, nodes: int, batch: int, t_plain: float) -> float:
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
