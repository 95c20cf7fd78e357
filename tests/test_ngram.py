"""Prompt lookup (``--spec ngram``): the index and trie against brute force, greedy output identical
to plain decoding (with and without a draft model, mixed with draft-model requests), sampled output
following the target's distribution with a point-mass proposer, and per-proposer statistics."""

import collections
import random

import pytest

from specd.config import EngineConfig, SchedulerConfig, SpecConfig
from specd.engine.engine import Engine
from specd.engine.sequence import SpecParams
from specd.sampling.params import SamplingParams
from specd.speculation.ngram import NgramConfig, NgramIndex, trie
from specd.speculation.request import SpecState
from specd.speculation.suffix import SuffixConfig, SuffixStore
from tests.conftest import DRAFT, TARGET
from tests.test_spec_sampling import TEMP, TOPK, assert_follows, two_token_joint

GREEDY = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
REPETITIVE = [
    "Once upon a time, there was a girl. Once upon a time, there was a",
    "Tom had a red ball. Tom had a red ball. Tom had a red ball. Tom had a",
    "The cat sat on the mat. The dog sat on the mat. The bird sat on the",
    "Lily said: I like cake. Sam said: I like cake. Mom said: I like",
]


def _brute_continuations(tokens, sizes, max_tokens, branches):
    L = len(tokens)
    for n in reversed(sizes):
        if L < n:
            continue
        tail = tokens[L - n :]
        out = []
        for end in range(L - 1, n - 1, -1):  # most recent occurrence first
            if tokens[end - n : end] == tail:
                cont = tokens[end : min(end + max_tokens, L)]
                if cont not in out:
                    out.append(cont)
                if len(out) == branches:
                    break
        if out:
            return out
    return []


def test_index_matches_brute_force_as_the_context_grows():
    rng = random.Random(0)
    for trial in range(30):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 12))]
        ix = NgramIndex(range(1, 4))
        for _ in range(25):  # incremental: one or a few tokens committed per step
            want = _brute_continuations(tokens, range(1, 4), 5, 3)
            assert ix.continuations(tokens, 5, 3) == want, (trial, tokens)
            tokens += [rng.randrange(4) for _ in range(rng.randrange(1, 4))]


def _brute_extended(tokens, sizes, max_tokens, branches, extend):
    """Occurrences longest match first (then most recent), each cut to its match length + extend."""
    L = len(tokens)
    for n in reversed(sizes):
        tail = tokens[L - n :] if L >= n else None
        occ = [e for e in range(L - 1, n - 1, -1) if tail is not None and tokens[e - n : e] == tail]
        if not occ:
            continue
        m = {}
        for e in occ:
            m[e] = n
            while m[e] < max_tokens - extend and e - 1 - m[e] >= 0 and tokens[e - 1 - m[e]] == tokens[L - 1 - m[e]]:
                m[e] += 1
        out = []
        for e in sorted(occ, key=lambda e: -m[e]):
            cont = tokens[e : min(e + min(max_tokens, m[e] + extend), L)]
            if cont not in out:
                out.append(cont)
            if len(out) == branches:
                break
        return out
    return []


def test_extended_lookup_cuts_each_continuation_to_its_match_length():
    """``extend``: a continuation is as long as its occurrence's match + extend (at most max_tokens),
    the longest matches first; against brute force as the context grows."""
    rng = random.Random(1)
    for trial in range(30):
        tokens = [rng.randrange(3) for _ in range(rng.randrange(1, 10))]
        ix = NgramIndex(range(1, 4))
        for _ in range(12):
            for extend in (0, 1, 3):
                want = _brute_extended(tokens, range(1, 4), 6, 3, extend)
                assert ix.continuations(tokens, 6, 3, extend) == want, (trial, tokens, extend)
            tokens += [rng.randrange(3) for _ in range(rng.randrange(1, 4))]
    # a b c d a b x a b: both bigram matches are 2 long; extend 1 gives 3 tokens, most recent first
    a, b, c, d, x = range(5)
    ix = NgramIndex(range(1, 3))
    assert ix.continuations([a, b, c, d, a, b, x, a, b], 3, 2, 1) == [[x, a, b], [c, d, a]]
    assert ix.continuations([a, b, c, d, a, b, x, a, b], 8, 2, 0) == [[x, a], [c, d]]
    # a longer match wins over a more recent one: ... c a b | ... x a b | query c a b
    toks = [c, a, b, d, d, x, a, b, d, c, a, b]
    assert NgramIndex(range(2, 3)).continuations(toks, 8, 1, 1) == [[d, d, x, a]]


