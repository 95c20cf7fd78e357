"""What a feature-head step costs next to the target's, piece by piece (one process, medians).

The target's layers over W new rows after a ``--context``-token prefix (W = 1: a plain step; W > 1:
a verification of W - 1 draft tokens), with and without capturing the head's features, and its LM
head over those rows; then the head's pieces for one draft row: ``fc`` (fusing the features), its
layer (through the CPU kernel where the engine drafts through it, else op by op), and its logits
over the draft vocabulary. This is where a speculative step's time goes beyond a plain one.

    OMP_NUM_THREADS=2 python -m eval costs head --rows 1,2,4,8 --context 200 --threads 2 [--cold-mb 256]
"""

from __future__ import annotations

import argparse

import torch

from eval import harness as H
from eval.harness.stats import median_ms  # (tests/test_head.py checks it through this module)

COMMAND = "costs head"  # python -m eval costs head (this module's ``main``)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default=None, help="target (default: the built-in model, as `specd serve` runs it)")
    ap.add_argument("--head", default=None, help="head folder (default: the built-in head)")
    ap.add_argument("--act-quant", default="auto", choices=("auto", "none", "int8"))
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--cold-mb", type=int, default=0, help="evict the caches before each call (MB read; 0: warm)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None, help="folder for results.json")
    return ap.parse_args(argv)


def target_costs(target, head, rows: list, ctx: int, reps: int, cold=None, kv_dtype=None) -> dict:
    from specd.model.attention import get_backend

    c, dev = target.config, target.device
    backend, g, V = get_backend("auto", dev), torch.Generator().manual_seed(0), c.vocab_size
    pre = H.PagedPrefix(c.num_layers, c.num_kv_heads, c.head_dim, ctx, max(rows), kv_dtype or target.dtype, dev)
    target.model(torch.randint(0, V, (ctx,), generator=g), torch.arange(ctx), pre.cache.kv, pre.meta(ctx, 0), backend)
    out = {}
    for w in rows:
        ids, pos, meta = torch.randint(0, V, (w,), generator=g), torch.arange(ctx, ctx + w), pre.meta(w)
        hidden = target.model(ids, pos, pre.cache.kv, meta, backend)

        def layers(ids=ids, pos=pos, meta=meta, caps=False):
            target.model(ids, pos, pre.cache.kv, meta, backend, capture=dict.fromkeys(head.layers) if caps else None)

        out[w] = {
            "layers_ms": median_ms(layers, reps, cold),
            "layers_capture_ms": median_ms(lambda f=layers: f(caps=True), reps, cold),
            "lm_head_ms": median_ms(lambda h=hidden: target.model.compute_logits(h), reps, cold),
        }
    return out


def head_costs(target, head, ctx: int, reps: int, cold=None, kv_dtype=None) -> dict:
    from specd.model.attention import get_backend

    hc, dev = head.cfg, target.device
    backend = get_backend("auto", dev)
    pre = H.PagedPrefix(1, hc.num_kv_heads, hc.head_dim, ctx, 1, kv_dtype or target.dtype, dev)
    feats = torch.randn((ctx + 1, len(head.layers) * head.target_hidden), generator=torch.Generator().manual_seed(0))
    ids, x = torch.randint(0, target.config.vocab_size, (ctx + 1,)), head.fuse(feats * 0.1)
    head(ids[:ctx], torch.arange(ctx), x[:ctx], pre.cache.kv, pre.meta(ctx, 0), backend)
    meta, pos, x1 = pre.meta(1), torch.tensor([ctx]), x[ctx:]
    out = head(ids[ctx:], pos, x1, pre.cache.kv, meta, backend)
    return {
        "kernel": head.fused is not None,
        "draft_vocab": head.draft_vocab_size,
        "fc_ms": median_ms(lambda: head.fuse(feats[ctx:]), reps, cold),
        "layer_ms": median_ms(lambda: head(ids[ctx:], pos, x1, pre.cache.kv, meta, backend), reps, cold),
        "logits_ms": median_ms(lambda: head.compute_logits(out, reduced=True), reps, cold),
    }


def main(argv=None) -> int:
    from specd.config import EngineConfig
    from specd.engine.builder import kv_dtype, load_head_for, load_models
    from specd.model import builtin
    from specd.model.attention import get_backend

    args = parse_args(argv)
    H.set_threads(args.threads)
    cfg = EngineConfig(target=args.target or str(builtin.builtin_gguf()), act_quant=args.act_quant,
                       head=args.head or str(builtin.head_path()))  # fmt: skip
    target = load_models(cfg, None, None)[0]
    head = load_head_for(cfg, target, None)  # as the engine loads it (drafting through the kernel there)
    rows = [int(r) for r in args.rows.split(",")]
    cold = torch.zeros(args.cold_mb << 18) if args.cold_mb else None  # fp32: 2^18 per MB
    kvd = kv_dtype(cfg, target, get_backend("auto", target.device))  # the engine's cache (fp16 on the CPU kernel)
    res = {"target": target_costs(target, head, rows, args.context, args.reps, cold, kvd)}
    res["head"] = head_costs(target, head, args.context, args.reps, cold, kvd)
    res["kv_dtype"] = str(kvd).removeprefix("torch.")
    for w, r in res["target"].items():
        print(f"target, {w} row(s): layers {r['layers_ms']} ms (capturing features {r['layers_capture_ms']}), "
              f"LM head {r['lm_head_ms']} ms", flush=True)  # fmt: skip
    h = res["head"]
    print(f"head ({h['draft_vocab']} draft tokens, kernel {h['kernel']}), one row: fc {h['fc_ms']} ms, "
          f"layer {h['layer_ms']} ms, logits {h['logits_ms']} ms", flush=True)  # fmt: skip
    H.write_json(H.out_dir(args.out, "head_costs") / "results.json", {"args": vars(args), **res})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
