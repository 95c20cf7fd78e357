"""Soak test: N concurrent streaming websocket clients for T minutes, checking every message.

    OMP_NUM_THREADS=1 .venv/bin/python eval/soak.py --clients 8 --minutes 3
    .venv/bin/python eval/soak.py --url ws://10.0.0.5:8765/ws --pid 4242 --clients 32 --minutes 60

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
- server memory (VmRSS from /proc/PID/status, engine process included; needs the PID: own server or ``--pid``) is flat
after
  warm-up: end RSS <= warm-up RSS * 1.1 + 20 MB (warm-up = the first ``--warmup-frac`` of the run);
- afterwards every KV block is free again (``specd_kv_blocks_used`` on /metrics is 0 for both caches).

Prints a summary (clients, duration, requests, tokens, errors, RSS start/warm/end/peak, latencies)
and writes it as JSON with ``--json PATH``. Exit status 0 when every check passed, 1 otherwise.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import argparse  # noqa: E402
import asyncio  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import re  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import urllib.error  # noqa: E402
import urllib.request  # noqa: E402
from collections import Counter  # noqa: E402
from pathlib import Path  # noqa: E402
from urllib.parse import urlsplit  # noqa: E402

import orjson  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "eval"))

from common import child_pids  # noqa: E402

PROMPTS = [
    "Once upon a time",
    "The little dog",
    "Lily and Tom went to the park",
    "One day, a big bird",
    "There was a girl named Sue",
    "The sun was hot and",
    "Tim had a red ball",
    "Mom said to Ben",
]
MODES = ("off", "chain", "tree", "auto")
MB = 1 << 20


# server ------------------------------------------------------------------------------------------
def rss_bytes(pid: int):
    """VmRSS in bytes of a process plus its live descendants (`specd serve`'s engine process), from
    Linux /proc; None when the process is gone."""
    own = None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                own = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    if own is None:
        return None
    return own + sum(rss_bytes(k) or 0 for k in child_pids(pid))


def start_server(a):
    """``specd serve`` on a free loopback port; returns (Popen, ws url, its stderr lines)."""
    from specd.serving.app import ServerProcess

    args = [
        "--target",
        a.target,
        *(["--draft", a.draft] if a.draft else []),
        "--device",
        a.device,
        "--num-blocks",
        str(a.num_blocks),
        "--port",
        "0",
        "--grpc-port",
        "0",
        "--max-queue",
        str(a.max_queue),
        "--log-level",
        "info",
        "--drain-timeout",
        "10",
    ]  # info: the "listening"/"ready" lines
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("SPECD_") and k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC")
    }
    sp = ServerProcess(args, env=env, cwd=ROOT).start()
    return sp.proc, f"ws://127.0.0.1:{sp.port}/ws", sp.logs


def http_base(ws_url: str) -> str:
    u = urlsplit(ws_url)
    return f"{'https' if u.scheme == 'wss' else 'http'}://{u.netloc}"


def kv_blocks_used(ws_url: str, api_key):
    """(target, draft) from /metrics' specd_kv_blocks_used, or None."""
    req = urllib.request.Request(
        http_base(ws_url) + "/metrics", headers={"Authorization": f"Bearer {api_key}"} if api_key else {}
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            text = r.read().decode()
    except (OSError, urllib.error.HTTPError):
        return None
    got = dict(re.findall(r'^specd_kv_blocks_used\{cache="(\w+)"\}\s+(\S+)$', text, re.M))
    if not got:
        return None
    return int(float(got.get("target", 0))), int(float(got.get("draft", 0)))


# references --------------------------------------------------------------------------------------
class References:
    """Expected (token ids, text) per (prompt, max_tokens): in-process greedy generation when the models
    are local, else the first reply seen for the pair."""

    def __init__(self, target=None, draft=None, device="cpu"):
        self.engine = None
        self.table: dict = {}
        self.source = "first-reply"
        if target:
            from specd.options import engine_config, serve_parser

            a = serve_parser().parse_args(
                ["--target", target, *(["--draft", draft] if draft else []), "--device", device, "--num-blocks", "512"]
            )
            from specd.engine.engine import Engine

            self.engine = Engine(engine_config(a))
            self.source = "in-process Engine.generate"

    def precompute(self, prompts, max_tokens_set) -> None:
        if self.engine is None:
            return
        from specd.engine.sampling import SamplingParams
        from specd.engine.sequence import SpecParams

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
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed

    rng = random.Random(a.seed * 1000 + k)
    headers = {"Authorization": f"Bearer {a.api_key}"} if a.api_key else None
    serial = 0
    while time.monotonic() < deadline:
        try:
            async with connect(url, compression=None, open_timeout=60, max_size=None, additional_headers=headers) as ws:
                live: dict = {}  # id -> state
                sent_on_conn = 0

                async def send_one(live=live):
                    nonlocal serial, sent_on_conn
                    serial += 1
                    sent_on_conn += 1
                    rid = f"c{k}-{serial}"
                    prompt, m, mode = rng.choice(PROMPTS), rng.choice(a.max_tokens_set), rng.choice(MODES)
                    live[rid] = {
                        "prompt": prompt,
                        "m": m,
                        "seq": 0,
                        "ids": [],
                        "text": [],
                        "t0": time.monotonic(),
                        "first": None,
                    }
                    stats.modes[mode] += 1
                    await ws.send(
                        orjson.dumps(
                            {
                                "type": "generate",
                                "id": rid,
                                "prompt": prompt,
                                "max_tokens": m,
                                "temperature": 0,
                                "speculation": {"mode": mode},
                            }
                        ).decode()
                    )

                while True:
                    while len(live) < a.inflight and sent_on_conn < a.requests_per_conn and time.monotonic() < deadline:
                        await send_one()
                    if not live:
                        break
                    raw = await asyncio.wait_for(ws.recv(), a.timeout)
                    msg = orjson.loads(raw)
                    rid, typ = msg.get("id"), msg.get("type")
                    st = live.get(rid)
                    if st is None:
                        stats.bad(f"frame for an id that is not running: {str(msg)[:200]}")
                        continue
                    if typ == "delta":
                        if msg["seq"] != st["seq"]:
                            stats.bad(
                                f"{rid}: delta seq {msg['seq']}, expected {st['seq']} (lost/duplicated/reordered)"
                            )
                        st["seq"] = msg["seq"] + 1
                        if st["first"] is None:
                            st["first"] = time.monotonic()
                        st["ids"].extend(msg["token_ids"])
                        st["text"].append(msg["text"])
                        stats.deltas += 1
                        continue
                    del live[rid]
                    stats.requests += 1
                    if typ == "error":
                        stats.errors[msg.get("code")] += 1
                        continue
                    if typ != "done":
                        stats.bad(f"{rid}: unexpected frame {str(msg)[:200]}")
                        continue
                    if msg["finish_reason"] == "error":
                        stats.errors[(msg.get("error") or {}).get("code", "internal")] += 1
                    stats.tokens += len(st["ids"])
                    if msg["usage"]["completion_tokens"] != len(st["ids"]):
                        stats.bad(
                            f"{rid}: usage.completion_tokens {msg['usage']['completion_tokens']} "
                            f"!= {len(st['ids'])} tokens received"
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
        except (ConnectionClosed, OSError, asyncio.TimeoutError) as e:
            stats.disconnects += 1
            stats.bad(f"client {k}: connection lost: {type(e).__name__}: {e}")
            await asyncio.sleep(0.5)


async def run_clients(url, a, refs, stats, pid, rss: dict) -> float:
    t0 = time.monotonic()
    deadline = t0 + a.minutes * 60
    warm_at = t0 + a.minutes * 60 * a.warmup_frac

    async def sample():
        while True:
            v = rss_bytes(pid) if pid else None
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
        v = rss_bytes(pid)
        if v is not None:
            rss["end"] = v
    sampler.cancel()
    return time.monotonic() - t0


def pct(xs, q):
    if not xs:
        return None
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 1)


def main(argv=None) -> int:
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

    proc, tail = None, None
    url, pid = a.url, a.pid
    if url is None:
        proc, url, tail = start_server(a)
        pid = proc.pid
    try:
        refs = References(None if a.no_reference else a.target, a.draft, a.device)
        t_ref = time.monotonic()
        refs.precompute(PROMPTS, a.max_tokens_set)
        t_ref = time.monotonic() - t_ref
        refs.engine = None  # free it: the soak measures the server, not this process
        stats, rss = Stats(), {}
        duration = asyncio.run(run_clients(url, a, refs, stats, pid, rss))
        # every KV block free once idle
        kv, end = None, time.monotonic() + 30
        while time.monotonic() < end:
            kv = kv_blocks_used(url, a.api_key)
            if kv == (0, 0):
                break
            time.sleep(0.2)
    finally:
        exit_status = None
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            try:
                exit_status = proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                exit_status = proc.wait()

    checks = {
        "no_errors": sum(stats.errors.values()) == 0,
        "no_violations": stats.num_violations == 0,
        "requests_done": stats.requests > 0,
        "kv_freed": kv in ((0, 0), None),
    }
    if rss.get("warm") and rss.get("end"):
        checks["rss_flat"] = rss["end"] <= rss["warm"] * a.rss_factor + a.rss_slack_mb * MB
    if proc is not None:
        checks["server_exit_0"] = exit_status == 0
    summary = {
        "url": url,
        "own_server": proc is not None,
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
        "reference_s": round(t_ref, 1),
        "ttft_ms": {"p50": pct(stats.ttft_ms, 0.5), "p99": pct(stats.ttft_ms, 0.99)},
        "latency_ms": {"p50": pct(stats.total_ms, 0.5), "p99": pct(stats.total_ms, 0.99)},
        "rss_mb": {k: round(v / MB, 1) for k, v in rss.items()},
        "kv_blocks_used_after": kv,
        "server_exit_status": exit_status,
        "checks": checks,
        "ok": all(checks.values()),
    }
    r = summary["rss_mb"]
    print(
        f"soak: {a.clients} clients x {a.inflight} in flight, {duration:.0f} s: {stats.requests} requests, "
        f"{stats.tokens} tokens ({summary['tokens_per_s']} tok/s), errors {dict(stats.errors) or 0}, "
        f"violations {stats.num_violations}, disconnects {stats.disconnects}"
    )
    print(
        f"      ttft p50/p99 {summary['ttft_ms']['p50']}/{summary['ttft_ms']['p99']} ms, latency p50/p99 "
        f"{summary['latency_ms']['p50']}/{summary['latency_ms']['p99']} ms; server RSS start {r.get('start')} MB, "
        f"warm-up {r.get('warm')} MB, end {r.get('end')} MB, peak {r.get('peak')} MB; KV after {kv}"
    )
    for v in stats.violations[:10]:
        print("      violation:", v)
    print("      checks:", " ".join(f"{k}={'ok' if v else 'FAIL'}" for k, v in checks.items()))
    print(json.dumps(summary))
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(summary, indent=2) + "\n")
    if proc is not None and not summary["ok"] and tail:
        print("server log tail:\n" + "".join(tail[-50:]), file=sys.stderr)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