def test_trie_merges_shared_prefixes_in_breadth_first_order_within_the_budget():
    tree = trie(7, [[1, 2, 3], [1, 4], [5]], budget=16)
    assert tree.token_list == [7, 1, 5, 2, 4, 3]
    assert [tree.path_to(i) for i in range(tree.num_nodes)][-1] == [0, 1, 3, 5]
    assert trie(7, [[1, 2, 3], [4, 5]], budget=3).token_list == [7, 1, 2, 3]  # budget: 3 draft nodes
    with pytest.raises(ValueError):
        NgramConfig(min_n=3, max_n=2)


@pytest.fixture(scope="module")
def engines(shared_pair):
    """(with the draft model loaded, target only), both defaulting to prompt lookup."""
    t, d = shared_pair
    spec = SpecConfig(mode="ngram", ngram_tokens=6, ngram_branches=2, adaptive=False)
    sch = SchedulerConfig(max_num_seqs=16)
    with_draft = Engine(EngineConfig(target=str(TARGET), draft=str(DRAFT), spec=spec, scheduler=sch), t, d)
    alone = Engine(EngineConfig(target=str(TARGET), spec=spec, scheduler=sch), t)
    return with_draft, alone


def _ids(eng, texts):
    return [eng.tokenizer(x)["input_ids"] for x in texts]


def test_greedy_prompt_lookup_equals_plain_decoding(engines):
    with_draft, alone = engines
    prompts = _ids(alone, REPETITIVE)
    plain = [s.output_ids for s in alone.generate(prompts, GREEDY, SpecParams(mode="off"))]
    alone.stats.by_proposer.clear()
    for p, want in zip(prompts, plain):  # batch 1, no draft model at all
        assert alone.generate([p], GREEDY, SpecParams(mode="ngram"))[0].output_ids == want
    row = alone.stats.by_proposer["ngram"]
    assert row[2] > 0, "no prompt-lookup draft was ever accepted: the test proves nothing"
    # a mixed batch on the engine with a draft model: ngram, tree, auto (= ngram here) and off together
    modes = ["ngram", "tree", "auto", "off"]
    seqs = [with_draft.add_request(p, GREEDY, SpecParams(mode=m)) for p, m in zip(prompts, modes)]
    while any(not s.finished for s in seqs):
        with_draft.step()
    assert [s.output_ids for s in seqs] == plain
    assert set(with_draft.stats.by_proposer) == {"ngram", "draft"}
    assert with_draft.kv_blocks_used() == (0, 0) and alone.kv_blocks_used() == (0, 0)


def test_per_proposer_statistics_add_up(engines):
    _, alone = engines
    seq = alone.generate(_ids(alone, REPETITIVE[1:2]), GREEDY, SpecParams(mode="ngram"))[0]
    by = seq.stats.as_dict()["by_proposer"]  # prompt lookup, and (the prompt ran before) earlier requests
    assert sum(d["accepted_tokens"] for d in by.values()) == seq.stats.accepted_tokens
    assert sum(d["draft_tokens"] for d in by.values()) == seq.stats.draft_tokens
    assert sum(d["steps"] for d in by.values()) <= seq.stats.steps
    assert by["ngram"]["mean_accepted_length"] > 1.0 and by["suffix"]["accepted_tokens"] > 0


