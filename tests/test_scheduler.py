"""Scheduler policy with a fake clock and no model (deterministic)."""

import pytest
import torch

from specd.config import SchedulerConfig, SpecConfig
from specd.engine.kv_cache import KVCache
from specd.engine.ledger import KVLedger
from specd.engine.scheduler import Scheduler
from specd.engine.sequence import Sequence, SpecParams, Status
from specd.sampling.params import SamplingParams
from specd.speculation.policy import LOOKUP_ONLY, SpecPolicy


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def _sched(num_blocks=64, block_size=4, spec=None, **cfg):
    clock = Clock()
    cache = KVCache(1, 1, 1, num_blocks, block_size, torch.float32, torch.device("cpu"))
    dcache = KVCache(1, 1, 1, num_blocks, block_size, torch.float32, torch.device("cpu"))
    scfg = SchedulerConfig(**cfg)
    ledger = KVLedger(cache, dcache)  # (no prefix cache: the scheduler alone)
    s = Scheduler(scfg, SpecPolicy(spec or SpecConfig(adaptive=False), has_draft=True), ledger, clock=clock)
    return s, clock


def _seq(clock, rid, n=10, prio="interactive", mode="off", max_tokens=50):
    return Sequence(
        rid, list(range(3, 3 + n)), SamplingParams(max_tokens=max_tokens), SpecParams(mode=mode), prio, arrival=clock()
    )


def _run(s, out):
    """Pretend the engine ran the step: advance computed tokens, emit one token per final chunk."""
    for sc in out.scheduled:
        seq = sc.seq
        if sc.final:
            seq.num_computed = len(seq.tokens)
            seq.tokens.append(7)
            seq.blocks.truncate(seq.num_computed)
        else:
            seq.num_computed += sc.num_tokens


def test_interactive_before_batch_then_arrival_order():
    s, clock = _sched(max_num_seqs=2)
    seqs = []
    for rid, prio in (("b1", "batch"), ("i1", "interactive"), ("b2", "batch"), ("i2", "interactive")):
        seqs.append(_seq(clock, rid, prio=prio))
        s.add(seqs[-1])
        clock.t += 0.01
    out = s.schedule()
    assert [sc.seq.request_id for sc in out.scheduled] == ["i1", "i2"]
    _run(s, out)
    # running interactive requests keep their place; batch waits
    assert [sc.seq.request_id for sc in s.schedule().scheduled] == ["i1", "i2"]


def test_starvation_guard_promotes_old_batch_work():
    s, clock = _sched(max_num_seqs=1, batch_starvation_s=2.0)
    b = _seq(clock, "b", prio="batch")
    s.add(b)
    clock.t = 1.0
    i = _seq(clock, "i")
    s.add(i)
    assert s.schedule().scheduled[0].seq is i  # batch has waited 1 s < 2 s
    s.finish(i)
    s.add(i2 := _seq(clock, "i2"))
    clock.t = 2.5  # batch has now waited 2.5 s: served ahead of newer interactive work
    assert s.schedule().scheduled[0].seq is b
    assert i2.status is Status.WAITING


def test_chunked_prefill_bounds_and_decodes_never_wait():
    s, clock = _sched(max_num_batched_tokens=64, prefill_chunk=32, num_blocks=256)
    running = [_seq(clock, f"r{k}", n=5) for k in range(3)]
    for r in running:
        s.add(r)
    _run(s, s.schedule())  # the three short prompts prefill in one step
    long = _seq(clock, "long", n=300)
    s.add(long)
    for _ in range(12):
        out = s.schedule()
        ids = {sc.seq.request_id: sc for sc in out.scheduled}
        assert all(f"r{k}" in ids and ids[f"r{k}"].final for k in range(3)), "a running decode waited"
        assert out.num_tokens <= 64
        if "long" in ids and not ids["long"].final:
            assert ids["long"].num_tokens <= 32
        _run(s, out)
    assert long.num_computed >= 300  # the long prompt finished prefilling in chunks


