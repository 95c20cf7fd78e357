"""Tests for specd.sampling.verify: the greedy walk and lossless tree rejection sampling.

The sampling tests run the real verifier (``verify_batch``) over 1e5 independent trials at once
(one tree per trial) on a toy Markov "language model" with a 6-token vocabulary:

    target  p(next | current) = P_TAB[current]        draft  q(next | current) = Q_TAB[current]

Each trial drafts a tree below a fixed root token (children drawn without replacement from the
draft row of their parent, or the draft's top-k), verifies it, and records the first two emitted
tokens (when a step emits only one token, a second step from that token supplies the next one, as
the engine would). Losslessness: the first token ~ p(. | root) and the pair ~ p(x1 | root) p(x2 | x1),
checked by a chi-square test (p-value > 1e-3) and a total-variation bound.

Negative controls: three deliberately broken versions of the per-node table function (always
accept; residual not clamped; without-replacement children checked against the un-renormalised
draft) are swapped in through the module's ``_node_tables`` hook, and the very same check must
reject them.
"""

from __future__ import annotations

import contextlib
import gc
import itertools

import numpy as np
import pytest
import scipy.stats
import torch

import specd.sampling.verify as verify_mod
from specd.sampling.probs import logits_to_probs, make_generator
from specd.sampling.tree import DraftTree
from specd.sampling.verify import AcceptResult, greedy_verify, sample_verify, verify_batch

# ------------------------------------------------------------------------------------ toy model
V = 6
ROOT = 0
# Row x is the distribution of the token after x. The draft is peaked and offset from the target
# by one position, which makes every bug below visible (each shifts the output by TV >= 0.05).
_P_PROFILE = torch.tensor([0.30, 0.25, 0.15, 0.12, 0.10, 0.08], dtype=torch.float64)
_Q_PROFILE = torch.tensor([0.55, 0.20, 0.10, 0.07, 0.05, 0.03], dtype=torch.float64)
P_TAB = torch.stack([_P_PROFILE.roll(x + 1) for x in range(V)])  # [V, V] target
Q_TAB = torch.stack([_Q_PROFILE.roll(x) for x in range(V)])  # [V, V] draft