def test_sampled_prompt_lookup_follows_the_targets_distribution(shared_pair):
    """The draft distribution of prompt lookup is a point mass: verification in deterministic mode
    keeps sampling exact (chi-square on the first two tokens, as for the draft model)."""
    t, _ = shared_pair
    eng = Engine(
        EngineConfig(
            target=str(TARGET),
            spec=SpecConfig(mode="ngram", ngram_tokens=3, ngram_branches=2, adaptive=False),
            scheduler=SchedulerConfig(max_num_seqs=128, max_num_batched_tokens=4096),
        ),
        target=t,
    )
    prompt = eng.tokenizer("Once upon a time, there was a girl. Once upon a time, there was a")["input_ids"]
    joint = two_token_joint(t, prompt)
    n = 2000
    # max_tokens 3: the first step may draft two tokens; the tiny model copies rarely (~5% accepted)
    params = [SamplingParams(temperature=TEMP, top_k=TOPK, seed=i, max_tokens=3, ignore_eos=True) for i in range(n)]
    seqs = eng.generate([prompt] * n, params, SpecParams(mode="ngram"))
    assert eng.stats.by_proposer["ngram"][2] > 0.03 * n  # drafts were really accepted
    assert_follows(joint, [s.output_ids for s in seqs], tv_bound=0.07)
    assert eng.kv_blocks_used() == (0, 0)


def test_adaptive_requests_choose_a_proposer_per_step_and_stay_lossless(shared_pair):
    """``auto`` requests on an engine with a draft model: each step drafts with prompt lookup when it
    has a match the policy expects to pay more, else with the draft model; greedy output is still
    identical to plain decoding, and both proposers show up in the statistics."""
    t, d = shared_pair
    spec = SpecConfig(mode="tree", adaptive=True, suffix_store=False)  # (else the plain run predicts everything)
    eng = Engine(EngineConfig(target=str(TARGET), draft=str(DRAFT), spec=spec), t, d)
    prompts = _ids(eng, REPETITIVE)
    plain = [s.output_ids for s in eng.generate(prompts, GREEDY, SpecParams(mode="off"))]
    eng.stats.by_proposer.clear()
    for p, want in zip(prompts, plain):
        assert eng.generate([p], GREEDY, SpecParams(mode="auto"))[0].output_ids == want
    assert set(eng.stats.by_proposer) == {"ngram", "draft"}
    assert eng.kv_blocks_used() == (0, 0)


def test_adaptive_requests_keep_prompt_lookup_while_the_model_does_not_pay(shared_pair, monkeypatch):
    """When the policy turns model drafting off (depth 0), ``auto`` requests still draft with prompt
    lookup, which costs nothing to propose (``LOOKUP_ONLY``); output stays identical to plain."""
    t, d = shared_pair
    spec = SpecConfig(mode="tree", adaptive=True, suffix_store=False)
    eng = Engine(EngineConfig(target=str(TARGET), draft=str(DRAFT), spec=spec), t, d)
    monkeypatch.setattr(eng.policy, "choose_depth", lambda alphas, narrow=None: 0)  # the model never pays here
    prompts = _ids(eng, REPETITIVE)
    plain = [s.output_ids for s in eng.generate(prompts, GREEDY, SpecParams(mode="off"))]
    eng.stats.by_proposer.clear()
    for p, want in zip(prompts, plain):
        assert eng.generate([p], GREEDY, SpecParams(mode="auto"))[0].output_ids == want
    assert set(eng.stats.by_proposer) == {"ngram"} and eng.stats.by_proposer["ngram"][2] > 0
    assert eng.kv_blocks_used() == (0, 0)
    by_len = eng.policy.lookup_by_len  # outcomes kept by how long each match let the draft be
    assert by_len and all(1 <= v <= 8 and all(0 <= a <= n <= v for a, n in obs) for v, obs in by_len.items())


