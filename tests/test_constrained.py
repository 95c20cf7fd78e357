"""Constrained decoding in the engine (issue 41): every verified row gets its path's mask, drafts the
grammar forbids are pruned, forced tokens are free drafts, the matcher follows the one rollback;
greedy constrained output is the same with every proposer and batch size as plain constrained
decoding, and every reply is valid under its grammar."""

import itertools
import json

import pytest
import torch

from specd.config import EngineConfig, SpecConfig
from specd.engine.engine import Engine
from specd.engine.kv_cache import KVCache
from specd.model.attention import build_metadata
from specd.sampling.params import SamplingParams
from specd.sampling.probs import logits_to_probs
from specd.speculation.request import SpecParams
from specd.structured import GrammarSpec
from tests.conftest import DRAFT, TARGET

PETS = ["cat", "dog", "bird"]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"enum": PETS},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 2},
    },
    "required": ["name", "age", "pet"],
    "additionalProperties": False,
}
STORIES = ["Once upon a time", "Tom had a big red ball.", "The cat and the dog", "Sam was sad because"]
GREEDY = SamplingParams(temperature=0, max_tokens=96)


def _valid(obj) -> bool:
    """SCHEMA's rules, checked by hand (a reply must satisfy every one)."""
    if not isinstance(obj, dict) or set(obj) - set(SCHEMA["properties"]) or not {"name", "age", "pet"} <= set(obj):
        return False
    tags = obj.get("tags", [])
    return (
        isinstance(obj["name"], str)
        and len(obj["name"]) <= 12
        and isinstance(obj["age"], int)
        and 0 <= obj["age"] <= 120
        and obj["pet"] in PETS
        and isinstance(tags, list)
        and len(tags) <= 2
        and all(isinstance(t, str) and len(t) <= 6 for t in tags)
    )


@pytest.fixture(scope="module")
def engine(shared_pair):
    t, d = shared_pair
    cfg = EngineConfig(target=str(TARGET), draft=str(DRAFT), spec=SpecConfig(adaptive=True), mask_overlap="off")
    return Engine(cfg, t, d)  # (masks on the engine thread; the ``overlapped`` fixture turns the worker on)


@pytest.fixture(scope="module")
def reference(engine):
    prompts = [engine.tokenizer(s)["input_ids"] for s in STORIES]
    seqs = engine.generate(prompts, GREEDY, SpecParams(mode="off"), grammar=GrammarSpec("json_schema", SCHEMA))
    return prompts, [s.output_ids for s in seqs]


def _reply(engine, ids) -> str:
    text = engine.tokenizer.decode(ids, skip_special_tokens=True)
    return text


def test_plain_constrained_replies_are_valid_and_end_at_the_grammar(engine, reference):
    prompts, outs = reference
    for out in outs:
        obj = json.loads(_reply(engine, out))
        assert _valid(obj), obj
        assert out[-1] in engine.eos_ids  # the grammar allowed only a stop token once complete


@pytest.fixture
def overlapped(engine):
    """The engine with its masks filled on the worker thread during the forward (as on a GPU)."""
    engine.constraints.overlap = True
    yield engine
    engine.constraints.overlap = False


def _greedy_replies(engine, prompts, mode, batch) -> list:
    g = GrammarSpec("json_schema", SCHEMA)
    got = []
    for i in range(0, len(prompts), batch):
        got += [s.output_ids for s in engine.generate(prompts[i : i + batch], GREEDY, SpecParams(mode=mode), grammar=g)]
    return got


@pytest.mark.parametrize("mode", ["chain", "tree", "ngram", "hybrid", "auto"])
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_constrained_speculation_equals_plain(engine, reference, mode, batch):
    prompts, outs = reference
    failures = engine.health.stage_failures
    assert _greedy_replies(engine, prompts, mode, batch) == outs
    assert engine.kv_blocks_used() == (0, 0)
    assert engine.health.stage_failures == failures  # (no step failed and was retried in halves)


@pytest.mark.parametrize("mode", ["off", "tree", "auto"])
def test_overlapped_masks_give_the_same_replies(overlapped, reference, mode):
    prompts, outs = reference
    failures = overlapped.health.stage_failures
    assert _greedy_replies(overlapped, prompts, mode, 4) == outs
    assert overlapped.health.stage_failures == failures
    assert overlapped.kv_blocks_used() == (0, 0)


