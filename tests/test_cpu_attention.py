"""specd's CPU attention kernel (``--attention-backend cpu``, the CPU default where it builds): equal to
the pure-torch reference on decode, causal chunks, trees and mixed batches, and batch-invariant: a
query row's output is bitwise the same whatever else shares the step. With it (and the kernel's
row-independent quantized matmuls) a quantized model's forward gives each token the same bits in a
decode step, a verification tree or a batch of other requests, so speculative output equals plain
output exactly and plain output does not depend on the batch."""

from __future__ import annotations

import random

import pytest
import torch

from specd.config import CacheConfig, EngineConfig, SpecConfig
from specd.engine.engine import Engine
from specd.engine.kv_cache import KVCache
from specd.engine.sequence import SpecParams
from specd.model.attention import CpuAttention, TorchAttention, build_metadata, get_backend
from specd.model.loader import load_model
from specd.model.qkernel import kernel
from specd.sampling.params import SamplingParams
from tests.conftest import TARGET

CPU = torch.device("cpu")


def _tree_mask(n: int, rng: random.Random) -> torch.Tensor:
    parents = [-1] + [rng.randrange(i) for i in range(1, n)]
    m = torch.zeros((n, n), dtype=torch.bool)
    for i, p in enumerate(parents):
        m[i, i] = True
        if p >= 0:
            m[i] |= m[p]
    return m