def test_a_lookups_length_is_chosen_once_its_match_is_known(shared_pair):
    """An ``auto`` request's lookup-only step reserves the full lookup budget; the draft length is
    chosen once the match is known (``SpecPolicy.lookup_len``), from the outcomes of lookups whose
    match allowed as many tokens: long matches accepted in full are drafted in full, short ones that
    were rejected are not drafted (a staggered probe at most), and a length with few outcomes is
    priced from all of the request's lookups. The proposer hands over the match's length and keeps
    it on the proposal."""
    from types import SimpleNamespace

    from specd.speculation.ngram import NgramProposer
    from specd.speculation.policy import LOOKUP_BY_LEN_MIN, LOOKUP_ONLY, LOOKUP_PROBE, StepPlan, _offset

    t, d = shared_pair
    eng = Engine(EngineConfig(target=str(TARGET), draft=str(DRAFT), spec=SpecConfig(adaptive=True)), t, d)
    pol = eng.policy
    pol.costs.t_target, pol.costs.t_per_token, pol.costs.t_plain = 0.004, 0.0005, {1: 0.004}
    pol.costs.note_width(1, 16)
    seq = eng.add_request([5, 6, 7, 8], GREEDY, SpecParams(mode="auto"))
    assert pol.budget(seq, StepPlan(0, None, 1 << 30, 1)) == (8, LOOKUP_ONLY)  # reserved in full
    for _ in range(LOOKUP_BY_LEN_MIN):
        pol.note_lookup(seq, 8, 8, available=8)  # matches allowing 8 tokens: accepted in full
        pol.note_lookup(seq, 0, 3, available=3)  # matches allowing 3: rejected
    every = pol.lookup_probe_every(1)
    pol.step = next(k for k in range(every) if (k + _offset(seq)) % every)  # not this request's probe step
    assert pol.lookup_len(seq, 8, 1) == 8
    assert pol.lookup_len(seq, 3, 1) == 0
    pol.step = next(k for k in range(every) if (k + _offset(seq)) % every == 0)
    assert pol.lookup_len(seq, 3, 1) == LOOKUP_PROBE
    # no outcomes of 5-token matches: all the request's lookups (half accepted in full) price it
    assert pol.lookup_len(seq, 5, 1) == 5

    a, b, c, dd, e = 11, 12, 13, 14, 15
    ctx = SimpleNamespace(tokens=[a, b, c, dd, e, a, b], spec_state=SpecState(), tenant=None)
    prop, seen = NgramProposer(), []
    full = prop.propose_one(ctx, 8)
    assert full.available == 3 and full.tree.num_nodes - 1 == 3  # "a b" matched 2 long: 2 + extend 1
    cut = prop.propose_one(ctx, 8, lambda v: seen.append(v) or 2)
    assert seen == [3] and cut.available == 3 and cut.tree.num_nodes - 1 == 2
    assert prop.propose_one(ctx, 8, lambda v: 0) is None


def test_the_policy_prefers_the_proposal_with_more_tokens_per_second(shared_pair):
    t, d = shared_pair
    eng = Engine(EngineConfig(target=str(TARGET), draft=str(DRAFT), spec=SpecConfig(adaptive=True)), t, d)
    pol, seq = eng.policy, eng.add_request([5, 6, 7], GREEDY)
    assert pol.prefer_ngram(seq, 4, 3, 1)  # nothing measured yet: the free proposal
    pol.costs.t_target, pol.costs.t_per_token, pol.costs.t_draft, pol.costs.t_plain = 0.010, 0.001, 0.004, {1: 0.010}
    seq.spec_state.ngram_accept, seq.spec_state.recent_accept = 0.9, 0.3
    assert pol.prefer_ngram(seq, 4, 3, 1)  # lookup accepted far more often than the model
    seq.spec_state.ngram_accept, seq.spec_state.recent_accept = 0.05, 0.9
    assert not pol.prefer_ngram(seq, 4, 3, 1)