def test_overlapped_masks_are_filled_while_the_forward_runs(overlapped, reference, monkeypatch):
    """The forward waits (bounded) for the step's mask fills to finish on the worker thread: were
    the fills run after the forward, or on the engine thread, the wait would time out."""
    import threading

    import specd.engine.constraints as C
    import specd.engine.engine as E

    filled, threads, waits = threading.Event(), set(), []
    fill, forward = C._fill_masks, E.target_pass

    def traced_fill(jobs):
        threads.add(threading.current_thread().name)
        out = fill(jobs)
        filled.set()
        return out

    def waiting_forward(*a, **k):
        waits.append(filled.wait(timeout=10))
        filled.clear()
        return forward(*a, **k)

    monkeypatch.setattr(C, "_fill_masks", traced_fill)
    monkeypatch.setattr(E, "target_pass", waiting_forward)
    prompts, outs = reference
    assert _greedy_replies(overlapped, prompts[:1], "tree", 1) == outs[:1]
    assert waits and all(waits)
    assert threads and all(t.startswith("specd-masks") for t in threads)


def test_a_failed_step_waits_for_its_mask_fills_before_rolling_back(overlapped, reference, monkeypatch):
    """A forward that fails for the whole batch (then succeeds for its halves) while the worker is
    still filling masks (it is made to take 50 ms): the ledger rolls the matchers back only once the
    fills are over, and the replies are what they are without the failure."""
    import threading
    import time

    import specd.engine.constraints as C

    prompts, outs = reference
    started, done, failures, early = threading.Event(), threading.Event(), [], []
    fill, restore = C._fill_masks, overlapped.ledger.restore

    def slow_fill(jobs):
        started.set()
        time.sleep(0.05)
        out = fill(jobs)
        done.set()
        return out

    def hook(stage, seqs):
        if stage == "forward" and len(seqs) > 1 and len(failures) < 3:
            failures.append(len(seqs))
            assert started.wait(10)
            done.clear()  # (set only when this step's fills end)
            raise RuntimeError("injected")

    def checked_restore(seq, cp):
        if failures and not done.is_set():
            early.append(seq.request_id)
        return restore(seq, cp)

    monkeypatch.setattr(C, "_fill_masks", slow_fill)
    monkeypatch.setattr(overlapped.ledger, "restore", checked_restore)
    overlapped.fault_hook = hook
    try:
        assert _greedy_replies(overlapped, prompts, "tree", 4) == outs
    finally:
        overlapped.fault_hook = None
    assert failures and not early and overlapped.kv_blocks_used() == (0, 0)


def test_the_matcher_after_a_speculative_reply_equals_a_replay_of_it(engine, reference):
    prompts, outs = reference
    g = GrammarSpec("json_schema", SCHEMA)
    seq = engine.generate(
        prompts[:1], SamplingParams(temperature=0, max_tokens=20), SpecParams(mode="tree"), grammar=g
    )[0]
    assert seq.finish_reason == "length" and seq.matcher is not None
    fresh = engine.constraints.compiler.compile(g).matcher()
    for t in seq.output_ids:
        assert fresh.advance(t)
    assert fresh.num_tokens == seq.matcher.num_tokens == len(seq.output_ids)
    assert fresh.allowed().equal(seq.matcher.allowed())


def _run(engine, prompts, mode, grammar, tenant):
    seqs = [engine.add_request(p, GREEDY, SpecParams(mode=mode), tenant=tenant, grammar=grammar) for p in prompts]
    while any(not s.finished for s in seqs):
        engine.step()
    return seqs


