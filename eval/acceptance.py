"""Acceptance-rate evaluation: how many tokens each target forward yields, and what that buys.

    python -m eval accept --target ../shared/models/stories260K \\
        --draft ../shared/models/stories260K-draft-1L64 \\
        --prompts ../shared/data/mt_bench/question.jsonl --raw --max-tokens 128 \\
        --modes off,chain:4,tree:16 --temperature 0,1 --limit 16 --out eval/out/mt_bench

For every prompt (MT-bench / Spec-Bench ``question.jsonl``, or a text file with one prompt per line)
and every speculation mode, the conversation is run one request at a time (batch 1, the latency
setting of Spec-Bench); turn 2 sees the model's own turn-1 answer (chat template: as messages; raw:
the texts joined by blank lines). Modes run back to back per prompt, in an order rotated from prompt
to prompt, so that load from other processes on a shared machine hits every mode alike. The
target-only baseline (``off``, an engine without a draft) always runs: speedups are measured against
it in the same run, on the same prompts.

Reported per category and overall (``report.json``, ``summary.md``, plots):

- mean accepted length: tokens per target forward, counting the bonus/correction token
- acceptance rate (accepted / drafted), acceptance per depth, conditional alpha per position,
  the accepted-length distribution
- tokens/s (output tokens / wall time, prefill included) and the speedup over ``off``
- theory check (chains): Leviathan et al. (2023) predict E / (k c + 1) with
  E = (1 - alpha^(k+1)) / (1 - alpha) and c = draft forward time / target-only step time, both
  measured here; "speculation efficiency" = measured speedup / predicted speedup
- greedy: how many outputs equal the target-only output token for token (lossless check)
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from eval import harness as H

COMMAND = "accept"  # python -m eval accept (this module's ``main``)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    H.add_model_prompt_args(ap, max_tokens=128)
    ap.add_argument("--temperature", default="0", help="comma list, e.g. 0,1 (0 = greedy)")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0, help="sampling seed base (same per prompt for every mode)")
    ap.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens tokens")
    ap.add_argument(
        "--modes",
        default="off,chain:4,tree:16",
        help="comma list of off | chain:K | tree:N[:TOPK[:DEPTH]] | static:N (off is always added)",
    )
    ap.add_argument("--tree-topk", type=int, default=4, help="dynamic tree: children per node / nodes per level")
    ap.add_argument("--tree-depth", type=int, default=6, help="dynamic tree: max depth")
    ap.add_argument("--limit", type=int, default=None, help="N prompts in all, round-robin over categories")
    ap.add_argument("--start", type=int, default=0, help="skip the file's first N prompts (GSM8K held-out: 7273)")
    ap.add_argument("--per-category", type=int, default=None, help="first N prompts of each category")
    ap.add_argument("--categories", default=None, help="comma list of categories to keep")
    ap.add_argument("--max-turns", type=int, default=None, help="only the first N turns of each prompt")
    ap.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=None,
        help="left-truncate prompts to this (default: context - max_tokens)",
    )
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--out", default=None, help="output dir (default eval/out/accept-DATE)")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--no-plots", action="store_true")
    return ap.parse_args(argv)


# running ----------------------------------------------------------------------------------------
@dataclass
class Run:
    """What every request of one evaluation shares: the tokenizer, the prompt budget, the sampling
    settings (per temperature: ``temp``)."""

    tok: object
    bos: int | None
    max_prompt: int
    max_tokens: int
    chat_template: bool
    top_p: float
    seed: int
    ignore_eos: bool
    temp: float = 0.0


def run_eval(
    target,
    draft,
    prompts: list,
    modes: list,
    *,
    temperatures=(0.0,),
    max_tokens: int = 128,
    chat_template: bool = False,
    top_p: float = 1.0,
    seed: int = 0,
    ignore_eos: bool = False,
    max_prompt_tokens=None,
    device: str = "cpu",
    progress: bool = True,
    warmup: bool = True,
    desc: str = "eval",
) -> dict:
    """Run every prompt under every mode and temperature. Returns the report's ``runs``, ``requests``
    and ``prompts``.

    ``target``/``draft`` are loaded models (``harness.load_pair``); ``modes`` are ``harness.Mode``.
    """
    if not any(m.kind == "off" for m in modes):
        modes = [H.Mode("off", "off")] + list(modes)
    engines = {m.name: H.make_engine(m, target, draft, device) for m in modes}
    run = Run(
        target.tokenizer,
        target.config.bos_token_id,
        prompt_budget(engines, modes, max_tokens, max_prompt_tokens),
        max_tokens,
        chat_template,
        top_p,
        seed,
        ignore_eos,
    )
    if warmup:
        warm_up(engines, modes, run.tok)
    timers = {n: H.StepTimer(e) for n, e in engines.items()}
    requests, runs = [], []
    for temp in temperatures:
        run.temp = temp
        for t in timers.values():
            t.reset()
        logs = {n: H.StepLog(e) for n, e in engines.items()}  # engine-wide totals from here, per temperature
        rows = run_temperature(run, prompts, modes, logs, progress, desc)
        runs.append(summarise(rows, modes, temp, timers, logs))
        for r in rows:
            r.pop("output_ids", None)  # only needed for the greedy lossless check
        requests += rows
    return {"runs": runs, "requests": requests, "prompts": prompts_summary(prompts, requests, run, temperatures)}


def prompt_budget(engines: dict, modes: list, max_tokens: int, max_prompt_tokens) -> int:
    """Prompt tokens kept: ``max_prompt_tokens``, else the context less the reply and, with a static
    tree, its depth (the engine caps chains and dynamic trees at the context end, but a static tree
    is drafted whole: its draft positions would run past the context)."""
    ctx = min(e.max_model_len for e in engines.values())
    margin = max((m.depth for m in modes if m.kind == "static"), default=0)
    max_prompt = max_prompt_tokens or (ctx - max_tokens - 1 - margin)
    if max_prompt < 1:
        raise ValueError(f"--max-tokens {max_tokens} leaves no room for a prompt in a {ctx}-token context")
    return max_prompt


def warm_up(engines: dict, modes: list, tok) -> None:
    """A short greedy generation per engine: first-call costs are not measured."""
    from specd.sampling.params import SamplingParams

    w = list(tok("Once upon a time")["input_ids"])
    for m in modes:
        engines[m.name].generate([w], SamplingParams(temperature=0.0, max_tokens=8), m.spec_params())


def run_temperature(run: Run, prompts: list, modes: list, logs: dict, progress: bool, desc: str) -> list:
    """Every prompt's conversation under every mode at ``run.temp``, the modes in an order rotated
    from prompt to prompt; one row per request (turn)."""
    from tqdm import tqdm

    rows = []
    bar = tqdm(
        total=len(prompts) * len(modes),
        desc=f"{desc} T={run.temp:g}",
        disable=not progress,
        unit="conv",
        dynamic_ncols=True,
    )
    for qi, p in enumerate(prompts):
        for m in modes[qi % len(modes) :] + modes[: qi % len(modes)]:
            rows += conversation(run, p, qi, m, logs[m.name])
            bar.update(1)
    bar.close()
    return rows


def conversation(run: Run, p, qi: int, m, steplog) -> list:
    """One prompt's turns under mode ``m``, each turn seeing the model's own earlier answers."""
    from specd.sampling.params import SamplingParams

    answers, rows = [], []
    for ti in range(len(p.turns)):
        ids = H.encode_conversation(run.tok, p.turns[: ti + 1], answers, run.chat_template)
        ids, truncated = H.fit_prompt(ids, run.max_prompt, run.bos)
        params = SamplingParams(
            temperature=run.temp,
            top_p=run.top_p,
            max_tokens=run.max_tokens,
            seed=run.seed + 1000 * qi + ti,
            ignore_eos=run.ignore_eos,
        )
        steplog.take()
        t0, c0 = time.perf_counter(), time.process_time()
        seq = steplog.generate(ids, params, m.spec_params())
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
        answers.append(steplog.engine.output_text(seq))
        rows.append(
            {
                "prompt_id": p.id,
                "category": p.category,
                "subcategory": p.subcategory,
                "turn": ti + 1,
                "mode": m.name,
                "temperature": run.temp,
                "prompt_tokens": len(ids),
                "truncated": truncated,
                "output_tokens": seq.num_output,
                "wall_s": round(dt, 6),
                "cpu_s": round(cpu, 6),
                "tokens_per_s": round(seq.num_output / dt, 3) if dt > 0 else 0.0,
                "finish_reason": seq.finish_reason,
                "output_ids": list(seq.output_ids),
                "stats": H.stats_dict(seq.stats, H.tried_per_depth(steplog.take())),
            }
        )
    return rows


def prompts_summary(prompts: list, requests: list, run: Run, temperatures) -> dict:
    return {
        "count": len(prompts),
        "turns": sum(len(p.turns) for p in prompts),
        "categories": sorted({p.category for p in prompts}),
        "truncated": sum(
            1 for r in requests if r["truncated"] and r["mode"] == "off" and r["temperature"] == temperatures[0]
        ),
        "max_prompt_tokens": run.max_prompt,
        "chat_template": run.chat_template,
        "ids": [p.id for p in prompts],
    }


# summarising ------------------------------------------------------------------------------------
def metrics(rows: list) -> dict:
    """Totals over request rows: merged SpecStats, tokens/s, medians."""
    st = H.stats_from_dicts([r["stats"] for r in rows])
    tried = []
    for r in rows:
        tried = H.add_lists(tried, r["stats"].get("tried_per_depth", []))
    wall = sum(r["wall_s"] for r in rows)
    cpu = sum(r["cpu_s"] for r in rows)
    out_tok = sum(r["output_tokens"] for r in rows)
    d = {
        "requests": len(rows),
        "prompt_tokens": sum(r["prompt_tokens"] for r in rows),
        "output_tokens": out_tok,
        "wall_s": round(wall, 4),
        "cpu_s": round(cpu, 4),
        "tokens_per_s": round(out_tok / wall, 2) if wall > 0 else 0.0,
        "tokens_per_cpu_s": round(out_tok / cpu, 2) if cpu > 0 else 0.0,
        "median_request_tokens_per_s": round(H.median([r["tokens_per_s"] for r in rows], empty=0.0), 2),
    }
    d.update(H.stats_dict(st, tried))
    return d


def _speedups(rows: list, base: list) -> dict:
    key = lambda r: (r["prompt_id"], r["turn"])  # noqa: E731
    b = {key(r): r for r in base}
    ratios = [
        r["tokens_per_s"] / b[key(r)]["tokens_per_s"]
        for r in rows
        if key(r) in b and b[key(r)]["tokens_per_s"] > 0 and r["tokens_per_s"] > 0
    ]
    return {"median_request_speedup": round(H.median(ratios, empty=0.0), 4)}


def compared(rows: list, base: list) -> dict:
    """:func:`metrics` of ``rows`` with their speedups over ``base`` (the ``off`` rows of the same
    prompts): aggregate tokens/s, CPU-time tokens/s, and the median of per-request ratios."""
    m, b = metrics(rows), metrics(base)
    m["speedup"] = round(m["tokens_per_s"] / b["tokens_per_s"], 4) if b["tokens_per_s"] else 0.0
    m["speedup_cpu"] = round(m["tokens_per_cpu_s"] / b["tokens_per_cpu_s"], 4) if b["tokens_per_cpu_s"] else 0.0
    m.update(_speedups(rows, base))
    return m


def summarise(rows: list, modes: list, temp: float, timers: dict, logs: dict) -> dict:
    """One temperature's ``run``: per mode, overall and per-category figures, timings, the engine's
    own totals over the run (``engine_stats``), greedy agreement with ``off`` and the theory check."""
    by_mode = {m.name: [r for r in rows if r["mode"] == m.name] for m in modes}
    base = by_mode["off"]
    cats = sorted({r["category"] for r in rows})
    off_timing = timers["off"].as_dict()
    out = {"temperature": temp, "modes": []}
    for m in modes:
        mr = by_mode[m.name]
        ov = compared(mr, base)
        per_cat = {
            c: compared([r for r in mr if r["category"] == c], [r for r in base if r["category"] == c]) for c in cats
        }
        timing = timers[m.name].as_dict()
        entry = {
            "mode": m.describe(),
            "overall": ov,
            "per_category": per_cat,
            "timing": timing,
            "engine_stats": H.stats_dict(logs[m.name].engine_stats()),
        }
        if temp == 0 and m.kind != "off":
            bo = {(r["prompt_id"], r["turn"]): r["output_ids"] for r in base}
            same = sum(1 for r in mr if bo.get((r["prompt_id"], r["turn"])) == r["output_ids"])
            entry["greedy_match"] = {"equal": same, "of": len(mr)}
        if m.kind != "off":
            entry["theory"] = theory(m, ov, timing, off_timing)
        out["modes"].append(entry)
    return out


def theory(m, ov: dict, timing: dict, off_timing: dict) -> dict:
    """Leviathan et al. (2023) for a chain of k (and the same cost model, generalised, for trees).

    c = (mean draft forward time) / (mean target-only step time), both measured in this run. The
    CPU-time version (``*_cpu``) is the steadier one on a shared machine; the wall-clock version
    compares with the tokens/s speedup.
    """

    def ratio(x, y):
        return x / y if y else 0.0

    e_meas = ov["mean_accepted_length"]
    f = timing["draft_forwards_per_step"]
    d = {"draft_forwards_per_step": f, "measured_tokens_per_step": e_meas}
    if m.kind == "chain":
        k = m.size
        a = ov.get("alpha_iid", 0.0)
        e_iid = H.expected_tokens_iid(a, k)
        e_prod = H.expected_tokens_product(ov.get("conditional_acceptance_per_depth", [])[:k])
        d.update(
            {
                "model": "leviathan_chain",
                "k": k,
                "alpha": a,
                "expected_tokens_iid": round(e_iid, 4),
                "expected_tokens_product": round(e_prod, 4),
            }
        )
    else:  # same cost model: one target step + (draft forwards per step) draft forwards
        e_iid = e_prod = None
        d["model"] = "leviathan_cost_tree"
    for clock, sp in (("", "speedup"), ("cpu_", "speedup_cpu")):
        sfx = "_cpu" if clock else ""
        c = ratio(timing[f"{clock}draft_forward_ms_mean"], off_timing[f"{clock}step_ms_mean"])
        d[f"c{sfx}"] = round(c, 4)
        d[f"verify_cost_ratio{sfx}"] = round(
            ratio(timing[f"{clock}target_forward_ms_per_step"], off_timing[f"{clock}target_forward_ms_per_step"]), 4
        )
        if m.kind == "chain":
            pred = H.leviathan_speedup(e_iid, m.size, c)
            d[f"predicted_speedup_product{sfx}"] = round(H.leviathan_speedup(e_prod, m.size, c), 4)
        else:
            pred = e_meas / (f * c + 1)
        d[f"predicted_speedup{sfx}"] = round(pred, 4)
        d[f"measured_speedup{sfx}"] = ov[sp]
        d[f"speculation_efficiency{sfx}"] = round(ratio(ov[sp], pred), 4)
    return d


# output -----------------------------------------------------------------------------------------
def markdown(report: dict) -> str:
    """``summary.md``: how the run was made, then per temperature the modes table, the per-category
    table and the theory check."""
    lines = md_header(report)
    for run in report["runs"]:
        t = run["temperature"]
        lines += [f"## temperature {t:g} ({'greedy' if t == 0 else 'sampling'})", ""]
        lines += md_modes(run) + md_categories(run) + md_theory(run)
    return "\n".join(lines)


def md_header(report: dict) -> list:
    meta, pr = report["meta"], report["prompts"]
    return [
        "# specd acceptance evaluation",
        "",
        f"- command: `{meta['command']}`",
        f"- date: {meta['date']}; device: {meta['device']} ({meta['cpu']}, {meta['cpu_count']} cores, "
        f"{meta['torch_threads']} torch threads); versions: "
        + ", ".join(f"{k} {v}" for k, v in meta["versions"].items())
        + f"; git {meta['git_commit']}",
        f"- target `{meta['target']}`, draft `{meta['draft']}`; prompts `{meta['prompts_file']}`: "
        f"{pr['count']} prompts / {pr['turns']} turns, categories {', '.join(pr['categories'])}; max_tokens "
        f"{meta['max_tokens']}; {'chat template' if pr['chat_template'] else 'raw prompts'}; "
        f"{pr['truncated']} prompts left-truncated to {pr['max_prompt_tokens']} tokens",
        "",
    ]


def md_modes(run: dict) -> list:
    rows = []
    for e in run["modes"]:
        o, gm = e["overall"], e.get("greedy_match")
        rows.append(
            [
                e["mode"]["name"],
                o["mean_accepted_length"],
                o["acceptance_rate"],
                " ".join(f"{x:.2f}" for x in o["acceptance_per_depth"][:8]),
                o["tokens_per_s"],
                o["speedup"],
                o["median_request_speedup"],
                o["speedup_cpu"],
                f"{gm['equal']}/{gm['of']}" if gm else "-",
            ]
        )
    headers = [
        "mode",
        "tokens/step",
        "accept rate",
        "P(reach depth 1..)",
        "tok/s",
        "speedup",
        "median speedup",
        "CPU-time speedup",
        "greedy == off",
    ]
    return [H.md_table(headers, rows), ""]


def md_categories(run: dict) -> list:
    cats = list(run["modes"][0]["per_category"])
    if len(cats) <= 1:
        return []
    spec = [e for e in run["modes"] if e["mode"]["kind"] != "off"]
    hdr = (
        ["category"] + [f"{e['mode']['name']} tok/step" for e in spec] + [f"{e['mode']['name']} speedup" for e in spec]
    )
    crow = [
        [c]
        + [e["per_category"][c]["mean_accepted_length"] for e in spec]
        + [e["per_category"][c]["speedup"] for e in spec]
        for c in cats
    ]
    return ["Per category:", "", H.md_table(hdr, crow), ""]


THEORY_COLUMNS = (
    ("alpha", "alpha"),
    ("E iid", "expected_tokens_iid"),
    ("E measured", "measured_tokens_per_step"),
    ("draft fwd/step", "draft_forwards_per_step"),
    ("c", "c"),
    ("verify cost", "verify_cost_ratio"),
    ("predicted", "predicted_speedup"),
    ("measured", "measured_speedup"),
    ("efficiency", "speculation_efficiency"),
    ("c (cpu)", "c_cpu"),
    ("predicted (cpu)", "predicted_speedup_cpu"),
    ("measured (cpu)", "measured_speedup_cpu"),
    ("efficiency (cpu)", "speculation_efficiency_cpu"),
)


def md_theory(run: dict) -> list:
    th = [e for e in run["modes"] if "theory" in e]
    if not th:
        return []
    trows = [[e["mode"]["name"]] + [e["theory"].get(key, "-") for _, key in THEORY_COLUMNS] for e in th]
    return [
        "Theory check (Leviathan et al. 2023: E = (1 - alpha^(k+1)) / (1 - alpha), speedup = "
        "E / (k c + 1), c = draft forward / target-only step; trees: E_measured / (forwards c + 1); "
        "efficiency = measured / predicted; wall clock, then CPU time):",
        "",
        H.md_table(["mode"] + [h for h, _ in THEORY_COLUMNS], trows),
        "",
    ]


def plots(report: dict, out: Path) -> list:
    files = []
    for run in report["runs"]:
        t = f"T{run['temperature']:g}"
        spec = [e for e in run["modes"] if e["mode"]["kind"] != "off"]
        files.append(
            H.plot_acceptance_per_depth(
                {e["mode"]["name"]: e["overall"]["acceptance_per_depth"] for e in spec},
                out / f"acceptance_per_depth_{t}.png",
                f"acceptance per depth (temperature {run['temperature']:g})",
            )
        )
        files.append(
            H.plot_accept_hist(
                {e["mode"]["name"]: e["overall"]["accept_len_dist"] for e in spec},
                out / f"accept_len_hist_{t}.png",
                f"accepted draft tokens per step (temperature {run['temperature']:g})",
            )
        )
        series = {}
        for kind, key in (("chain", "k"), ("tree", "budget"), ("static", "budget")):
            es = sorted((e for e in spec if e["mode"]["kind"] == kind), key=lambda e: e["mode"][key])
            if es:
                series[f"{kind} (x = {'k' if kind == 'chain' else 'tree budget N'})"] = (
                    [e["mode"][key] for e in es],
                    [e["overall"]["speedup"] for e in es],
                )
        if series:
            files.append(
                H.plot_xy(
                    series,
                    out / f"speedup_{t}.png",
                    "draft tokens per step (k or N)",
                    "speedup over target-only",
                    f"speedup (temperature {run['temperature']:g})",
                    hline=1.0,
                    logx=True,
                )
            )
    return files


def main(argv=None) -> int:
    a = parse_args(argv)
    H.set_threads(a.threads)
    temps = [float(x) for x in a.temperature.split(",") if x.strip()]
    modes = H.parse_modes(a.modes, tree_topk=a.tree_topk, tree_depth=a.tree_depth)
    if not any(m.kind == "off" for m in modes):
        modes = [H.Mode("off", "off")] + modes
    cats = [c.strip() for c in a.categories.split(",")] if a.categories else None
    prompts = H.load_prompts(a.prompts, a.limit, cats, a.per_category, a.max_turns, start=a.start)
    if not prompts:
        print("acceptance: no prompts selected", file=sys.stderr)
        return 2
    out = Path(a.out) if a.out else H.default_out("accept")
    t0 = time.perf_counter()
    meta = H.run_meta(COMMAND, argv, a.device)  # at the start: the code that runs
    target, draft = H.load_pair(a.target, a.draft, a.device)
    chat = a.chat_template if a.chat_template is not None else H.has_chat_template(target.tokenizer)
    if chat and not H.has_chat_template(target.tokenizer):
        print("acceptance: the tokenizer has no chat template; use --raw", file=sys.stderr)
        return 2
    res = run_eval(
        target,
        draft,
        prompts,
        modes,
        temperatures=temps,
        max_tokens=a.max_tokens,
        chat_template=chat,
        top_p=a.top_p,
        seed=a.seed,
        ignore_eos=a.ignore_eos,
        max_prompt_tokens=a.max_prompt_tokens,
        device=a.device,
        progress=not a.no_progress,
    )
    meta.update(run_settings(a, temps, modes, cats), elapsed_s=round(time.perf_counter() - t0, 2))
    report = {"schema": H.SCHEMA, "kind": "acceptance", "meta": meta, **res}
    write_report(report, out, plots_too=not a.no_plots)
    print(f"\nwrote {out}/report.json, summary.md and plots ({meta['elapsed_s']} s)")
    return 0


def run_settings(a, temps: list, modes: list, cats) -> dict:
    return {
        "target": a.target,
        "draft": a.draft,
        "prompts_file": a.prompts,
        "max_tokens": a.max_tokens,
        "temperatures": temps,
        "top_p": a.top_p,
        "seed": a.seed,
        "ignore_eos": a.ignore_eos,
        "modes": [m.name for m in modes],
        "limit": a.limit,
        "per_category": a.per_category,
        "categories": cats,
    }


def write_report(report: dict, out: Path, plots_too: bool = True) -> None:
    """``report.json``, ``summary.md`` (also printed) and the plots under ``out``."""
    H.write_json(out / "report.json", report)
    md = markdown(report)
    (out / "summary.md").write_text(md + "\n", encoding="utf-8")
    if plots_too:
        plots(report, out)
    print(md)


if __name__ == "__main__":
    sys.exit(main())