# drafting from earlier requests -------------------------------------------------------------------
def test_suffix_store_is_bounded_and_never_crosses_tenants():
    store = SuffixStore(SuffixConfig(max_tokens_per_tenant=40, max_tenants=2, min_n=2, max_n=3))
    store.add("alice", [1, 2, 3, 4, 5, 6])
    assert store.continuation("alice", [9, 1, 2], 3) == [3, 4, 5]
    assert store.continuation("bob", [9, 1, 2], 3) == []  # another key never sees alice's requests
    assert store.continuation(None, [9, 1, 2], 3) == []
    for k in range(10):  # 10 x 10 tokens into a 40-token budget: the oldest documents go
        store.add("alice", [100 + k] * 2 + list(range(20 + 10 * k, 28 + 10 * k)))
    assert store.stats() == {"tenants": 1, "tokens": 40}
    assert store.continuation("alice", [9, 1, 2], 3) == []  # evicted, and its index entries with it
    assert store.continuation("alice", [109, 109], 2) == [110, 111]
    store.add("bob", [1, 2, 3])
    store.add("carol", [1, 2, 3])  # a third tenant evicts the least recently used (alice)
    assert store.stats()["tenants"] == 2 and store.continuation("alice", [109, 109], 2) == []


def test_a_repeated_request_drafts_from_the_first_and_stays_lossless(shared_pair):
    t, _ = shared_pair
    eng = Engine(EngineConfig(target=str(TARGET), spec=SpecConfig(mode="ngram", adaptive=False)), t)
    prompt = _ids(eng, ["Sam was sad because"])[0]
    first = eng.add_request(prompt, GREEDY, SpecParams(mode="ngram"), tenant="k1")
    while not first.finished:
        eng.step()
    eng.stats.by_proposer.clear()
    again = eng.generate([prompt], GREEDY, SpecParams(mode="ngram"))[0]  # tenant None: nothing to reuse
    assert "suffix" not in eng.stats.by_proposer
    second = eng.add_request(prompt, GREEDY, SpecParams(mode="ngram"), tenant="k1")
    while not second.finished:
        eng.step()
    assert second.output_ids == first.output_ids == again.output_ids
    steps, drafted, accepted = eng.stats.by_proposer["suffix"]
    assert accepted >= 0.8 * drafted and second.stats.steps < 0.5 * len(second.output_ids)


def test_a_long_request_is_stored_by_its_last_tokens_only():
    store = SuffixStore(SuffixConfig(max_doc_tokens=8, min_n=2, max_n=2))
    store.add("k", list(range(100)))
    assert store.stats()["tokens"] == 8
    assert store.continuation("k", [93, 94], 2) == [95, 96] and store.continuation("k", [3, 4], 2) == []


def test_lookup_probes_are_short_and_staggered_while_lookup_does_not_pay(shared_pair):
    """At an acceptance where no lookup length pays, each request still probes (so a change is
    noticed), but with ``LOOKUP_PROBE`` tokens once every ``lookup_probe_every(batch)`` of its
    steps, and a batch's requests probe in different steps (all at once made one wide verification
    every 16 steps); a wide batch averages at most one probe per 4 steps (one per step made most of
    its steps a row wider than plain ones, across the int8 tiles' 16-row pass)."""
    from specd.speculation.policy import LOOKUP_PROBE

    t, d = shared_pair
    eng = Engine(EngineConfig(target=str(TARGET), draft=str(DRAFT), spec=SpecConfig(adaptive=True)), t, d)
    pol = eng.policy
    pol.costs.t_target, pol.costs.t_per_token, pol.costs.t_plain = 0.010, 0.0002, {16: 0.010}
    pol.costs.note_width(16, 16 * 1000)  # (the fit measured out to wide steps)
    seqs = [eng.add_request([5, 6, 7, i], GREEDY, SpecParams(mode="ngram")) for i in range(16)]
    for s in seqs:
        s.spec_state.ngram_accept = 0.02
    probes = collections.defaultdict(list)  # step -> budgets of the requests that probed
    every = pol.lookup_probe_every(16)
    for step in range(every):
        pol.step = step
        for s in seqs:
            n = pol.ngram_budget(s, 16)
            assert n in (0, LOOKUP_PROBE)
            if n:
                probes[step].append(s.request_id)
    assert sorted(r for ids in probes.values() for r in ids) == sorted(s.request_id for s in seqs)  # once each
    assert len(probes) > 1  # not all in one step
    assert len(seqs) / every <= 0.25 and pol.lookup_probe_every(1) == pol.lookup_probe_every(4) == pol.probe_min
    for s in seqs:
        s.spec_state.ngram_accept = 0.95  # lookup pays again: the full length, every step
        assert pol.ngram_budget(s, 16) > LOOKUP_PROBE


