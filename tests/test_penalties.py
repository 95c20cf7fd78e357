"""Repetition, frequency and presence penalties and min-p (``specd.sampling.penalties``, ``logits_to_probs``):

- each row of a draft tree is penalized exactly as plain decoding penalizes the row at that place
  (the reply as far as the row's path), bit for bit;
- greedy output with penalties is identical with and without speculation (chain, tree, prompt lookup,
  hybrid; alone and in mixed batches), and equals Hugging Face transformers' greedy decoding with its
  repetition penalty and a plain loop over its logits with OpenAI's presence / frequency penalties;
- sampled speculative output follows the penalized, min-p-filtered target distribution (chi-square);
- every front end takes the fields (OpenAI HTTP, the websocket, gRPC) and refuses bad values.
"""

from __future__ import annotations

import random

import pytest
import torch

from specd.config import EngineConfig, SpecConfig
from specd.engine.engine import Engine
from specd.engine.sequence import SpecParams
from specd.sampling.params import SamplingParams
from specd.sampling.penalties import penalize_, penalized_reference
from specd.sampling.probs import logits_to_probs
from specd.sampling.tree import DraftTree
from tests.conftest import DRAFT, TARGET
from tests.test_constrained import _logits
from tests.test_spec import _prompts
from tests.test_spec_sampling import assert_follows, tree_engine

PENALTIES = [
    {"repetition_penalty": 1.3},
    {"frequency_penalty": 0.8},
    {"presence_penalty": 1.2, "frequency_penalty": -0.3},
    {"repetition_penalty": 0.8, "presence_penalty": -0.5, "frequency_penalty": 0.4},
]


# params -------------------------------------------------------------------------------------------
def test_params_bounds_and_defaults():
    p = SamplingParams()
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.min_p) == (0.0, 0.0, 1.0, 0.0)
    assert not p.penalized and SamplingParams(repetition_penalty=1.0, presence_penalty=0).penalized is False
    assert SamplingParams(frequency_penalty=-2).penalized and SamplingParams(repetition_penalty=0.5).penalized
    assert not SamplingParams(min_p=0.5).penalized  # (a filter of the distribution, not a penalty)
    for field, bad in [
        ("presence_penalty", 2.01),
        ("frequency_penalty", -3),
        ("presence_penalty", float("nan")),
        ("frequency_penalty", "1"),
        ("repetition_penalty", 0),
        ("repetition_penalty", 10.5),
        ("repetition_penalty", True),
        ("min_p", -0.01),
        ("min_p", 1.01),
    ]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**{field: bad})


# one step's rows ----------------------------------------------------------------------------------
def _random_tree(rng: random.Random, n: int, vocab: int) -> DraftTree:
    tokens = [rng.randrange(vocab) for _ in range(n)]
    parents = [-1] + [rng.randrange(i) for i in range(1, n)]
    return DraftTree(tokens, parents)


def _path(tree: DraftTree, i: int) -> list:
    """The draft tokens from below the root down to node i."""
    out = []
    while i > 0:
        out.append(tree.token_list[i])
        i = tree.parent_list[i]
    return out[::-1]


@pytest.mark.parametrize("kw", PENALTIES)
def test_every_tree_row_is_the_plain_row_of_its_path_bit_for_bit(kw):
    """Node i's row equals the dense reference for the reply + node i's path (the row plain decoding
    computes after accepting that path), and rows of other requests are untouched."""
    rng = random.Random(0)
    params = SamplingParams(**kw)
    vocab = 97
    for trial in range(30):
        n = rng.randint(1, 12)
        tree = _random_tree(rng, n, vocab)
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(0, 20))]
        output = [rng.randrange(8) for _ in range(rng.randint(0, 30))]  # (few distinct ids: repeats)
        logits = torch.randn(n + 5, vocab) * 4
        before = logits.clone()
        penalize_(logits, 2, tree, params, prompt, output)
        for i in range(n):
            want = penalized_reference(before[2 + i], params, prompt, output + _path(tree, i))
            assert torch.equal(logits[2 + i], want), (trial, i)
        assert torch.equal(logits[:2], before[:2]) and torch.equal(logits[2 + n :], before[2 + n :])
    off = torch.randn(3, vocab)
    kept = off.clone()
    penalize_(off, 0, _random_tree(rng, 3, vocab), SamplingParams(), [1, 2], [3])
    assert torch.equal(off, kept)


@pytest.mark.parametrize("kw", PENALTIES)
def test_a_reduced_vocabulary_is_penalized_in_its_own_columns(kw):
    """``penalize_rows_`` with ``columns`` (a feature head's reduced vocabulary): each kept token's column
    gets what the full vocabulary's row gets; tokens without a column are left out."""
    from specd.sampling.penalties import penalize_rows_

    rng = random.Random(1)
    params, vocab = SamplingParams(**kw), 60
    d2t = torch.tensor(sorted(rng.sample(range(vocab), 25)))
    columns = torch.full((vocab,), -1, dtype=torch.int64)
    columns[d2t] = torch.arange(len(d2t))
    for _ in range(10):
        paths = [[rng.randrange(vocab) for _ in range(rng.randint(0, 4))] for _ in range(4)]
        prompt, output = [rng.randrange(vocab) for _ in range(9)], [rng.randrange(vocab) for _ in range(12)]
        full = torch.randn(4, vocab) * 3
        small = full[:, d2t].clone()
        penalize_rows_(full, range(4), paths, params, prompt, output)
        penalize_rows_(small, [0, 1, 2, 3], paths, params, prompt, output, columns)
        assert torch.equal(small, full[:, d2t])


