"""The feature head on the built-in model: plain vs the head (chain and tree) vs the built-in draft
model (chain and tree) vs prompt lookup vs hybrid trees (the head's tree + lookup) per Spec-Bench
category, greedy, one process (the target loaded once, two engines), methods interleaved per
prompt, outputs checked identical to plain. Also where a step's time goes for each method: drafting
vs the target's verification forward (the engine's stage timings, thread CPU seconds).

    OMP_NUM_THREADS=2 python -m eval accept methods --per-category 2 --max-tokens 128 --threads 2

``--penalties '{"repetition_penalty": 1.1}'``: every request with those penalties (presence, frequency,
repetition; still greedy, so the methods' outputs are still checked identical).
"""

from __future__ import annotations

import argparse
import collections
import json
import time
from pathlib import Path

from eval import harness as H

COMMAND = "accept methods"  # python -m eval accept methods (this module's ``main``)

CATEGORIES = "summarization,rag,qa,math_reasoning,translation,writing"
# method -> (engine, speculation mode)
METHODS = {
    "plain": ("head", "off"),
    "head-chain": ("head", "chain"),
    "head-tree": ("head", "head"),
    "draft-chain": ("draft", "chain"),
    "draft-tree": ("draft", "tree"),
    "ngram": ("head", "ngram"),  # prompt lookup alone (no suffix store: every method sees the same history)
    "head-hybrid": ("head", "hybrid"),  # the head's tree and prompt lookup's branch in one verification
    "auto": ("auto", "auto"),  # the adaptive policy (head, lookup, both or nothing, sized per step)
}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("--categories", default=CATEGORIES)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--act-quant", default="none", choices=("none", "int8"), help="the target's activations")
    ap.add_argument("--head", default=None, help="head folder (default: the built-in head)")
    ap.add_argument("--chain", type=int, default=4, help="chain length")
    ap.add_argument("--auto-mode", default="tree", help="auto engine: --spec-mode (tree, chain)")
    ap.add_argument("--tree-budget", type=int, default=16)
    ap.add_argument("--tree-topk", type=int, default=4)
    ap.add_argument("--tree-depth", type=int, default=6)
    ap.add_argument("--out", default=None, help="folder for results.json and speedup.png")
    ap.add_argument("--penalties", type=_penalties, default={}, help="JSON: penalty fields of every request")
    return ap.parse_args(argv)


PENALTY_FIELDS = ("presence_penalty", "frequency_penalty", "repetition_penalty")


def _penalties(text: str) -> dict:
    """``--penalties``: a JSON object of ``SamplingParams`` penalty fields, checked by it."""
    from specd.sampling.params import SamplingParams

    try:
        d = json.loads(text)
        if not isinstance(d, dict) or set(d) - set(PENALTY_FIELDS):
            raise ValueError(f"an object of {', '.join(PENALTY_FIELDS)}")
        SamplingParams(**d)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--penalties: {e}") from None
    return d


def build(a) -> dict:
    """{"head": fixed shapes with the head, "draft": with the draft model, "auto": the head with the
    adaptive policy}, sharing one loaded target."""
    from specd.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
    from specd.engine.engine import Engine
    from specd.model import builtin

    shapes = dict(num_draft_tokens=a.chain, tree_budget=a.tree_budget, tree_topk=a.tree_topk, tree_depth=a.tree_depth)
    target = None

    def engine(adaptive: bool, **model) -> Engine:
        nonlocal target
        mode = {"mode": a.auto_mode} if adaptive else {}
        cfg = EngineConfig(
            target=str(builtin.builtin_gguf()),
            dtype=a.dtype,
            act_quant=a.act_quant,
            cache=CacheConfig(num_blocks=1024),
            spec=SpecConfig(adaptive=adaptive, suffix_store=False, **shapes, **mode),  # type: ignore[arg-type]
            scheduler=SchedulerConfig(enable_prefix_cache=False),
            **model,
        )
        e = Engine(cfg, target=target)
        target = e.target
        return e

    head = str(a.head or builtin.head_path())
    make = {
        "head": lambda: engine(False, head=head),
        "draft": lambda: engine(False, draft=str(builtin.draft_path())),
        "auto": lambda: engine(True, head=head),
    }
    wanted = {"head"} | {METHODS[m][0] for m in a.methods.split(",")}
    return {name: make[name]() for name in make if name in wanted}


def _one(eng, ids: list, mode: str, params) -> tuple:
    """(sequence, seconds, draft CPU s, forward CPU s, step CPU s) of one greedy generation."""
    from specd.engine.sequence import SpecParams

    c = eng.timings.cpu
    d0, f0, s0 = c["draft"], c["forward"], c["step"]
    t0 = time.perf_counter()
    s = eng.generate([ids], params, SpecParams(mode))[0]
    return s, time.perf_counter() - t0, c["draft"] - d0, c["forward"] - f0, c["step"] - s0


