"""Pay first-call costs before a server reports ready."""

from __future__ import annotations


def warm_up(engine) -> None:
    """A short greedy and a sampled generation: first-call costs (allocations, kernel compilation)
    are paid before the server reports ready. Speculation totals are reset afterwards."""
    from specd.engine.sequence import SpecStats
    from specd.sampling.params import SamplingParams

    tok = engine.tokenizer
    ids = list(tok("Hello")["input_ids"]) if tok is not None else [0]
    ids = ids or [0]
    engine.generate(
        [ids, ids],
        [
            SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
            SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True, seed=0),
        ],
    )
    engine.stats = SpecStats()
    engine.num_steps = 0