def test_the_reference_is_openais_and_hugging_faces_formula():
    """Presence / frequency: minus p once and f per occurrence in the reply; repetition: HF's
    ``RepetitionPenaltyLogitsProcessor`` over prompt + reply."""
    from transformers import RepetitionPenaltyLogitsProcessor

    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0])
    got = penalized_reference(logits, SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), [4], [0, 0, 2])
    assert got.tolist() == [2.0 - 0.5 - 0.5, -1.0, 0.5 - 0.5 - 0.25, 3.0, -2.0]
    rep = SamplingParams(repetition_penalty=2.0)
    hf = RepetitionPenaltyLogitsProcessor(2.0)(torch.tensor([[4, 0, 1]]), logits[None].clone())[0]
    assert torch.equal(penalized_reference(logits, rep, [4], [0, 1]), hf)


def test_min_p_drops_tokens_below_its_share_of_the_likeliest():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.25, 0.25, 0.25, 0.25]]))
    probs = logits_to_probs(logits, [1.0, 1.0], [0, 0], [1.0, 1.0], [0.2, 0.9])
    assert probs[0].tolist() == pytest.approx([0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0])  # 0.05 < 0.2 * 0.5
    assert probs[1].tolist() == pytest.approx([0.25] * 4)  # (ties with the likeliest stay)
    both = logits_to_probs(logits, [1.0, 1.0], [2, 0], [1.0, 1.0], [0.2, 0.0])  # min-p, then top-k
    assert both[0].tolist() == pytest.approx([0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0])
    assert torch.equal(logits_to_probs(logits, [1.0] * 2, [0] * 2, [1.0] * 2, [0.0] * 2), torch.softmax(logits, -1))
    greedy = logits_to_probs(logits, [0.0, 0.0], [0, 0], [1.0, 1.0], [0.9, 0.9])
    assert greedy.argmax(-1).tolist() == [0, 0] and greedy.sum(-1).tolist() == [1.0, 1.0]


# greedy: speculation changes nothing, and transformers agrees -------------------------------------
@pytest.fixture(scope="module")
def engine(shared_pair):
    t, d = shared_pair
    cfg = EngineConfig(target=str(TARGET), draft=str(DRAFT), spec=SpecConfig(adaptive=False))
    return Engine(cfg, target=t, draft=d)


@pytest.fixture(scope="module")
def prompts(engine):
    return _prompts(engine.tokenizer, 10)


@pytest.mark.parametrize("kw", PENALTIES)
def test_greedy_with_penalties_is_the_same_with_every_proposer(engine, prompts, kw):
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, **kw)
    off = [s.output_ids for s in engine.generate(prompts, params, SpecParams(mode="off"))]
    plain = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    assert off != [s.output_ids for s in engine.generate(prompts, plain, SpecParams(mode="off"))]  # (they bite)
    for mode in ("chain", "tree", "ngram", "hybrid"):
        seqs = engine.generate(prompts, params, SpecParams(mode=mode))
        assert [s.output_ids for s in seqs] == off, mode
        if mode in ("chain", "tree"):
            assert sum(s.stats.accepted_tokens for s in seqs) > len(prompts)  # drafts were verified and kept
    assert engine.kv_blocks_used() == (0, 0)


def test_the_drafter_drafts_from_the_penalized_distribution(engine, prompts, monkeypatch):
    """The draft model's rows are penalized as the target's will be (the reply as far as each node):
    with a repetition penalty its drafts are accepted more often than unpenalized drafts (the same
    output either way)."""
    from specd.speculation.drafter import Drafter

    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, repetition_penalty=1.3)

    def run():
        seqs = engine.generate(prompts, params, SpecParams(mode="chain"))
        return [s.output_ids for s in seqs], sum(s.stats.accepted_tokens for s in seqs)

    out, accepted = run()
    monkeypatch.setattr(Drafter, "_penalize", lambda self, frontier, logits: None)
    out_plain, accepted_plain = run()
    assert out == out_plain and accepted > 1.05 * accepted_plain, (accepted, accepted_plain)


def test_a_mixed_batch_penalizes_each_request_by_its_own_reply(engine, prompts):
    """Requests with different penalties (and none) in one tree-speculating batch: each reply is its
    own plain penalized greedy reply."""
    kws = [{}, *PENALTIES]
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, **kws[i % len(kws)]) for i in range(8)]
    ps = [prompts[i % len(prompts)] for i in range(8)]
    alone = [engine.generate([p], q, SpecParams(mode="off"))[0].output_ids for p, q in zip(ps, params)]
    together = engine.generate(ps, params, SpecParams(mode="tree"))
    assert [s.output_ids for s in together] == alone