def _problem(qlens, ctxs, masks, kvh=2, group=3, d=16, bs=4, seed=0):
    """(q [T, H, D], kv layer [2, NB, BS, KVH, D], metadata) with shuffled physical blocks."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-(c + q) // bs) for c, q in zip(ctxs, qlens)]
    perm = torch.randperm(sum(need) + 3, generator=g).tolist()
    tables, slots, k = [], [], 0
    for c, q, n in zip(ctxs, qlens, need):
        t = perm[k : k + n]
        k += n
        tables.append(t)
        slots += [t[p // bs] * bs + p % bs for p in range(c, c + q)]
    kv = torch.randn(2, len(perm), bs, kvh, d, generator=g)
    q = torch.randn(sum(qlens), kvh * group, d, generator=g)
    meta = build_metadata(qlens, ctxs, tables, slots, bs, CPU, tree_masks=masks)
    return q, kv, meta


def _cases():
    rng = random.Random(4)
    return {
        "decode": ([1, 1, 1, 1], [0, 5, 16, 37], None),
        "causal chunks": ([9, 1, 24], [0, 30, 7], None),
        "trees": ([7, 13], [11, 0], [_tree_mask(7, rng), _tree_mask(13, rng)]),
        "mixed": ([24, 11, 1, 6], [3, 30, 77, 16], [None, _tree_mask(11, rng), None, _tree_mask(6, rng)]),
    }


@pytest.fixture(scope="module")
def backend():
    lib = kernel()
    assert lib is not None, "the CPU kernel is built on this machine (x86-64 AVX2 + FMA, g++)"
    b = get_backend("auto", CPU)
    assert isinstance(b, CpuAttention)
    return b


@pytest.mark.parametrize("d", [16, 64, 12], ids=["d16", "d64", "d12"])
@pytest.mark.parametrize("case", list(_cases()))
def test_cpu_attention_equals_the_torch_reference(backend, case, d):
    """Head sizes: vector paths (16), the register path of 64, and the scalar fallback (12)."""
    qlens, ctxs, masks = _cases()[case]
    q, kv, meta = _problem(qlens, ctxs, masks, d=d, seed=len(case))
    out = backend.attention(q, kv, meta, 0.25)
    meta.cache.clear()
    ref = TorchAttention.attention(q, kv, meta, 0.25)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("d", [64, 12])
def test_a_query_row_does_not_depend_on_the_batch(backend, d):
    """A tree request's rows: alone, next to a longer causal chunk (more padded keys, more
    queries), and next to a decode row: bitwise equal."""
    rng = random.Random(9)
    tree = _tree_mask(9, rng)
    q, kv, meta = _problem([9, 40, 1], [20, 90, 5], [tree, None, None], d=d, seed=3)
    together = backend.attention(q, kv, meta, 0.3)[:9]
    block_tables = [meta.block_tables[0, : -(-29 // 4)].tolist()]
    alone_meta = build_metadata([9], [20], block_tables, meta.slot_mapping[:9].tolist(), 4, CPU, tree_masks=[tree])
    alone = backend.attention(q[:9], kv, alone_meta, 0.3)
    assert torch.equal(alone, together)


def _logits(lm, ids, chunks, kv_dtype=torch.float32):
    c = lm.config
    cache = KVCache(c.num_layers, c.num_kv_heads, c.head_dim, 16, 4, kv_dtype, CPU)
    seq = cache.new_seq()
    seq.reserve(len(ids))
    out, pos = [], 0
    for n in chunks:
        meta = build_metadata([n], [pos], [seq.blocks], seq.slots(pos, pos + n), 4, CPU)
        h = lm.model(
            torch.tensor(ids[pos : pos + n]), torch.arange(pos, pos + n), cache.kv, meta, get_backend("auto", CPU)
        )
        out.append(lm.model.compute_logits(h))
        pos += n
    return torch.cat(out)


@pytest.mark.parametrize("kv", [torch.float32, torch.float16], ids=["kv32", "kv16"])
@pytest.mark.parametrize("act", [False, True], ids=["fp32-act", "int8-act"])
def test_a_quantized_forward_is_batch_invariant(act, kv):
    """Same tokens through a quantized model in one chunk, one token at a time, and in uneven
    chunks: bitwise-equal logits, over an fp32 or an fp16 KV cache."""
    from specd.model.quant import set_act_int8

    lm = load_model(TARGET, "cpu", "float32", quantization="int4")
    set_act_int8(lm.model, act)
    ids = [1, 403, 407, 261, 378, 365, 167, 282, 395, 263, 320, 326]
    whole = _logits(lm, ids, [12], kv)
    assert torch.equal(whole, _logits(lm, ids, [1] * 12, kv))
    assert torch.equal(whole, _logits(lm, ids, [5, 2, 5], kv))
    if kv == torch.float16:  # (the fp16 cache is read, not an fp32 copy: its rounding shows in the logits)
        assert not torch.equal(whole, _logits(lm, ids, [12]))


@pytest.mark.parametrize("kv", ["auto", "float32"])
def test_plain_output_does_not_depend_on_the_batch_and_speculation_matches_it_exactly(kv):
    """int4 weights, int8 activations: batch 4 == batch 1 to the last bit of every log-probability,
    and chain / tree speculation give the same tokens and the same log-probabilities; with the KV
    cache ``auto`` picks for a quantized model on the CPU kernel (fp16) and with an fp32 one."""
    t = load_model(TARGET, "cpu", "float32", quantization="int4")
    d = load_model(TARGET.parent / "stories260K-draft-1L64", "cpu", "float32", quantization="int4")
    cfg = EngineConfig(target=str(TARGET), draft="d", dtype="float32", quantization="int4", act_quant="int8",
                       cache=CacheConfig(num_blocks=256, dtype=kv), spec=SpecConfig(adaptive=False))  # fmt: skip
    eng = Engine(cfg, target=t, draft=d)
    assert eng.cache.kv.dtype == (torch.float16 if kv == "auto" else torch.float32)
    tok = eng.tokenizer
    prompts = [tok(p)["input_ids"] for p in ("Once upon a time", "The dog ran", "Lily saw a big", "Tom and Sue")]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=0)
    batch = eng.generate(prompts, params, SpecParams("off"))
    alone = [eng.generate([p], params, SpecParams("off"))[0] for p in prompts]
    assert [s.logprobs for s in batch] == [s.logprobs for s in alone]
    for mode in ("chain", "tree"):
        spec = eng.generate(prompts, params, SpecParams(mode))
        assert sum(s.stats.accepted_tokens for s in spec) > 0
        assert [s.output_ids for s in spec] == [s.output_ids for s in batch], mode
        assert [s.logprobs for s in spec] == [s.logprobs for s in batch], mode
