"""Soak test: N concurrent streaming websocket clients for T minutes, checking every message.

    OMP_NUM_THREADS=1 .venv/bin/python -m eval load soak --clients 8 --minutes 3
    .venv/bin/python -m eval load soak --url ws://10.0.0.5:8765/ws --pid 4242 --clients 32 --minutes 60

Without ``--url`` it starts its own ``specd serve`` (``--target/--draft``, default: the built-in pair)
on a free loopback port and stops it with SIGTERM at the end (expecting exit status 0).

Each client keeps one connection with up to ``--inflight`` requests multiplexed on it and reconnects
every ``--requests-per-conn`` requests. Requests are greedy (temperature 0) with a random prompt,
``max_tokens`` from ``--max-tokens-set`` and speculation mode (off / chain / tree / auto), so every
reply has exactly one right answer. Checked for every request:

- deltas arrive with ``seq`` 0, 1, 2, ... (nothing lost, duplicated or reordered), then exactly one
  ``done``, nothing after it, and no frame for an id that is not running;
- ``usage.completion_tokens`` = tokens received; the concatenated delta text and token ids equal the
  reference: an in-process ``Engine.generate`` of the same prompt and ``max_tokens`` (computed once per
  distinct pair, when the models are local), else the first reply seen for that pair (so all modes
  and repeats must agree);
- no ``error`` frame (the load stays under ``--max-queue``);
- server memory (VmRSS from /proc/PID/status, engine process included; needs the PID: own server or
  ``--pid``) is flat after warm-up: end RSS <= warm-up RSS * 1.1 + 20 MB (warm-up = the first
  ``--warmup-frac`` of the run);
- afterwards every KV block is free again (``specd_kv_blocks_used`` on /metrics is 0 for both caches).

Prints a summary (clients, duration, requests, tokens, errors, RSS start/warm/end/peak, latencies:
p50/p99 by ``harness.percentile``, rounded to 0.1 ms) and writes it as JSON with ``--json PATH``.
Exit status 0 when every check passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from collections import Counter
from pathlib import Path

import orjson

from eval import harness as H

COMMAND = "load soak"  # python -m eval load soak (this module's ``main``)
PROMPTS = H.STORY_PROMPTS[:8]
MODES = ("off", "chain", "tree", "auto")
MB = 1 << 20


# server ------------------------------------------------------------------------------------------
def start_server(a) -> H.Daemon:
    """``specd serve`` as a child process on a free loopback port (``harness.start_daemon``)."""
    return H.start_daemon(
        [
            "--target",
            a.target,
            *(["--draft", a.draft] if a.draft else []),
            "--device",
            a.device,
            "--num-blocks",
            str(a.num_blocks),
            "--max-queue",
            str(a.max_queue),
            "--drain-timeout",
            "10",
        ],
        child=True,
    )


# references --------------------------------------------------------------------------------------
class References:
    """Expected (token ids, text) per (prompt, max_tokens): in-process greedy generation when the models
    are local, else the first reply seen for the pair."""

    def __init__(self, target=None, draft=None, device="cpu"):
        self.engine = None
        self.table: dict = {}
        self.source = "first-reply"
        if target:
            flags = [
                "--target",
                target,
                *(["--draft", draft] if draft else []),
                "--device",
                device,
                "--num-blocks",
                "512",
            ]
            self.engine = H.engine_from_flags(flags)
            self.source = "in-process Engine.generate"

    def precompute(self, prompts, max_tokens_set) -> None:
        if self.engine is None:
            return
        from specd.engine.sequence import SpecParams
        from specd.sampling.params import SamplingParams

        for p in prompts:
            ids = self.engine.tokenizer(p)["input_ids"]
            for m in max_tokens_set:
                seq = self.engine.generate(
                    [ids], SamplingParams(temperature=0.0, max_tokens=m), SpecParams(mode="off")
                )[0]
                self.table[p, m] = (list(seq.output_ids), self.engine.output_text(seq))

    def check(self, prompt, m, ids, text):
        """None when it matches (or becomes the reference), else a description of the mismatch."""
        ref = self.table.get((prompt, m))
        if ref is None:
            self.table[prompt, m] = (ids, text)
            return None
        if ref[0] != ids:
            return f"token ids differ from the reference for {prompt!r} max_tokens={m}: {ids[:16]} vs {ref[0][:16]}"
        if ref[1] != text:
            return f"text differs from the reference for {prompt!r} max_tokens={m}: {text[:60]!r} vs {ref[1][:60]!r}"
        return None


# clients -----------------------------------------------------------------------------------------
class Stats:
    def __init__(self):
        self.requests = 0
        self.tokens = 0
        self.deltas = 0
        self.errors: Counter = Counter()  # error codes from `error` frames / done(error)
        self.violations: list = []  # protocol / ordering / content problems (first 50 kept)
        self.num_violations = 0
        self.disconnects = 0
        self.ttft_ms: list = []
        self.total_ms: list = []
        self.modes: Counter = Counter()

    def bad(self, msg: str) -> None:
        self.num_violations += 1
        if len(self.violations) < 50:
            self.violations.append(msg)


async def client(k: int, url: str, a, refs: References, stats: Stats, deadline: float) -> None:
    """Client ``k`` until ``deadline``: connection after connection (reconnecting every
    ``--requests-per-conn`` requests, and after a lost connection, which counts as a violation)."""
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed

    rng = random.Random(a.seed * 1000 + k)
    headers = {"Authorization": f"Bearer {a.api_key}"} if a.api_key else None
    serial = [0]  # requests sent by this client so far (ids c{k}-{serial})
    while time.monotonic() < deadline:
        try:
            async with connect(url, compression=None, open_timeout=60, max_size=None, additional_headers=headers) as ws:
                await connection(ws, k, a, rng, serial, refs, stats, deadline)
        except (ConnectionClosed, OSError, asyncio.TimeoutError) as e:
            stats.disconnects += 1
            stats.bad(f"client {k}: connection lost: {type(e).__name__}: {e}")
            await asyncio.sleep(0.5)


async def connection(ws, k: int, a, rng, serial: list, refs: References, stats: Stats, deadline: float) -> None:
    """One connection: up to ``--inflight`` requests multiplexed on it, every frame checked, until
    it has sent ``--requests-per-conn`` requests (or the deadline passed) and all have ended."""
    live: dict = {}  # id -> state
    sent = 0
    while True:
        while len(live) < a.inflight and sent < a.requests_per_conn and time.monotonic() < deadline:
            serial[0] += 1
            sent += 1
            await send_request(ws, f"c{k}-{serial[0]}", a, rng, live, stats)
        if not live:
            return
        on_frame(orjson.loads(await asyncio.wait_for(ws.recv(), a.timeout)), live, refs, stats)


async def send_request(ws, rid: str, a, rng, live: dict, stats: Stats) -> None:
    """A greedy request with a random prompt, ``max_tokens`` and speculation mode."""
    prompt, m, mode = rng.choice(PROMPTS), rng.choice(a.max_tokens_set), rng.choice(MODES)
    live[rid] = {"prompt": prompt, "m": m, "seq": 0, "ids": [], "text": [], "t0": time.monotonic(), "first": None}
    stats.modes[mode] += 1
    msg = {
        "type": "generate",
        "id": rid,
        "prompt": prompt,
        "max_tokens": m,
        "temperature": 0,
        "speculation": {"mode": mode},
    }
    await ws.send(orjson.dumps(msg).decode())


def on_frame(msg: dict, live: dict, refs: References, stats: Stats) -> None:
    """Check one server frame: it belongs to a running request; deltas arrive in ``seq`` order."""
    rid, typ = msg.get("id"), msg.get("type")
    st = live.get(rid)
    if st is None:
        stats.bad(f"frame for an id that is not running: {str(msg)[:200]}")
        return
    if typ != "delta":
        del live[rid]
        on_end(rid, typ, msg, st, refs, stats)
        return
    if msg["seq"] != st["seq"]:
        stats.bad(f"{rid}: delta seq {msg['seq']}, expected {st['seq']} (lost/duplicated/reordered)")
    st["seq"] = msg["seq"] + 1
    if st["first"] is None:
        st["first"] = time.monotonic()
    st["ids"].extend(msg["token_ids"])
    st["text"].append(msg["text"])
    stats.deltas += 1


def on_end(rid: str, typ: str, msg: dict, st: dict, refs: References, stats: Stats) -> None:
    """Check a request's last frame: no error, a ``done`` whose usage and finish reason fit and
    whose streamed tokens and text equal the reference."""
    stats.requests += 1
    if typ == "error":
        stats.errors[msg.get("code")] += 1
        return
    if typ != "done":
        stats.bad(f"{rid}: unexpected frame {str(msg)[:200]}")
        return
    if msg["finish_reason"] == "error":
        stats.errors[(msg.get("error") or {}).get("code", "internal")] += 1
    stats.tokens += len(st["ids"])
    if msg["usage"]["completion_tokens"] != len(st["ids"]):
        stats.bad(
            f"{rid}: usage.completion_tokens {msg['usage']['completion_tokens']} != {len(st['ids'])} tokens received"
        )
    if msg["finish_reason"] not in ("stop", "length"):
        stats.bad(f"{rid}: finish_reason {msg['finish_reason']}")
    problem = refs.check(st["prompt"], st["m"], st["ids"], "".join(st["text"]))
    if problem:
        stats.bad(f"{rid}: {problem}")
    now = time.monotonic()
    stats.total_ms.append((now - st["t0"]) * 1000)
    if st["first"] is not None:
        stats.ttft_ms.append((st["first"] - st["t0"]) * 1000)


async def run_clients(url, a, refs, stats, pid, rss: dict) -> float:
    t0 = time.monotonic()
    deadline = t0 + a.minutes * 60
    warm_at = t0 + a.minutes * 60 * a.warmup_frac

    async def sample():
        while True:
            v = H.process_rss_bytes(pid) if pid else None
            if v is not None:
                now = time.monotonic()
                rss.setdefault("start", v)
                rss["peak"] = max(rss.get("peak", 0), v)
                if now >= warm_at and "warm" not in rss:
                    rss["warm"] = v
                rss["end"] = v
            await asyncio.sleep(1.0)

    sampler = asyncio.create_task(sample())
    await asyncio.gather(*(client(k, url, a, refs, stats, deadline) for k in range(a.clients)))
    if pid:
        v = H.process_rss_bytes(pid)
        if v is not None:
            rss["end"] = v
    sampler.cancel()
    return time.monotonic() - t0


def parse_args(argv=None):
    from specd.options import demo_pair

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="ws://HOST:PORT/ws of a running server (default: start one)")
    p.add_argument("--pid", type=int, help="the running server's PID, for RSS (with --url on this host)")
    p.add_argument("--api-key", default=os.environ.get("SPECD_API_KEY"))
    p.add_argument("--target", help="target model folder (own server and/or in-process references)")
    p.add_argument("--draft")
    p.add_argument("--device", default="cpu")
    p.add_argument("--num-blocks", type=int, default=1024, help="own server: KV blocks per cache")
    p.add_argument("--max-queue", type=int, default=256, help="own server: --max-queue")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--minutes", type=float, default=3.0)
    p.add_argument("--inflight", type=int, default=2, help="requests in flight per connection")
    p.add_argument("--requests-per-conn", type=int, default=20, help="reconnect after this many requests")
    p.add_argument("--max-tokens-set", default="8,16,32,64", help="max_tokens values to draw from")
    p.add_argument("--warmup-frac", type=float, default=0.2, help="share of the run before the warm-up RSS sample")
    p.add_argument("--rss-factor", type=float, default=1.1)
    p.add_argument("--rss-slack-mb", type=float, default=20.0)
    p.add_argument("--timeout", type=float, default=120.0, help="seconds without a frame before a client gives up")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-reference", action="store_true", help="first reply per (prompt, max_tokens) is the reference")
    p.add_argument("--json", help="write the summary here")
    a = p.parse_args(argv)
    a.max_tokens_set = [int(x) for x in a.max_tokens_set.split(",") if x]
    if a.url is None and a.target is None:
        a.target, d = demo_pair()
        if a.target is None:
            p.error("no --url and no --target (and no built-in model)")
        a.draft = a.draft or d
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    srv = start_server(a) if a.url is None else None
    url, pid = (srv.url, srv.pid) if srv is not None else (a.url, a.pid)
    try:
        refs = References(None if a.no_reference else a.target, a.draft, a.device)
        t_ref = time.monotonic()
        refs.precompute(PROMPTS, a.max_tokens_set)
        t_ref = time.monotonic() - t_ref
        refs.engine = None  # free it: the soak measures the server, not this process
        stats, rss = Stats(), {}
        duration = asyncio.run(run_clients(url, a, refs, stats, pid, rss))
        kv = H.wait_kv_freed(url, a.api_key)  # every KV block free once idle
    finally:
        exit_status = srv.stop() if srv is not None else None
    run = {"url": url, "duration": duration, "kv": kv, "exit_status": exit_status, "t_ref": t_ref}
    summary = summarize(a, srv is not None, run, stats, rss, refs)
    print_summary(a, summary, stats)
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(summary, indent=2) + "\n")
    if srv is not None and not summary["ok"] and srv.logs:
        print("server log tail:\n" + "".join(srv.logs[-50:]), file=sys.stderr)
    return 0 if summary["ok"] else 1


def summarize(a, own_server: bool, run: dict, stats: Stats, rss: dict, refs: References) -> dict:
    """The checks and the figures of the run (the JSON summary)."""
    duration, kv, exit_status = run["duration"], run["kv"], run["exit_status"]
    checks = {
        "no_errors": sum(stats.errors.values()) == 0,
        "no_violations": stats.num_violations == 0,
        "requests_done": stats.requests > 0,
        "kv_freed": kv in ((0, 0), None),
    }
    if rss.get("warm") and rss.get("end"):
        checks["rss_flat"] = rss["end"] <= rss["warm"] * a.rss_factor + a.rss_slack_mb * MB
    if own_server:
        checks["server_exit_0"] = exit_status == 0
    return {
        "url": run["url"],
        "own_server": own_server,
        "target": a.target,
        "draft": a.draft,
        "clients": a.clients,
        "inflight_per_client": a.inflight,
        "minutes": a.minutes,
        "duration_s": round(duration, 1),
        "requests": stats.requests,
        "tokens": stats.tokens,
        "deltas": stats.deltas,
        "tokens_per_s": round(stats.tokens / duration, 1) if duration else 0.0,
        "requests_per_s": round(stats.requests / duration, 2) if duration else 0.0,
        "errors": dict(stats.errors),
        "violations": stats.num_violations,
        "violation_examples": stats.violations[:10],
        "disconnects": stats.disconnects,
        "modes": dict(stats.modes),
        "reference": refs.source,
        "reference_pairs": len(refs.table),
        "reference_s": round(run["t_ref"], 1),
        "ttft_ms": H.p50_p99(stats.ttft_ms),
        "latency_ms": H.p50_p99(stats.total_ms),
        "rss_mb": {k: round(v / MB, 1) for k, v in rss.items()},
        "kv_blocks_used_after": kv,
        "server_exit_status": exit_status,
        "checks": checks,
        "ok": all(checks.values()),
    }


def print_summary(a, summary: dict, stats: Stats) -> None:
    r, checks = summary["rss_mb"], summary["checks"]
    print(
        f"soak: {a.clients} clients x {a.inflight} in flight, {summary['duration_s']:.0f} s: {stats.requests} "
        f"requests, {stats.tokens} tokens ({summary['tokens_per_s']} tok/s), errors {dict(stats.errors) or 0}, "
        f"violations {stats.num_violations}, disconnects {stats.disconnects}"
    )
    print(
        f"      ttft p50/p99 {summary['ttft_ms']['p50']}/{summary['ttft_ms']['p99']} ms, latency p50/p99 "
        f"{summary['latency_ms']['p50']}/{summary['latency_ms']['p99']} ms; server RSS start {r.get('start')} MB, "
        f"warm-up {r.get('warm')} MB, end {r.get('end')} MB, peak {r.get('peak')} MB; "
        f"KV after {summary['kv_blocks_used_after']}"
    )
    for v in stats.violations[:10]:
        print("      violation:", v)
    print("      checks:", " ".join(f"{k}={'ok' if v else 'FAIL'}" for k, v in checks.items()))
    print(json.dumps(summary))


if __name__ == "__main__":
    sys.exit(main())
