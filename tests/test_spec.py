"""Speculative decoding core: exact greedy losslessness, rollback invariant, acceptance extremes."""

import json
import random
import shutil

import pytest
import torch

import specd.engine.stages as stages_mod
from specd.config import CacheConfig, EngineConfig, SpecConfig
from specd.engine.engine import Engine
from specd.engine.kv_cache import KVCache
from specd.engine.sequence import SpecParams
from specd.model.attention import build_metadata
from specd.model.loader import LoadError, load_model
from specd.sampling.params import SamplingParams
from specd.sampling.verify import AcceptResult
from tests.conftest import DRAFT, SHARED, TARGET

GREEDY = SamplingParams(temperature=0, max_tokens=128)


def _prompts(tok, n=24):
    """Raw-text prompts: MT-bench first turns (cut to ~40 tokens) and story openings."""
    qs = [json.loads(line)["turns"][0] for line in (SHARED / "data/mt_bench/question.jsonl").open()]
    stories = [
        "Once upon a time, there was a little",
        "Tom had a big red ball. One day",
        "The cat and the dog",
        "Lily went to the park with her mom. She saw",
        "Sam was sad because",
        "It was a sunny day and",
    ]
    texts = stories + qs[: n - len(stories)]
    return [tok(t)["input_ids"][:40] for t in texts]


@pytest.fixture(scope="module")
def spec_engine(shared_pair):
    t, d = shared_pair
    return Engine(
        EngineConfig(target=str(TARGET), draft=str(DRAFT), spec=SpecConfig(adaptive=False)), target=t, draft=d
    )


@pytest.fixture(scope="module")
def references(spec_engine, hf_target):
    prompts = _prompts(spec_engine.tokenizer)
    off = [s.output_ids for s in spec_engine.generate(prompts, GREEDY, SpecParams(mode="off"))]
    hf = []
    for p in prompts:
        out = hf_target.generate(
            torch.tensor([p]), max_new_tokens=128, do_sample=False, eos_token_id=[2, 1], pad_token_id=0
        )[0, len(p) :].tolist()
        hf.append(out)
    return prompts, off, hf


def test_spec_off_equals_transformers_greedy(references):
    prompts, off, hf = references
    assert len(prompts) >= 20
    assert off == hf


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_greedy_speculation_is_lossless(spec_engine, references, mode):
    prompts, off, _ = references
    seqs = spec_engine.generate(prompts, GREEDY, SpecParams(mode=mode))
    assert [s.output_ids for s in seqs] == off
    mal = sum(s.stats.accepted_tokens for s in seqs) / sum(s.stats.steps for s in seqs) + 1
    assert mal > 1.8, "the shared draft should be accepted often"
    assert spec_engine.kv_blocks_used() == (0, 0)


def test_mixed_batches_of_1_to_8_are_lossless(spec_engine, references):
    prompts, off, _ = references
    rng = random.Random(0)
    i = 0
    for size in (1, 2, 3, 5, 8):
        idx = list(range(i, i + size))
        i += size
        modes = [rng.choice(["off", "chain", "tree"]) for _ in idx]
        seqs = [
            spec_engine.add_request(prompts[j], GREEDY, SpecParams(mode=m, max_draft_tokens=rng.choice([None, 2, 7])))
            for j, m in zip(idx, modes)
        ]
        while any(not s.finished for s in seqs):
            spec_engine.step()
        assert [s.output_ids for s in seqs] == [off[j] for j in idx], modes
    assert spec_engine.kv_blocks_used() == (0, 0)


def test_static_tree_is_lossless(shared_pair, references):
    t, d = shared_pair
    choices = ((0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 0, 0, 0))
    eng = Engine(
        EngineConfig(
            target=str(TARGET), draft=str(DRAFT), spec=SpecConfig(mode="static", static_tree=choices, adaptive=False)
        ),
        target=t,
        draft=d,
    )
    prompts, off, _ = references
    seqs = eng.generate(prompts[:8], GREEDY, SpecParams(mode="auto"))
    assert [s.output_ids for s in seqs] == off[:8]
    assert max(len(s.stats.drafted_per_depth) for s in seqs) == 4
    assert eng.stats.mean_accepted_length > 1.8
    # near the end of the context the tree is cut to the room left (regression: it ran past RoPE)
    long_prompt = (prompts[0] * 20)[: 512 - 12]
    s = eng.generate([long_prompt], SamplingParams(temperature=0, max_tokens=12), SpecParams(mode="auto"))[0]
    ref = Engine(EngineConfig(target=str(TARGET)), target=t).generate(
        [long_prompt], SamplingParams(temperature=0, max_tokens=12), SpecParams(mode="off")
    )[0]
    assert s.output_ids == ref.output_ids and len(s.tokens) <= 512
    with pytest.raises(ValueError, match="no parent choice"):
        SpecConfig(mode="static", static_tree=((0, 0),))