def test_forced_tokens_are_drafted_and_accepted(shared_pair):
    """Once a choice grammar's first token is written the rest is forced: digits, which this
    tokenizer only writes one per token, so the forced tokens are the only tokenization and the
    target must accept all of them. (A new tenant: the suffix store has nothing of theirs.) A fresh
    engine: forced text is drafted even where prompt lookup has never paid (its budget is priced at
    the grammar proposer's acceptance, not lookup's)."""
    engine = Engine(EngineConfig(target=str(TARGET), draft=str(DRAFT), spec=SpecConfig(adaptive=True)), *shared_pair)
    assert engine.constraints.overlap  # (the default: masks filled during the forward)
    # every step priced alike (one tick of the policy's clock): the forced drafts' budget must not hang on
    # this machine's timings of the first steps (with the thread's CPU time, 2 of 5 runs on a busy 2-core
    # machine drafted only part of the forced run)
    engine._policy_clock = itertools.count().__next__
    prompts = [engine.tokenizer(s)["input_ids"] for s in STORIES[:2]]
    g = GrammarSpec("choice", ("0123456789012", "x"))
    plain = [s.output_ids for s in _run(engine, prompts, "off", g, "forced-plain")]
    assert all(_reply(engine, p) in g.value for p in plain)
    before = list(engine.stats.by_proposer.get("grammar", [0, 0, 0]))
    seqs = _run(engine, prompts, "ngram", g, "forced-spec")
    assert [s.output_ids for s in seqs] == plain
    steps, drafted, accepted = (a - b for a, b in zip(engine.stats.by_proposer["grammar"], before))
    digits = [s for s in seqs if _reply(engine, s.output_ids).startswith("0")]
    assert digits, "the model chose x for every prompt: pick prompts that start the number"
    assert accepted >= 8 * len(digits) and accepted == drafted  # the whole forced run, never rejected
    assert sum(s.stats.steps for s in digits) < sum(len(s.output_ids) for s in digits) - 8


def test_a_refused_grammar_ends_its_request_alone(engine, reference):
    prompts, outs = reference
    bad = GrammarSpec("regex", "(unclosed")
    good = GrammarSpec("json_schema", SCHEMA)
    seqs = engine.generate(prompts[:2], GREEDY, SpecParams(mode="tree"), grammar=[bad, good])
    assert seqs[0].finish_reason == "error" and "regex" in seqs[0].error
    assert seqs[1].output_ids == outs[1]
    assert engine.kv_blocks_used() == (0, 0)


def test_logit_bias_params_are_validated():
    p = SamplingParams(logit_bias={"17": -100, 3: 2.5})
    assert p.logit_bias == ((3, 2.5), (17, -100.0))
    for bad in ({"x": 1}, {1: 101}, {1: float("nan")}, {i: 1 for i in range(301)}, [(1, 2, 3)]):
        with pytest.raises(ValueError, match="logit_bias"):
            SamplingParams(logit_bias=bad)


def test_logit_bias_steers_every_mode_alike(engine, reference):
    """A -100 bias bans the plain reply's most frequent token: the replies change, never contain it,
    and speculation (every mode, batch 1 and 4) gives the biased target's output exactly."""
    from specd.engine.requests import RequestError

    prompts = [engine.tokenizer(s)["input_ids"] for s in STORIES]
    plain = [s.output_ids for s in engine.generate(prompts, GREEDY, SpecParams(mode="off"))]
    banned = max(set(plain[0]), key=plain[0].count)
    biased = SamplingParams(temperature=0, max_tokens=96, logit_bias={banned: -100})
    ref = [s.output_ids for s in engine.generate(prompts, biased, SpecParams(mode="off"))]
    assert ref[0] != plain[0] and all(banned not in r for r in ref)
    for mode in ("tree", "ngram", "auto"):
        assert [s.output_ids for s in engine.generate(prompts, biased, SpecParams(mode=mode))] == ref
        got = [engine.generate([p], biased, SpecParams(mode=mode))[0].output_ids for p in prompts]
        assert got == ref
    with pytest.raises(RequestError, match="logit_bias"):
        engine.add_request(prompts[0], SamplingParams(logit_bias={engine.vocab_size: 1}))