def test_preemption_picks_lowest_priority_latest_arrival():
    s, clock = _sched(num_blocks=12, block_size=4, max_num_seqs=8, batch_seqs_with_interactive=0)
    a = _seq(clock, "i-old", n=14)
    clock.t += 1
    b = _seq(clock, "b-old", n=14, prio="batch")
    clock.t += 1
    c = _seq(clock, "b-new", n=14, prio="batch")
    for q in (a, b, c):
        s.add(q)
    _run(s, s.schedule())  # 3 x 4 blocks = the whole pool
    assert s.ledger.cache.pool.num_free == 0
    clock.t += 1
    d = _seq(clock, "i-new", n=14)
    s.add(d)
    out = s.schedule()
    assert c in out.preempted and c.status is Status.WAITING and not c.blocks.blocks
    assert b not in out.preempted and a not in out.preempted
    assert d in [sc.seq for sc in out.scheduled]
    assert s.num_preemptions >= 1
    s.ledger.cache.pool.check()


def test_budget_counts_verification_tokens():
    s, clock = _sched(max_num_batched_tokens=40, spec=SpecConfig(mode="tree", tree_budget=16, adaptive=False))
    seqs = [_seq(clock, f"s{k}", n=3, mode="tree") for k in range(4)]
    for q in seqs:
        s.add(q)
    _run(s, s.schedule())
    out = s.schedule()
    assert out.num_tokens <= 40
    assert sum(1 + sc.spec_budget for sc in out.scheduled if sc.final) <= 40
    assert any(sc.spec_budget == 16 for sc in out.scheduled)


def _plain_costs(s, sizes=(1, 2, 64, 256)):
    """Plain (no-draft) step costs consistent with the fitted model at these batch sizes, and the
    fit measured out to steps wider than any draft there (so it prices every width)."""
    s.policy.costs.t_plain = {b: s.policy.costs.t_target + s.policy.costs.t_per_token * b for b in sizes}
    for b in sizes:
        s.policy.costs.note_width(b, 1000 * b)


def test_adaptive_start_is_a_plain_step_then_a_short_narrow_draft():
    """Before any measurement: a plain step at each new batch size (it measures depth 0), then a
    depth-2 draft, narrow where shapes are weighed (2 nodes, not a 4-level tree of 16: at 16
    requests that first measurement verified 68 rows), then what the measured costs say."""
    s, _ = _sched(spec=SpecConfig(mode="head", tree_depth=6, tree_budget=16, adaptive=True))
    pol = s.policy
    assert pol.choose_depth([0.8] * 4, narrow=[0.8] * 4) == 0
    pol.costs.observe_plain(4, 0.010)
    assert pol.choose_depth([0.8] * 4, narrow=[0.8] * 4) == 2 and pol.last_nodes == 2
    assert pol.choose_depth([0.8] * 4) == 2 and pol.last_nodes is None  # (no narrow estimates given)
    assert pol.choose_depth([0.8] * 5, narrow=[0.8] * 5) == 0  # another batch size: measured first


def test_adaptive_depth_follows_acceptance_and_step_costs():
    s, _ = _sched(spec=SpecConfig(mode="tree", tree_depth=6, adaptive=True))
    s.policy.costs.observe(t_target=0.010, t_draft_level=0.001)  # a cheap draft
    s.policy.step = 1
    assert s.policy.choose_depth([0.8]) == 0  # batch size never measured without drafts: measure depth 0 first
    _plain_costs(s)
    hi = s.policy.choose_depth([0.8])
    lo = s.policy.choose_depth([0.2])
    assert hi > lo >= 0 and hi >= 4
    s.policy.costs.t_target, s.policy.costs.t_draft = 0.010, 0.009  # draft nearly as expensive as the target
    _plain_costs(s)
    s.policy.step = 1
    assert s.policy.choose_depth([0.3]) == 0  # speculation would cost throughput: off
    s.policy.step = s.policy.probe_every
    assert s.policy.choose_depth([0.3]) == 1  # ...but it keeps probing
    s.policy.step = 1
    s.policy.costs.t_target, s.policy.costs.t_draft, s.policy.costs.t_per_token = (
        0.002,
        0.0005,
        0.00002,
    )  # verification tokens cost compute
    _plain_costs(s)
    small, big = s.policy.choose_depth([0.7]), s.policy.choose_depth([0.7] * 64)
    assert big < small and small >= 2  # big batches: smaller trees
    assert s.policy.choose_depth([0.7] * 256) == 0  # at high batch speculation turns off...
    assert s.policy.choose_depth([0.7] * 2) >= 2  # ...and grows back when the batch drains
    # the fit: step times that grow with tokens give a positive marginal cost
    s2, _ = _sched(spec=SpecConfig(adaptive=True))
    for k in range(16):
        s2.policy.costs.observe(0.001 + 0.0001 * (10 + k), 0.0005, tokens=10 + k)
    assert abs(s2.policy.costs.t_per_token - 0.0001) < 1e-9 and abs(s2.policy.costs.t_target - 0.001) < 1e-9
    assert (
        s2.policy.costs.t_draft is not None and abs(s2.policy.costs.t_draft - 0.0005) < 1e-12
    )  # draft cost recorded on the fit path too