def _random_draft(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(str(DRAFT))
    torch.manual_seed(123)
    model = AutoModelForCausalLM.from_config(cfg)
    out = tmp_path / "random-draft"
    model.save_pretrained(str(out))
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(DRAFT / f, out / f)
    return out


def test_random_draft_is_still_lossless(shared_pair, references, tmp_path):
    t, _ = shared_pair
    d = _random_draft(tmp_path)
    eng = Engine(
        EngineConfig(target=str(TARGET), draft=str(d), spec=SpecConfig(adaptive=False)),
        target=t,
        draft=load_model(d, "cpu", "float32"),
    )
    prompts, off, _ = references
    for mode in ("chain", "tree"):
        seqs = eng.generate(prompts[:8], GREEDY, SpecParams(mode=mode))
        assert [s.output_ids for s in seqs] == off[:8]
    st = eng.stats
    assert st.accepted_tokens / st.draft_tokens < 0.1  # near-zero acceptance
    assert eng.kv_blocks_used() == (0, 0)


def test_target_as_its_own_draft_accepts_everything(shared_pair, references):
    t, _ = shared_pair
    eng = Engine(
        EngineConfig(
            target=str(TARGET), draft=str(TARGET), spec=SpecConfig(mode="chain", num_draft_tokens=4, adaptive=False)
        ),
        target=t,
        draft=load_model(TARGET, "cpu", "float32"),
    )
    prompts, off, _ = references
    seqs = eng.generate(
        prompts[:6], SamplingParams(temperature=0, max_tokens=128, ignore_eos=True), SpecParams(mode="chain")
    )
    for s in seqs:
        assert s.stats.accepted_tokens == s.stats.draft_tokens  # acceptance exactly 1.0
        assert s.stats.accept_len_hist[4] == s.stats.steps - 1  # every step but the capped last one: k=4
    ref = eng.generate(
        prompts[:6], SamplingParams(temperature=0, max_tokens=128, ignore_eos=True), SpecParams(mode="off")
    )
    assert [s.output_ids for s in seqs] == [r.output_ids for r in ref]


def test_mismatched_draft_vocabulary_is_refused(shared_pair, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(str(DRAFT))
    cfg.vocab_size = 600
    out = tmp_path / "other-vocab"
    AutoModelForCausalLM.from_config(cfg).save_pretrained(str(out))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DRAFT / f, out / f)
    t, _ = shared_pair
    with pytest.raises(LoadError, match="draft vocabulary .* does not match"):
        Engine(EngineConfig(target=str(TARGET), draft=str(out)), target=t, draft=load_model(out, "cpu", "float32"))


# ---------------------------------------------------------------------------------------------
def _fresh_kv(lm, tokens):
    """From-scratch prefill of ``tokens``: contiguous K/V [L, 2, n, KVH, D] and next-token logits."""
    c = lm.config
    cache = KVCache(
        c.num_layers, c.num_kv_heads, c.head_dim, -(-len(tokens) // 16) + 1, 16, torch.float32, torch.device("cpu")
    )
    s = cache.new_seq()
    s.reserve(len(tokens))
    meta = build_metadata([len(tokens)], [0], [s.blocks], s.slots(0, len(tokens)), 16, torch.device("cpu"))
    h = lm.model(torch.tensor(tokens), torch.arange(len(tokens)), cache.kv, meta)
    kv = cache.kv.view(c.num_layers, 2, -1, c.num_kv_heads, c.head_dim)[:, :, torch.tensor(s.slots(0, len(tokens)))]
    return kv, lm.model.compute_logits(h[-1:])


def _cached_kv(cache, blocks, n):
    kv = cache.kv
    return kv.view(kv.shape[0], 2, -1, kv.shape[-2], kv.shape[-1])[:, :, torch.tensor(blocks.slots(0, n))]


def _assert_caches_equal_a_fresh_prefill(eng, s) -> None:
    """``s``'s target and draft caches equal a from-scratch prefill of its committed tokens, and the
    next step's logits from its cache equal the from-scratch ones."""
    n = s.num_computed
    ref_kv, ref_logits = _fresh_kv(eng.target, s.tokens[: n + 1])
    assert torch.allclose(_cached_kv(eng.cache, s.blocks, n), ref_kv[:, :, :n], atol=1e-5)
    if s.draft_computed:
        dn = s.draft_computed
        dref, _ = _fresh_kv(eng.draft, s.tokens[:dn])
        assert torch.allclose(_cached_kv(eng.draft_cache, s.draft_blocks, dn), dref, atol=1e-5)
    kv = eng.cache.kv.clone()
    s.blocks.reserve(n + 1)
    meta = build_metadata([1], [n], [s.blocks.blocks], [s.blocks.slot(n)], 4, torch.device("cpu"))
    h = eng.target.model(torch.tensor([s.tokens[n]]), torch.tensor([n]), kv, meta)
    assert (eng.target.model.compute_logits(h) - ref_logits).abs().max() < 1e-4


def test_rollback_invariant_over_thousands_of_random_steps(shared_pair, monkeypatch):
    """Random accept lengths (random paths, random next tokens): after every step both pools balance,
    and every sequence's caches equal a from-scratch prefill of its committed tokens."""
    t, d = shared_pair
    eng = Engine(
        EngineConfig(
            target=str(TARGET),
            draft=str(DRAFT),
            cache=CacheConfig(block_size=4, num_blocks=400),
            spec=SpecConfig(adaptive=False, tree_budget=10),
        ),
        target=t,
        draft=d,
    )
    rng = random.Random(7)

    def random_verify(tree, argmax):
        node, acc = 0, []
        while tree.children[node] and rng.random() < 0.7:
            node = rng.choice(tree.children[node])
            acc.append(node)
        nxt = rng.randrange(3, 500)
        return AcceptResult(acc, [tree.token_list[i] for i in acc] + [nxt], nxt, not tree.children[node])

    monkeypatch.setattr(stages_mod, "greedy_verify", random_verify)
    prompts = _prompts(eng.tokenizer, 6)
    modes = ["chain", "tree", "off", "tree", "chain", "tree"]
    steps = 0
    checked = 0
    while steps < 1500:
        seqs = [
            eng.add_request(
                p,
                SamplingParams(temperature=0, max_tokens=rng.randint(40, 200), ignore_eos=True),
                SpecParams(mode=m, max_draft_tokens=rng.choice([None, 1, 3, 12])),
            )
            for p, m in zip(prompts, modes)
        ]
        while any(not s.finished for s in seqs):
            eng.step()
            steps += 1
            eng.cache.pool.check()
            eng.draft_cache.pool.check()
            if steps % 50 == 0:
                for s in seqs:
                    if not s.finished and s.num_computed > 0:
                        _assert_caches_equal_a_fresh_prefill(eng, s)
                        checked += 1
    assert checked > 20
    assert eng.kv_blocks_used() == (0, 0)
    assert eng.cache.pool.num_free == eng.cache.pool.num_blocks


def test_greedy_tokens_are_torch_argmax_ties_and_nan_included():
    """The verifier's per-row argmax (numpy on a CPU) picks what ``torch.argmax`` picks: the first of
    equal maxima, and a NaN where one is."""
    from specd.engine.stages import greedy_tokens

    g = torch.Generator().manual_seed(0)
    x = torch.randn(17, 49152, generator=g)
    x[3, 100] = x[3, 7] = x[3].max() + 1  # a tie: the lower id wins
    x[5, 2000] = float("nan")
    x[6] = 0.0  # all equal
    assert greedy_tokens(x) == x.argmax(-1).tolist()
    assert greedy_tokens(x)[3] == 7 and greedy_tokens(x)[6] == 0
    assert greedy_tokens(x[:, ::2]) == x[:, ::2].argmax(-1).tolist()  # a strided view
