"""Model-free drafting on the built-in model: plain vs prompt lookup (``ngram``) vs the draft model
(``chain``) per Spec-Bench category, greedy, one process, modes interleaved per prompt (so load on a
shared machine hits every mode alike), outputs checked identical to plain.

    OMP_NUM_THREADS=1 python -m eval.bench_ngram --per-category 2 --max-tokens 128 --threads 1
"""

from __future__ import annotations

import argparse
import collections
import json
import time

from eval import harness as H

CATEGORIES = "summarization,rag,qa,math_reasoning,translation,writing"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("--categories", default=CATEGORIES)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--modes", default="off,ngram,chain")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quantization", default="auto")
    return ap.parse_args(argv)


def questions(cats: list, per: int) -> dict:
    by: dict = collections.defaultdict(list)
    for line in (H.ROOT.parent / "shared/data/spec_bench/question.jsonl").open():
        r = json.loads(line)
        if r["category"] in cats and len(by[r["category"]]) < per:
            by[r["category"]].append(r["turns"][0])
    return by


def build(quantization: str):
    from specd.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
    from specd.engine.engine import Engine
    from specd.model import builtin

    draft = builtin.draft_path()
    cfg = EngineConfig(
        target=str(builtin.builtin_gguf()),
        draft=str(draft) if draft else None,
        quantization=quantization,
        cache=CacheConfig(num_blocks=1024),
        spec=SpecConfig(adaptive=True, suffix_store=False),
        scheduler=SchedulerConfig(enable_prefix_cache=False),
    )
    return Engine(cfg)


def run(eng, by: dict, modes: list, max_tokens: int) -> dict:
    from specd.engine.sequence import SpecParams
    from specd.sampling.params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    res: dict = collections.defaultdict(lambda: {m: [0, 0.0, 0, 0] for m in modes})  # tokens, s, steps, accepted
    for cat, qs in by.items():
        for q in qs:
            ids = eng.tokenizer.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True, return_dict=False
            )
            ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)[-1800:]
            ref = None
            for m in modes:
                t0 = time.perf_counter()
                s = eng.generate([ids], params, SpecParams(m))[0]
                row = res[cat][m]
                row[0] += s.num_output
                row[1] += time.perf_counter() - t0
                row[2] += s.stats.steps
                row[3] += s.stats.accepted_tokens
                ref = s.output_ids if ref is None else ref
                assert s.output_ids == ref, f"{m} differs from {modes[0]} on a {cat} prompt"
    return res


def main(argv=None) -> int:
    a = parse_args(argv)
    H.set_threads(a.threads)
    modes = a.modes.split(",")
    from specd.engine.warmup import warm_up

    eng = build(a.quantization)
    warm_up(eng)
    res = run(eng, questions(a.categories.split(","), a.per_category), modes, a.max_tokens)
    print(f"`{H.command_line('bench_ngram', argv)}`; CPU {H.cpu_name()}; {a.threads} thread(s)\n")
    print("| category | " + " | ".join(f"{m} tok/s | {m} speedup | {m} tokens/step" for m in modes) + " |")
    print("|---|" + "---|---|---|" * len(modes))
    tot = {m: [0, 0.0, 0, 0] for m in modes}
    for cat, d in list(res.items()) + [("overall", tot)]:
        if cat != "overall":
            for m in modes:
                tot[m] = [x + y for x, y in zip(tot[m], d[m])]
        base = d[modes[0]][0] / d[modes[0]][1]
        cells = []
        for m in modes:
            n, sec, steps, acc = d[m]
            cells += [f"{n / sec:.1f}", f"{n / sec / base:.2f}x", f"{1 + acc / max(1, steps):.2f}"]
        print(f"| {cat} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