def test_running_batch_requests_are_not_promoted_by_age():
    """Regression: the starvation guard once promoted RUNNING batch requests by age, so a new
    interactive request queued behind every batch request older than batch_starvation_s."""
    s, clock = _sched(max_num_seqs=1, batch_starvation_s=2.0)
    b = _seq(clock, "b", prio="batch")
    s.add(b)
    _run(s, s.schedule())  # b runs
    clock.t = 5.0  # running for 5 s
    i = _seq(clock, "i")
    s.add(i)
    out = s.schedule()
    assert out.scheduled[0].seq is i  # the interactive request takes the only slot
    assert b in out.preempted or b.status is Status.RUNNING


def test_batch_work_rotates_in_small_groups_while_interactive_runs():
    s, clock = _sched(num_blocks=256, batch_seqs_with_interactive=2)
    batch = [_seq(clock, f"b{k}", prio="batch") for k in range(6)]
    for q in batch:
        s.add(q)
    out = s.schedule()
    assert len(out.scheduled) == 6  # no interactive work: batch uses the whole step
    _run(s, out)
    s.add(_seq(clock, "i"))
    served = set()
    for _ in range(3):
        out = s.schedule()
        ids = [sc.seq.request_id for sc in out.scheduled]
        assert ids[0] == "i" and len(ids) == 3  # interactive + 2 batch
        served |= set(ids[1:])
        _run(s, out)
    assert served == {q.request_id for q in batch}  # round robin: every batch request progressed


def test_probes_draft_one_token_and_back_off():
    s, _ = _sched(spec=SpecConfig(mode="tree", adaptive=True))
    s.policy.costs.t_target, s.policy.costs.t_draft = 0.010, 0.009  # speculation does not pay
    _plain_costs(s)
    picks = []
    for step in range(1, 200):
        s.policy.step = step
        picks.append(s.policy.choose_depth([0.3]))
    probes = [k + 1 for k, d in enumerate(picks) if d]
    assert probes and all(picks[p - 1] == 1 for p in probes)
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps == sorted(gaps) and gaps[-1] > gaps[0]  # ever rarer


def test_probe_steps_draft_for_one_request_in_rotation():
    """While speculation does not pay, a probe drafts one token for ONE request (least recently
    probed), so its cost does not grow with the batch and every request's estimate stays fresh."""
    s, clock = _sched(num_blocks=256, spec=SpecConfig(mode="tree", adaptive=True))
    seqs = [_seq(clock, f"s{k}", n=3, mode="auto", max_tokens=1000) for k in range(4)]
    for q in seqs:
        s.add(q)
    _run(s, s.schedule())  # prefill
    s.policy.costs.t_target, s.policy.costs.t_draft, s.policy.costs.t_per_token = (
        0.010,
        0.009,
        0.0,
    )  # the draft costs almost a target step
    _plain_costs(s, (4,))
    for q in seqs:
        q.spec_state.recent_accept = 0.3
    probed, plain_steps = [], 0
    for _ in range(250):  # probes back off: 16, 32, 64, 128 steps apart (250 steps: within the KV capacity)
        out = s.schedule()
        model = [sc for sc in out.scheduled if sc.spec_budget and sc.spec_depth != LOOKUP_ONLY]  # (lookup is free)
        drafting = [sc.seq.request_id for sc in model]
        assert len(drafting) <= 1
        if drafting:
            assert s.policy.probing and [sc.spec_budget for sc in model] == [1]
            probed.append(drafting[0])
        else:
            plain_steps += 1
        _run(s, out)
    assert probed == ["s0", "s1", "s2", "s3"]  # each request probed once, in rotation
    assert plain_steps == 246


