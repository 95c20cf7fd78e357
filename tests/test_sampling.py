"""Tests for specd.sampling: params validation, logits -> probs, per-request sampling."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import scipy.stats
import torch

from specd.sampling.params import SamplingParams
from specd.sampling.probs import (
    draw_uniforms,
    logits_to_probs,
    make_generator,
    sample,
    sample_from_uniform,
    sampling_tensors,
)


# ------------------------------------------------------------------------------- SamplingParams
def test_params_defaults_and_normalisation():
    p = SamplingParams()
    assert not p.greedy and p.top_k == 0 and p.top_p == 1.0 and p.seed is None
    q = SamplingParams(temperature=0, top_p=1, stop=["\n\n", "END"], stop_token_ids=[2, 7], seed=-3)
    assert q.greedy and isinstance(q.temperature, float) and isinstance(q.top_p, float)
    assert q.stop == ("\n\n", "END") and q.stop_token_ids == (2, 7)
    assert SamplingParams(stop="x").stop == ("x",)
    hash(q)  # frozen and hashable
    with pytest.raises(dataclasses.FrozenInstanceError):
        q.temperature = 1.0  # type: ignore[misc]


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(temperature=-0.1),
        dict(temperature=math.nan),
        dict(temperature=math.inf),
        dict(temperature="1"),
        dict(temperature=True),
        dict(temperature=None),
        dict(top_p=0.0),
        dict(top_p=1.5),
        dict(top_p=-1.0),
        dict(top_p=math.nan),
        dict(top_k=-2),
        dict(top_k=1.5),
        dict(top_k=True),
        dict(seed=1.5),
        dict(seed="7"),
        dict(max_tokens=0),
        dict(max_tokens=-5),
        dict(max_tokens=2.0),
        dict(stop=[""]),
        dict(stop=[1]),
        dict(stop=5),
        dict(stop_token_ids=[-1]),
        dict(stop_token_ids=[1.0]),
        dict(stop_token_ids=3),
        dict(ignore_eos="yes"),
    ],
)
def test_params_validation(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_params_valid_edges():
    SamplingParams(top_k=-1)
    SamplingParams(top_k=1, top_p=1e-9, temperature=1e-6, max_tokens=1, seed=2**70)
    assert sampling_tensors([SamplingParams(temperature=0.5, top_k=3, top_p=0.9, min_p=0.1)] * 2) == (
        [0.5, 0.5],
        [3, 3],
        [0.9, 0.9],
        [0.1, 0.1],
    )


# ------------------------------------------------------------------------------ logits_to_probs
def reference_probs(logits: torch.Tensor, temperature, top_k, top_p) -> torch.Tensor:
    """Straightforward per-row version (float64)."""
    n, v = logits.shape
    out = torch.zeros((n, v), dtype=torch.float64)
    for i in range(n):
        row = logits[i].double()
        if temperature[i] == 0:
            out[i, int(torch.argmax(logits[i]))] = 1.0
            continue
        row = row / float(torch.tensor(temperature[i], dtype=torch.float32))
        order = torch.sort(row, descending=True, stable=True).indices.tolist()
        k = top_k[i] if 0 < top_k[i] < v else v
        keep = order[:k]
        probs = torch.softmax(row[keep], dim=0)
        p = float(torch.tensor(top_p[i], dtype=torch.float32))
        if p < 1:
            mass, n_keep = 0.0, 0
            for pr in probs.tolist():  # already in descending order
                if mass >= p:
                    break
                mass += pr
                n_keep += 1
            keep, probs = keep[:n_keep], probs[:n_keep] / probs[:n_keep].sum()
        out[i, keep] = probs
    return out


def test_logits_to_probs_matches_reference():
    g = torch.Generator().manual_seed(0)
    n, v = 96, 37
    logits = torch.randn((n, v), generator=g) * 3
    logits[5, 3] = logits[5, 9] = logits[5].max() + 1  # a tie at the top
    choice = lambda xs: [xs[int(j)] for j in torch.randint(0, len(xs), (n,), generator=g)]  # noqa
    temperature = choice([0.0, 0.3, 0.7, 1.0, 1.6])
    top_k = choice([0, -1, 1, 2, 5, 36, 37, 100])
    top_p = choice([1.0, 1.0, 0.95, 0.8, 0.5, 0.1, 1e-6])
    want = reference_probs(logits, temperature, top_k, top_p)
    got = logits_to_probs(logits, temperature, top_k, top_p)
    assert got.dtype == torch.float32 and got.shape == (n, v)
    torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=1e-4)
    assert torch.equal(got > 0, want > 0)  # the same support, exactly
    # tensor parameters (CPU) give the same
    got_t = logits_to_probs(logits, torch.tensor(temperature), torch.tensor(top_k), torch.tensor(top_p))
    assert torch.equal(got, got_t)


def test_fast_path_is_plain_softmax():
    logits = torch.randn((8, 50), generator=torch.Generator().manual_seed(1))
    t = [0.5, 1.0, 2.0, 1.0, 0.7, 1.3, 1.0, 0.9]
    got = logits_to_probs(logits, t, [0] * 8, [1.0] * 8)
    want = torch.softmax(logits / torch.tensor(t)[:, None], dim=-1)
    torch.testing.assert_close(got, want)
    assert torch.equal(got, logits_to_probs(logits, t, [-1] * 8, [1.0] * 8))
    assert torch.equal(got, logits_to_probs(logits, t, [50] * 8, [1.0] * 8))  # k >= V is off


def test_temperature_zero_is_onehot_lowest_index_on_ties():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [0.0, 0.0, 0.0, 0.0], [5.0, -1.0, 2.0, 5.0]])
    got = logits_to_probs(logits, [0.0] * 3, [0] * 3, [1.0] * 3)
    assert torch.equal(got, torch.eye(4)[[1, 0, 0]])
    # mixed with sampled rows and filters: greedy rows ignore top-k/top-p
    got = logits_to_probs(logits, [0.0, 1.0, 0.0], [2, 2, 1], [0.5, 0.5, 0.1])
    assert torch.equal(got[0], torch.eye(4)[1]) and torch.equal(got[2], torch.eye(4)[0])
    assert torch.equal(got.argmax(-1), logits.argmax(-1))


def test_top_p_keeps_at_least_one_token_and_top_k_one():
    logits = torch.randn((16, 30), generator=torch.Generator().manual_seed(2))
    onehot = torch.nn.functional.one_hot(logits.argmax(-1), 30).float()
    for p in (1e-9, 1e-3):
        assert torch.equal(logits_to_probs(logits, [1.0] * 16, [0] * 16, [p] * 16), onehot)
    assert torch.equal(logits_to_probs(logits, [0.8] * 16, [1] * 16, [1.0] * 16), onehot)
    probs = logits_to_probs(logits, [1.0] * 16, [0] * 16, [0.9] * 16)
    torch.testing.assert_close(probs.sum(-1), torch.ones(16))
    # the kept set is the smallest prefix of the sorted probs with mass >= 0.9
    full = torch.softmax(logits, -1)
    for i in range(16):
        s = torch.sort(full[i], descending=True).values
        n_keep = int((probs[i] > 0).sum())
        assert s[:n_keep].sum() >= 0.9 - 1e-6 and (n_keep == 1 or s[: n_keep - 1].sum() < 0.9)


def test_logits_to_probs_bad_shapes():
    with pytest.raises(ValueError):
        logits_to_probs(torch.zeros(3), [1.0], [0], [1.0])
    with pytest.raises(ValueError):
        logits_to_probs(torch.zeros(2, 3), [1.0], [0, 0], [1.0, 1.0])


# ------------------------------------------------------------------------------------ sampling
def test_sample_distribution():
    probs = torch.tensor([[0.1, 0.0, 0.25, 0.05, 0.6, 0.0]], dtype=torch.float64)
    n = 100_000
    torch.manual_seed(0)
    draws = sample(probs.expand(n, -1), [None] * n).numpy()
    counts = np.bincount(draws, minlength=6)
    assert counts[1] == 0 and counts[5] == 0
    keep = probs[0].numpy() > 0
    pval = scipy.stats.chisquare(counts[keep], n * probs[0].numpy()[keep]).pvalue
    assert pval > 1e-3
    assert 0.5 * np.abs(counts / n - probs[0].numpy()).sum() < 0.01


def test_sample_from_uniform_edges():
    probs = torch.tensor(
        [[0.0, 0.5, 0.5, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0, 2.0], [0.3, 0.0, 0.0, 0.7, 0.0]], dtype=torch.float64
    )
    top = torch.full((3,), 1.0 - 2.0**-53, dtype=torch.float64)  # largest uniform below 1
    assert sample_from_uniform(probs, top).tolist() == [2, 4, 3]
    assert sample_from_uniform(probs, torch.zeros(3, dtype=torch.float64)).tolist() == [1, 4, 0]
    assert sample_from_uniform(probs, torch.full((3,), 0.5, dtype=torch.float64)).tolist() == [2, 4, 3]


def test_per_request_generators_reproducible_and_batch_independent():
    g = torch.Generator().manual_seed(3)
    probs = torch.softmax(torch.randn((5, 40), generator=g), -1)
    seeds = [11, 12, 13, 14, 15]

    def run(rows):
        gens = [make_generator(seeds[r]) for r in rows]
        return [sample(probs[rows], gens).tolist() for _ in range(20)]  # 20 steps

    alone = {r: [step[0] for step in run([r])] for r in range(5)}
    for rows in ([0, 1, 2, 3, 4], [4, 2, 0], [3, 1]):
        out = run(rows)
        for j, r in enumerate(rows):
            assert [step[j] for step in out] == alone[r]
    # unseeded generators differ (with overwhelming probability) and a None entry works
    a = sample(probs[:1].expand(64, -1), [make_generator(None) for _ in range(64)])
    assert len(set(a.tolist())) > 1
    assert sample(probs[:2], [None, make_generator(1)]).shape == (2,)


def test_draw_uniforms_layout():
    u = draw_uniforms([2, 0, 3], [make_generator(1), None, make_generator(2)])
    assert u.shape == (5,) and u.dtype == torch.float64
    assert torch.equal(u[:2], torch.rand(2, dtype=torch.float64, generator=make_generator(1)))
    assert torch.equal(u[2:], torch.rand(3, dtype=torch.float64, generator=make_generator(2)))
    assert bool(((u >= 0) & (u < 1)).all())
