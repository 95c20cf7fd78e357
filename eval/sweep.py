"""Sweep the speculation size: chain length k, dynamic tree budget N, and static vs dynamic trees.

    python -m eval.sweep --target ../shared/models/stories260K \\
        --draft ../shared/models/stories260K-draft-1L64 \\
        --prompts ../shared/data/mt_bench/question.jsonl --raw --limit 8 --max-tokens 64 \\
        --out eval/out/sweep

Every setting runs on the same prompts in one run (modes interleaved per prompt, see
``eval.acceptance``), against the target-only baseline. Static trees (Medusa/Sequoia style) get the
same node budgets as the dynamic ones; their shape is the best N-node tree for the draft's measured
rank agreement (P(the target's greedy token is the draft's rank-r token), measured here on the
target's own greedy continuations of the prompts, with transformers; ``--no-fit`` uses
``common.DEFAULT_RANK_PROBS``).

Writes report.json (the acceptance report plus a ``sweep`` table), summary.md, and plots:
speedup vs k / N, mean accepted length vs k / N. Prints the best setting for this pair and machine.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from eval import acceptance as A
from eval import common as C
from eval import harness as H


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    C.add_model_prompt_args(ap, max_tokens=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ks", default="1,2,3,4,5,6,7,8", help="chain lengths")
    ap.add_argument("--budgets", default="4,8,16,32,64", help="tree node budgets (dynamic and static)")
    ap.add_argument("--tree-topk", type=int, default=4)
    ap.add_argument("--tree-depth", type=int, default=6)
    ap.add_argument("--no-static", action="store_true", help="skip static trees")
    ap.add_argument("--no-fit", action="store_true", help="static trees from DEFAULT_RANK_PROBS, not measured")
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--per-category", type=int, default=None)
    ap.add_argument("--categories", default=None)
    ap.add_argument("--max-turns", type=int, default=1, help="turns per prompt (default 1)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None)
    ap.add_argument("--no-progress", action="store_true")
    return ap.parse_args(argv)


def measure_rank_probs(target_dir: str, draft_dir: str, prompt_ids: list, max_tokens: int, max_rank: int = 8):
    """P(target's greedy next token == draft's rank-r token), r < max_rank, on the target's own greedy
    continuations (teacher-forced through the draft). Uses transformers, independent of specd."""
    import torch
    from transformers import AutoModelForCausalLM

    tgt = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    drf = AutoModelForCausalLM.from_pretrained(draft_dir).eval()
    counts = [0] * max_rank
    total = 0
    with torch.no_grad():
        for ids in prompt_ids:
            x = torch.tensor([ids])
            full = tgt.generate(x, max_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
            n = x.shape[1]
            if full.shape[1] <= n:
                continue
            logits = drf(full[:, :-1]).logits[0, n - 1 :]  # [new, V]: draft's prediction of each new token
            truth = full[0, n:]
            ranks = (logits > logits.gather(1, truth[:, None])).sum(1)  # strictly better tokens
            for r in ranks.tolist():
                if r < max_rank:
                    counts[r] += 1
            total += len(truth)
    probs = [c / total for c in counts] if total else list(C.DEFAULT_RANK_PROBS)
    # the static-tree builder needs strictly positive, non-increasing probabilities
    out, prev = [], 1.0
    for p in probs:
        p = min(max(p, 1e-4), prev)
        out.append(p)
        prev = p
    return [round(p, 4) for p in out], total


def sweep_modes(a, target, prompts: list, chat: bool) -> tuple:
    """``off``, the chains, the dynamic trees and (unless ``--no-static``) the static trees shaped by
    the draft's rank agreement (measured unless ``--no-fit``). Returns (modes, rank probs, tokens
    they were measured on)."""
    ks = [int(x) for x in a.ks.split(",") if x.strip()]
    budgets = [int(x) for x in a.budgets.split(",") if x.strip()]
    modes = [C.Mode("off", "off")] + [C.Mode.parse(f"chain:{k}") for k in ks]
    modes += [C.Mode.parse(f"tree:{n}", tree_topk=a.tree_topk, tree_depth=a.tree_depth) for n in budgets]
    rank_probs, rank_tokens = list(C.DEFAULT_RANK_PROBS), 0
    if a.no_static:
        return modes, rank_probs, rank_tokens
    if not a.no_fit:
        ids = [
            C.fit_prompt(
                C.encode_conversation(target.tokenizer, p.turns[:1], [], chat),
                target.config.max_position_embeddings - a.max_tokens - 1,
                target.config.bos_token_id,
            )[0]
            for p in prompts
        ]
        rank_probs, rank_tokens = measure_rank_probs(a.target, a.draft, ids, a.max_tokens)
        print(f"draft rank agreement (r = 0..7, {rank_tokens} tokens): {rank_probs}", file=sys.stderr)
    modes += [C.Mode.parse(f"static:{n}", rank_probs=rank_probs) for n in budgets]
    return modes, rank_probs, rank_tokens


def sweep_table(run: dict) -> list:
    """One row per mode: size, accepted length, acceptance, speed, speedups, prediction."""
    table = []
    for e in run["modes"]:
        o, m = e["overall"], e["mode"]
        table.append(
            {
                "mode": m["name"],
                "kind": m["kind"],
                "size": m.get("k", m.get("budget", 0)),
                "mean_accepted_length": o["mean_accepted_length"],
                "acceptance_rate": o["acceptance_rate"],
                "tokens_per_s": o["tokens_per_s"],
                "speedup": o["speedup"],
                "speedup_cpu": o["speedup_cpu"],
                "median_request_speedup": o["median_request_speedup"],
                "predicted_speedup": e.get("theory", {}).get("predicted_speedup"),
                "draft_forwards_per_step": e["timing"]["draft_forwards_per_step"],
            }
        )
    return table


def sweep_markdown(report: dict) -> str:
    """The acceptance summary, the sweep table and the verdict."""
    table, sw = report["sweep"]["table"], report["sweep"]
    by_name = {r["mode"]: r for r in table}
    best, best_cpu, best_len = by_name[sw["best"]], by_name[sw["best_cpu"]], by_name[sw["best_accepted_length"]]
    cols = (
        "mean_accepted_length",
        "acceptance_rate",
        "draft_forwards_per_step",
        "tokens_per_s",
        "speedup",
        "median_request_speedup",
        "speedup_cpu",
    )
    rows = [
        [r["mode"], *(r[c] for c in cols), r["predicted_speedup"] if r["predicted_speedup"] is not None else "-"]
        for r in table
    ]
    headers = [
        "mode",
        "tokens/step",
        "accept rate",
        "draft fwd/step",
        "tok/s",
        "speedup",
        "median speedup",
        "CPU-time speedup",
        "predicted",
    ]
    md = A.markdown(report) + "\n## sweep\n\n" + C.md_table(headers, rows)
    verdict = (
        f"\n\nbest (tokens/s): **{best['mode']}** ({best['speedup']:.2f}x); best by CPU time: "
        f"**{best_cpu['mode']}** ({best_cpu['speedup_cpu']:.2f}x); most tokens per step: "
        f"**{best_len['mode']}** ({best_len['mean_accepted_length']:.2f})"
    )
    if best["mode"] == "off":
        verdict += " -- no speculative setting beats target-only decoding on this pair/hardware"
    return md + verdict + "\n"


def sweep_plots(table: list, out: Path, temperature: float) -> None:
    """Accepted length and speedup (wall clock and CPU time) against the draft size, per kind."""
    t = f"T{temperature:g}"
    series_len, series_sp = {}, {}
    for kind, label in (
        ("chain", "chain (x = k)"),
        ("tree", "dynamic tree (x = N)"),
        ("static", "static tree (x = N)"),
    ):
        rs = sorted((r for r in table if r["kind"] == kind), key=lambda r: r["size"])
        if rs:
            series_len[label] = ([r["size"] for r in rs], [r["mean_accepted_length"] for r in rs])
            series_sp[label] = ([r["size"] for r in rs], [r["speedup"] for r in rs])
            series_sp[label + ", CPU time"] = ([r["size"] for r in rs], [r["speedup_cpu"] for r in rs])
    C.plot_xy(
        series_len,
        out / f"accepted_length_vs_size_{t}.png",
        "draft tokens per step (k or N)",
        "mean accepted length (tokens / target forward)",
        "accepted length vs draft size",
        logx=True,
    )
    C.plot_xy(
        series_sp,
        out / f"sweep_speedup_{t}.png",
        "draft tokens per step (k or N)",
        "speedup over target-only",
        "speedup vs draft size",
        hline=1.0,
        logx=True,
    )


def main(argv=None) -> int:
    a = parse_args(argv)
    H.set_threads(a.threads)
    H.quiet_transformers()
    t0 = time.perf_counter()
    meta = H.run_meta("sweep", argv, a.device)  # at the start: the code that runs
    cats = [c.strip() for c in a.categories.split(",")] if a.categories else None
    prompts = C.load_prompts(a.prompts, a.limit, cats, a.per_category, a.max_turns)
    if not prompts:
        print("sweep: no prompts selected", file=sys.stderr)
        return 2
    out = Path(a.out) if a.out else C.default_out("sweep")
    target, draft = A.load_pair(a.target, a.draft, a.device)
    chat = a.chat_template if a.chat_template is not None else C.has_chat_template(target.tokenizer)
    modes, rank_probs, rank_tokens = sweep_modes(a, target, prompts, chat)
    res = A.run_eval(
        target,
        draft,
        prompts,
        modes,
        temperatures=(a.temperature,),
        max_tokens=a.max_tokens,
        chat_template=chat,
        seed=a.seed,
        device=a.device,
        progress=not a.no_progress,
        desc="sweep",
    )
    table = sweep_table(res["runs"][0])
    meta.update(
        target=a.target,
        draft=a.draft,
        prompts_file=a.prompts,
        max_tokens=a.max_tokens,
        temperatures=[a.temperature],
        rank_probs=rank_probs,
        rank_tokens=rank_tokens,
        elapsed_s=round(time.perf_counter() - t0, 2),
    )
    best = {
        "best": max(table, key=lambda r: r["speedup"])["mode"],
        "best_cpu": max(table, key=lambda r: r["speedup_cpu"])["mode"],
        "best_accepted_length": max(table, key=lambda r: r["mean_accepted_length"])["mode"],
    }
    report = {"schema": C.SCHEMA, "kind": "sweep", "meta": meta, **res, "sweep": {"table": table, **best}}
    C.write_json(out / "report.json", report)
    md = sweep_markdown(report)
    (out / "summary.md").write_text(md, encoding="utf-8")
    A.plots(report, out)
    sweep_plots(table, out, a.temperature)
    print(md)
    print(f"\nwrote {out} ({meta['elapsed_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