def test_new_requests_start_from_the_engine_wide_acceptance():
    s, clock = _sched(spec=SpecConfig(mode="tree", adaptive=True))
    for _ in range(50):
        s.policy.note_accept(0.2)
    q = _seq(clock, "late", mode="auto")
    s.add(q)
    assert abs(q.spec_state.recent_accept - 0.2) < 0.01


def test_plain_decoding_is_measured_not_extrapolated():
    """Depth 0 is priced by measured draft-free steps at that batch size: when plain decoding is
    cheaper than the speculative-step fit suggests, speculation stays off."""
    s, _ = _sched(spec=SpecConfig(mode="tree", adaptive=True))
    s.policy.costs.t_target, s.policy.costs.t_draft, s.policy.costs.t_per_token = (
        0.010,
        0.001,
        0.0,
    )  # speculative steps: 10 ms + 1 ms / level
    s.policy.costs.note_width(4, 4000)  # (measured out to wide steps)
    s.policy.costs.observe_plain(4, 0.010)
    assert s.policy.choose_depth([0.7] * 4) >= 2  # plain steps cost as much as speculative ones: speculate
    s.policy.forget()
    for _ in range(30):
        s.policy.costs.observe_plain(4, 0.003)  # plain decoding turns out to be far cheaper (a lighter code path)
    s.policy.step = 1
    assert s.policy.choose_depth([0.7] * 4) == 0


def test_probe_state_does_not_outlive_the_adaptive_requests():
    """Regression: a probe decided on one step must not be applied on a later step whose batch
    has no adaptive request (the scheduler crashed choosing a probe among none)."""
    s, clock = _sched(num_blocks=256, spec=SpecConfig(mode="tree", adaptive=True))
    s.policy.costs.t_target, s.policy.costs.t_draft, s.policy.costs.t_per_token = 0.010, 0.009, 0.0
    _plain_costs(s, (1,))
    a = _seq(clock, "a", n=3, mode="auto")
    s.add(a)
    _run(s, s.schedule())
    s.policy.step = s.policy.probe_every - 1
    out = s.schedule()  # a probe step
    assert s.policy.probing and [sc.spec_budget for sc in out.scheduled] == [1]
    s.remove(a)
    s.add(_seq(clock, "fixed", n=3, mode="off"))
    out = s.schedule()  # no adaptive request left
    assert not s.policy.probing and out.scheduled


def test_no_acceptance_probes_when_even_perfect_acceptance_would_not_pay():
    """When drafting could not pay at this batch size even if every draft token were accepted (a
    draft level costs more than a plain step), probing acceptance cannot change the answer: probes
    drop to one per ``probe_hopeless`` steps (which still refreshes the costs). When perfect
    acceptance would pay, probes keep their 16 -> 256 back-off."""
    s, _ = _sched(spec=SpecConfig(mode="tree", adaptive=True))
    c = s.policy.costs
    c.t_target, c.t_draft, c.t_per_token = 0.010, 0.030, 0.0  # a draft level costs 3 plain steps
    _plain_costs(s)
    picks = []
    for step in range(1, 3000):
        s.policy.step = step
        picks.append(s.policy.choose_depth([0.6]))
    assert sum(picks) == 0  # no probe within 3000 steps
    s.policy.step = s.policy.probe_hopeless
    s.policy.forget()
    assert s.policy.choose_depth([0.6]) == 1 and s.policy.probing  # the rare cost-refreshing probe

    s2, _ = _sched(spec=SpecConfig(mode="tree", adaptive=True))
    s2.policy.costs.t_target, s2.policy.costs.t_draft, s2.policy.costs.t_per_token = (
        0.010,
        0.004,
        0.0,
    )  # cheap draft: 0.6 does not pay, 1.0 would
    _plain_costs(s2)
    probes = 0
    for step in range(1, 300):
        s2.policy.step = step
        probes += s2.policy.choose_depth([0.05])
    assert probes >= 3  # 16, 48, 112, 240: acceptance could still change the answer


