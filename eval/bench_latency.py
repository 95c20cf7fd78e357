#!/usr/bin/env python3
"""Latency benchmark of the latency-priority scheduler, over loopback websockets to in-process servers.

    OMP_NUM_THREADS=1 .venv/bin/python -m eval load latency [--json PATH] [--parts 1,2,3]
        [--p1-requests 10] [--p1-tokens 128] [--p1-batch 8] [--p1-batch-tokens 768] [--p1-spec auto,off]
        [--p1-saturate 8] [--mt-questions 20] [--p3-pairs shared,demo] [--p3-concurrency 1,4,16]
        [--p3-repeats 7]                       # defaults: ~6-7 min on 2 shared CPU cores

Every figure comes from websocket clients (``websockets`` asyncio, one connection per stream) talking
to a real ``specd`` server (``specd.serving.app.ServerThread``: the daemon's ``App`` on its own event
loop thread, the engine on its own thread) started in this process with the ``specd serve`` defaults
(``--spec-mode tree``, adaptive speculation on, requests ``speculation: auto`` unless stated), greedy.
Client and server share one Python process (and its GIL) on purpose: the numbers include event-loop
and GIL contention, as a co-located client would see them.

1. **Interactive latency under batch load** (demo pair). ``--p1-requests`` interactive requests, one
   after the other, alone ("idle") and then with ``--p1-batch`` concurrent batch-priority streams
   running (closed loop: each resubmits as soon as it ends; long ``max_tokens``), and once more with
   those streams sent as interactive (no priority). Client-side time to first token (``generate``
   sent -> first ``delta``) and inter-token latency from delta arrival times: per-token ITL (the gap
   between a delta and the previous one divided by the tokens in the delta, one sample per token:
   what ``specd_inter_token_latency_seconds`` records server-side) and the raw per-delta gaps.
   Once per ``--p1-spec`` mode (every request of the block: ``auto`` = adaptive, ``off``), with the
   engine's step times and the draft depth the adaptive policy chose per step (an ``AsyncEngine``
   listener) next to the scheduler's cost-model prediction. With ``--p1-saturate N`` (default 8) the
   same again on a server with ``--max-num-seqs N`` = the batch streams (spec ``off``, shorter batch
   requests), where priority decides who gets a slot at all. Target: p99 per-token ITL under batch
   load <= 1.5x idle.
2. **MT-bench turn-2 time to first token, prefix cache on vs off** (demo pair, chat template).
   Per question: turn 1 as chat messages, then turn 2 = [user turn 1, assistant answer 1, user turn 2].
   Two servers (one started with ``--no-prefix-cache``) alive at once, questions alternating between
   them so that machine load drifts hit both alike. Reports ``specd_prefix_cache_hit_rate`` from
   ``/metrics`` and the turn-2-only hit rate (engine prefix-cache counters around the turn-2 requests).
3. **Aggregate tokens/s vs concurrency**: adaptive (``auto``) vs fixed (``tree``: the configured tree,
   16 nodes) vs none (``off``), greedy, same prompts, ``ignore_eos``; c requests submitted at once
   on c connections, tokens/s = generated tokens / (last ``done`` - first send). Modes interleave,
   their order rotating every repeat; medians of ``--p3-repeats``. Both pairs: the shared tiny
   stories260K pair (raw prompts) and the demo pair (GSM8K chat prompts). Target: adaptive >= the best
   of the other two at every concurrency (within noise). Greedy outputs must be identical across modes
   (speculation is lossless): the "same tokens" column checks it.

Prints Markdown (tables, the exact command, date, machine, versions) to stdout, progress to stderr,
and writes everything (with per-repeat values) to ``--json PATH``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from eval import harness as H
from eval.harness import ROOT, log, median, percentile

COMMAND = "load latency"  # python -m eval load latency (this module's ``main``)
DEMO = (ROOT / "models" / "demo" / "target", ROOT / "models" / "demo" / "draft")
STORIES = (H.SHARED / "models" / "stories260K", H.SHARED / "models" / "stories260K-draft-1L64")


# statistics: harness.percentile / harness.median (linear interpolation) --------------------------
def f1(x, nd=1) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


# models and servers -----------------------------------------------------------------------------
@dataclass
class Pair:
    name: str  # "demo" | "shared"
    target: Path
    draft: Path
    loaded: tuple = ()  # (LoadedModel target, LoadedModel draft)
    chat: bool = False
    max_len: int = 0

    def short(self) -> str:
        return f"`{H.short_path(self.target)}` + `{H.short_path(self.draft)}`"


def load_pair(name: str, paths: tuple, device: str, dtype: str) -> Pair:
    t, d = H.load_pair(paths[0], paths[1], device, dtype)
    return Pair(
        name, Path(paths[0]), Path(paths[1]), (t, d), H.has_chat_template(t.tokenizer), t.config.max_position_embeddings
    )


def start_server(pair: Pair, a, extra: list = ()) -> H.Daemon:
    """A ``specd serve`` in this process (``harness.start_daemon``: a fresh Engine sharing the loaded
    weights, warmed up, a ``StepLog`` listening) with the benchmark's flags + ``extra``."""
    flags = [
        "--target",
        str(pair.target),
        "--draft",
        str(pair.draft),
        "--device",
        a.device,
        "--dtype",
        a.dtype,
        "--num-blocks",
        str(a.num_blocks),
        "--max-queue",
        "1024",
        *extra,
    ]
    return H.start_daemon(flags, target=pair.loaded[0], draft=pair.loaded[1])


