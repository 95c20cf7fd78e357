"""GGUF K-quants kept vs requantized, and resident memory after a load (issue #42 items 2-3), on
random-weight SmolLM2-1.7B-shaped files (``tests/test_memory.py``'s ``write_random_llama``:
llama.cpp's Q4_K_M mix, or Q4_0).

    python -m eval.bench_kquants write /tmp/kq            # smol17_q4km.gguf, smol17_q40.gguf there
    OMP_NUM_THREADS=2 python -m eval.bench_kquants decode /tmp/kq --threads 2 --rounds 8 --steps 8
    OMP_NUM_THREADS=2 python -m eval.bench_kquants rss /tmp/kq/smol17_q4km.gguf gguf

``decode``: one process loads the Q4_K_M file requantized (``int4``) and kept (``gguf``) and the Q4_0
file kept, int8 activations, fp16 KV cache; per round each configuration's 1-row then 4-row step
after a 64-token context (``--steps`` timed steps each after one untimed), ``--rounds`` rounds
alternating, so each ratio is taken under the same machine load; medians and first quartiles.
``rss``: in a fresh process (run it alone), a tiny file loaded and dropped first (imports, the
kernel), the baseline RSS, the file loaded (load time, RSS growth, peak growth), then a 0.25 GiB fp16
KV cache written and one 16-token forward: the growth less the cache over the file's size.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

G = 2**30


def write(out: Path) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from specd.model import builtin
    from tests.test_memory import SMOLLM2_1_7B, write_random_llama

    out.mkdir(parents=True, exist_ok=True)
    for mix, name in (("q4_k_m", "smol17_q4km.gguf"), ("q4_0", "smol17_q40.gguf")):
        write_random_llama(out / name, mix, tokenizer_from=builtin.builtin_gguf(), **SMOLLM2_1_7B)
        print("wrote", out / name, f"{(out / name).stat().st_size / G:.3f} GiB", flush=True)


def _loaded(path: Path, q: str):
    from eval import harness as H
    from specd.model.attention import get_backend
    from specd.model.loader import load_model
    from specd.model.quant import set_act_int8

    lm = load_model(path, "cpu", "float32", quantization=q, with_tokenizer=False)
    set_act_int8(lm.model, True)
    c, cpu = lm.config, torch.device("cpu")
    pre = {}
    for rows in (1, 4):
        p = H.PagedPrefix(c.num_layers, c.num_kv_heads, c.head_dim, 64, rows, torch.float16, cpu)
        lm.model(
            torch.randint(0, c.vocab_size, (64,)), torch.arange(64), p.cache.kv, p.meta(64, 0), get_backend("auto", cpu)
        )
        pre[rows] = p
    codes = sum(b.numel() * b.element_size() for b in lm.model.buffers() if b.dtype in (torch.uint8, torch.int8))
    return lm, pre, codes


def decode(folder: Path, rounds: int, steps: int) -> dict:
    from specd.model.attention import get_backend

    be = get_backend("auto", torch.device("cpu"))
    cfgs = [
        ("Q4_K_M requantized (int4)", "smol17_q4km.gguf", "int4"),
        ("Q4_K_M kept (gguf)", "smol17_q4km.gguf", "gguf"),
        ("Q4_0 kept (gguf)", "smol17_q40.gguf", "gguf"),
    ]
    runs = []
    for name, f, q in cfgs:
        lm, pre, codes = _loaded(folder / f, q)
        runs.append((name, lm, pre))
        print(f"loaded {name}: {codes / G:.3f} GiB of codes and scales", flush=True)
    times: dict = {(n, r): [] for n, _, _ in runs for r in (1, 4)}
    for _ in range(rounds):
        for name, lm, pre in runs:
            for rows, p in pre.items():
                ids = torch.randint(0, lm.config.vocab_size, (rows,))
                lm.model(ids, torch.arange(64, 64 + rows), p.cache.kv, p.meta(rows), be)
                for _ in range(steps):
                    t = time.perf_counter()
                    lm.model(ids, torch.arange(64, 64 + rows), p.cache.kv, p.meta(rows), be)
                    times[(name, rows)].append(time.perf_counter() - t)
    out = {}
    for (name, rows), ts in times.items():
        ms = statistics.median(ts) * 1e3
        q1 = statistics.quantiles(ts, n=4)[0] * 1e3 if len(ts) > 1 else ms
        out[f"{name} b{rows}"] = {
            "median_ms": round(ms, 1),
            "q1_ms": round(q1, 1),
            "tok_per_s": round(rows * 1e3 / ms, 2),
        }
        print(f"{name:26s} b{rows}: step {ms:7.1f} ms (q1 {q1:.1f}) = {rows * 1e3 / ms:6.2f} tok/s, n={len(ts)}")
    return out


def _status() -> dict:
    out = {}
    for line in open("/proc/self/status"):
        k, v = line.split(":", 1)
        if k in ("VmRSS", "VmHWM"):
            out[k] = int(v.split()[0]) * 1024
    return out


def rss(path: Path, q: str, warm: Path, kv_mib: int = 256) -> dict:
    """The measurement of the module doc; byte counts (``tests/test_memory.py`` asserts on them) and
    the same in GiB, one JSON line."""
    from specd.engine.kv_cache import KVCache
    from specd.model.attention import build_metadata, get_backend
    from specd.model.loader import load_model
    from specd.model.quant import set_act_int8

    lm = load_model(warm, "cpu", "float32", quantization="auto", with_tokenizer=False)
    del lm
    gc.collect()
    ctypes.CDLL(None).malloc_trim(0)
    base = _status()["VmRSS"]
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak (VmHWM) from here
    t = time.time()
    lm = load_model(path, "cpu", "float32", quantization=q, with_tokenizer=False)
    load_s, loaded = time.time() - t, _status()
    set_act_int8(lm.model, True)
    c, cpu = lm.config, torch.device("cpu")
    per_block = c.num_layers * 2 * c.num_kv_heads * c.head_dim * 16 * 2
    cache = KVCache(c.num_layers, c.num_kv_heads, c.head_dim, (kv_mib << 20) // per_block, 16, torch.float16, cpu)
    cache.kv.zero_()
    seq = cache.new_seq()
    seq.reserve(16)
    meta = build_metadata([16], [0], [seq.blocks], seq.slots(0, 16), 16, cpu)
    lm.model.compute_logits(lm.model(torch.arange(16), torch.arange(16), cache.kv, meta, get_backend("auto", cpu))[-1:])
    r = {"file": path.stat().st_size, "kv": cache.kv.numel() * cache.kv.element_size(), "base": base,
         "loaded": loaded["VmRSS"], "peak": loaded["VmHWM"], "after": _status()["VmRSS"], "load_s": round(load_s, 1),
         "kinds": sorted({type(m).__name__ for m in lm.model.modules() if "Quant" in type(m).__name__})}  # fmt: skip
    gib = lambda b: round(b / G, 3)  # noqa: E731
    r.update(name=path.name, quantization=q, file_GiB=gib(r["file"]), kv_GiB=gib(r["kv"]), base_GiB=gib(base),
             loaded_growth_GiB=gib(r["loaded"] - base), peak_growth_GiB=gib(r["peak"] - base),
             after_growth_GiB=gib(r["after"] - base),
             growth_less_kv_over_file=round((r["after"] - base - r["kv"]) / r["file"], 3))  # fmt: skip
    print(json.dumps(r))
    return r


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=("write", "decode", "rss"))
    ap.add_argument("path", type=Path, help="write / decode: the files' folder; rss: one file")
    ap.add_argument("quantization", nargs="?", default="gguf", help="rss: --quantization of the load")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warm", type=Path, default=None, help="rss: a small GGUF loaded first (default: the built-in)")
    ap.add_argument("--kv-mib", type=int, default=256, help="rss: the KV cache allocated after the load")
    args = ap.parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    torch.set_num_threads(args.threads)
    if args.what == "write":
        write(args.path)
    elif args.what == "decode":
        decode(args.path, args.rounds, args.steps)
    else:
        from specd.model import builtin

        rss(args.path, args.quantization, args.warm or builtin.builtin_gguf(), args.kv_mib)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