def test_verification_never_priced_below_a_plain_step():
    """A speculative step's target cost is at least the measured plain step plus its extra tokens:
    a fit with a fixed part near 0 (from a few probe steps) must not make drafting look cheap."""
    s, _ = _sched(spec=SpecConfig(mode="chain", num_draft_tokens=4, adaptive=True))
    c = s.policy.costs
    c.t_target, c.t_per_token, c.t_draft = 1e-6, 0.0001, 0.001  # fitted: almost free verification
    s.policy.costs.t_plain = {1: 0.001}  # a plain step measured 1 ms
    by_fit = 1.9 / (
        s.policy.costs.t_target + s.policy.costs.t_per_token * 2 + s.policy.costs.t_draft
    )  # depth 1 at acceptance 0.9, fit alone
    assert by_fit > 1.02 / s.policy.costs.t_plain[1]  # ... would speculate
    s.policy.step = 1
    assert s.policy.choose_depth([0.9]) == 0  # >= 1.1 ms per verification + 1 ms per draft level: not worth it
    s.policy.costs.t_draft = 0.0001  # a much cheaper draft level does pay
    s.policy.forget()
    s.policy.step = 2
    assert s.policy.choose_depth([0.9]) > 0


def test_a_measured_narrow_verification_beats_the_linear_fit():
    """On a CPU one extra row rides on the weights one row already reads (2 rows ~1.14x one row),
    which a line fitted over wider steps cannot see: once steps of exactly that width are measured,
    the policy prices them as measured, and a short chain that pays is taken."""
    s, _ = _sched(spec=SpecConfig(mode="chain", num_draft_tokens=4, adaptive=True))
    c = s.policy.costs
    c.t_target, c.t_per_token, c.t_draft = 0.002, 0.0025, 0.0005  # fitted over wide steps
    s.policy.costs.t_plain = {1: 0.010}
    s.policy.step = 1
    assert s.policy.choose_depth([0.3]) == 0  # by the fit: 1.3 tokens per >= 13 ms
    for _ in range(2):
        s.policy.costs.t_width.setdefault((1, 2), [0.0114, 0])[1] += 1  # two steps of 2 tokens measured 11.4 ms
    s.policy.forget()
    s.policy.step = 2
    assert s.policy.choose_depth([0.3]) == 1  # 1.3 tokens per 11.9 ms beats 1 per 10 ms
    assert s.policy.choose_depth([0.05]) == 0  # ... at this acceptance, not at a poor one
    s.policy.costs.observe(0.011, 0.0005, tokens=3, batch=1)
    assert s.policy.costs.t_width[(1, 3)] == [0.011, 1]  # observe() records each width's step cost, per batch size


def test_the_narrow_shape_wins_where_verification_rows_cost_compute():
    """A tree mode weighs a D-node draft (the top-1 chain, at the requests' chain acceptance)
    against its D * topk-node tree (at their tree acceptance): costly rows pick the narrow one,
    free rows the wide tree; the plan's budget follows the shape."""
    s, clock = _sched(spec=SpecConfig(mode="tree", tree_topk=4, tree_budget=16, tree_depth=6, adaptive=True))
    pol = s.policy
    pol.costs.t_target, pol.costs.t_per_token, pol.costs.t_draft = 0.008, 0.002, 0.0005  # CPU: each row 25% of a step
    pol.costs.t_plain = {1: 0.010}
    pol.costs.note_width(1, 1000)  # (measured out to wide steps)
    pol.step = 1
    d = pol.choose_depth([0.6], narrow=[0.45])
    assert d >= 1 and pol.last_nodes == d  # the narrow draft
    assert pol.choose_depth([0.6]) >= 0 and pol.last_nodes is None  # (without chain estimates: the mode's width)
    pol.forget()
    pol.costs.t_target, pol.costs.t_per_token = 0.010, 0.0  # GPU-like: rows nearly free
    pol.costs.t_plain = {1: 0.010}
    d = pol.choose_depth([0.6], narrow=[0.45])
    assert d >= 2 and pol.last_nodes is None  # the wide tree
    seq = _seq(clock, "a", n=3, mode="auto")
    seq.spec_state.recent_accept, seq.spec_state.chain_accept = 0.6, 0.45
    seq.stats.by_proposer["draft"] = [1, 2, 1]  # (its own acceptance measured: not a first draft)
    pol.forget()
    pol.costs.t_target, pol.costs.t_per_token = 0.008, 0.002
    plan = pol.plan([seq], 1)
    assert plan.depth and plan.nodes == plan.depth and pol.budget(seq, plan) == (plan.depth, plan.depth)