# prompts ----------------------------------------------------------------------------------------
def prompt_fields(pair: Pair, text: str) -> dict:
    return {"messages": [{"role": "user", "content": text}]} if pair.chat else {"prompt": text}


def prompts_for(pair: Pair, n: int, offset: int = 0) -> list:
    if pair.name == "demo":
        return [prompt_fields(pair, q) for q in H.gsm8k_questions(n, offset)]
    return [{"prompt": H.STORY_PROMPTS[(offset + i) % len(H.STORY_PROMPTS)]} for i in range(n)]


# the engine ---------------------------------------------------------------------------------------
async def wait_idle(eng, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while eng.has_work() and time.monotonic() < end:
        await asyncio.sleep(0.02)


# part 1: interactive latency under batch load ---------------------------------------------------
class BatchLoad:
    """Closed-loop streams (one connection each, resubmitting as soon as a request ends) until
    ``stop()``; closing the connection cancels what runs on it."""

    def __init__(self, port: int, bodies: list, priority: str):
        self.stopping = asyncio.Event()
        self.started: list = []  # per stream: set at its first delta
        self.tokens = self.requests = 0
        self.tasks = [asyncio.ensure_future(self._worker(port, k, b, priority)) for k, b in enumerate(bodies)]

    async def _worker(self, port: int, k: int, body: dict, priority: str) -> None:
        async with H.connect(port) as ws:
            i = 0
            first = asyncio.Event()
            self.started.append(first)
            while not self.stopping.is_set():
                try:
                    r = await H.request(ws, f"b{k}-{i}", {**body, "priority": priority}, on_first=first.set)
                except Exception:  # noqa: BLE001 - the connection closed under us at stop
                    if self.stopping.is_set():
                        return
                    raise
                self.tokens += len(r.token_ids)
                self.requests += 1
                i += 1

    async def running(self, settle: float) -> None:
        """Every stream has streamed its first delta, then ``settle`` seconds more (steady state:
        the adaptive policy's estimates settle)."""
        while len(self.started) < len(self.tasks):
            await asyncio.sleep(0.01)
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in self.started)), 120)
        await asyncio.sleep(settle)

    async def stop(self) -> None:
        self.stopping.set()
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


async def p1_condition(
    srv: H.Daemon, a, pair: Pair, load: str | None, spec: str, n_req: int, batch_tokens: int
) -> dict:
    """``n_req`` interactive requests one after the other; ``load`` None (idle) or the batch streams'
    priority; every request (interactive and batch) has ``speculation: {mode: spec}``."""
    sp = {"speculation": {"mode": spec}}
    bodies = [
        {**b, **sp, "max_tokens": batch_tokens, "ignore_eos": True} for b in prompts_for(pair, a.p1_batch, offset=100)
    ]
    batch = BatchLoad(srv.port, bodies, load) if load is not None else None
    if batch is not None:
        await batch.running(a.p1_settle)
    m = srv.app.metrics
    s0, c0, k0 = m.step_time.sum, m.step_time.count, srv.steplog.mark()
    tb0 = batch.tokens if batch is not None else 0
    results = []
    t0 = time.perf_counter()
    async with H.connect(srv.port) as ws:
        for i, body in enumerate(prompts_for(pair, n_req, offset=0)):
            extra = {"max_tokens": a.p1_tokens, "ignore_eos": True, "priority": "interactive"}
            results.append(await H.request(ws, f"i{i}", {**body, **sp, **extra}))
            await asyncio.sleep(0.05)
    wall = time.perf_counter() - t0
    engine = {
        "engine_step_ms_mean": (m.step_time.sum - s0) / (m.step_time.count - c0) * 1000
        if m.step_time.count > c0
        else None
    }
    steps = srv.steplog.since(k0)
    batch_tok_s = (batch.tokens - tb0) / wall if batch is not None else None
    if batch is not None:
        await batch.stop()
        await wait_idle(srv.engine)
    return {
        "load": load,
        "spec": spec,
        **client_figures(results),
        **engine,
        **step_figures(steps, srv.engine.policy),
        "batch_tokens_per_s": batch_tok_s,
        "wall_s": wall,
    }


