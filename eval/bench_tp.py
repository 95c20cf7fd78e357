"""Tensor parallelism on this machine: the target split over 2 ranks (two processes, one thread
each, gloo over loopback) vs one rank with two threads and with one thread; decode tokens/s at
batch 1 and 4 on the built-in model in fp32, and the collectives' cost per decode step measured
inside the sharded forward on rank 0 (two all-reduces per layer, plus the LM head's broadcast and
gather). Both LM-head layouts of TP=2 are timed: split by vocabulary (gathered once) and the whole
head on rank 0.

Configurations are interleaved pass by pass (drift on a shared machine hits all alike); figures are
medians over passes. Plain greedy decoding, ``ignore_eos``; decode rate = tokens emitted by the
steps after every request's first token / their wall time. Every configuration's tokens are
checked identical to TP=1's. Prints the CPU (model, SIMD flags), versions and a Markdown table;
``--json`` writes everything.

    OMP_NUM_THREADS=1 python -m eval bench tp --max-tokens 48 --repeats 5 --json eval/out/bench_tp.json
"""

from __future__ import annotations

import argparse
import time

import torch

from eval import harness as H

COMMAND = "bench tp"  # python -m eval bench tp (this module's ``main``)

TEXTS = [
    "The capital of France is",
    "Write a short poem about the sea.",
    "Explain why the sky is blue in one paragraph.",
    "List three uses of a paperclip:",
]
# name -> (tensor_parallel_size, threads on rank 0 (and per rank), lm head)
CONFIGS = {
    "TP=1, 1 thread": (1, 1, "split"),
    "TP=1, 2 threads": (1, 2, "split"),
    "TP=2, 1 thread/rank, head split": (2, 1, "split"),
    "TP=2, 1 thread/rank, head on rank 0": (2, 1, "rank0"),
}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=None, help="default: the built-in model (dequantized to fp32)")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--repeats", type=int, default=5, help="interleaved passes per configuration")
    ap.add_argument("--json", default=None)
    return ap.parse_args(argv)


def build(a) -> tuple:
    """(loaded target, {name: engine}); TP=1 configurations share one engine (threads set per pass)."""
    from specd.config import CacheConfig, EngineConfig, SpecConfig
    from specd.engine.engine import Engine
    from specd.model import builtin
    from specd.model.loader import load_model

    path = a.target or str(builtin.ensure(download=False))
    target = load_model(path, "cpu", "float32", quantization="none", progress=False)
    engines: dict = {}
    for name, (tp, threads, head) in CONFIGS.items():
        if tp == 1 and engines:
            engines[name] = next(iter(engines.values()))
            continue
        cfg = EngineConfig(
            target=path, device="cpu", dtype="float32", quantization="none", threads=threads,
            tensor_parallel_size=tp, tensor_parallel_lm_head=head, cache=CacheConfig(num_blocks=256),
            spec=SpecConfig(mode="off", adaptive=False),
        )  # fmt: skip
        engines[name] = Engine(cfg, target=target)
    return target, engines


def decode_pass(eng, prompts: list, max_tokens: int) -> tuple:
    """One batch to completion: (decode tokens/s, collective seconds per decode step or None, steps,
    output token lists)."""
    from specd.engine.sequence import SpecParams
    from specd.sampling.params import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    seqs = [eng.add_request(p, sp, SpecParams(mode="off")) for p in prompts]
    while any(s.num_output == 0 for s in seqs):  # prefill (and the first token) untimed
        eng.step()
    tp = eng.tp
    c0 = (tp.allreduce_seconds, tp.comm.logits_seconds) if tp is not None else (0.0, 0.0)
    n0, steps = sum(s.num_output for s in seqs), 0
    t0 = time.perf_counter()
    while any(not s.finished for s in seqs):
        eng.step()
        steps += 1
    dt = time.perf_counter() - t0
    comm = None
    if tp is not None and steps:
        comm = ((tp.allreduce_seconds - c0[0]) / steps, (tp.comm.logits_seconds - c0[1]) / steps)
    return (sum(s.num_output for s in seqs) - n0) / dt, comm, dt / max(steps, 1), [s.output_ids for s in seqs]


def run(a, engines: dict, prompts: list) -> dict:
    """Every configuration x batch, ``--repeats`` interleaved passes: samples by (name, batch)."""
    samples: dict = {}
    for rep in range(a.repeats + 1):  # pass 0 warms up (first-call costs), not recorded
        for b in [int(x) for x in a.batches.split(",")]:
            for name, (_, threads, _) in CONFIGS.items():
                torch.set_num_threads(threads)
                rate, comm, step_s, outs = decode_pass(engines[name], prompts[:b], a.max_tokens)
                if rep:
                    s = samples.setdefault((name, b), {"rate": [], "step": [], "ar": [], "lg": [], "outs": outs})
                    s["rate"].append(rate)
                    s["step"].append(step_s)
                    if comm is not None:
                        s["ar"].append(comm[0])
                        s["lg"].append(comm[1])
        H.log(f"pass {rep} done")
    return samples


def report(a, samples: dict, engines: dict, argv) -> dict:
    rows, res = [], {}
    for (name, b), s in samples.items():
        ref = samples[("TP=1, 1 thread", b)]["outs"]
        rate, step = H.median(s["rate"]), H.median(s["step"])
        ar, lg = H.median(s["ar"]), H.median(s["lg"])
        base = H.median(samples[("TP=1, 2 threads", b)]["rate"])
        share = f"{100 * ar / step:.0f}%" if ar is not None else "-"
        row = [b, name, rate, rate / base, 1000 * step, 1000 * ar if ar is not None else "-"]
        rows.append(row + [share, 1000 * lg if lg is not None else "-", s["outs"] == ref])
        res[f"{name} b{b}"] = {"tokens_per_s": rate, "step_ms": 1000 * step, "allreduce_ms_per_step": row[5],
                               "logits_collectives_ms_per_step": rows[-1][7], "same_tokens_as_tp1": s["outs"] == ref,
                               "rates": s["rate"]}  # fmt: skip
    probe = {}
    for name, (tp, _, _) in CONFIGS.items():
        if tp > 1 and not probe:
            probe = {b: engines[name].tp.probe_allreduce(500, b) for b in (1, 4)}
    for b, sec in probe.items():
        print(f"all-reduce of [{b}, hidden] fp32 with both ranks ready: {1e6 * sec:.0f} us")
    res["allreduce_probe_us"] = {str(b): 1e6 * sec for b, sec in probe.items()}
    meta = H.run_meta(COMMAND, argv)
    cpu = H.cpu_info()
    print(f"\n{meta['date']}  `{meta['command']}`")
    print(f"CPU {cpu['model']} ({cpu['usable_cpus']} usable), SIMD {' '.join(cpu['simd_flags'])}; {meta['versions']}\n")
    heads = ["batch", "configuration", "decode tok/s", "vs TP=1 2 threads", "step ms", "all-reduce ms/step"]
    print(H.md_table(heads + ["all-reduce share", "LM-head collectives ms/step", "same tokens"], rows))
    return {"meta": meta, "cpu": {k: v for k, v in cpu.items() if k != "flags"}, "flags": cpu["flags"], "results": res}


def main(argv=None) -> None:
    a = parse_args(argv)
    H.set_threads(1)
    target, engines = build(a)
    tok = target.tokenizer
    prompts = [tok(t)["input_ids"] for t in TEXTS]
    try:
        out = report(a, run(a, engines, prompts), engines, argv)
    finally:
        for e in engines.values():
            e.close()
    if a.json:
        H.write_json(a.json, out)


if __name__ == "__main__":
    main()