def _dirichlet_tables(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = np.random.default_rng(seed)
    p = 0.85 * g.dirichlet(np.ones(V), size=V) + 0.15 / V
    q = 0.85 * g.dirichlet(np.full(V, 0.5), size=V) + 0.15 / V
    return torch.tensor(p), torch.tensor(q)


P_RAND, Q_RAND = _dirichlet_tables(3)

N_TRIALS = 100_000
# Sampling noise of the empirical TV at 1e5 samples: ~0.0027 +- 0.0009 over the 6 first tokens,
# ~0.0070 +- 0.0010 over the 36 pairs, so these bounds sit >= 6 standard deviations above it;
# every broken sampler below is off by >= 0.05.
TV_BOUND_FIRST = 0.01
TV_BOUND_PAIR = 0.013
P_VALUE_MIN = 1e-3


def shape_parents(branching: list[int]) -> list[int]:
    """Parents of a full tree: ``branching[d]`` children under every node of depth d (BFS)."""
    parents, level = [-1], [0]
    for b in branching:
        nxt = []
        for node in level:
            for _ in range(b):
                parents.append(node)
                nxt.append(len(parents) - 1)
        level = nxt
    return parents


def draw_children(q: torch.Tensor, m: int, mode: str, gen: torch.Generator) -> torch.Tensor:
    """[N, V] draft rows -> [N, m] children: without replacement, in draw order (Gumbel top-k),
    or the top-m (ties to the lower id)."""
    if mode == "deterministic":
        return torch.sort(q, dim=1, descending=True, stable=True).indices[:, :m]
    gumbel = -torch.log(-torch.log(torch.rand(q.shape, dtype=torch.float64, generator=gen)))
    kids = torch.sort(q.log() + gumbel, dim=1, descending=True).indices[:, :m]
    assert bool((q.gather(1, kids) > 0).all()), "draft support smaller than the number of children"
    return kids


class Harness:
    def __init__(self, P, Q, branching, mode, seed=0):
        self.P, self.Q, self.mode = P, Q, mode
        self.parents = shape_parents(branching)
        self.kids = [[c for c, p in enumerate(self.parents) if p == i] for i in range(len(self.parents))]
        self.gen = torch.Generator().manual_seed(seed)
        self.trees: dict[tuple, DraftTree] = {}
        torch.manual_seed(seed)  # verify_batch without generators draws from the global RNG

    def step(self, roots: torch.Tensor) -> list[AcceptResult]:
        """One decode step for every trial: draft a tree below each root, verify it."""
        with _no_gc():  # 1e5 trees and results: the cyclic GC would double the run time
            return self._step(roots)

    def _step(self, roots: torch.Tensor) -> list[AcceptResult]:
        n = len(self.parents)
        tokens = torch.zeros((roots.shape[0], n), dtype=torch.int64)  # [N, n]
        tokens[:, 0] = roots
        for i, kids in enumerate(self.kids):
            if kids:
                tokens[:, kids] = draw_children(self.Q[tokens[:, i]], len(kids), self.mode, self.gen)
        trees = []
        for row in tokens.tolist():
            key = tuple(row)
            t = self.trees.get(key)
            if t is None:
                t = self.trees[key] = DraftTree(row, self.parents, validate=False)
            trees.append(t)
        flat = tokens.reshape(-1)
        return verify_batch(trees, self.P[flat], greedy=False, draft_probs=self.Q[flat], draft_mode=self.mode)

    def first_two(self, n_trials: int):
        """(first [N], second [N], accepted counts [N]) of the emitted stream after ROOT."""
        res = self.step(torch.full((n_trials,), ROOT, dtype=torch.int64))
        first = np.array([r.tokens[0] for r in res])
        second = np.array([r.tokens[1] if len(r.tokens) > 1 else -1 for r in res])
        n_acc = np.array([len(r.accepted) for r in res])
        need = np.nonzero(second < 0)[0]
        if need.size:
            more = self.step(torch.as_tensor(first[need]))
            second[need] = [r.tokens[0] for r in more]
        return first, second, n_acc


@contextlib.contextmanager
def _no_gc():
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def dist_check(samples: np.ndarray, probs: np.ndarray) -> tuple[float, float]:
    """(chi-square p-value, total variation) of integer samples against ``probs``."""
    counts = np.bincount(samples, minlength=probs.size).astype(np.float64)
    n = counts.sum()
    tv = 0.5 * float(np.abs(counts / n - probs).sum())
    support = probs > 0
    if counts[~support].any():
        return 0.0, tv
    expected = n * probs[support] / probs[support].sum()
    return float(scipy.stats.chisquare(counts[support], expected).pvalue), tv


def losslessness_stats(P, Q, branching, mode, n_trials=N_TRIALS, seed=0):
    """Run the harness; return ((p, tv) of the first token, (p, tv) of the pair, accepted)."""
    first, second, n_acc = Harness(P, Q, branching, mode, seed).first_two(n_trials)
    p1 = P[ROOT].numpy()
    pair = (p1[:, None] * P.numpy()).ravel()  # p(x1 | root) p(x2 | x1)
    return dist_check(first, p1), dist_check(first * V + second, pair), n_acc


def assert_lossless(stats):
    (p1, tv1), (p2, tv2), _ = stats
    assert p1 > P_VALUE_MIN and tv1 < TV_BOUND_FIRST, f"first token: p={p1:.3g} tv={tv1:.4f}"
    assert p2 > P_VALUE_MIN and tv2 < TV_BOUND_PAIR, f"first two tokens: p={p2:.3g} tv={tv2:.4f}"


def is_rejected(stats) -> bool:
    """The statistical check flags the sampler (on the first token or on the pair)."""
    (p1, tv1), (p2, tv2), _ = stats
    return p1 < 1e-6 or tv1 > TV_BOUND_FIRST or p2 < 1e-6 or tv2 > TV_BOUND_PAIR


# --------------------------------------------------------------------- broken samplers (tests only)
def make_tables(bug: str | None):
    """A re-implementation of ``verify._node_tables`` with an optional deliberate bug:

    "always_accept"    accept every draft token
    "unclamped"        residual |p_m - q_m| / sum |p_m - q_m| instead of max(p_m - q_m, 0) / sum
    "unrenormalised"   the m-th without-replacement child checked against q with earlier siblings
                       zeroed but not renormalised
    """

    def tables(p, q, kid_tok, kid_ok, det):
        num, k_max = kid_tok.shape
        accept = p.new_zeros((num, k_max))
        r, qc = p, q
        for k in range(k_max):
            x, ok = kid_tok[:, k : k + 1], kid_ok[:, k : k + 1]
            onehot = torch.zeros_like(r).scatter_(1, x, 1.0)
            if qc is None:
                qk = onehot
            else:
                s = qc.sum(1, keepdim=True)
                qk = torch.where(det[:, None], onehot, qc if bug == "unrenormalised" else qc / s)
            px, qx = r.gather(1, x), qk.gather(1, x)
            a = torch.where(qx > 0, (px / qx).clamp(max=1.0), (px > 0).double())
            if bug == "always_accept":
                a = torch.ones_like(a)
            accept[:, k : k + 1] = torch.where(ok, a, 0.0)
            res = (r - qk).abs() if bug == "unclamped" else (r - qk).clamp_min(0.0)
            z = res.sum(1, keepdim=True)
            r = torch.where(ok & (z > 1e-9), res / z.clamp_min(1e-300), r)
            if qc is not None:
                qc = torch.where(ok, qc.masked_fill(onehot.bool(), 0.0), qc)
        return accept, r

    return tables


BUGS = ["always_accept", "unclamped", "unrenormalised"]


# ---------------------------------------------------------------------------------------- greedy
EXAMPLE = DraftTree.from_parents([5, 7, 9, 3, 8], [-1, 0, 0, 1, 1])


def test_greedy_docstring_example():
    r = greedy_verify(EXAMPLE, [9, 2, 4, 6, 1])
    assert (r.accepted, r.tokens, r.next_token, r.bonus) == ([2], [9, 4], 4, True)
    r = greedy_verify(EXAMPLE, torch.tensor([7, 6, 4, 6, 1]))
    assert (r.accepted, r.tokens, r.next_token, r.bonus) == ([1], [7, 6], 6, False)
    r = greedy_verify(EXAMPLE, [7, 8, 4, 6, 2])  # accept 7 then 8 (a leaf): bonus 2
    assert (r.accepted, r.tokens, r.next_token, r.bonus) == ([1, 4], [7, 8, 2], 2, True)
    r = greedy_verify(EXAMPLE, [1, 8, 4, 6, 2])  # root's children all wrong: correction 1
    assert (r.accepted, r.tokens, r.next_token, r.bonus) == ([], [1], 1, False)


def test_greedy_root_only_is_bonus():
    r = greedy_verify(DraftTree.chain(11), [42])
    assert (r.accepted, r.tokens, r.next_token, r.bonus) == ([], [42], 42, True)


def test_greedy_chain_all_accepted_and_partial():
    t = DraftTree.chain(1, [2, 3, 4])
    assert greedy_verify(t, [2, 3, 4, 5]).tokens == [2, 3, 4, 5]
    r = greedy_verify(t, [2, 3, 0, 5])
    assert (r.accepted, r.tokens, r.bonus) == ([1, 2], [2, 3, 0], False)


def test_greedy_repeated_sibling_token_takes_first():
    t = DraftTree.from_parents([0, 4, 4, 6], [-1, 0, 0, 2])
    assert greedy_verify(t, [4, 1, 6, 2]).accepted == [1]


def test_verify_batch_greedy_offsets_and_mixed():
    trees = [EXAMPLE, DraftTree.chain(0, [3]), EXAMPLE]
    am = [9, 2, 4, 6, 1] + [3, 7] + [7, 6, 4, 6, 1]
    logits = torch.full((len(am) + 2, 16), -1.0)
    logits[torch.arange(len(am)) + 1, torch.tensor(am)] = 3.0  # one padding row before, one after
    out = verify_batch(trees, logits, [1, 6, 8, 13])
    assert [r.tokens for r in out] == [[9, 4], [3, 7], [7, 6]]
    # the same batch with the middle request sampled from one-hot targets: same result
    probs = logits_to_probs(logits, [0.0] * logits.shape[0], [0] * logits.shape[0], [1.0] * logits.shape[0])
    out = verify_batch(
        trees,
        probs,
        [1, 6, 8, 13],
        greedy=[True, False, True],
        draft_probs=torch.full_like(probs, 1 / 16),
        generators=[None, make_generator(0), None],
    )
    assert [r.tokens for r in out] == [[9, 4], [3, 7], [7, 6]]
    with pytest.raises(ValueError):
        verify_batch(trees, logits, [0, 5, 7])
    with pytest.raises(ValueError):
        verify_batch(trees, logits, [0, 4, 6, 11])


def test_sampling_with_onehot_target_equals_greedy():
    """A temperature-0 target (one-hot) makes the rejection sampler reproduce the greedy walk."""
    g = torch.Generator().manual_seed(1)
    for trial in range(200):
        n = int(torch.randint(1, 12, (1,), generator=g))
        parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]
        tokens = torch.randint(0, 5, (n,), generator=g)
        tree = DraftTree.from_parents(tokens, parents)
        am = torch.randint(0, 5, (n,), generator=g)
        onehot = torch.nn.functional.one_hot(am, 5).double()
        q = torch.rand((n, 5), generator=g, dtype=torch.float64) + 0.01
        mode = "sampled" if trial % 2 else "deterministic"
        want = greedy_verify(tree, am)
        got = sample_verify(tree, onehot, q, make_generator(trial), mode)
        assert (got.accepted, got.tokens, got.bonus) == (want.accepted, want.tokens, want.bonus)