def test_a_hopeless_decision_is_reused_briefly_then_revisited():
    """Loaded steady state: once drafting is found hopeless at a batch size, steps skip the
    acceptance bookkeeping (no drafting at all); when the costs change (a cheaper draft), the
    decision is revisited within 64 steps and speculation comes back."""
    s, clock = _sched(num_blocks=256, spec=SpecConfig(mode="tree", adaptive=True))
    seqs = [_seq(clock, f"s{k}", n=3, mode="auto", max_tokens=1000) for k in range(4)]
    for q in seqs:
        s.add(q)
    _run(s, s.schedule())  # prefill
    c = s.policy.costs
    c.t_target, c.t_draft, c.t_per_token = 0.010, 0.030, 0.0  # a draft level costs 3 plain steps
    _plain_costs(s, (4,))
    for q in seqs:
        q.spec_state.recent_accept = 0.9
    for _ in range(300):
        out = s.schedule()
        assert not any(sc.spec_budget for sc in out.scheduled if sc.spec_depth != LOOKUP_ONLY)  # (lookup is free)
        _run(s, out)
    assert s.policy.hopeless_batch is not None
    s.policy.costs.t_draft = 0.0005  # the draft became cheap (e.g. the machine got quieter)
    drafted_at = None
    for k in range(70):
        out = s.schedule()
        if any(sc.spec_budget for sc in out.scheduled) and not s.policy.probing:
            drafted_at = k
            break
        _run(s, out)
    assert drafted_at is not None and drafted_at <= 64


def test_lookup_waits_for_a_measured_plain_step_at_each_batch_size():
    """Adaptive prompt lookup drafts nothing at a batch size whose plain step is not measured yet
    (that step measures it), then at most ``LOOKUP_PROBE`` tokens until a speculative step is
    measured, and only then what the costs say: the full budget before any measurement made a new
    16-request batch verify 9 rows per request until one plain step happened by chance (0.6x plain)."""
    from specd.speculation.policy import LOOKUP_PROBE

    s, clock = _sched(spec=SpecConfig(mode="ngram", ngram_tokens=8, adaptive=True))
    pol = s.policy
    seq = _seq(clock, "a", n=3, mode="ngram")
    for _ in range(8):
        pol.note_lookup(seq, 8, 8)  # every lookup fully accepted: long drafts pay once costs are known
    assert pol.ngram_budget(seq, 16) == 0  # no plain step at 16 requests yet
    pol.costs.observe_plain(16, 0.030)
    assert pol.ngram_budget(seq, 16) == LOOKUP_PROBE  # no speculative step measured yet
    assert pol.ngram_budget(seq, 12) == 0  # another batch size: its own plain step first
    pol.costs.observe(0.032, None, tokens=16 * 9, batch=16)  # a step as wide as every request's full draft
    assert pol.ngram_budget(seq, 16) == 8
    fixed, _ = _sched(spec=SpecConfig(mode="ngram", ngram_tokens=8, adaptive=False))
    assert fixed.policy.ngram_budget(seq, 16) == 8  # a fixed lookup length is kept as configured


def test_costs_are_kept_per_context_bucket():
    """A step's costs are recorded under its context bucket (the batch's total context, one bucket
    per doubling from 512 tokens): costs measured on short prompts do not price a 2k-token one's
    verification rows (each row attends over the whole context); a new bucket falls back to the
    nearest shorter one's plain step until its own is measured."""
    from specd.speculation.costs import ctx_bucket

    assert [ctx_bucket(n) for n in (0, 511, 512, 1023, 1024, 2048, 5000)] == [0, 0, 1, 1, 2, 3, 4]
    s, clock = _sched(spec=SpecConfig(mode="ngram", ngram_tokens=8, adaptive=True))
    pol = s.policy
    seq = _seq(clock, "a", n=3, mode="ngram")
    for k in range(8):
        pol.note_lookup(seq, k % 2, 2)  # every other lookup's first token accepted: 1.5 tokens per step
    seq.num_computed = 100
    pol.plan([seq], 1)
    pol.costs.observe_plain(1, 0.005)
    pol.costs.observe(0.0055, None, tokens=2, batch=1)
    pol.costs.observe(0.0055, None, tokens=2, batch=1)  # short context: a 2-row step costs 1.1x a plain one
    assert pol.ngram_budget(seq, 1, want=1) == 1
    seq.num_computed = 2100
    pol.plan([seq], 1)
    assert pol.costs.ctx_bucket == 3 and pol.costs.plain_cost(1) == 0.005  # (the shorter bucket's, until measured)
    assert (1, 2) not in pol.costs.t_width  # the short context's verification costs are not this one's
    pol.costs.observe_plain(1, 0.014)
    pol.costs.observe(0.022, None, tokens=2, batch=1)
    pol.costs.observe(0.022, None, tokens=2, batch=1)  # 2k tokens: the extra row costs half a step
    assert pol.costs.plain_cost(1) == 0.014 and pol.ngram_budget(seq, 1, want=1) == 0
    seq.num_computed = 100
    pol.plan([seq], 1)
    assert pol.costs.plain_cost(1) == 0.005 and pol.ngram_budget(seq, 1, want=1) == 1


