"""Prefix cache: turn 2 of a chat prefills only the new message; output unchanged with and without hits."""

from specd.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from specd.engine.engine import Engine
from specd.engine.sequence import SpecParams
from specd.sampling.params import SamplingParams
from tests.conftest import DRAFT, TARGET

G = SamplingParams(temperature=0, max_tokens=40)


def _engine(shared_pair, prefix=True, **cache):
    t, d = shared_pair
    return Engine(
        EngineConfig(
            target=str(TARGET),
            draft=str(DRAFT),
            cache=CacheConfig(block_size=4, **cache),
            spec=SpecConfig(adaptive=False),
            scheduler=SchedulerConfig(enable_prefix_cache=prefix),
        ),
        target=t,
        draft=d,
    )


def test_second_turn_reuses_first_turn_blocks_and_output_is_unchanged(shared_pair):
    eng = _engine(shared_pair)
    cold = _engine(shared_pair, prefix=False)
    tok = eng.tokenizer
    turn1 = tok("Once upon a time, there was a little girl named Lily. She liked to")["input_ids"]
    for mode in ("off", "tree"):
        s1 = eng.generate([turn1], G, SpecParams(mode=mode))[0]
        turn2 = s1.tokens + tok("One day, Lily's friend came to")["input_ids"][1:]
        s2 = eng.generate([turn2], G, SpecParams(mode=mode))[0]
        ref = cold.generate([turn2], G, SpecParams(mode=mode))[0]
        assert s2.output_ids == ref.output_ids
        # everything but the last partial block of turn 1 (and the pending token) came from the cache
        assert s2.cached_prefix_tokens >= (len(s1.tokens) - 1) // 4 * 4 - 4
        assert s2.cached_prefix_tokens > 0.6 * len(turn2)
        assert ref.cached_prefix_tokens == 0
    assert eng.prefix_cache.hit_rate > 0.3
    assert eng.kv_blocks_used() == (0, 0)
    eng.cache.pool.check()


def test_tiny_pool_with_preemption_and_prefix_hits_keeps_greedy_output(shared_pair):
    tok = shared_pair[0].tokenizer
    system = "Tom and Sue went to the big park to play with the ball. "
    prompts = [tok(system + p)["input_ids"] for p in ("The dog", "One day", "He was", "A bird", "They saw", "It")]
    ref = _engine(shared_pair, prefix=False).generate(prompts, G, SpecParams(mode="off"))
    for prefix in (False, True):
        eng = _engine(shared_pair, prefix=prefix, num_blocks=48)
        out = eng.generate(prompts, G, SpecParams(mode="tree"))
        assert [s.output_ids for s in out] == [r.output_ids for r in ref]
        assert eng.scheduler.num_preemptions > 0
        if prefix:
            assert eng.prefix_cache.hit_tokens > 0
        assert eng.kv_blocks_used() == (0, 0)
        eng.cache.pool.check()
        eng.draft_cache.pool.check()