# ---------------------------------------------------------------- exact check of the node tables
def exact_first_token(tables, p, q, m, mode) -> torch.Tensor:
    """Exact distribution of the token emitted at a node with m children, averaged over the
    drafter's draws (all ordered without-replacement draws, or the top-m)."""
    if mode == "deterministic":
        orders = [(tuple(torch.sort(q, descending=True, stable=True).indices[:m].tolist()), 1.0)]
    else:
        orders = []
        for perm in itertools.permutations(range(V), m):
            pr, left = 1.0, 1.0
            for x in perm:
                pr, left = pr * float(q[x]) / left, left - float(q[x])
            if pr > 0:
                orders.append((perm, pr))
    out = torch.zeros(V, dtype=torch.float64)
    for perm, pr in orders:
        acc, res = tables(
            p[None],
            q[None],
            torch.tensor([perm]),
            torch.ones((1, m), dtype=torch.bool),
            torch.tensor([mode == "deterministic"]),
        )
        stay = 1.0
        for k, x in enumerate(perm):
            out[x] += pr * stay * float(acc[0, k])
            stay *= 1.0 - float(acc[0, k])
        out += pr * stay * res[0]
    return out


@pytest.mark.parametrize("mode", ["sampled", "deterministic"])
@pytest.mark.parametrize("m", [1, 2, 3, 4])
def test_node_tables_exactly_lossless(mode, m):
    p_zero_q = Q_TAB[2].clone()
    p_zero_q[[0, 3]] = 0.0  # draft mass 0 where the target's is > 0
    p_zero_q /= p_zero_q.sum()
    cases = [
        (P_TAB[0], Q_TAB[0]),
        (P_RAND[1], Q_RAND[1]),
        (P_TAB[3], p_zero_q),
        (Q_TAB[4], Q_TAB[4]),  # draft == target
        (
            torch.tensor([0.5, 0.3, 0.2, 0, 0, 0], dtype=torch.float64),  # disjoint supports
            torch.tensor([0, 0, 0, 0.2, 0.3, 0.5], dtype=torch.float64),
        ),
    ]
    for p, q in cases:
        if mode == "sampled" and int((q > 0).sum()) < m:
            continue
        got = exact_first_token(verify_mod._node_tables, p, q, m, mode)
        torch.testing.assert_close(got, p, rtol=0, atol=1e-12)
        # the test-file reference without a bug agrees with the library
        torch.testing.assert_close(exact_first_token(make_tables(None), p, q, m, mode), p, rtol=0, atol=1e-12)