def test_lookup_length_follows_the_outcomes_not_one_lucky_match():
    """Prompt-lookup drafts are cut where the recent outcomes say they pay: 1 + mean(min(accepted,
    d)) (a prefix is accepted or not), so after one full 8-token match among misses a request does
    not jump to 8-token drafts that a wide batch pays for row by row."""
    s, clock = _sched(spec=SpecConfig(mode="ngram", ngram_tokens=8, adaptive=True))
    pol = s.policy
    seq = _seq(clock, "a", n=3, mode="ngram")
    for acc in (0, 1, 0, 8, 0, 1):  # bimodal: misses, a token, one full match
        pol.note_lookup(seq, acc, 8)
    assert pol.lookup_expected(seq, 1) == 1 + 3 / 6 and pol.lookup_expected(seq, 8) == 1 + 10 / 6
    assert len(pol.lookup_outcomes) == 6 and list(seq.spec_state.lookup_outcomes)[3] == (8, 8)
    seq.spec_state.ngram_accept = 0.7  # the per-position EMA right after the full match
    pol.costs.t_target, pol.costs.t_per_token, pol.costs.t_draft = 0.028, 0.0007, 0.0
    pol.costs.t_plain = {16: 0.039}  # 16 rows: each extra row ~0.7 ms, a plain token 2.4 ms
    d = pol.ngram_budget(seq, 16)
    assert d == 1  # the geometric E(0.7, d) of the EMA would take 2 (and 8 at 1 row per 0.2 ms)
    fresh = _seq(clock, "b", n=3, mode="ngram")  # no outcomes of its own: the engine's
    assert pol.lookup_expected(fresh, 1) == pol.lookup_expected(seq, 1)
    empty, _ = _sched(spec=SpecConfig(mode="ngram", adaptive=True))
    assert (
        empty.policy.lookup_expected(fresh, 2) == 1 + fresh.spec_state.ngram_accept + fresh.spec_state.ngram_accept**2
    )  # no history
    assert pol.lookup_expected(fresh, 2) == 1 + 4 / 6
    seq.spec_state.lookup_outcomes.clear()
    for _ in range(6):
        pol.note_lookup(seq, 2, 2)  # short drafts always fully accepted: longer ones are worth trying
    assert pol.lookup_expected(fresh, 2) == 1 + 16 / 12  # the engine's estimate follows new outcomes
    assert pol.lookup_expected(seq, 4) > pol.lookup_expected(seq, 2) == 3.0


def test_widths_beyond_twice_the_widest_measured_step_are_priced_as_plain_rows():
    """The cost fit prices verification widths up to twice the widest step measured at that batch
    size; the rows beyond cost what a plain step's rows do on average until a step that wide is
    measured, so a fresh engine explores wider drafts by doubling (a fit from narrow steps priced
    16 requests' 16-node trees at a third of their cost: ~150 ms steps at 0.5 acceptance)."""
    s, _ = _sched(spec=SpecConfig(mode="tree", tree_topk=4, tree_budget=16, tree_depth=6, adaptive=True))
    pol = s.policy
    pol.costs.t_target, pol.costs.t_per_token, pol.costs.t_draft = 0.020, 0.0001, 0.001  # a fit: rows look nearly free
    pol.costs.t_plain = {16: 0.025}
    pol.costs.note_width(16, 48)  # the widest step measured at 16 requests: 2 draft tokens each
    assert pol.costs.verify_cost(5, 16, 0.025) == pytest.approx(0.025 + 0.0001 * 80)  # 96 tokens: the fit
    wide = 0.025 + 0.0001 * 80 + 80 * 0.025 / 16  # 176 tokens: 80 of them at a plain row's average cost
    assert pol.costs.verify_cost(10, 16, 0.025) == pytest.approx(wide)
    pol.step = 1
    assert pol.choose_depth([0.5] * 16) <= 5  # a 16-node tree per request is not bet on unmeasured
    pol.costs.note_width(16, 16 * 17)  # once measured, the fit is trusted there
    assert pol.costs.verify_cost(16, 16, 0.025) == pytest.approx(0.025 + 0.0001 * 256)


