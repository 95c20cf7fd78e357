"""Engine-level fuzzing (hypothesis), in process, on the shared stories260K pair.

Each case (``specd.engine.chaos.random_case``, driven by hypothesis' random source) is a mix of 1-5 requests
with generated parameters (every sampling field across its whole accepted range, edges often;
speculation modes, priorities, prompts of random token ids), added and cancelled at generated steps,
a quarter carrying a value validation refuses forced in after validation (``HOSTILE_VALUES``), half
the cases with a fault injected in a random stage for one request. The KV cache is small, so
requests are preempted and recomputed. Oracle after every case (``specd.engine.chaos.run_checked``):

- every request ends exactly once; a request that is neither hostile nor the fault's target never
  ends with ``error`` and never emits more than its ``max_tokens``;
- no KV block is held and the pools' invariants hold;
- the greedy canary produces exactly what a fresh engine produces.

``make test`` runs a derandomized short version; ``make test-slow`` runs 10,000 random cases.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specd.engine.chaos import canary, random_case, run_checked
from tests.conftest import serve_engine

pytestmark = pytest.mark.timeout(3600)

FAST = dict(deadline=None, suppress_health_check=list(HealthCheck), derandomize=True, database=None)
SLOW = dict(deadline=None, suppress_health_check=list(HealthCheck), database=None)
N_FAST = int(os.environ.get("SPECD_ENGINE_FUZZ_EXAMPLES", "120"))
N_SLOW = 10_000
VOCAB = 512  # stories260K
ENGINE_KW = dict(num_blocks=40, prefill_chunk=24)  # 640 KV slots for up to 5 requests: preemption happens


@pytest.fixture(scope="module")
def fuzz_engine(shared_pair):
    return serve_engine(shared_pair, **ENGINE_KW)


@pytest.fixture(scope="module")
def canary_prompt(fuzz_engine):
    return fuzz_engine.tokenizer("Once upon a time")["input_ids"]


@pytest.fixture(scope="module")
def canary_ref(shared_pair, canary_prompt):
    return canary(serve_engine(shared_pair, **ENGINE_KW), canary_prompt)


def _check(engine, canary_prompt, canary_ref, rng) -> None:
    reqs, fault = random_case(rng, VOCAB)
    run_checked(engine, reqs, fault, canary_prompt, canary_ref)


@settings(max_examples=N_FAST, **FAST)
@given(rng=st.randoms(use_true_random=False))
def test_engine_fuzz(fuzz_engine, canary_prompt, canary_ref, rng):
    _check(fuzz_engine, canary_prompt, canary_ref, rng)


@pytest.mark.slow
@settings(max_examples=N_SLOW, **SLOW)
@given(rng=st.randoms(use_true_random=False))
def test_engine_fuzz_long(fuzz_engine, canary_prompt, canary_ref, rng):
    _check(fuzz_engine, canary_prompt, canary_ref, rng)