def client_figures(results: list) -> dict:
    """What the interactive clients saw: TTFT, per-token and per-delta inter-token latency."""
    itl_tok = [x for r in results for x in r.itl_token_ms()]
    itl_del = [x for r in results for x in r.itl_delta_ms()]
    ttft = [r.ttft_ms for r in results]
    sttft = [r.done["timing"]["ttft_ms"] for r in results]
    spec_st = [r.done["spec"] for r in results]
    vsteps = sum(x["steps"] for x in spec_st)
    toks = sum(len(r.token_ids) for r in results)
    return {
        "requests": len(results),
        "tokens": toks,
        "ttft_ms": {"p50": percentile(ttft, 50), "p99": percentile(ttft, 99), "max": max(ttft), "samples": ttft},
        "server_ttft_ms": {"p50": percentile(sttft, 50), "max": max(sttft)},
        "itl_token_ms": {
            "p50": percentile(itl_tok, 50),
            "p90": percentile(itl_tok, 90),
            "p99": percentile(itl_tok, 99),
            "max": max(itl_tok),
            "mean": statistics.mean(itl_tok),
            "n": len(itl_tok),
        },
        "itl_delta_ms": {
            "p50": percentile(itl_del, 50),
            "p99": percentile(itl_del, 99),
            "max": max(itl_del),
            "n": len(itl_del),
        },
        "tokens_per_delta": toks / sum(len(r.arrivals) for r in results),
        "interactive_draft_tokens_per_step": sum(x["draft_tokens"] for x in spec_st) / vsteps if vsteps else 0.0,
    }


def step_figures(steps: list, policy) -> dict:
    """What the engine did over the interval (``StepLog`` rows): step wall / engine-thread CPU time,
    the draft depth the adaptive policy chose, steps by depth against its cost model."""
    cpu_steps = [y.cpu_clock - x.cpu_clock for x, y in zip(steps, steps[1:])]
    return {
        "engine_steps": len(steps),
        "engine_step_wall_ms_median": 1000 * median([x.seconds for x in steps]) if steps else None,
        "engine_step_cpu_ms_median": 1000 * median(cpu_steps) if cpu_steps else None,
        "depth_mean": statistics.mean([x.depth for x in steps]) if steps else None,
        "drafting_steps_pct": 100 * sum(1 for x in steps if x.depth > 0) / len(steps) if steps else None,
        "by_depth": depth_rows(steps, policy),
        "cost_model_end": {
            "t_target_ms": 1000 * (policy.costs.t_target or 0),
            "t_per_token_ms": 1000 * policy.costs.t_per_token,
            "t_draft_level_ms": 1000 * (policy.costs.t_draft or 0),
        },
    }


def depth_rows(steps: list, policy) -> list:
    """Per draft depth the policy chose: steps, median requests per step, median measured step time
    and the cost model's prediction for that depth and batch (``SpecPolicy``: t_target +
    t_per_token x batch x (1 + nodes(depth)) + depth x t_draft)."""
    by_depth: dict = {}
    for x in steps:
        by_depth.setdefault(x.depth, []).append((x.seconds, x.outputs))
    rows = []
    for d in sorted(by_depth):
        xs = by_depth[d]
        b = median([n for _, n in xs])
        pred = None
        if policy.costs.t_target is not None:
            nodes = policy.nodes_for_depth(d) if d else 0
            pred = policy.costs.t_target + policy.costs.t_per_token * b * (1 + nodes) + d * (policy.costs.t_draft or 0)
        rows.append(
            {
                "depth": d,
                "steps": len(xs),
                "batch_median": b,
                "step_ms_median": 1000 * median([x for x, _ in xs]),
                "model_pred_ms": None if pred is None else 1000 * pred,
            }
        )
    return rows


P1_CONDITIONS = (
    ("idle", None),
    ("+ batch streams (priority batch)", "batch"),
    ("+ same streams as interactive", "interactive"),
)


def part1(a, pair: Pair) -> dict:
    out = {"pair": pair.name, "servers": []}
    configs = [
        ("default", [], [m.strip() for m in a.p1_spec.split(",") if m.strip()], a.p1_requests, a.p1_batch_tokens)
    ]
    if a.p1_saturate:
        configs.append(
            (
                f"--max-num-seqs {a.p1_saturate}",
                ["--max-num-seqs", str(a.p1_saturate)],
                [a.p1_saturate_spec],
                a.p1_saturate_requests,
                a.p1_saturate_batch_tokens,
            )
        )
    for label, extra, specs, n_req, btok in configs:
        srv = start_server(pair, a, extra)
        try:
            for spec in specs:
                conds = {}
                for name, load in P1_CONDITIONS:
                    log(f"part 1 [{label}, spec {spec}]: {name}")
                    conds[name] = H.run_async(p1_condition(srv, a, pair, load, spec, n_req, btok))
                    c = conds[name]
                    log(
                        f"  TTFT p50 {c['ttft_ms']['p50']:.1f} ms, ITL/token p50 {c['itl_token_ms']['p50']:.2f} "
                        f"p99 {c['itl_token_ms']['p99']:.2f} ms, engine step {c['engine_step_ms_mean'] or 0:.1f} ms, "
                        f"mean depth {c['depth_mean'] or 0:.2f}, {c['wall_s']:.0f} s"
                    )
                out["servers"].append(
                    {
                        "label": label,
                        "flags": list(extra),
                        "spec": spec,
                        "requests": n_req,
                        "batch_tokens": btok,
                        "conditions": conds,
                    }
                )
        finally:
            srv.stop()
    return out


