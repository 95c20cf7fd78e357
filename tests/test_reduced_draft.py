"""Reduced-vocabulary drafts that use the target's embeddings by reference (specd.training.distill_reduced).

On the tiny stories260K target: a draft trained for a few steps over 96 of the 512 tokens (those its replies use, then
the lowest ids), exported,
loaded beside its target. Its files hold no embeddings or head; in memory its embedding IS the
target's tensor; it never drafts a token outside its vocabulary; and speculative greedy output equals
plain greedy output token for token (chain and tree), whatever the draft's quality.
"""

from __future__ import annotations

import json
import random

import pytest
import torch
from safetensors import safe_open

from specd.config import CacheConfig, EngineConfig, SpecConfig
from specd.engine.engine import Engine
from specd.engine.sequence import SpecParams
from specd.model.loader import LoadError, load_model
from specd.sampling.params import SamplingParams
from specd.training.data import pick_vocab
from specd.training.draft import DraftNet, init_from_target, reduced_config
from specd.training.export import export_reduced
from specd.training.loop import reduced_agreement, train_reduced
from tests.conftest import TARGET

pytestmark = pytest.mark.timeout(300)
N = 96


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory, shared_pair):
    target, _ = shared_pair
    tok = target.tokenizer
    texts = [
        "Once upon a time, there was a little girl named Lily.",
        "The dog ran to the park and played.",
        "Tom saw a big red ball. He was very happy.",
        "One day, the sun was hot and the birds sang.",
    ] * 4
    data = [(tok(t)["input_ids"], 3) for t in texts]
    d2t = pick_vocab(data, N, [2], target.config.vocab_size)
    t2d = torch.full((target.config.vocab_size,), -100, dtype=torch.long)
    t2d[d2t] = torch.arange(d2t.numel())
    embed = target.model.embed.weight.detach().float()
    hf_cfg = reduced_config(TARGET, 1)
    torch.manual_seed(0)
    net = DraftNet(hf_cfg, embed, embed.index_select(0, d2t))
    init_from_target(net, TARGET, 1)
    before = reduced_agreement(net, data, t2d)
    train_reduced(net, data, t2d, steps=30, batch=4, lr=3e-3, seed=0)
    assert reduced_agreement(net, data, t2d) > before  # it learns the replies
    out = tmp_path_factory.mktemp("draft")
    export_reduced(net, hf_cfg, d2t, out, {"test": True})
    random.seed(0)
    return out


def test_draft_files_hold_no_embeddings_and_the_target_is_shared_by_reference(draft_dir, shared_pair):
    target, _ = shared_pair
    with safe_open(str(draft_dir / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert "specd.d2t" in names and not any("embed" in n or "lm_head" in n for n in names)
    assert (draft_dir / "model.safetensors").stat().st_size < 200_000
    d = load_model(draft_dir, "cpu", "float32", target=target)
    assert d.model.embed.weight is target.model.embed.weight
    n = json.loads((draft_dir / "config.json").read_text())["specd_draft"]["draft_vocab_size"]
    assert d.model.d2t.numel() == n == N < 512 and 2 in d.model.d2t.tolist() and d.tokenizer is None
    logits = d.model.compute_logits(torch.randn(3, target.config.hidden_size))
    outside = torch.ones(target.config.vocab_size, dtype=torch.bool)
    outside[d.model.d2t] = False
    assert torch.isinf(logits[:, outside]).all() and torch.isfinite(logits[:, ~outside]).all()
    with pytest.raises(LoadError, match="load it with its target"):
        load_model(draft_dir, "cpu", "float32")


def test_speculative_greedy_equals_plain_with_a_reduced_vocabulary_draft(draft_dir, shared_pair):
    target, _ = shared_pair
    draft = load_model(draft_dir, "cpu", "float32", target=target)
    eng = Engine(
        EngineConfig(
            target=str(TARGET),
            draft=str(draft_dir),
            dtype="float32",
            cache=CacheConfig(num_blocks=256),
            spec=SpecConfig(adaptive=False),
        ),
        target=target,
        draft=draft,
    )
    tok = eng.tokenizer
    prompts = [tok(p)["input_ids"] for p in ("Once upon a time", "The dog", "Lily saw a big", "Tom and Sue")]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    plain = [s.output_ids for s in eng.generate(prompts, params, SpecParams("off"))]
    for mode in ("chain", "tree"):
        seqs = eng.generate(prompts, params, SpecParams(mode))
        assert [s.output_ids for s in seqs] == plain
        assert sum(s.stats.accepted_tokens for s in seqs) > 0  # the draft is really used
    # seeded sampling runs through the reduced draft too (its distribution is the verifier's job)
    sp = SamplingParams(temperature=0.8, seed=3, max_tokens=24, ignore_eos=True)
    assert all(s.num_output == 24 for s in eng.generate(prompts, sp, SpecParams("tree")))
    assert eng.kv_blocks_used() == (0, 0)
