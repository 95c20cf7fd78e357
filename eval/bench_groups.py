"""Groups of B requests started together, specd modes against plain decoding: the group's time to
its last request (what ``python -m eval bench`` reports at batch B > 1) and each request's own time to
completion (what each user waits), with the cost of the steps by batch size and draft tokens
verified. The adaptive policy maximises each step's tokens per second, which is the same as the
requests' mean completion time; a fixed group's makespan also follows its slowest request.

    OMP_NUM_THREADS=2 python -m eval bench groups --target ~/.cache/specd/models/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --categories qa,math_reasoning --per-category 16 --batch 16 --max-tokens 64 --rounds 3

Modes alternate group by group (first mode first in even groups, last in odd ones); every mode's
greedy output is compared with the first mode's.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time

from eval import harness as H

COMMAND = "bench groups"  # python -m eval bench groups (this module's ``main``)

DRAFT_BINS = ((0, 0), (1, 8), (9, 24), (25, 1 << 30))


def run_group(system, ids_list: list) -> tuple:
    """(completion seconds per request, output ids per request, decode steps [(running, drafted,
    seconds, tokens)]: steps where every running request had its first token, so no prefill) of one
    group through ``system``'s engine."""
    eng = system.engine
    seqs = [eng.add_request(x, system.params, system.mode.spec_params()) for x in ids_list]
    t0, done, steps = time.perf_counter(), {}, []
    while len(done) < len(seqs):
        live = [s for s in seqs if not s.finished]
        decode = all(s.num_output > 0 for s in live)
        out0, dr0 = sum(s.num_output for s in seqs), sum(s.stats.draft_tokens for s in seqs)
        ts = time.perf_counter()
        eng.step()
        now = time.perf_counter()
        if decode:
            drafted = sum(s.stats.draft_tokens for s in seqs) - dr0
            steps.append((len(live), drafted, now - ts, sum(s.num_output for s in seqs) - out0))
        for i, s in enumerate(seqs):
            if s.finished and i not in done:
                done[i] = now - t0
    return [done[i] for i in range(len(seqs))], [list(s.output_ids) for s in seqs], steps


def step_table(steps: list) -> list:
    """Rows (batch size bin, draft tokens bin, steps, ms per step, tokens per step, tokens/s)."""
    agg: dict = collections.defaultdict(lambda: [0, 0.0, 0])
    for live, drafted, sec, toks in steps:
        k = (live // 4 * 4, next(i for i, (lo, hi) in enumerate(DRAFT_BINS) if lo <= drafted <= hi))
        a = agg[k]
        a[0], a[1], a[2] = a[0] + 1, a[1] + sec, a[2] + toks
    rows = []
    for (b, d), (n, sec, toks) in sorted(agg.items()):
        lo, hi = DRAFT_BINS[d]
        rows.append([f"{b}-{b + 3}", f"{lo}-{hi}" if hi < 1 << 30 else f"{lo}+", n, f"{1e3 * sec / n:.1f}",
                     f"{toks / n:.2f}", f"{toks / sec:.0f}"])  # fmt: skip
    return rows


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", default="models/smollm2-draft")
    ap.add_argument("--head", default=None, help="feature head (default: the built-in one; 'none': no head)")
    ap.add_argument("--prompts", default="../shared/data/spec_bench/question.jsonl")
    ap.add_argument("--categories", default="qa,math_reasoning")
    ap.add_argument("--per-category", type=int, default=16)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--modes", default="off,auto", help="specd speculation modes, the first is the baseline")
    ap.add_argument("--quantization", default="gguf+a8")
    ap.add_argument("--threads", type=int, default=2)
    return ap.parse_args(argv)


def make_systems(a) -> tuple:
    """(groups of prompt id lists, {mode: harness.Specd}) for the arguments, engines warmed up."""
    from specd.model import builtin

    target, draft = H.load_pair(a.target, a.draft, quantization=a.quantization)
    head = None if a.head == "none" else (a.head or builtin.head_path())
    cats = H.split_list(a.categories)
    prompts, ids, _ = H.first_turns(a.prompts, target, a.max_tokens, categories=cats, per_category=a.per_category)
    groups = [idl for _, idl in H.groups_of(prompts, ids, a.batch)]
    kw = dict(prefix_cache=False, memory_bytes=1 << 30, max_num_seqs=a.batch, head=None if head is None else str(head))
    systems = {m: H.Specd(H.Mode.parse(m), target, draft, "cpu", a.max_tokens, **kw) for m in a.modes.split(",")}
    for s in systems.values():  # first calls allocate and pick kernels
        s.set_max_tokens(8)
        s.batch(groups[0])
        s.set_max_tokens(a.max_tokens)
    return groups, systems


def run_rounds(groups: list, systems: dict, rounds: int) -> dict:
    """Per mode: summed makespans and mean completion times, decode steps, groups whose greedy
    output equals the first mode's."""
    modes = list(systems)
    res = {m: {"makespan": 0.0, "completion": 0.0, "steps": [], "equal": 0, "groups": 0} for m in modes}
    for r in range(rounds):
        for gi, idl in enumerate(groups):
            outs = {}
            for m in modes if (gi + r) % 2 == 0 else modes[::-1]:
                times, outs[m], steps = run_group(systems[m], idl)
                d = res[m]
                d["makespan"] += max(times)
                d["completion"] += statistics.mean(times)
                d["steps"] += steps
                d["groups"] += 1
            for m in modes:
                res[m]["equal"] += outs[m] == outs[modes[0]]
    return res


def report(res: dict, systems: dict, meta: dict, cpu: dict, threads: int) -> None:
    base = res[next(iter(res))]
    print(f"{meta['command']}\n{meta['date']}, commit {meta['git_commit']}; CPU {cpu['model']}, "
          f"{cpu['usable_cpus']} usable; SIMD {' '.join(cpu['simd_flags'])}; threads {threads}")  # fmt: skip
    rows = [
        [
            m,
            f"{d['makespan']:.2f}",
            f"{base['makespan'] / d['makespan']:.3f}x",
            f"{d['completion']:.2f}",
            f"{base['completion'] / d['completion']:.3f}x",
            f"{d['equal']}/{d['groups']}",
        ]  # fmt: skip
        for m, d in res.items()
    ]
    head_row = ["mode", "makespan s", "speed (makespan)", "mean completion s", "speed (mean completion)", "greedy =="]
    print(H.md_table(head_row, rows))
    for m, d in res.items():
        print(f"\n{m}: steps by requests running and draft tokens verified (group prefills excluded)")
        cols = ["requests", "draft tokens", "steps", "ms/step", "tokens/step", "tokens/s"]
        print(H.md_table(cols, step_table(d["steps"])))
        print(f"{m}: by proposer (steps, drafted, accepted): {dict(systems[m].engine.stats.by_proposer)}")


def main(argv=None) -> int:
    a = parse(argv)
    H.set_threads(a.threads)
    H.quiet_transformers()
    meta, cpu = H.run_meta(COMMAND, argv), H.cpu_info()
    groups, systems = make_systems(a)
    report(run_rounds(groups, systems, a.rounds), systems, meta, cpu, a.threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
