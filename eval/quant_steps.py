"""Step costs per weight format (issue 19), one process, rotated: plain greedy decode tokens/s of the
target alone for each ``DTYPE:QUANT`` variant, and the cost of a forward of W rows (a verification
of W - 1 draft tokens) relative to one row, which is what the adaptive speculation policy weighs.

    python -m eval.quant_steps --target ~/.cache/specd/models/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --variants float32:none,bfloat16:none,float32:int8,float32:int4,float32:gguf --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from eval import common as C
from eval import harness as H

PROMPTS = ["The capital of France is a city that", "Write a short poem about the sea.", "What is 17 times 23?"]


def forward_ms(lm, rows: int, reps: int = 15, ctx: int = 32, kv_dtype=None) -> float:
    """Median ms of one target forward of ``rows`` new tokens after a ``ctx``-token context (the
    cache's contents are whatever it holds: the cost does not depend on them), with the attention
    backend the engine picks here (on a CPU with the kernel: the fused layers), over a KV cache of
    ``kv_dtype`` (default: the model's dtype)."""
    import torch

    from specd.engine.kv_cache import KVCache
    from specd.model.attention import build_metadata, get_backend

    c, m = lm.config, lm.model
    blocks, dt = (ctx + rows) // 16 + 2, kv_dtype or lm.dtype
    cache = KVCache(c.num_layers, c.num_kv_heads, c.head_dim, blocks, 16, dt, torch.device("cpu"))
    seq = cache.new_seq()
    seq.reserve(ctx + rows)
    meta = build_metadata([rows], [ctx], [seq.blocks], seq.slots(ctx, ctx + rows), 16, torch.device("cpu"))
    ids, pos = torch.randint(0, c.vocab_size, (rows,)), torch.arange(ctx, ctx + rows)
    backend = get_backend("auto", torch.device("cpu"))
    times = []
    for _ in range(reps + 2):
        t0 = time.perf_counter()
        m.compute_logits(m(ids, pos, cache.kv, meta, backend))
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times[2:])


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--variants", default="float32:none,bfloat16:none,float32:int8,float32:int4,float32:gguf")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--widths", default="1,5,17")
    ap.add_argument(
        "--contexts",
        default="",
        help="comma list of context lengths: also print the forward ms of each width after each context",
    )
    ap.add_argument(
        "--isas",
        default="",
        help="comma list of int8-activation GEMM instruction sets (amx, avx512vnni, avx2): the forward ms "
        "of each width per set and context (--contexts, else 32) for the first variant, in rotated rounds",
    )
    ap.add_argument(
        "--kv-dtypes",
        default="",
        help="comma list of KV cache dtypes (float32, float16): the forward ms of each width per dtype and "
        "context (--contexts, else 32) for the first variant, in rotated rounds",
    )
    return ap.parse_args(argv)


def main(argv=None) -> int:
    a = parse(argv)
    H.set_threads(a.threads)
    H.quiet_transformers()
    from specd.sampling.params import SamplingParams

    engines, models = {}, {}
    for v in a.variants.split(","):
        dtype, q = v.split(":")
        models[v] = C.load_variant(a.target, q, "cpu", dtype, progress=False)
        engines[v] = H.make_engine(C.Mode.parse("off"), models[v], None, "cpu", prefix_cache=False)
    tok = next(iter(models.values())).tokenizer
    ids = [tok(p)["input_ids"] for p in PROMPTS]
    p = SamplingParams(temperature=0.0, max_tokens=a.tokens, ignore_eos=True)
    tps = {v: [] for v in engines}
    for e in engines.values():
        e.generate(ids[:1], SamplingParams(temperature=0.0, max_tokens=4))
    for _ in range(a.rounds):  # rotated: the variants see the same machine load
        for v, e in engines.items():
            for x in ids:
                t0 = time.perf_counter()
                e.generate([x], p)
                tps[v].append(a.tokens / (time.perf_counter() - t0))
    widths = [int(w) for w in a.widths.split(",")]
    rows = []
    for v, lm in models.items():
        ms = {w: forward_ms(lm, w) for w in widths}
        rows.append([v, f"{statistics.median(tps[v]):.1f}"] + [f"{ms[w]:.1f}" for w in widths]
                    + [f"{ms[w] / ms[widths[0]]:.2f}" for w in widths[1:]])  # fmt: skip
    head = ["dtype:weights", "plain tokens/s"] + [f"forward {w} rows ms" for w in widths]
    head += [f"{w} rows / {widths[0]}" for w in widths[1:]]
    print(f"threads {a.threads}; {a.tokens} tokens x {len(PROMPTS)} prompts x {a.rounds} rounds, medians")
    print(C.md_table(head, rows))
    if a.contexts:
        ctxs = [int(x) for x in a.contexts.split(",")]
        for v, lm in models.items():
            print(f"\n{v}: target forward ms by context (rows) and width (columns)")
            table = [[str(n)] + [f"{forward_ms(lm, w, ctx=n):.1f}" for w in widths] for n in ctxs]
            print(C.md_table(["context"] + [f"{w} rows" for w in widths], table))
    if a.isas:
        isa_table(next(iter(models.values())), a.isas.split(","), widths, a.contexts or "32", a.rounds)
    if a.kv_dtypes:
        kv_table(next(iter(models.values())), a.kv_dtypes.split(","), widths, a.contexts or "32", a.rounds)
    return 0


def isa_table(lm, isas: list, widths: list, contexts: str, rounds: int) -> None:
    """Forward ms by instruction set of the int8-activation GEMMs (bitwise-equal results), the sets
    rotated within each round; medians over rounds."""
    from specd.model.qkernel import ISAS, x8_isa

    ctxs = [int(x) for x in contexts.split(",")]
    ms: dict = {}
    try:
        for _ in range(rounds):
            for isa in isas:
                if x8_isa(ISAS.index(isa)) != isa:
                    raise SystemExit(f"error: this CPU cannot run {isa} (in use: {x8_isa()})")
                for n in ctxs:
                    for w in widths:
                        ms.setdefault((isa, n, w), []).append(forward_ms(lm, w, ctx=n))
    finally:
        x8_isa(-1)
    print("\nforward ms by int8-activation GEMM instruction set")
    head = ["set", "context"] + [f"{w} rows" for w in widths]
    rows = [[isa, str(n)] + [f"{statistics.median(ms[(isa, n, w)]):.2f}" for w in widths] for n in ctxs for isa in isas]
    print(C.md_table(head, rows))


def kv_table(lm, kv_dtypes: list, widths: list, contexts: str, rounds: int) -> None:
    """Forward ms by KV cache element type, the types rotated within each round; medians over rounds."""
    import torch

    ctxs = [int(x) for x in contexts.split(",")]
    ms: dict = {}
    for _ in range(rounds):
        for n in ctxs:
            for w in widths:
                for kv in kv_dtypes:
                    ms.setdefault((kv, n, w), []).append(forward_ms(lm, w, ctx=n, kv_dtype=getattr(torch, kv)))
    print("\nforward ms by KV cache dtype")
    head = ["KV cache", "context"] + [f"{w} rows" for w in widths]
    med = {k: statistics.median(v) for k, v in ms.items()}
    rows = [[kv, str(n)] + [f"{med[(kv, n, w)]:.2f}" for w in widths] for n in ctxs for kv in kv_dtypes]
    print(C.md_table(head, rows))


if __name__ == "__main__":
    sys.exit(main())