def test_lookups_stop_at_a_batch_size_where_they_delivered_less_than_plain(shared_pair):
    """At a batch size (its power-of-two bucket) where adaptive requests' lookup-only steps have
    delivered fewer tokens per second than plain steps (an EMA over ``LOOKUP_GUARD_MIN`` or more of
    them), a request's lookup
    budget is a staggered ``LOOKUP_PROBE`` only, whatever its priced length; once they deliver more,
    the priced length is back. Batch 1 is never guarded."""
    from specd.speculation.costs import LOOKUP_GUARD_MIN
    from specd.speculation.policy import LOOKUP_ONLY, LOOKUP_PROBE, StepPlan

    t, d = shared_pair
    eng = Engine(EngineConfig(target=str(TARGET), draft=str(DRAFT), spec=SpecConfig(adaptive=True)), t, d)
    pol = eng.policy
    pol.costs.t_target, pol.costs.t_per_token = 0.010, 0.0001
    pol.costs.t_plain = {1: 0.010, 16: 0.016, **{b: 0.001 * b for b in range(12, 16)}}  # 1000 tokens/s plain
    pol.costs.note_width(16, 16 * 1000)
    seqs = [eng.add_request([5, 6, 7, i], GREEDY, SpecParams(mode="auto")) for i in range(16)]
    for s in seqs:
        for _ in range(8):
            pol.note_lookup(s, 8, 8)  # every lookup fully accepted: long lookups price well
    plan = StepPlan(0, None, 1 << 30, 16)

    def budgets():
        out = []
        for step in range(pol.lookup_probe_every(16)):
            pol.step = step
            out.append([pol.budget(s, plan) for s in seqs])
        return out

    assert all(n > LOOKUP_PROBE and depth == LOOKUP_ONLY for row in budgets() for n, depth in row)
    for _ in range(LOOKUP_GUARD_MIN):
        pol.costs.note_lookup_step(16, 17, 0.020)  # 850 tokens/s against plain's 16 / 0.016 = 1000
    assert pol.costs.lookups_lose(16) and not pol.costs.lookups_lose(4) and not pol.costs.lookups_lose(15)
    for _ in range(LOOKUP_GUARD_MIN):  # sizes 8-15 are judged together (a draining group's steps)
        pol.costs.note_lookup_step(12 + _ % 4, 12, 0.020)  # 600 tokens/s against ~1000
    assert pol.costs.lookups_lose(8) and pol.costs.lookups_lose(15) and not pol.costs.lookups_lose(7)
    rows = budgets()
    assert all(b in ((0, 0), (LOOKUP_PROBE, LOOKUP_ONLY)) for row in rows for b in row)
    probes = [step for step, row in enumerate(rows) for b in row if b[0]]
    assert len(probes) == len(seqs) and len(set(probes)) > 1  # each probes once, not all at once
    for _ in range(30):
        pol.costs.note_lookup_step(16, 30, 0.020)  # 1500 tokens/s: lookups pay again
    assert not pol.costs.lookups_lose(16)
    assert all(n > LOOKUP_PROBE for row in budgets() for n, _ in row)
    pol.costs.note_lookup_step(1, 1, 1.0)  # (batch 1 is not recorded)
    assert not pol.costs.lookups_lose(1) and (1).bit_length() not in pol.costs._lookup_gain


