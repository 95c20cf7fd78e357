"""Hybrid trees (``--spec hybrid``, and ``auto`` when the policy expects it to pay): the model's tree
and prompt lookup's branch verified as one tree. The merge against hand-built trees; greedy output
identical to plain decoding (batch 1 and a mixed batch) with tokens accepted from both proposers;
sampled output following the target's distribution; per-proposer statistics adding up; the policy's
choice."""

import pytest

from specd.config import EngineConfig, SchedulerConfig, SpecConfig
from specd.engine.engine import Engine
from specd.engine.sequence import SpecParams
from specd.sampling.params import SamplingParams
from specd.sampling.tree import DraftTree
from specd.speculation.hybrid import credit, merge
from specd.speculation.proposal import Proposal
from tests.conftest import DRAFT, TARGET
from tests.test_ngram import GREEDY, REPETITIVE
from tests.test_spec_sampling import TEMP, TOPK, assert_follows, two_token_joint


def _prop(tokens, parents, proposer):
    tree = DraftTree(tokens, parents)
    return Proposal(tree, None, tree.max_depth, proposer=proposer, chosen=proposer != "draft")


def test_merge_shares_agreeing_nodes_keeps_order_and_budget_and_credits_each_proposer():
    model = _prop([5, 7, 9, 3], [-1, 0, 0, 1], "draft")  # 5 -> {7 -> 3, 9}
    lookup = _prop([5, 7, 4, 8], [-1, 0, 1, 2], "ngram")  # 5 -> 7 -> 4 -> 8
    m = merge(model, lookup, budget=16)
    assert m.tree.token_list == [5, 7, 9, 3, 4, 8]  # breadth first; 7 shared, 4 after the model's 3
    assert m.tree.parent_list == [-1, 0, 0, 1, 1, 4]
    assert m.node_proposers == ["draft", "draft", "draft", "draft", "ngram", "ngram"]
    assert m.deterministic and m.draft_probs is None and m.depth == 3
    assert credit(m, [1, 4, 5]) == {"draft": [3, 1, 2], "ngram": [2, 2, 3]}
    assert merge(model, lookup, budget=4).tree.token_list == [5, 7, 9, 3, 4]  # room for one more node
    assert merge(model, lookup, budget=3).tree.token_list == [5, 7, 9, 3]
    assert credit(model, [1, 3]) == {"draft": [3, 2, 2]}
    with pytest.raises(ValueError):
        merge(model, _prop([6, 7], [-1, 0], "ngram"), budget=16)


@pytest.fixture(scope="module")
def engine(shared_pair):
    t, d = shared_pair
    spec = SpecConfig(mode="hybrid", ngram_tokens=4, tree_budget=8, adaptive=False, suffix_store=False)
    cfg = EngineConfig(target=str(TARGET), draft=str(DRAFT), spec=spec, scheduler=SchedulerConfig(max_num_seqs=16))
    return Engine(cfg, t, d)


def _ids(eng, texts):
    return [eng.tokenizer(x)["input_ids"] for x in texts]


def test_greedy_hybrid_equals_plain_decoding_alone_and_in_a_mixed_batch(engine):
    prompts = _ids(engine, REPETITIVE)
    plain = [s.output_ids for s in engine.generate(prompts, GREEDY, SpecParams(mode="off"))]
    engine.stats.by_proposer.clear()
    for p, want in zip(prompts, plain):
        seq = engine.generate([p], GREEDY, SpecParams(mode="hybrid"))[0]
        assert seq.output_ids == want
        by = seq.stats.as_dict()["by_proposer"]
        assert sum(r["accepted_tokens"] for r in by.values()) == seq.stats.accepted_tokens
        assert sum(r["draft_tokens"] for r in by.values()) == seq.stats.draft_tokens
    by = engine.stats.by_proposer
    assert by["ngram"][2] > 0 and by["draft"][2] > 0, f"both proposers must get tokens accepted: {by}"
    modes = ["hybrid", "tree", "ngram", "off"]
    seqs = [engine.add_request(p, GREEDY, SpecParams(mode=m)) for p, m in zip(prompts, modes)]
    while any(not s.finished for s in seqs):
        engine.step()
    assert [s.output_ids for s in seqs] == plain
    assert engine.kv_blocks_used() == (0, 0)


