"""The batch-invariant ops wired into the model's forward (``LlamaModel.forward(..., ops=...)``,
``compute_logits(..., ops=...)``) and into the engine's target pass (``--batch-invariant``).

A tiny random-weight fp32 Llama (transformers' ``LlamaConfig``: 2 layers, hidden 64, vocabulary 128),
saved and loaded through specd's loader, runs op by op (``FOLD_MAX_HIDDEN = 0``: the folded fp32 path
is CPU-only and calls torch.mm itself) with the invariant kernels forced onto CPU tensors without CUDA
(``InvariantOps(True, devices=("cpu",))``, under the Triton interpreter; in production only CUDA
tensors take them). Shown: the invariant forward equals the ordinary one within fp32 tolerance; a
token's logits row has the same bits whether it is decoded alone, among other requests, or verified
as a node of a draft tree (what makes greedy speculative output == plain output on a GPU); control:
the ordinary torch path does not promise that (it is only checked to be close). The engine passes
its setting through ``target_pass``: ``on`` / ``auto`` with a greedy row take the kernels on CUDA,
never on a CPU, never for a target that does not take them.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import pytest  # noqa: E402

import specd_kernels as sk  # noqa: E402
from specd.engine import stages  # noqa: E402
from specd.model import invariant  # noqa: E402
from specd.model.attention import TorchAttention, build_metadata  # noqa: E402
from specd.model.loader import load_model  # noqa: E402

TOL = 1e-4
BS = 4  # KV block size
# without CUDA the interpreted kernels on CPU tensors (forced: production takes them for CUDA tensors only)
DEVICE = torch.device("cuda" if (torch.cuda.is_available() and not sk.interpreting()) else "cpu")
OPS = invariant.InvariantOps(True, devices=(DEVICE.type,))


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    from tests.conftest import tiny_llama_folder

    path = tiny_llama_folder(tmp_path_factory)
    loaded = load_model(path, DEVICE.type, "float32", progress=False, with_tokenizer=False)
    m = loaded.model
    m.FOLD_MAX_HIDDEN = 0  # op by op, as a bf16 model on a GPU runs
    m._flat = None
    assert not m._flat_weights()[1], "the op-by-op path"
    return loaded


@pytest.fixture(scope="module")
def model(lm):
    return lm.model


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts the invariant kernels' calls by name (so a test sees they ran, not a fallback)."""
    from collections import Counter

    from specd_kernels import batch_invariant as bi

    calls: Counter = Counter()
    for name in ("matmul", "rms_norm", "attention"):
        real = getattr(bi, name)

        def counted(*a, _real=real, _name=name, **kw):
            calls[_name] += 1
            return _real(*a, **kw)

        monkeypatch.setattr(bi, name, counted)
    return calls


def new_cache(m, blocks: int = 16) -> torch.Tensor:
    c = m.cfg
    return torch.zeros((c.num_layers, 2, blocks, BS, c.num_kv_heads, c.head_dim), device=DEVICE)  # [L,2,NB,BS,KVH,D]


