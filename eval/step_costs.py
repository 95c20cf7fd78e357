"""What the target's forward costs on this machine, outside the engine: a prompt's prefill in chunks
(tokens per second, time per chunk as the context grows) and decode / verification steps of W rows
after a C-token context (medians). The model is loaded as ``specd serve`` loads it (the built-in
model by default: its GGUF blocks, int8 activations where the CPU kernel takes them, the engine's
KV cache dtype); token ids are random (the cost does not depend on them).

    OMP_NUM_THREADS=2 python -m eval costs --prefill 768:256,1152:128 --decode 8:1,900:1,900:4 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from eval import harness as H

COMMAND = "costs"  # python -m eval costs (this module's ``main``)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default=None, help="target (default: the built-in model)")
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--act-quant", default="auto", choices=("auto", "none", "int8"))
    ap.add_argument("--prefill", default="768:256", help="TOKENS:CHUNK,... prompts prefilled in chunks")
    ap.add_argument("--decode", default="8:1,900:1,900:4", help="CONTEXT:ROWS,... steps after a context")
    ap.add_argument("--reps", type=int, default=5, help="prefills per size (median per chunk)")
    ap.add_argument("--steps", type=int, default=300, help="timed steps per decode shape")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None, help="folder for results.json")
    return ap.parse_args(argv)


def _pairs(spec: str) -> list:
    try:
        out = [tuple(int(v) for v in p.split(":")) for p in spec.split(",") if p.strip()]
    except ValueError:
        raise SystemExit(f"expected A:B,... of integers, got {spec!r}") from None
    if any(len(p) != 2 or min(p) < 1 for p in out):
        raise SystemExit(f"expected A:B,... of positive integers, got {spec!r}")
    return out


class _Target:
    """The loaded model, its attention backend and KV dtype, and a random-token source."""

    def __init__(self, args):
        from specd.config import EngineConfig
        from specd.engine.builder import kv_dtype, load_models
        from specd.model import builtin
        from specd.model.attention import get_backend

        cfg = EngineConfig(target=args.target or str(builtin.builtin_gguf()), quantization=args.quantization,
                           act_quant=args.act_quant)  # fmt: skip
        self.lm = load_models(cfg, None, None)[0]
        self.c, self.dev = self.lm.config, self.lm.device
        self.backend = get_backend("auto", self.dev)
        self.kvd = kv_dtype(cfg, self.lm, self.backend)
        self.gen = torch.Generator().manual_seed(0)

    def ids(self, n: int) -> torch.Tensor:
        return torch.randint(0, self.c.vocab_size, (n,), generator=self.gen)

    def prefix(self, n: int, extra: int) -> H.PagedPrefix:
        c = self.c
        return H.PagedPrefix(c.num_layers, c.num_kv_heads, c.head_dim, n, extra, self.kvd, self.dev)

    def forward(self, pre: H.PagedPrefix, ids: torch.Tensor, start: int) -> None:
        w = len(ids)
        self.lm.model(ids, torch.arange(start, start + w), pre.cache.kv, pre.meta(w, start), self.backend)

    def fill(self, pre: H.PagedPrefix, n: int, chunk: int) -> list:
        """Prefill ``n`` tokens into ``pre`` in chunks: seconds per chunk."""
        ids, ts = self.ids(n), []
        for s in range(0, n, chunk):
            t = time.perf_counter()
            self.forward(pre, ids[s : s + chunk], s)
            ts.append(time.perf_counter() - t)
        return ts


def prefill_costs(t: _Target, n: int, chunk: int, reps: int) -> dict:
    runs = [t.fill(t.prefix(0, n), n, chunk) for _ in range(reps + 1)][1:]  # the first warms up
    per_chunk = [statistics.median(r[i] for r in runs) * 1e3 for i in range(len(runs[0]))]
    total = sum(per_chunk)
    return {"chunk_ms": [round(v, 2) for v in per_chunk], "total_ms": round(total, 2),
            "tokens_per_s": round(n / total * 1e3, 1)}  # fmt: skip


def decode_costs(t: _Target, ctx: int, rows: int, steps: int) -> float:
    pre = t.prefix(ctx, rows)
    t.fill(pre, ctx, 256)
    ids = t.ids(rows)
    return H.median_ms(lambda: t.forward(pre, ids, ctx), steps)


def main(argv=None) -> int:
    args = parse_args(argv)
    prefills, decodes = _pairs(args.prefill), _pairs(args.decode)
    H.set_threads(args.threads)
    t = _Target(args)
    res: dict = {"kv_dtype": str(t.kvd).removeprefix("torch."), "prefill": {}, "decode": {}}
    for n, chunk in prefills:
        r = res["prefill"][f"{n}:{chunk}"] = prefill_costs(t, n, chunk, args.reps)
        print(f"prefill {n} tokens in chunks of {chunk}: {r['total_ms']} ms = {r['tokens_per_s']} tok/s "
              f"(chunks {r['chunk_ms']} ms)", flush=True)  # fmt: skip
    for ctx, rows in decodes:
        ms = res["decode"][f"{ctx}:{rows}"] = decode_costs(t, ctx, rows, args.steps)
        print(f"step of {rows} row(s) after {ctx} tokens: {ms} ms", flush=True)
    H.write_json(H.out_dir(args.out, "step_costs") / "results.json", {"args": vars(args), **res})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