def test_a_requests_first_model_draft_is_a_short_chain():
    """An adaptive request's first model draft is a FIRST_MODEL_DRAFT-node chain, whatever depth the
    step chose from the engine-wide acceptance (another group's last drafts set it); once its own
    acceptance is measured it drafts what the step decided."""
    from specd.speculation.policy import FIRST_MODEL_DRAFT

    s, clock = _sched(spec=SpecConfig(mode="tree", tree_topk=4, tree_budget=16, tree_depth=6, adaptive=True))
    pol = s.policy
    c = pol.costs
    c.t_target, c.t_per_token, c.t_draft = 0.010, 0.0, 0.0005  # rows free: a deep wide tree pays
    _plain_costs(s)
    seq = _seq(clock, "a", n=3, mode="auto")
    seq.spec_state.recent_accept = seq.spec_state.chain_accept = 0.9
    plan = pol.plan([seq], 1)
    assert plan.depth > FIRST_MODEL_DRAFT
    assert pol.budget(seq, plan) == (FIRST_MODEL_DRAFT, FIRST_MODEL_DRAFT)
    seq.stats.by_proposer["head"] = [1, 2, 2]  # its first draft was verified
    want, depth = pol.budget(seq, plan)
    assert depth == plan.depth and want > FIRST_MODEL_DRAFT


def test_before_the_fit_the_marginal_cost_is_anchored_at_the_plain_step():
    """Until the least-squares fit has 8 steps of varied widths, each speculative step measured
    gives the marginal cost of a token through the plain step at its batch size: a flat 0 made a
    fresh engine's first wide drafts look free (16 requests x 6 nodes priced at ~60% of their cost)."""
    s, _ = _sched(spec=SpecConfig(mode="tree", tree_depth=6, adaptive=True))
    pol = s.policy
    pol.costs.observe_plain(16, 0.025)
    pol.costs.observe(0.049, 0.005, tokens=48, batch=16)  # 32 draft tokens cost 24 ms more than plain
    assert pol.costs.t_per_token == pytest.approx(0.00075)
    assert pol.costs.verify_cost(2, 16, 0.025) == pytest.approx(0.049)  # the measured step, on the line
    assert pol.costs.verify_cost(4, 16, 0.025) == pytest.approx(0.025 + 0.00075 * 64)


def test_the_cost_line_is_kept_per_context_bucket():
    """The fitted line (fixed cost and marginal cost per verified token) is kept per context bucket
    like the plain costs: a row attends over its context, so 16 requests of 1.5k tokens pay ~4x per
    verification row what 16 of 150 do; one line for all priced long-context lookups at the short
    ones' rate (batch 16: 47 ms steps for 2 extra tokens each where plain ran 28 ms). A bucket not
    measured yet borrows the nearest measured one's line."""
    s, _ = _sched(spec=SpecConfig(mode="ngram", adaptive=True))
    pol = s.policy
    for bucket, per_row in ((0, 0.0007), (5, 0.003)):
        pol.costs.ctx_bucket = bucket
        pol.costs.observe_plain(16, 0.025)
        for k in range(12):  # varied widths: the least-squares fit
            pol.costs.observe(0.025 + per_row * (k % 4 + 1), None, tokens=16 + k % 4 + 1, batch=16)
    pol.costs.ctx_bucket = 0
    assert pol.costs.t_per_token == pytest.approx(0.0007)
    pol.costs.ctx_bucket = 5
    assert pol.costs.t_per_token == pytest.approx(0.003)
    pol.costs.ctx_bucket = 4
    assert pol.costs.t_per_token == pytest.approx(0.003)  # nearest measured bucket (shorter first on a tie)
    pol.costs.ctx_bucket = 2
    assert pol.costs.t_per_token == pytest.approx(0.0007)
