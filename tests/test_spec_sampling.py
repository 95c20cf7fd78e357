"""End to end on the real pair: sampled speculative output follows the target's distribution."""

import numpy as np
import torch
from scipy.stats import chisquare

from specd.config import EngineConfig, SchedulerConfig, SpecConfig
from specd.engine.engine import Engine
from specd.engine.kv_cache import KVCache
from specd.engine.sequence import SpecParams
from specd.model.attention import build_metadata
from specd.sampling.params import SamplingParams
from specd.sampling.probs import logits_to_probs
from tests.conftest import DRAFT, TARGET

TEMP, TOPK = 1.0, 8


def _target_probs(lm, tokens):
    c = lm.config
    cache = KVCache(c.num_layers, c.num_kv_heads, c.head_dim, 8, 16, torch.float32, torch.device("cpu"))
    s = cache.new_seq()
    s.reserve(len(tokens))
    meta = build_metadata([len(tokens)], [0], [s.blocks], s.slots(0, len(tokens)), 16, torch.device("cpu"))
    h = lm.model(torch.tensor(tokens), torch.arange(len(tokens)), cache.kv, meta)
    logits = lm.model.compute_logits(h[-1:])
    return logits_to_probs(logits, torch.tensor([TEMP]), torch.tensor([TOPK]), torch.tensor([1.0]))[0].double()


def two_token_joint(lm, prompt: list) -> dict:
    """(x1, x2) -> the target's probability of sampling x1 then x2 after ``prompt`` (TEMP, TOPK)."""
    p1, joint = _target_probs(lm, prompt), {}
    for x1 in torch.nonzero(p1).flatten().tolist():
        p2 = _target_probs(lm, prompt + [x1])
        for x2 in torch.nonzero(p2).flatten().tolist():
            joint[(x1, x2)] = float(p1[x1] * p2[x2])
    return joint


def assert_follows(joint: dict, outputs: list, tv_bound: float) -> None:
    """The outputs' first tokens against ``joint`` (token tuple -> probability under the target):
    chi-square with cells under 5 expected pooled (p > 1e-3) and total variation below ``tv_bound``.
    A prefix outside the target's support raises KeyError."""
    n, keys = len(outputs), sorted(joint)
    counts = dict.fromkeys(keys, 0)
    for out in outputs:
        counts[tuple(out[: len(keys[0])])] += 1
    obs = np.array([counts[k] for k in keys], dtype=float)
    exp = np.array([joint[k] for k in keys]) * n
    big = exp >= 5
    obs_m, exp_m = np.append(obs[big], obs[~big].sum()), np.append(exp[big], exp[~big].sum())
    exp_m *= obs_m.sum() / exp_m.sum()
    assert chisquare(obs_m, exp_m).pvalue > 1e-3
    assert 0.5 * np.abs(obs / n - exp / n).sum() < tv_bound


def tree_engine(target, draft) -> Engine:
    """A fixed small drafting tree (8 nodes, 3 children, depth 3) for up to 128 requests at once."""
    return Engine(
        EngineConfig(
            target=str(TARGET),
            draft=str(DRAFT),
            spec=SpecConfig(mode="tree", tree_budget=8, tree_topk=3, tree_depth=3, adaptive=False),
            scheduler=SchedulerConfig(max_num_seqs=128, max_num_batched_tokens=4096),
        ),
        target=target,
        draft=draft,
    )


def test_sampled_tree_speculation_matches_target_joint_distribution(shared_pair):
    t, d = shared_pair
    eng = tree_engine(t, d)
    prompt = eng.tokenizer("Once upon a time, there was a")["input_ids"]
    p1 = _target_probs(t, prompt)
    support = torch.nonzero(p1).flatten().tolist()
    joint = {}
    for x1 in support:
        p2 = _target_probs(t, prompt + [x1])
        for x2 in torch.nonzero(p2).flatten().tolist():
            joint[(x1, x2)] = float(p1[x1] * p2[x2])
    n = 3000
    params = [SamplingParams(temperature=TEMP, top_k=TOPK, seed=i, max_tokens=2, ignore_eos=True) for i in range(n)]
    seqs = eng.generate([prompt] * n, params, SpecParams(mode="tree"))
    assert eng.stats.accepted_tokens > 0.3 * n  # drafts were really accepted (not just fallbacks)
    keys = sorted(joint)
    counts = {k: 0 for k in keys}
    for s in seqs:
        counts[tuple(s.output_ids[:2])] += 1  # a pair outside the target's support raises KeyError
    obs = np.array([counts[k] for k in keys], dtype=float)
    exp = np.array([joint[k] for k in keys]) * n
    big = exp >= 5  # merge rare cells into one
    obs_m = np.append(obs[big], obs[~big].sum())
    exp_m = np.append(exp[big], exp[~big].sum())
    exp_m *= obs_m.sum() / exp_m.sum()  # float rounding only
    assert chisquare(obs_m, exp_m).pvalue > 1e-3
    assert 0.5 * np.abs(obs / n - exp / n).sum() < 0.06  # TV distance (noise at n=3000 is ~0.03)
    assert eng.kv_blocks_used() == (0, 0)