# part 2: MT-bench turn-2 TTFT, prefix cache on vs off -------------------------------------------
def mt_questions(n: int) -> list:
    rows = [json.loads(ln) for ln in H.MT_BENCH.read_text(encoding="utf-8").splitlines() if ln.strip()]
    return [r for r in rows if len(r.get("turns", [])) >= 2][:n] if n else rows


def chat_len(tok, msgs: list) -> int:
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
    if isinstance(ids, dict):
        ids = ids["input_ids"]
    return len(ids)


async def p2_run(servers: dict, a, pair: Pair) -> dict:
    tok = pair.loaded[0].tokenizer
    qs = mt_questions(a.mt_questions)
    per = {
        k: {
            "turn1_ttft": [],
            "turn2_ttft": [],
            "turn2_server_ttft": [],
            "turn2_prompt": [],
            "answers": [],
            "t2_query": 0,
            "t2_hit": 0,
        }
        for k in servers
    }
    skipped = 0
    conns = {}
    for k, srv in servers.items():
        conns[k] = await H.connect(srv.port).__aenter__()
    try:
        for qi, q in enumerate(qs):
            t1, t2 = q["turns"][0], q["turns"][1]
            m1 = [{"role": "user", "content": t1}]
            if chat_len(tok, m1) + a.mt_max_tokens + 1 > pair.max_len:
                skipped += 1
                continue
            order = list(servers) if qi % 2 == 0 else list(servers)[::-1]
            for k in order:
                eng = servers[k].engine
                ws = conns[k]
                r1 = await H.request(ws, f"q{qi}-1", {"messages": m1, "max_tokens": a.mt_max_tokens})
                m2 = m1 + [{"role": "assistant", "content": r1.text}, {"role": "user", "content": t2}]
                n2 = chat_len(tok, m2)
                if n2 + a.mt_turn2_tokens + 1 > pair.max_len:
                    continue
                await asyncio.sleep(0.02)
                pc = eng.prefix_cache
                q0, h0 = pc.queried_tokens, pc.hit_tokens
                r2 = await H.request(ws, f"q{qi}-2", {"messages": m2, "max_tokens": a.mt_turn2_tokens})
                p = per[k]
                p["t2_query"] += pc.queried_tokens - q0
                p["t2_hit"] += pc.hit_tokens - h0
                p["turn1_ttft"].append(r1.ttft_ms)
                p["turn2_ttft"].append(r2.ttft_ms)
                p["turn2_server_ttft"].append(r2.done["timing"]["ttft_ms"])
                p["turn2_prompt"].append(r2.done["usage"]["prompt_tokens"])
                p["answers"].append(r1.token_ids)
                await asyncio.sleep(0.02)
    finally:
        for ws in conns.values():
            await ws.close()
    return {"per": per, "skipped": skipped, "questions": len(qs)}


def part2(a, pair: Pair) -> dict:
    servers = {}
    try:
        log("part 2: starting prefix cache on/off servers")
        flags = {"prefix cache on": [], "prefix cache off": ["--no-prefix-cache"]}
        for k, extra in flags.items():
            servers[k] = start_server(pair, a, extra)
        log(f"part 2: {a.mt_questions} MT-bench questions, alternating servers")
        res = H.run_async(p2_run(servers, a, pair))
        out = {"pair": pair.name, "questions": res["questions"], "skipped_too_long": res["skipped"], "servers": {}}
        for k, srv in servers.items():
            p = res["per"][k]
            text = H.http_get(srv.port, "/metrics")
            out["servers"][k] = {
                "flags": flags[k],
                "n": len(p["turn2_ttft"]),
                "turn1_ttft_ms_p50": percentile(p["turn1_ttft"], 50),
                "turn2_ttft_ms": {
                    "p50": percentile(p["turn2_ttft"], 50),
                    "p90": percentile(p["turn2_ttft"], 90),
                    "mean": statistics.mean(p["turn2_ttft"]) if p["turn2_ttft"] else None,
                    "samples": p["turn2_ttft"],
                },
                "turn2_server_ttft_ms_p50": percentile(p["turn2_server_ttft"], 50),
                "turn2_prompt_tokens_mean": statistics.mean(p["turn2_prompt"]) if p["turn2_prompt"] else None,
                "metrics_prefix_cache_hit_rate": H.metric_value(text, "specd_prefix_cache_hit_rate"),
                "turn2_hit_rate": p["t2_hit"] / p["t2_query"] if p["t2_query"] else 0.0,
                "turn2_cached_tokens_mean": p["t2_hit"] / len(p["turn2_ttft"]) if p["turn2_ttft"] else None,
            }
        ks = list(servers)
        out["same_turn1_answers"] = res["per"][ks[0]]["answers"] == res["per"][ks[1]]["answers"]
        return out
    finally:
        for srv in servers.values():
            srv.stop()


