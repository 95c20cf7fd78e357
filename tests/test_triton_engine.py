"""The real engine on the Triton backend (interpreter on CPU): greedy speculative output == torch backend."""

import pytest

from specd.config import EngineConfig, SpecConfig
from specd.engine.engine import Engine
from specd.engine.sequence import SpecParams
from specd.sampling.params import SamplingParams
from tests.conftest import DRAFT, TARGET


def test_triton_backend_engine_is_lossless(shared_pair):
    pytest.importorskip("triton")
    t, d = shared_pair
    cfg = dict(target=str(TARGET), draft=str(DRAFT), spec=SpecConfig(adaptive=False, tree_budget=6, tree_depth=3))
    ref_eng = Engine(EngineConfig(**cfg, attention_backend="torch"), target=t, draft=d)
    tri = Engine(EngineConfig(**cfg, attention_backend="triton"), target=t, draft=d)
    assert type(tri.backend).__name__ == "TritonAttention"
    tok = ref_eng.tokenizer
    prompts = [
        tok(p)["input_ids"]
        for p in ("Once upon a time, there was a little", "The cat and the dog", "Tom had a big red ball. One day")
    ]
    params = SamplingParams(temperature=0, max_tokens=8)  # (10 + 8 tokens: across a 16-token KV block)
    ref = [s.output_ids for s in ref_eng.generate(prompts, params, SpecParams(mode="off"))]
    for mode in ("chain", "tree"):
        got = tri.generate(prompts, params, SpecParams(mode=mode))
        assert [s.output_ids for s in got] == ref, mode
        assert sum(s.stats.accepted_tokens for s in got) > 0  # compaction (copy_slots) was exercised
    assert tri.kv_blocks_used() == (0, 0)
