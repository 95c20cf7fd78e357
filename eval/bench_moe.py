"""Does the sparse mixture-of-experts path pay? (issue #42 item 1) A shape-true random-weight Qwen3-MoE
(default: hidden 1024, 16 layers, 64 experts, top-8, experts 512 wide, 16 q / 4 kv heads of 64) with
every projection in Q8_0-style int8 blocks of 32 (``QuantLinear``, the CPU kernel; the router in fp32),
decoded at batch 1: specd's path (each token runs its 8 chosen experts) against the same model with
all 64 experts computed densely (``SparseMoE.all_experts``, unchosen experts weighted 0).

    OMP_NUM_THREADS=2 python -m eval.bench_moe --threads 2 --act int8

One step = ``LlamaModel.forward`` of one token over the paged cache (CPU attention backend) +
``compute_logits`` + argmax, after a ``--prompt``-token prefill; per pass, sparse and dense alternate
(``--passes``), ``--steps`` timed decode steps each; medians of the step wall times and the median
of the per-pass dense / sparse ratios. Bytes read per step: the weights each path touches.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn as nn

from specd.config import ModelConfig
from specd.engine.kv_cache import KVCache
from specd.model.attention import build_metadata, get_backend
from specd.model.cpu import set_threads
from specd.model.llama import LlamaModel, Rotary
from specd.model.moe import SparseMoE
from specd.model.quant import QuantLinear, quantize_int8, set_act_int8

CPU = torch.device("cpu")


def config(a) -> ModelConfig:
    return ModelConfig(
        architecture="Qwen3MoeForCausalLM", vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=3 * a.hidden,
        num_layers=a.layers, num_heads=16, num_kv_heads=4, head_dim=a.hidden // 16, rms_norm_eps=1e-6,
        rope_theta=1e6, max_position_embeddings=4096, tie_word_embeddings=False, qk_norm=True,
        num_experts=a.experts, num_experts_per_tok=a.top_k, moe_intermediate_size=a.inter, norm_topk_prob=True,
        moe_layers=tuple(range(a.layers)),
    )  # fmt: skip


def _q(n: int, k: int, g: torch.Generator) -> QuantLinear:
    """A random [n, k] projection (std 1/sqrt(k)) in int8 blocks of 32 (Q8_0's layout)."""
    return quantize_int8(torch.randn(n, k, generator=g) / k**0.5, group=32)


def _norm(d: int) -> nn.Parameter:
    return nn.Parameter(torch.ones(d), requires_grad=False)


def build(cfg: ModelConfig, seed: int = 0) -> LlamaModel:
    """The model, built on the meta device and filled one quantized projection at a time (no fp32 copy)."""
    g = torch.Generator().manual_seed(seed)
    d, H, KVH, D = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    with torch.device("meta"):
        model = LlamaModel(cfg, max_positions=1024)
    model.rotary = Rotary(cfg, 1024)
    for blk in model.layers:
        blk.input_norm.weight, blk.post_norm.weight = _norm(d), _norm(d)
        blk.attn.q_norm.weight, blk.attn.k_norm.weight = _norm(D), _norm(D)
        blk.attn.qkv, blk.attn.o = _q((H + 2 * KVH) * D, d, g), _q(d, H * D, g)
        moe = blk.mlp
        moe.router = nn.Linear(d, cfg.num_experts, bias=False)
        moe.router.weight = nn.Parameter(torch.randn(cfg.num_experts, d, generator=g) / d**0.5, requires_grad=False)
        for ex in moe.experts:
            ex.gate_up, ex.down = _q(2 * cfg.moe_intermediate_size, d, g), _q(d, cfg.moe_intermediate_size, g)
    model.norm.weight = _norm(d)
    model.embed = nn.Embedding(cfg.vocab_size, d, _weight=torch.randn(cfg.vocab_size, d, generator=g))
    model.lm_head = _q(cfg.vocab_size, d, g)
    left = [n for n, p in list(model.named_parameters()) + list(model.named_buffers()) if p.is_meta]
    assert not left, left[0]
    return model.eval()


def decode_times(model: LlamaModel, prompt: int, steps: int) -> list:
    """(wall time, CPU time of the process's threads) in s of ``steps`` greedy one-token steps after a
    ``prompt``-token prefill (CPU time: what the step cost, whatever else the machine runs meanwhile)."""
    cfg = model.cfg
    cache = KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, (prompt + steps) // 16 + 2, 16, torch.float32, CPU)
    seq, be = cache.new_seq(), get_backend("cpu", CPU)
    seq.reserve(prompt + steps)
    ids = torch.randint(0, cfg.vocab_size, (prompt,), generator=torch.Generator().manual_seed(1))
    out = []
    for pos, n in [(0, prompt)] + [(prompt + i, 1) for i in range(steps)]:
        t0, c0 = time.perf_counter(), time.process_time()
        meta = build_metadata([n], [pos], [seq.blocks], seq.slots(pos, pos + n), 16, CPU)
        logits = model.compute_logits(model(ids, torch.arange(pos, pos + n), cache.kv, meta, be)[-1:])
        ids = logits.argmax(-1)
        out.append((time.perf_counter() - t0, time.process_time() - c0))
    return out[1:]


def bytes_per_step(model: LlamaModel, dense: bool) -> int:
    """Weight bytes one decode step reads: attention, router, norms, head, and the experts it runs."""
    cfg = model.cfg
    total = sum(m.nbytes() for n, m in model.named_modules() if isinstance(m, QuantLinear) and ".experts." not in n)
    expert = sum(p.nbytes() for p in (model.layers[0].mlp.experts[0].gate_up, model.layers[0].mlp.experts[0].down))
    per_layer = (cfg.num_experts if dense else cfg.num_experts_per_tok) * expert
    return total + cfg.num_layers * (per_layer + cfg.num_experts * cfg.hidden_size * 4)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, default in (("hidden", 1024), ("layers", 16), ("experts", 64), ("top-k", 8), ("inter", 512),
                          ("vocab", 32768), ("prompt", 32), ("steps", 24), ("passes", 3), ("threads", 2)):  # fmt: skip
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--act", choices=("int8", "none"), default="int8", help="the CPU kernel's activations")
    a = p.parse_args(argv)
    set_threads(a.threads)
    t0 = time.perf_counter()
    model = build(config(a))
    built = time.perf_counter() - t0
    set_act_int8(model, a.act == "int8")
    t0 = time.perf_counter()
    if a.act == "int8":  # the kernel's int8-activation layout, built on an op's first use: not timed per step
        for m in model.modules():
            if isinstance(m, QuantLinear):
                m.x8_pack()
    packed = time.perf_counter() - t0
    print(f"built in {built:.0f} s, packed in {packed:.0f} s; threads {torch.get_num_threads()}; activations {a.act}")
    times: dict = {"sparse": [], "dense": []}
    ratios: list = []
    for i in range(a.passes):
        med = {}
        for mode in ("sparse", "dense") if i % 2 == 0 else ("dense", "sparse"):
            SparseMoE.all_experts = mode == "dense"
            t = decode_times(model, a.prompt, a.steps)
            times[mode] += t
            med[mode] = [statistics.median(x) for x in zip(*t)]  # (wall, cpu)
        ratios.append([d / s for d, s in zip(med["dense"], med["sparse"])])
        print(f"pass {i}: sparse {1e3 * med['sparse'][0]:.1f} ms ({1e3 * med['sparse'][1]:.1f} ms CPU), "
              f"dense {1e3 * med['dense'][0]:.1f} ms ({1e3 * med['dense'][1]:.1f} ms CPU)")  # fmt: skip
    SparseMoE.all_experts = False
    print("| path | median step wall (ms) | tok/s (wall) | median step CPU (ms) | weight MiB read per step |")
    print("|---|---|---|---|---|")
    for mode in ("sparse", "dense"):
        wall, cpu = (statistics.median(x) for x in zip(*times[mode]))
        mib = bytes_per_step(model, mode == "dense") / 2**20
        print(f"| {mode} | {1e3 * wall:.1f} | {1 / wall:.2f} | {1e3 * cpu:.1f} | {mib:.0f} |")
    wall, cpu = (statistics.median(x) for x in zip(*ratios))
    print(f"dense / sparse, median of the per-pass ratios: wall {wall:.2f}x, CPU time {cpu:.2f}x")


if __name__ == "__main__":
    main()