def test_greedy_with_penalties_equals_transformers(engine, prompts, hf_target):
    """Hugging Face's greedy ``generate`` with its repetition penalty; OpenAI's presence and frequency
    penalties as a plain loop over its logits (transformers has no processor for them)."""
    for p in prompts[:4]:
        kw = {"repetition_penalty": 1.3}
        ours = engine.generate([p], SamplingParams(temperature=0, max_tokens=40, **kw), SpecParams(mode="tree"))[0]
        ref = hf_target.generate(
            torch.tensor([p]), max_new_tokens=40, do_sample=False, eos_token_id=[2, 1], pad_token_id=0, **kw
        )[0, len(p) :].tolist()
        assert ours.output_ids == ref
    pres, freq = 0.7, 0.4
    for p in prompts[:3]:
        params = SamplingParams(
            temperature=0, max_tokens=30, ignore_eos=True, presence_penalty=pres, frequency_penalty=freq
        )
        ours = engine.generate([p], params, SpecParams(mode="tree"))[0].output_ids
        ids, out = list(p), []
        with torch.no_grad():
            for _ in range(30):
                logits = hf_target(torch.tensor([ids])).logits[0, -1].float()
                counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=logits.shape[0]).float()
                out.append(int((logits - freq * counts - pres * (counts > 0).float()).argmax()))
                ids.append(out[-1])
        assert ours == out


# sampled: the penalized distribution ---------------------------------------------------------------
def _penalized_probs(lm, prompt: list, reply: list, params: SamplingParams, top_k: int) -> torch.Tensor:
    """The target's distribution for the token after ``prompt + reply`` under ``params`` (penalties,
    temperature 1, min-p, top-k), from a fresh forward."""
    from specd.sampling.probs import logits_to_probs as l2p

    raw = _target_probs_logits(lm, prompt + reply)
    pen = penalized_reference(raw, params, prompt, reply)
    return l2p(pen[None], [1.0], [top_k], [1.0], [params.min_p])[0].double()


def _target_probs_logits(lm, tokens: list) -> torch.Tensor:
    """The target's raw next-token logits after ``tokens`` [V] (tests/test_constrained.py's prefill)."""
    return _logits(lm, tokens)[0].float()


def test_sampled_speculation_follows_the_penalized_distribution(shared_pair):
    """Two sampled tokens per request from a drafting tree (its depth-1 rows are penalized with their
    own draft token): their joint distribution is the penalized, min-p and top-k filtered target's."""
    t, d = shared_pair
    eng = tree_engine(t, d)
    prompt = eng.tokenizer("Once upon a time, there was a")["input_ids"]
    kw = {"presence_penalty": 1.5, "frequency_penalty": 0.5, "repetition_penalty": 1.3, "min_p": 0.02}
    top_k = 8
    ref = SamplingParams(**kw)
    p1 = _penalized_probs(t, prompt, [], ref, top_k)
    joint = {}
    for x1 in torch.nonzero(p1).flatten().tolist():
        p2 = _penalized_probs(t, prompt, [x1], ref, top_k)
        for x2 in torch.nonzero(p2).flatten().tolist():
            joint[(x1, x2)] = float(p1[x1] * p2[x2])
    n = 3000
    params = [SamplingParams(top_k=top_k, seed=i, max_tokens=2, ignore_eos=True, **kw) for i in range(n)]
    seqs = eng.generate([prompt] * n, params, SpecParams(mode="tree"))
    assert eng.stats.accepted_tokens > 0.2 * n  # drafts were really accepted
    assert_follows(joint, [s.output_ids for s in seqs], 0.06)
    assert eng.kv_blocks_used() == (0, 0)


def test_specd_generate_takes_the_flags(engine, prompts):
    """``specd generate --repetition-penalty ... --presence-penalty ...``: the engine's penalized greedy
    reply; a bad value is a one-line error and a non-zero exit."""
    import json
    import subprocess
    import sys

    from tests.conftest import ROOT

    text = "Once upon a time, there was a little"
    kw = {"repetition_penalty": 1.3, "presence_penalty": 0.5, "frequency_penalty": 0.25, "min_p": 0.1}
    ids = engine.tokenizer(text)["input_ids"]
    want = engine.generate([ids], SamplingParams(temperature=0, max_tokens=30, **kw), SpecParams(mode="off"))[0]
    base = [sys.executable, "-m", "specd", "generate", "--target", str(TARGET), "--draft", str(DRAFT), "--raw"]
    base += ["--prompt", text, "--max-tokens", "30", "--spec", "tree", "--json"]
    flags = [f for k, v in kw.items() for f in (f"--{k.replace('_', '-')}", str(v))]
    env = {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    out = subprocess.run(base + flags, capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1])["token_ids"] == want.output_ids
    bad = subprocess.run(
        base + ["--repetition-penalty", "0"], capture_output=True, text=True, timeout=120, cwd=ROOT, env=env
    )
    assert bad.returncode != 0 and "repetition_penalty" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