# part 3: throughput vs concurrency, adaptive vs fixed vs none ------------------------------------
async def p3_round(conns: list, bodies: list, mode: str, tag: str) -> dict:
    c0 = time.process_time()
    t0 = time.perf_counter()
    rs = await asyncio.gather(
        *(
            H.request(ws, f"{tag}-{i}", {**b, "speculation": {"mode": mode}})
            for i, (ws, b) in enumerate(zip(conns, bodies))
        )
    )
    wall = max(r.t_end for r in rs) - t0
    cpu = time.process_time() - c0
    toks = sum(len(r.token_ids) for r in rs)
    steps = sum(r.done["spec"]["steps"] for r in rs)
    drafted = sum(r.done["spec"]["draft_tokens"] for r in rs)
    return {
        "tok_s": toks / wall,
        "cpu_us_per_token": 1e6 * cpu / toks,
        "tokens": toks,
        "wall_s": wall,
        "steps": steps,
        "draft_per_step": drafted / steps if steps else 0.0,
        "tokens_per_step": toks / steps if steps else 0.0,
        "ids": [r.token_ids for r in rs],
    }


def p3_repeats(a, c: int) -> int:
    """Small batches are cheap and the noisiest: c=1 gets 4x the repeats, c=2..3 2x."""
    return a.p3_repeats * max(1, 4 // c)


async def p3_run(srv, a, pair: Pair) -> dict:
    modes = ["auto", "tree", "off"]
    conc = [int(x) for x in a.p3_concurrency.split(",")]
    out = {}
    conns = [await H.connect(srv.port).__aenter__() for _ in range(max(conc))]
    try:
        base = [{**b, "max_tokens": a.p3_tokens, "ignore_eos": True} for b in prompts_for(pair, max(conc), 200)]
        for c in conc:  # warm-up rounds (discarded) at every concurrency: first-call costs; the adaptive
            for m in modes:  # policy measures each batch size and settles its probe interval
                for k in range(2 if c == 1 else 1):
                    await p3_round(conns[:c], base[:c], m, f"w{c}-{k}-{m}")
        for c in conc:
            reps = {m: [] for m in modes}
            for r in range(p3_repeats(a, c)):
                order = modes[r % 3 :] + modes[: r % 3]
                for m in order:
                    reps[m].append(await p3_round(conns[:c], base[:c], m, f"c{c}-r{r}-{m}"))
            ref = reps["off"][0]["ids"]
            same = all(x["ids"] == ref for m in modes for x in reps[m])
            for m in modes:
                for x in reps[m]:
                    x.pop("ids")
            row = {"same_tokens": same, "repeats": len(reps["off"])}
            for m in modes:
                row[m] = {
                    "tok_s_median": median([x["tok_s"] for x in reps[m]]),
                    "tok_s_runs": [round(x["tok_s"], 1) for x in reps[m]],
                    "cpu_us_per_token": median([x["cpu_us_per_token"] for x in reps[m]]),
                    "draft_per_step": median([x["draft_per_step"] for x in reps[m]]),
                    "tokens_per_step": median([x["tokens_per_step"] for x in reps[m]]),
                }
            best_other = max(row["tree"]["tok_s_median"], row["off"]["tok_s_median"])
            row["adaptive_vs_best_other"] = row["auto"]["tok_s_median"] / best_other
            row["cpu_best_other_vs_adaptive"] = (
                min(row["tree"]["cpu_us_per_token"], row["off"]["cpu_us_per_token"]) / row["auto"]["cpu_us_per_token"]
            )
            spread = [
                abs(x - row[m]["tok_s_median"]) / row[m]["tok_s_median"] for m in modes for x in row[m]["tok_s_runs"]
            ]
            row["median_abs_dev_pct"] = 100 * median(spread)
            out[c] = row
            log(
                f"part 3 [{pair.name}] c={c}: "
                + ", ".join(f"{m} {row[m]['tok_s_median']:.0f}" for m in modes)
                + f" tok/s (adaptive/best other {row['adaptive_vs_best_other']:.2f})"
            )
    finally:
        for ws in conns:
            await ws.close()
    return out


def part3(a, pair: Pair) -> dict:
    srv = start_server(pair, a, [])
    eng = srv.engine
    try:
        log(f"part 3 [{pair.name}]: concurrency {a.p3_concurrency}, {a.p3_repeats} repeats")
        rows = H.run_async(p3_run(srv, a, pair))
        return {
            "pair": pair.name,
            "flags": [],
            "tokens": a.p3_tokens,
            "repeats": a.p3_repeats,
            "t_draft_level_ms": (eng.policy.costs.t_draft or 0) * 1000,
            "t_target_fixed_ms": (eng.policy.costs.t_target or 0) * 1000,
            "t_per_token_ms": eng.policy.costs.t_per_token * 1000,
            "rows": rows,
        }
    finally:
        srv.stop()


# environment ------------------------------------------------------------------------------------
def environment(a) -> dict:
    """``harness.run_meta`` plus what a latency figure also depends on: the load average, the client
    and server libraries, whether specd/ had uncommitted changes."""
    import websockets

    def ver(mod):
        try:
            return __import__(mod).__version__
        except Exception:  # noqa: BLE001
            return None

    env = H.run_meta(COMMAND, None, a.device)
    env.update(
        loadavg_start=list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        websockets=websockets.__version__,
        orjson=ver("orjson"),
        uvloop=ver("uvloop"),
        git_dirty_specd=bool(H.git("status", "--porcelain", "--", "specd")),
        omp_num_threads=os.environ.get("OMP_NUM_THREADS"),
    )
    return env


# report -----------------------------------------------------------------------------------------
def markdown(rep: dict, pairs: dict, a) -> str:
    """The report: how it was run, then one section per part that ran."""
    L = md_header(rep, a)
    if "part1" in rep:
        L += md_part1(rep["part1"], pairs, a)
    if "part2" in rep:
        L += md_part2(rep["part2"], pairs, a)
    if "part3" in rep:
        L += md_part3(rep["part3"], pairs, a)
    return "\n".join(L)


def md_header(rep: dict, a) -> list:
    L = []
    env = rep["env"]
    v = env["versions"]
    L.append("### Latency benchmark (`python -m eval load latency`)\n")
    L.append(f"`{rep['command']}`\n")
    L.append(
        f"{env['date']} on `{env['host']}`: {env['cpu']}, {env['cpu_count']} CPUs, load average at start "
        f"{' '.join(f'{x:.1f}' for x in env['loadavg_start'] or [])} / end "
        f"{' '.join(f'{x:.1f}' for x in rep.get('loadavg_end') or [])}; Python {v['python']}, torch "
        f"{v['torch']} ({env['torch_threads']} thread), websockets {env['websockets']}, uvloop "
        f"{env['uvloop']}, transformers {v['transformers']}; specd {env['git_commit']}"
        f"{' (+ uncommitted specd/ changes)' if env['git_dirty_specd'] else ''}; total {rep['wall_s']:.0f} s. "
        f"Servers: `ServerThread` in this process, `specd serve` defaults (spec mode tree, adaptive), "
        f"`--num-blocks {a.num_blocks}`, device {a.device}, greedy.\n"
    )
    return L


def md_part1(p: dict, pairs: dict, a) -> list:
    L = []
    L.append(
        f"**1. Interactive latency under batch load** — demo pair {pairs[p['pair']].short()}. "
        f"{a.p1_requests} interactive requests one after another ({a.p1_tokens} tokens each, ignore_eos; "
        f"{a.p1_saturate_requests} on the `--max-num-seqs` server), alone vs with {a.p1_batch} closed-loop "
        f"streams of {a.p1_batch_tokens} tokens ({a.p1_saturate_batch_tokens} on the `--max-num-seqs` "
        f"server) running (measured after {a.p1_settle:g} s of load); every "
        f"request in a block has the `speculation` mode of the spec column. Client-side: TTFT = `generate` "
        f"sent -> first `delta`; ITL/token = gap between consecutive deltas / tokens in the later delta (one "
        f"sample per token, as `specd_inter_token_latency_seconds`); per-delta = the raw gaps. Engine step = "
        f"engine step time over the interval (server metrics), and the median wall vs engine-thread CPU "
        f"time of a step (the gap is time the engine thread waited: GIL held by the event loops of the "
        "server and the clients, other load on the machine); depth = mean draft depth the adaptive policy "
        "chose per step "
        f"(% of steps drafting).\n"
    )
    L.append(
        "| server | spec | condition | TTFT p50 ms | TTFT p99 ms | ITL/token p50 ms | ITL/token p99 ms | "
        "p99 vs idle | per-delta gap p50 / p99 ms | tokens/delta | engine step ms mean (median wall / CPU) | "
        "depth (drafting %) | batch tok/s |"
    )
    L.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for s in p["servers"]:
        idle = s["conditions"]["idle"]["itl_token_ms"]["p99"]
        for name, c in s["conditions"].items():
            ratio = c["itl_token_ms"]["p99"] / idle
            dep = "-" if c["depth_mean"] is None else f"{c['depth_mean']:.2f} ({c['drafting_steps_pct']:.0f}%)"
            L.append(
                f"| {s['label']} | {s['spec']} | {name} | {f1(c['ttft_ms']['p50'])} | {f1(c['ttft_ms']['p99'])} | "
                f"{f1(c['itl_token_ms']['p50'], 2)} | {f1(c['itl_token_ms']['p99'], 2)} | {ratio:.2f}x | "
                f"{f1(c['itl_delta_ms']['p50'], 2)} / {f1(c['itl_delta_ms']['p99'], 2)} | "
                f"{c['tokens_per_delta']:.2f} | {f1(c['engine_step_ms_mean'], 1)} "
                f"({f1(c['engine_step_wall_ms_median'], 1)} / "
                f"{f1(c['engine_step_cpu_ms_median'], 1)}) | {dep} | "
                f"{f1(c['batch_tokens_per_s'], 0)} |"
            )
    verdicts = []
    for s in p["servers"]:
        if s["label"] != "default":
            continue
        cs = s["conditions"]
        r = cs[P1_CONDITIONS[1][0]]["itl_token_ms"]["p99"] / cs["idle"]["itl_token_ms"]["p99"]
        verdicts.append(f"spec {s['spec']}: {r:.2f}x — {'met' if r <= 1.5 else 'missed'}")
    L.append(f"\nTarget p99 ITL under batch load <= 1.5x idle (default server): **{'; '.join(verdicts)}**.\n")
    for s in p["servers"]:
        L += md_p1_depths(s)
    return L


def md_p1_depths(s: dict) -> list:
    """Under batch load, on a server whose requests speculate adaptively: steps by the chosen depth
    against the cost model."""
    L = []
    c = s["conditions"][P1_CONDITIONS[1][0]]
    if s["spec"] != "auto" or not c["by_depth"]:
        return []
    cm = c["cost_model_end"]
    L.append(
        f"Adaptive policy under batch load ({s['label']} server, spec auto): steps by the chosen depth, "
        f"measured step time vs the scheduler's cost model at the end (t_target {cm['t_target_ms']:.2f} ms "
        f"+ {cm['t_per_token_ms']:.3f} ms/token, draft level {cm['t_draft_level_ms']:.2f} ms):\n"
    )
    L.append("| depth | steps | requests per step (median) | measured step ms (median) | cost-model ms |")
    L.append("|---|---|---|---|---|")
    for d in c["by_depth"]:
        L.append(
            f"| {d['depth']} | {d['steps']} | {d['batch_median']:g} | {d['step_ms_median']:.1f} | "
            f"{f1(d['model_pred_ms'])} |"
        )
    L.append("")
    return L


def md_part2(p: dict, pairs: dict, a) -> list:
    L = []
    L.append(
        f"**2. MT-bench turn-2 TTFT, prefix cache on vs off** — demo pair {pairs[p['pair']].short()} "
        f"(chat template; MT-bench is off-domain for this GSM8K model, which does not matter for TTFT). "
        f"First {p['questions']} MT-bench questions ({p['skipped_too_long']} skipped: too long for the "
        f"{pairs[p['pair']].max_len}-token context); turn 1 `max_tokens` {a.mt_max_tokens}, turn 2 "
        f"{a.mt_turn2_tokens}; the two servers run side by side, questions alternating between them. "
        f"Same turn-1 answers on both: {'yes' if p['same_turn1_answers'] else 'NO'}.\n"
    )
    L.append(
        "| server | turns 2 | turn-2 prompt tokens (mean) | turn-2 TTFT p50 ms | p90 ms | mean ms | "
        "server TTFT p50 ms | turn-1 TTFT p50 ms | turn-2 cached tokens (mean) | turn-2 hit rate | "
        "`specd_prefix_cache_hit_rate` |"
    )
    L.append("|---|---|---|---|---|---|---|---|---|---|---|")
    for k, s in p["servers"].items():
        L.append(
            f"| {k} | {s['n']} | {f1(s['turn2_prompt_tokens_mean'], 0)} | {f1(s['turn2_ttft_ms']['p50'])} | "
            f"{f1(s['turn2_ttft_ms']['p90'])} | {f1(s['turn2_ttft_ms']['mean'])} | "
            f"{f1(s['turn2_server_ttft_ms_p50'])} | {f1(s['turn1_ttft_ms_p50'])} | "
            f"{f1(s['turn2_cached_tokens_mean'], 0)} | {100 * s['turn2_hit_rate']:.0f}% | "
            f"{f1(s['metrics_prefix_cache_hit_rate'], 3)} |"
        )
    on, off = p["servers"]["prefix cache on"], p["servers"]["prefix cache off"]
    if on["turn2_ttft_ms"]["p50"] and off["turn2_ttft_ms"]["p50"]:
        L.append(
            "\nTurn-2 TTFT p50 with the prefix cache: "
            f"{on['turn2_ttft_ms']['p50'] / off['turn2_ttft_ms']['p50']:.2f}x "
            f"of without. (`specd_prefix_cache_hit_rate` counts every prompt, turn 1 included; the turn-2 "
            f"hit rate counts only turn-2 prompts.)\n"
        )
    return L


def md_part3(parts: list, pairs: dict, a) -> list:
    L = []
    L.append(
        f"**3. Aggregate tokens/s vs concurrency** — greedy, {a.p3_tokens} tokens per request "
        f"(ignore_eos), c requests at once on c connections; medians of interleaved repeats "
        f"({', '.join(f'c={c}: {p3_repeats(a, int(c))}' for c in a.p3_concurrency.split(','))}). adaptive = "
        "`speculation: auto` (cost-model depth), fixed = `mode: tree` (the configured "
        f"16-node tree, depth <= 6), none = `mode: off`. draft/step = draft tokens per target step "
        f"(median), tok/step = tokens per target step; CPU µs/token = CPU time of this whole process (engine "
        f"thread, server loop, clients) per generated token, which other load on the machine distorts "
        f"less than tokens/s; median abs dev = spread of the repeats around their median.\n"
    )
    for p in parts:
        L.append(
            f"{p['pair']} pair {pairs[p['pair']].short()} "
            f"({'GSM8K chat prompts' if p['pair'] == 'demo' else 'raw story prompts'}); cost model at the "
            f"end: target step fixed {p['t_target_fixed_ms']:.2f} ms + {p['t_per_token_ms']:.3f} ms/token, "
            f"draft level {p['t_draft_level_ms']:.2f} ms.\n"
        )
        L.append(
            "| concurrency | adaptive tok/s | fixed tree tok/s | none tok/s | adaptive / best other | "
            "CPU µs/token adaptive / fixed / none | adaptive draft/step, tok/step | fixed tok/step | "
            "median abs dev % | same tokens |"
        )
        L.append("|---|---|---|---|---|---|---|---|---|---|")
        for c, r in p["rows"].items():
            L.append(
                f"| {c} | {r['auto']['tok_s_median']:.0f} | {r['tree']['tok_s_median']:.0f} | "
                f"{r['off']['tok_s_median']:.0f} | **{r['adaptive_vs_best_other']:.2f}** | "
                f"{r['auto']['cpu_us_per_token']:.0f} / {r['tree']['cpu_us_per_token']:.0f} / "
                f"{r['off']['cpu_us_per_token']:.0f} | "
                f"{r['auto']['draft_per_step']:.2f}, {r['auto']['tokens_per_step']:.2f} | "
                f"{r['tree']['tokens_per_step']:.2f} | {r['median_abs_dev_pct']:.1f} | "
                f"{'yes' if r['same_tokens'] else 'NO'} |"
            )
        v = []
        for c, r in p["rows"].items():
            ok = r["adaptive_vs_best_other"] >= 1 - r["median_abs_dev_pct"] / 100
            v.append(
                f"c={c} {r['adaptive_vs_best_other']:.2f} {'met' if ok else 'missed'} (CPU/token: best "
                f"other / adaptive {r['cpu_best_other_vs_adaptive']:.2f})"
            )
        L.append(
            f"\nTarget adaptive tok/s >= best of fixed/none, within the repeat spread ({p['pair']} pair): "
            f"**{'; '.join(v)}**.\n"
        )
    return L


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--parts", default="1,2,3")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--num-blocks", type=int, default=2048, help="KV blocks per cache (both pairs)")
    p.add_argument("--p1-requests", type=int, default=10)
    p.add_argument("--p1-tokens", type=int, default=128)
    p.add_argument("--p1-batch", type=int, default=8)
    p.add_argument("--p1-batch-tokens", type=int, default=768)
    p.add_argument("--p1-spec", default="auto,off", help="speculation modes of the part-1 requests (each a run)")
    p.add_argument("--p1-settle", type=float, default=1.0, help="seconds of batch load before measuring")
    p.add_argument(
        "--p1-saturate",
        type=int,
        default=8,
        help="also run part 1 on a server with --max-num-seqs N (= the batch streams: priority "
        "decides who gets a slot); 0: skip",
    )
    p.add_argument("--p1-saturate-spec", default="off")
    p.add_argument("--p1-saturate-requests", type=int, default=5)
    p.add_argument("--p1-saturate-batch-tokens", type=int, default=256)
    p.add_argument("--mt-questions", type=int, default=20)
    p.add_argument("--mt-max-tokens", type=int, default=64)
    p.add_argument("--mt-turn2-tokens", type=int, default=16)
    p.add_argument("--p3-pairs", default="shared,demo")
    p.add_argument("--p3-concurrency", default="1,4,16")
    p.add_argument("--p3-repeats", type=int, default=7, help="repeats per cell (x4 at c=1, x2 at c=2..3)")
    p.add_argument("--p3-tokens", type=int, default=64)
    p.add_argument("--json", default=None, help="write the full report here")
    return p.parse_args(argv)


