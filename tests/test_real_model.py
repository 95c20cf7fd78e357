"""Losslessness on the real built-in model (SmolLM2-135M-Instruct) with its built-in draft, fp32.

- specd plain greedy == transformers greedy on the same weights; where they differ, it must be a
  near-tie of the target's logits at the first differing token (the gap is reported);
- specd speculative greedy (chain and tree, batch 1 and 4) == specd plain, token for token, always.

`make test` runs 3 chat prompts; `make test-slow` runs 32 (GSM8K test-style questions and
Spec-Bench first turns are evaluation data only in the other direction: these prompts are read,
never trained on).
"""

from __future__ import annotations

import json

import pytest
import torch

from specd.config import CacheConfig, EngineConfig, SpecConfig
from specd.engine.engine import Engine
from specd.engine.sequence import SpecParams
from specd.model import builtin
from specd.model.loader import checkpoint_folder
from specd.sampling.params import SamplingParams
from tests.conftest import SHARED

pytestmark = pytest.mark.timeout(3600)
NEAR_TIE = 1e-3  # logit gap (fp32) under which transformers and specd may break a tie differently
SHORT = [
    "What is the capital of France?",
    "Tom has 3 apples and buys 4 more. How many apples does he have?",
    "Write a haiku about the sea.",
]


def _prompts(n: int) -> list:
    if n <= len(SHORT):
        return SHORT[:n]
    rows = [json.loads(x) for x in (SHARED / "data" / "spec_bench" / "question.jsonl").read_text().splitlines()]
    return SHORT + [r["turns"][0] for r in rows[:: max(1, len(rows) // n)]][: n - len(SHORT)]


@pytest.fixture(scope="module")
def engine():
    draft = builtin.draft_path()
    assert draft is not None, "models/smollm2-draft is missing"
    return Engine(
        EngineConfig(
            target=str(builtin.builtin_gguf()),
            draft=str(draft),
            dtype="float32",
            cache=CacheConfig(num_blocks=256),
            spec=SpecConfig(adaptive=False),
        )
    )


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        str(checkpoint_folder(builtin.builtin_gguf())), dtype=torch.float32
    ).eval()


def _ids(engine, text: str) -> list:
    ids = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def _tie_gap(hf, ids: list, out_a: list, out_b: list) -> float:
    """The target's top-2 logit gap where the two outputs first differ."""
    k = next(i for i, (a, b) in enumerate(zip(out_a, out_b)) if a != b)
    with torch.no_grad():
        logits = hf(torch.tensor([ids + out_a[:k]])).logits[0, -1]
    top = logits.topk(2).values
    return float(top[0] - top[1])


def check(engine, hf, texts: list, max_tokens: int) -> None:
    prompts = [_ids(engine, t) for t in texts]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    plain = [s.output_ids for s in engine.generate(prompts, params, SpecParams("off"))]
    for ids, out in zip(prompts, plain):
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False)[0, len(ids) :].tolist()
        ref = ref[: len(out)] if len(ref) > len(out) else ref
        if ref != out[: len(ref)]:
            gap = _tie_gap(hf, ids, ref, out)
            assert gap < NEAR_TIE, f"specd and transformers differ where the target's top-2 gap is {gap}"
    for mode in ("chain", "tree", "ngram", "hybrid"):
        for batch in (1, 4):
            got = []
            for i in range(0, len(prompts), batch):
                got += [s.output_ids for s in engine.generate(prompts[i : i + batch], params, SpecParams(mode))]
            assert got == plain, (mode, batch)
    assert engine.kv_blocks_used() == (0, 0)


def test_speculative_equals_plain_equals_transformers_on_the_real_model(engine, hf):
    check(engine, hf, _prompts(3), max_tokens=32)
    assert engine.stats.accepted_tokens > 0  # the draft really drafted and was accepted


@pytest.mark.slow
def test_speculative_equals_plain_equals_transformers_on_32_prompts(engine, hf):
    check(engine, hf, _prompts(32), max_tokens=96)