@pytest.mark.parametrize("bug", BUGS)
def test_broken_tables_are_exactly_biased(bug):
    """Sanity for the negative controls: each bug moves the output by a visible amount."""
    m = 2 if bug == "unrenormalised" else 1
    got = exact_first_token(make_tables(bug), P_TAB[ROOT], Q_TAB[ROOT], m, "sampled")
    assert 0.5 * float((got - P_TAB[ROOT]).abs().sum()) > 0.05


def test_residual_fallback_when_draft_equals_target():
    p = torch.tensor([[0.25, 0.25, 0.5, 0.0]], dtype=torch.float64)
    acc, res = verify_mod._node_tables(
        p, p.clone(), torch.tensor([[2, 0, 1]]), torch.ones((1, 3), dtype=torch.bool), torch.tensor([False])
    )
    assert torch.equal(acc[:, 0], torch.ones(1, dtype=torch.float64))  # never rejected
    assert torch.isfinite(res).all() and abs(float(res.sum()) - 1) < 1e-12 and float(res.min()) >= 0


# ------------------------------------------------------------------- statistical: losslessness
LOSSLESS_CASES = [
    pytest.param(P_TAB, Q_TAB, [1], "sampled", id="chain1"),
    pytest.param(P_TAB, Q_TAB, [1, 1], "sampled", id="chain2"),
    pytest.param(P_TAB, Q_TAB, [1, 1, 1], "sampled", id="chain3"),
    pytest.param(P_TAB, Q_TAB, [3, 2], "sampled", id="tree3x2-sampled"),
    pytest.param(P_RAND, Q_RAND, [2, 2], "sampled", id="tree2x2-sampled-dirichlet"),
    pytest.param(P_TAB, Q_TAB, [3, 2], "deterministic", id="tree3x2-topk"),
    pytest.param(P_TAB, Q_TAB, [1, 1], "deterministic", id="chain2-argmax"),
]