def test_sampled_constrained_speculation_follows_the_masked_target(shared_pair):
    """Sampled tree speculation under a grammar: the first two tokens follow the target's
    distribution with each row masked by its path's grammar state (masked, then temperature and
    top-k), chi-square and total variation as the unconstrained sampler test; the mask matters
    (the unmasked joint is far from it)."""
    from tests.test_spec_sampling import TEMP, TOPK, _target_probs, assert_follows

    t, d = shared_pair
    spec = SpecConfig(mode="tree", tree_budget=8, tree_topk=3, tree_depth=3, adaptive=False)
    eng = Engine(EngineConfig(target=str(TARGET), draft=str(DRAFT), spec=spec), t, d)
    g = GrammarSpec("regex", " [a-km-z][a-z ]{0,40}")  # no word starting with "l": not "little" (p 0.7)
    prompt = eng.tokenizer("Once upon a time, there was a")["input_ids"]
    m = eng.constraints.compiler.compile(g).matcher()

    def masked(prefix: list):
        for tok in prefix:
            assert m.advance(tok)
        allowed = m.allowed()
        m.rollback(len(prefix))
        logits = _logits(t, prompt + prefix)
        logits = logits.masked_fill(~allowed[: logits.shape[-1]], float("-inf"))
        return logits_to_probs(logits, torch.tensor([TEMP]), torch.tensor([TOPK]), torch.tensor([1.0]))[0].double()

    p1, joint, free = masked([]), {}, {}
    for x1 in torch.nonzero(p1).flatten().tolist():
        p2 = masked([x1])
        for x2 in torch.nonzero(p2).flatten().tolist():
            joint[(x1, x2)] = float(p1[x1] * p2[x2])
    q1 = _target_probs(t, prompt)
    for x1 in torch.nonzero(q1).flatten().tolist():
        q2 = _target_probs(t, prompt + [x1])
        for x2 in torch.nonzero(q2).flatten().tolist():
            free[(x1, x2)] = float(q1[x1] * q2[x2])
    tv_free = 0.5 * sum(abs(joint.get(k, 0) - free.get(k, 0)) for k in set(joint) | set(free))
    assert tv_free > 0.2  # the grammar changes the distribution a lot
    n = 2000
    params = [SamplingParams(temperature=TEMP, top_k=TOPK, seed=i, max_tokens=2, ignore_eos=True) for i in range(n)]
    seqs = eng.generate([prompt] * n, params, SpecParams(mode="tree"), grammar=g)
    assert eng.stats.accepted_tokens > 0.04 * n  # (the draft mostly proposes "little": pruned)
    assert_follows(joint, [s.output_ids for s in seqs], 0.07)
    assert eng.kv_blocks_used() == (0, 0)


def _logits(lm, tokens: list) -> torch.Tensor:
    """The target's raw next-token logits after ``tokens`` [1, V] (a fresh cache, one prefill)."""
    c = lm.config
    cache = KVCache(c.num_layers, c.num_kv_heads, c.head_dim, 8, 16, torch.float32, torch.device("cpu"))
    s = cache.new_seq()
    s.reserve(len(tokens))
    meta = build_metadata([len(tokens)], [0], [s.blocks], s.slots(0, len(tokens)), 16, torch.device("cpu"))
    with torch.inference_mode():
        h = lm.model(torch.tensor(tokens), torch.arange(len(tokens)), cache.kv, meta)
        return lm.model.compute_logits(h[-1:]).clone()


def test_the_grammar_vocabulary_is_built_off_the_callers_thread(engine, monkeypatch):
    """The first grammar builds the compiler's vocabulary (~1 s on a real tokenizer) on a thread of
    its own: ``compile`` returns at once (the engine loop keeps stepping), its future settles once
    the vocabulary and the grammar are built; a vocabulary that cannot be built fails the grammar."""
    import threading
    import time

    from specd.engine.constraints import Constraints
    from specd.structured import Vocabulary

    gate, build = threading.Event(), Vocabulary.from_tokenizer

    def slow(*a, **k):
        gate.wait(10)
        return build(*a, **k)

    monkeypatch.setattr(Vocabulary, "from_tokenizer", staticmethod(slow))
    c = Constraints(engine.tokenizer, engine.vocab_size, engine.eos_ids)
    t0 = time.perf_counter()
    fut = c.compile(GrammarSpec("json_schema", SCHEMA))
    assert time.perf_counter() - t0 < 0.5 and not fut.done()
    gate.set()
    assert fut.result(30).matcher().allowed().any()
    broken = Constraints(None, engine.vocab_size, engine.eos_ids)
    err = broken.compile(GrammarSpec("json_object")).exception(10)
    assert isinstance(err, ValueError) and "tokenizer" in str(err)
    c.close()