class Req:
    """One request's part of a step: ``tokens`` at ``positions``, after ``ctx`` cached tokens,
    its KV in ``table``'s blocks (slots: ``ctx`` onwards), an optional [q, q] ancestor mask."""

    def __init__(self, tokens, table, ctx, positions=None, mask=None):
        self.tokens, self.table, self.ctx, self.mask = list(tokens), list(table), ctx, mask
        self.positions = list(positions) if positions is not None else list(range(ctx, ctx + len(tokens)))

    def slots(self) -> list:
        return [self.table[p // BS] * BS + p % BS for p in range(self.ctx, self.ctx + len(self.tokens))]


def step(m, kv, reqs: list, ops=invariant.OFF) -> torch.Tensor:
    """One forward + logits over ``reqs`` -> fp32 logits [tokens, vocab]."""
    slots = [s for r in reqs for s in r.slots()]
    masks = [r.mask for r in reqs] if any(r.mask is not None for r in reqs) else None
    meta = build_metadata([len(r.tokens) for r in reqs], [r.ctx for r in reqs], [r.table for r in reqs], slots, BS,
                          DEVICE, tree_masks=masks)  # fmt: skip
    ids = torch.tensor([t for r in reqs for t in r.tokens], device=DEVICE)
    pos = torch.tensor([p for r in reqs for p in r.positions], device=DEVICE)
    return m.compute_logits(m(ids, pos, kv, meta, TorchAttention(), ops=ops), ops=ops)


PROMPT_A = [5, 17, 99, 3, 42, 8, 61]  # request A: 7 cached tokens, blocks 0-3
TABLE_A, TABLE_B, TABLE_C = [0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]
PROMPT_B, PROMPT_C = [7, 7, 120, 1, 64], [33, 2, 90, 14, 15, 16, 100, 77, 9]


def prefilled(m, ops) -> torch.Tensor:
    """A cache holding requests A, B and C's prompts (prefilled together)."""
    kv = new_cache(m)
    step(m, kv, [Req(PROMPT_A, TABLE_A, 0), Req(PROMPT_B, TABLE_B, 0), Req(PROMPT_C, TABLE_C, 0)], ops)
    return kv


def test_invariant_forward_matches_the_default_forward(model, kernel_calls):
    """Prefill of three requests and a decode step of two: logits within fp32 tolerance, and the
    KV they write too."""
    reqs = [Req(PROMPT_A, TABLE_A, 0), Req(PROMPT_B, TABLE_B, 0), Req(PROMPT_C, TABLE_C, 0)]
    kv_ref, kv_inv = new_cache(model), new_cache(model)
    ref = step(model, kv_ref, reqs)
    assert not kernel_calls
    got = step(model, kv_inv, reqs, OPS)
    # per layer: qkv, gate/up (matmul), o, down (matmul with add), 2 norms, attention; final norm, head
    assert kernel_calls == {"matmul": 4 * 2 + 1, "rms_norm": 2 * 2 + 1, "attention": 2}
    assert got.shape == ref.shape == (len(PROMPT_A) + len(PROMPT_B) + len(PROMPT_C), 128)
    torch.testing.assert_close(got, ref, atol=TOL, rtol=TOL)
    torch.testing.assert_close(kv_inv, kv_ref, atol=TOL, rtol=TOL)
    dec = [Req([11], TABLE_A, len(PROMPT_A)), Req([12], TABLE_C, len(PROMPT_C))]
    torch.testing.assert_close(step(model, kv_inv, dec, OPS), step(model, kv_ref, dec), atol=TOL, rtol=TOL)
    assert ref.abs().max() > 0.01  # (logits worth comparing)


def test_ops_off_is_the_default_path_bit_for_bit(model):
    reqs = [Req(PROMPT_A, TABLE_A, 0), Req(PROMPT_B, TABLE_B, 0)]
    kv1, kv2 = new_cache(model), new_cache(model)
    meta_args = ([7, 5], [0, 0], [TABLE_A, TABLE_B], reqs[0].slots() + reqs[1].slots(), BS, DEVICE)
    ids = torch.tensor(PROMPT_A + PROMPT_B, device=DEVICE)
    pos = torch.tensor(list(range(7)) + list(range(5)), device=DEVICE)
    plain = model.compute_logits(model(ids, pos, kv1, build_metadata(*meta_args), TorchAttention()))
    assert torch.equal(plain, step(model, kv2, reqs, invariant.OFF))
    assert torch.equal(kv1, kv2)


def test_a_tokens_logits_keep_their_bits_alone_in_a_batch_and_in_a_tree(model, kernel_calls):
    """Token 11 after A's prompt, then 23 after it, then 50 after that: decoded one step at a
    time alone; the same decode steps among requests B and C (A in the middle); and 11 -> 23 -> 50
    as the root path of a draft tree (siblings 90 and 91 around it), with B decoding in the same
    step. Every row of those tokens has the same bits in all three."""
    n = len(PROMPT_A)
    path = [11, 23, 50]
    base = prefilled(model, OPS)
    kv = base.clone()
    alone = [step(model, kv, [Req([t], TABLE_A, n + d)], OPS)[0] for d, t in enumerate(path)]
    kv = base.clone()
    batched = []
    for d, t in enumerate(path):
        reqs = [Req([100 + d], TABLE_B, len(PROMPT_B) + d), Req([t], TABLE_A, n + d), Req([60 + d], TABLE_C, 9 + d)]
        batched.append(step(model, kv, reqs, OPS)[1])
    # tree: 0 = 11 (root), 1 = 90 (child of 0), 2 = 23 (child of 0), 3 = 91 (child of 2), 4 = 50 (child of 2)
    parents, tokens = [-1, 0, 0, 2, 2], [11, 90, 23, 91, 50]
    depth = [0, 1, 1, 2, 2]
    mask = torch.zeros((5, 5), dtype=torch.bool, device=DEVICE)
    for i in range(5):
        j = i
        while j >= 0:
            mask[i, j], j = True, parents[j]
    kv = base.clone()
    tree_req = Req(tokens, TABLE_A, n, positions=[n + d for d in depth], mask=mask)
    tree = step(model, kv, [Req([101], TABLE_B, len(PROMPT_B)), tree_req], OPS)[1:]
    tree_rows = [tree[0], tree[2], tree[4]]
    for d in range(3):
        assert torch.equal(alone[d], batched[d]), f"depth {d}: alone vs batched"
        assert torch.equal(alone[d], tree_rows[d]), f"depth {d}: alone vs tree node"
    assert kernel_calls["attention"] == 2 * (1 + 3 + 3 + 1)  # every step through the kernels
    torch.testing.assert_close(tree[1], alone[1], atol=1.0, rtol=1.0)  # (a sibling: other logits, same scale)
    assert not torch.equal(tree[1], alone[1])


def test_the_torch_path_is_close_across_layouts(model):
    """Control: the ordinary ops in the same layouts agree within tolerance (their bits are not
    promised: on a GPU cuBLAS picks kernels by row count)."""
    n = len(PROMPT_A)
    base = prefilled(model, invariant.OFF)
    alone = step(model, base.clone(), [Req([11], TABLE_A, n)])[0]
    batched = step(model, base.clone(), [Req([100], TABLE_B, 5), Req([11], TABLE_A, n), Req([60], TABLE_C, 9)])[1]
    torch.testing.assert_close(batched, alone, atol=TOL, rtol=TOL)


class _NotLlama:
    pass


def test_target_pass_takes_the_kernels_where_the_setting_and_the_device_say(model):
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert stages.step_ops_kwargs(model, cuda, "on", False) == {"ops": invariant.ON}
    assert stages.step_ops_kwargs(model, cuda, "auto", True) == {"ops": invariant.ON}
    assert stages.step_ops_kwargs(model, cuda, "auto", False) == {}  # all rows sampled: cuBLAS
    assert stages.step_ops_kwargs(model, cuda, "off", True) == {}
    assert stages.step_ops_kwargs(model, cpu, "on", True) == {}  # a CPU engine: its own ops
    assert stages.step_ops_kwargs(_NotLlama(), cuda, "on", True) == {}  # e.g. the tensor-parallel target
    with pytest.raises(ValueError, match="batch_invariant"):
        stages.step_ops_kwargs(model, cuda, "yes", True)


def test_the_engine_runs_greedy_steps_through_the_invariant_ops(lm, monkeypatch, kernel_calls):
    """An engine with ``batch_invariant="on"`` / ``"auto"``, the kernels forced onto the CPU without CUDA: the
    target's forward and logits get the ops (counted) and the greedy output equals the plain
    engine's with ``off``; ``auto`` with a sampled request does not take them."""
    from specd.config import CacheConfig, EngineConfig
    from specd.engine.engine import Engine
    from specd.engine.sequence import SpecParams
    from specd.sampling.params import SamplingParams

    seen = []
    real_step_ops = invariant.step_ops

    def forced(mode, any_greedy):
        ops = real_step_ops(mode, any_greedy)
        seen.append(ops.enabled)
        return OPS if ops.enabled else ops

    monkeypatch.setattr(invariant, "step_ops", forced)  # (stages calls invariant.step_ops)

    def run(setting: str, temperature: float) -> list:
        cfg = EngineConfig(target=str(lm.path), device=DEVICE.type, dtype="float32", batch_invariant=setting,
                           attention_backend="torch", cache=CacheConfig(num_blocks=32))  # fmt: skip
        eng = Engine(cfg, target=lm)
        params = SamplingParams(temperature=temperature, max_tokens=3, ignore_eos=True, seed=1)
        return eng.generate([PROMPT_A], params, SpecParams("off"))[0].output_ids

    seen.clear()
    off = run("off", 0.0)
    assert seen and not any(seen) and not kernel_calls
    seen.clear()
    on = run("on", 0.0)
    assert seen and all(seen) and kernel_calls["attention"] == 2 * len(seen)
    assert on == off and len(on) == 3
    for setting, temperature, invariant_steps in (("auto", 1.0, False), ("auto", 0.0, True)):
        seen.clear()
        kernel_calls.clear()
        run(setting, temperature)
        assert seen and all(x == invariant_steps for x in seen)
        assert bool(kernel_calls) == invariant_steps