@pytest.mark.parametrize("P,Q,branching,mode", LOSSLESS_CASES)
def test_lossless(P, Q, branching, mode):
    stats = losslessness_stats(P, Q, branching, mode)
    assert_lossless(stats)
    n_acc = stats[2]
    assert 0 < n_acc.mean() < len(branching)  # some drafts accepted, some rejected


def test_lossless_draft_zero_where_target_positive():
    q = Q_TAB.clone()
    q[:, 1] = 0.0  # the draft never proposes token 1, the target often does
    q /= q.sum(1, keepdim=True)
    stats = losslessness_stats(P_TAB, q, [3, 2], "sampled")
    assert_lossless(stats)


def test_draft_equal_to_target_accepts_everything():
    for branching in ([1, 1, 1], [2, 2], [3, 2]):
        stats = losslessness_stats(P_TAB, P_TAB, branching, "sampled", n_trials=20_000)
        assert (stats[2] == len(branching)).all()  # acceptance 1: every step walks to a leaf


def test_disjoint_supports_accept_nothing():
    p = torch.zeros((V, V), dtype=torch.float64)
    q = torch.zeros((V, V), dtype=torch.float64)
    p[:, :3] = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    q[:, 3:] = torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64)
    stats = losslessness_stats(p, q, [3], "sampled")
    assert (stats[2] == 0).all()
    assert_lossless(stats)


# ------------------------------------------------------------------- statistical: negative controls
@pytest.mark.parametrize(
    "bug,branching",
    [
        ("always_accept", [1]),
        ("unclamped", [1, 1]),
        ("unrenormalised", [3, 2]),
    ],
)
def test_broken_samplers_fail_the_same_check(monkeypatch, bug, branching):
    monkeypatch.setattr(verify_mod, "_node_tables", make_tables(bug))
    stats = losslessness_stats(P_TAB, Q_TAB, branching, "sampled")
    assert is_rejected(stats), f"{bug} passed the losslessness check: {stats[:2]}"


# -------------------------------------------------------------------------- randomness, plumbing
def _random_case(seed, n_nodes=9):
    g = torch.Generator().manual_seed(seed)
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n_nodes)]
    tree = DraftTree.from_parents(torch.randint(0, V, (n_nodes,), generator=g), parents)
    p = torch.rand((n_nodes, V), generator=g, dtype=torch.float64)
    q = torch.rand((n_nodes, V), generator=g, dtype=torch.float64)
    return tree, p / p.sum(1, keepdim=True), q / q.sum(1, keepdim=True)


def test_per_request_generator_independent_of_batch():
    cases = [_random_case(s) for s in range(6)]
    alone = [sample_verify(t, p, q, make_generator(100 + i)) for i, (t, p, q) in enumerate(cases)]
    for order in ([0, 1, 2, 3, 4, 5], [5, 3, 1, 0, 2, 4], [2, 4]):
        trees = [cases[i][0] for i in order]
        target = torch.cat([cases[i][1] for i in order])
        draft = torch.cat([cases[i][2] for i in order])
        gens = [make_generator(100 + i) for i in order]
        out = verify_batch(trees, target, greedy=False, draft_probs=draft, generators=gens)
        for i, r in zip(order, out):
            assert r == alone[i]


def test_sample_verify_float32_inputs_and_result_shape():
    tree, p, q = _random_case(7)
    r = sample_verify(tree, p.float(), q.float(), make_generator(3), "sampled")
    assert r.tokens[:-1] == [tree.token_list[c] for c in r.accepted]
    assert r.next_token == r.tokens[-1] and 0 <= r.next_token < V
    path = tree.path_to(r.accepted[-1]) if r.accepted else [0]
    assert path[1:] == r.accepted  # a root-to-node path
    assert r.bonus == (not tree.children[path[-1]])
    with pytest.raises(ValueError):
        sample_verify(tree, p, None, None, "sampled")
    with pytest.raises(ValueError):
        sample_verify(tree, p, q, None, "beam")
    sample_verify(tree, p, None, None, "deterministic")


def test_memory_chunking_gives_same_result(monkeypatch):
    cases = [_random_case(s) for s in range(5)]
    trees = [c[0] for c in cases]
    target, draft = torch.cat([c[1] for c in cases]), torch.cat([c[2] for c in cases])
    run = lambda: verify_batch(
        trees,
        target,
        greedy=False,
        draft_probs=draft,  # noqa: E731
        generators=[make_generator(s) for s in range(5)],
    )
    want = run()
    monkeypatch.setattr(verify_mod, "_CHUNK_ELEMS", 2 * V)  # two rows per chunk
    assert run() == want
