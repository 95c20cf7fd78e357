"""The built-in demo pair (models/demo): specd == transformers greedy, and speculation is lossless."""

import torch

from specd.config import EngineConfig, SpecConfig
from specd.engine.engine import Engine
from specd.engine.sequence import SpecParams
from specd.sampling.params import SamplingParams
from tests.conftest import ROOT

DEMO = ROOT / "models" / "demo"
QUESTIONS = [
    "Tom has 3 apples and buys 2 more. How many apples does he have?",
    "A baker makes 24 cookies and sells half of them. How many cookies are left?",
    "Sara reads 12 pages a day. How many pages does she read in 5 days?",
]


def test_demo_pair_specd_matches_transformers_and_speculation_is_lossless():
    from transformers import AutoModelForCausalLM

    # fp32 as transformers runs it (dtype auto picks bf16 for this pair on an AMX CPU, by timing)
    cfg = EngineConfig(
        target=str(DEMO / "target"), draft=str(DEMO / "draft"), dtype="float32", spec=SpecConfig(adaptive=False)
    )
    eng = Engine(cfg)
    tok = eng.tokenizer
    prompts = [
        tok.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        for q in QUESTIONS
    ]
    params = SamplingParams(temperature=0, max_tokens=48)
    off = eng.generate(prompts, params, SpecParams(mode="off"))
    hf = AutoModelForCausalLM.from_pretrained(str(DEMO / "target"), dtype=torch.float32).eval()
    eos = hf.generation_config.eos_token_id
    for p, s in zip(prompts, off):
        ref = hf.generate(
            torch.tensor([p]), max_new_tokens=48, do_sample=False, eos_token_id=eos, pad_token_id=tok.pad_token_id
        )[0, len(p) :].tolist()
        assert s.output_ids == ref
    text = eng.output_text(off[0])
    assert any(w in text for w in ("answer", "=", "apples")), text  # GSM8K-style reply
    for mode in ("chain", "tree"):
        spec = eng.generate(prompts, params, SpecParams(mode=mode))
        assert [s.output_ids for s in spec] == [s.output_ids for s in off]
        assert sum(s.stats.accepted_tokens for s in spec) / sum(s.stats.steps for s in spec) > 0.8
    assert eng.kv_blocks_used() == (0, 0)