def test_hybrid_without_a_model_proposer_is_prompt_lookup(shared_pair):
    t, _ = shared_pair
    spec = SpecConfig(mode="hybrid", ngram_tokens=4, adaptive=False, suffix_store=False)
    eng = Engine(EngineConfig(target=str(TARGET), spec=spec), t)
    p = _ids(eng, REPETITIVE[1:2])
    want = eng.generate(p, GREEDY, SpecParams(mode="off"))[0].output_ids
    seq = eng.generate(p, GREEDY, SpecParams(mode="hybrid"))[0]
    assert seq.output_ids == want and set(seq.stats.by_proposer) == {"ngram"}


def test_sampled_hybrid_follows_the_targets_distribution(shared_pair, engine):
    """A hybrid tree mixes drawn (draft model) and chosen (lookup) children: it is verified as a
    chosen tree, which is exact whoever proposed the children (chi-square on the first two tokens)."""
    t, _ = shared_pair
    prompt = engine.tokenizer("Once upon a time, there was a girl. Once upon a time, there was a")["input_ids"]
    joint = two_token_joint(t, prompt)
    n = 1500
    engine.stats.by_proposer.clear()
    params = [SamplingParams(temperature=TEMP, top_k=TOPK, seed=i, max_tokens=3, ignore_eos=True) for i in range(n)]
    seqs = engine.generate([prompt] * n, params, SpecParams(mode="hybrid"))
    by = engine.stats.by_proposer
    assert by["draft"][2] > 0.1 * n and by["ngram"][2] > 0, by  # both kinds of branch were accepted
    assert_follows(joint, [s.output_ids for s in seqs], tv_bound=0.08)
    assert engine.kv_blocks_used() == (0, 0)


def test_the_policy_adds_a_lookup_branch_only_when_it_pays(shared_pair):
    t, d = shared_pair
    eng = Engine(EngineConfig(target=str(TARGET), draft=str(DRAFT), spec=SpecConfig(adaptive=True)), t, d)
    pol, seq = eng.policy, eng.add_request([5, 6, 7], GREEDY)
    assert not pol.hybrid_pays(seq, 4, 3, 1)  # nothing measured yet
    pol.costs.t_target, pol.costs.t_per_token, pol.costs.t_draft, pol.costs.t_plain = 0.010, 0.0005, 0.002, {1: 0.010}
    seq.spec_state.recent_accept, seq.spec_state.ngram_accept = 0.4, 0.9
    assert pol.hybrid_pays(seq, 4, 3, 1)  # the model often misses, the lookup rarely does
    seq.spec_state.ngram_accept = 0.02
    assert not pol.hybrid_pays(seq, 4, 3, 1)  # a branch that is never accepted only costs
    seq.spec_state.recent_accept, seq.spec_state.ngram_accept = 0.99, 0.9
    assert not pol.hybrid_pays(seq, 4, 3, 1)  # the model alone already gets nearly everything


def test_adaptive_requests_can_verify_both_proposers_in_one_tree_and_stay_lossless(shared_pair, monkeypatch):
    """``auto`` requests whose costs make the hybrid pay get hybrid trees; output stays exact."""
    t, d = shared_pair
    spec = SpecConfig(mode="tree", adaptive=True, suffix_store=False, ngram_tokens=4)
    eng = Engine(EngineConfig(target=str(TARGET), draft=str(DRAFT), spec=spec), t, d)
    prompts = _ids(eng, REPETITIVE)
    plain = [s.output_ids for s in eng.generate(prompts, GREEDY, SpecParams(mode="off"))]
    monkeypatch.setattr(eng.policy, "prefer_ngram", lambda *a: False)
    monkeypatch.setattr(eng.policy, "hybrid_pays", lambda *a: True)
    monkeypatch.setattr(eng.policy, "choose_depth", lambda alphas, narrow=None: 3)  # (the tiny pair's drafts never pay)
    eng.stats.by_proposer.clear()
    for p, want in zip(prompts, plain):
        assert eng.generate([p], GREEDY, SpecParams(mode="auto"))[0].output_ids == want
    by = eng.stats.by_proposer
    assert by["ngram"][2] > 0 and by["draft"][2] > 0, by
    assert eng.kv_blocks_used() == (0, 0)