def run(engines: dict, by: dict, methods: list, max_tokens: int, penalties: dict | None = None) -> dict:
    """{category: {method: [tokens, s, steps, accepted, draft CPU s, forward CPU s, step CPU s]}}"""
    from specd.sampling.params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, **(penalties or {}))
    res: dict = collections.defaultdict(lambda: {m: [0, 0.0, 0, 0, 0.0, 0.0, 0.0] for m in methods})
    tok = engines["head"].tokenizer
    for cat, qs in by.items():
        for q in qs:
            ids = H.fit_prompt(H.encode_conversation(tok, [q], [], True), 1800, None)[0]
            ref = None
            for m in methods:
                which, mode = METHODS[m]
                s, sec, dr, fw, st = _one(engines[which], ids, mode, params)
                row = res[cat][m]
                for k, v in enumerate((s.num_output, sec, s.stats.steps, s.stats.accepted_tokens, dr, fw, st)):
                    row[k] += v
                ref = s.output_ids if ref is None else ref
                assert s.output_ids == ref, f"{m} differs from {methods[0]} on a {cat} prompt"
            H.log(f"{cat}: {len(ref or [])} tokens, every method identical")
    return res


def table(res: dict, methods: list) -> list:
    """Per category and method: tokens per second (wall), tokens per CPU-second of the engine
    thread (immune to waiting for a shared machine's cores), the speedup by the latter, and the
    mean accepted length (tokens per target forward, the bonus token included)."""
    head = "tok/s wall / tok per CPU-s / speedup (CPU) / accepted length"
    lines = ["| category | " + " | ".join(f"{m}: {head}" for m in methods) + " |"]
    lines.append("|---|" + "---|" * len(methods))
    tot = {m: [0, 0.0, 0, 0, 0.0, 0.0, 0.0] for m in methods}
    for cat, d in list(res.items()) + [("overall", tot)]:
        if cat != "overall":
            for m in methods:
                tot[m] = [x + y for x, y in zip(tot[m], d[m])]
        base = d[methods[0]][0] / d[methods[0]][6]
        cells = []
        for m in methods:
            n, sec, steps, acc, cpu = d[m][0], d[m][1], d[m][2], d[m][3], d[m][6]
            cells.append(f"{n / sec:.1f} / {n / cpu:.1f} / {n / cpu / base:.2f}x / {1 + acc / max(1, steps):.2f}")
        lines.append(f"| {cat} | " + " | ".join(cells) + " |")
    lines += ["", "| method | steps | draft CPU ms/step | target forward CPU ms/step |", "|---|---|---|---|"]
    for m in methods:
        steps = max(1, tot[m][2])
        lines.append(f"| {m} | {tot[m][2]} | {1e3 * tot[m][4] / steps:.1f} | {1e3 * tot[m][5] / steps:.1f} |")
    return lines


def main(argv=None) -> int:
    a = parse_args(argv)
    H.set_threads(a.threads)
    methods = a.methods.split(",")
    from specd.engine.warmup import warm_up

    engines = build(a)
    for e in engines.values():
        warm_up(e)
    by = H.first_turns_by_category(H.SPEC_BENCH, a.categories.split(","), a.per_category)
    res = run(engines, by, methods, a.max_tokens, a.penalties)
    meta = H.run_meta(COMMAND, argv)
    print(f"`{meta['command']}`; {meta['date']}; commit {meta['git_commit']}; CPU {meta['cpu']}; "
          f"{a.threads} thread(s); dtype {engines['head'].target.dtype}; penalties {json.dumps(a.penalties)}; "
          f"{json.dumps(meta['versions'])}\n")  # fmt: skip
    print("\n".join(table(res, methods)))
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        H.write_json(out / "results.json", {"meta": meta, "methods": methods, "results": res})
        print(f"wrote {plot(res, methods, out / 'speedup.png', meta)}")
    return 0


def plot(res: dict, methods: list, path, meta: dict):
    """Per category: speedup over plain by CPU time (left) and mean accepted length (right), per method."""
    plt = H.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    cats = list(res)
    w = 0.8 / len(methods)
    for i, m in enumerate(methods):
        xs = [x + i * w for x in range(len(cats))]
        base = [res[c][methods[0]][0] / res[c][methods[0]][6] for c in cats]
        axes[0].bar(xs, [res[c][m][0] / res[c][m][6] / b for c, b in zip(cats, base)], w, label=m)
        axes[1].bar(xs, [1 + res[c][m][3] / max(1, res[c][m][2]) for c in cats], w, label=m)
    for ax, label in zip(axes, (f"speedup over {methods[0]} (tokens per CPU-second)", "mean accepted length")):
        ax.axhline(1.0, color="gray", lw=0.8, ls="--")
        ax.set_xticks([x + 0.4 - w / 2 for x in range(len(cats))])
        ax.set_xticklabels(cats, fontsize=8)
        ax.set_ylabel(label)
    axes[1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.suptitle(f"built-in model, {meta['cpu']}, {meta['date']}", fontsize=9)
    return H.save_fig(fig, path)


if __name__ == "__main__":
    raise SystemExit(main())