def command(argv) -> str:
    """The command line that reproduces the run (with its thread count)."""
    return f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']} " + H.command_line(COMMAND, argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    parts = {x.strip() for x in a.parts.split(",") if x.strip()}
    H.set_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    H.quiet_transformers()
    t_start = time.monotonic()
    rep = {"schema": "specd.bench_latency/1", "command": command(argv), "env": environment(a), "args": vars(a)}
    p3_pairs = [x.strip() for x in a.p3_pairs.split(",") if x.strip()]
    need = ({"demo"} if parts & {"1", "2"} else set()) | (set(p3_pairs) if "3" in parts else set())
    pairs = {}
    for name in sorted(need):
        log(f"loading {name} pair")
        pairs[name] = load_pair(name, DEMO if name == "demo" else STORIES, a.device, a.dtype)
    if "1" in parts:
        rep["part1"] = part1(a, pairs["demo"])
    if "2" in parts:
        rep["part2"] = part2(a, pairs["demo"])
    if "3" in parts:
        rep["part3"] = [part3(a, pairs[n]) for n in p3_pairs]
    rep["wall_s"] = time.monotonic() - t_start
    rep["loadavg_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    md = markdown(rep, pairs, a)
    rep["markdown"] = md
    print(md)
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(rep, indent=1, default=str) + "\n", encoding="utf-8")
        log(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