def test_new_requests_start_from_the_engines_lookup_acceptance(shared_pair):
    """A request's prompt-lookup acceptance starts from the engine-wide estimate (as the model's
    does), not from a fixed 0.5: where lookups keep failing, new requests do not pay to relearn it."""
    t, d = shared_pair
    eng = Engine(EngineConfig(target=str(TARGET), draft=str(DRAFT), spec=SpecConfig(adaptive=True)), t, d)
    first = eng.add_request([5, 6, 7], GREEDY)
    assert first.spec_state.ngram_accept == 0.5
    for _ in range(30):
        eng.policy.note_accept(0.1, lookup=True)
    assert eng.policy.accept_ema is None  # (the model's estimate is its own)
    second = eng.add_request([5, 6, 8], GREEDY)
    eng.step()  # (the scheduler takes the request in)
    assert abs(second.spec_state.ngram_accept - 0.1) < 1e-6


def test_the_policy_prices_the_tokens_verified_not_the_tokens_reserved(shared_pair, monkeypatch):
    """A lookup that finds no match (or a shorter one) reserves its budget and verifies fewer tokens:
    the step's cost is recorded against the rows the target verified. Keyed by the reservation, a
    16-request step verifying ~25 rows was priced as ~80 and drafting looked ~5x cheaper than it was
    (auto at batch 16: 0.85x plain)."""
    t, _ = shared_pair
    spec = SpecConfig(mode="ngram", ngram_tokens=6, ngram_branches=2, adaptive=False)
    eng = Engine(EngineConfig(target=str(TARGET), spec=spec, scheduler=SchedulerConfig(max_num_seqs=4)), t)
    seen = []
    real = eng.policy.costs.observe
    monkeypatch.setattr(eng.policy.costs, "observe", lambda *a, **k: (seen.append(a[2:4]), real(*a, **k)))
    prompts = _ids(eng, REPETITIVE[:2] + ["Sam was sad because", "The sun"])
    seqs = [eng.add_request(p, GREEDY, SpecParams(mode="ngram")) for p in prompts]
    short_of_reserved = 0
    while any(not s.finished for s in seqs):
        running = [s for s in seqs if not s.finished]
        drafted0 = sum(s.stats.draft_tokens for s in running)
        n = len(seen)
        eng.step()
        if len(seen) > n:  # a speculative decode step was priced
            verified = len(running) + sum(s.stats.draft_tokens for s in running) - drafted0
            assert seen[-1] == (verified, len(running))
            short_of_reserved += eng.scheduler.last_spec_budget + len(running) > verified
    assert short_of_reserved > 0, "every lookup verified its full reservation: the test proves nothing"


def test_ngram_extend_reaches_the_proposer_from_the_command_line(shared_pair):
    """``--ngram-extend N`` (default 1) sets how far past its match a lookup drafts; -1 drafts
    ``--ngram-tokens`` always; out-of-range values are refused."""
    from specd.options import engine_config, serve_parser

    t, _ = shared_pair
    for argv, want in (([], 1), (["--ngram-extend", "3"], 3), (["--ngram-extend", "-1"], None)):
        cfg = engine_config(serve_parser().parse_args(["--target", str(TARGET), *argv]))
        eng = Engine(EngineConfig(target=str(TARGET), spec=cfg.spec), t)
        assert eng.speculator.free[0].cfg.extend == want, argv
    with pytest.raises(ValueError, match="ngram_extend"):
        SpecConfig(ngram_extend=-2)
