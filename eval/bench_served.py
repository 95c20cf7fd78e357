"""specd serve vs llama.cpp's llama-server on one GGUF file, as a new user would try them: each server
started on the file with its defaults (specd also with ``--spec-mode off``), one client streaming
greedy completions of ``--tokens`` tokens (``ignore_eos``), the steady decode rate of each request.

    OMP_NUM_THREADS=2 python -m eval bench served --target FILE.gguf [--threads 2] [--rounds 2]
        [--requests 3] [--tokens 128] [--no-llama]

Rate = (tokens - 1) / (last streamed chunk - first streamed chunk): the first chunk carries the prompt's
token (prefill and start-up excluded), every server emits exactly ``--tokens`` tokens. Rounds alternate
the servers (each started fresh, one untimed 16-token request first), so a drifting machine affects each
alike; the table gives the median over rounds x requests. llama-server comes from ``make bench-deps``
(``--llama-tools``), started with ``-t THREADS -np 1 -c 2048 --no-webui``; specd with OMP_NUM_THREADS=THREADS.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from eval import harness as H

COMMAND = "bench served"
LLAMA_TOOLS = Path.home() / ".cache" / "specd" / "llama.cpp"
PROMPT = "The history of the city begins"


def stream_times(port: int, body: dict) -> list:
    """POST /v1/completions with ``stream``; the arrival time of each SSE event that carries text."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    try:
        c.request("POST", "/v1/completions", json.dumps({**body, "stream": True}), {"content-type": "application/json"})
        r = c.getresponse()
        if r.status != 200:
            raise RuntimeError(f"port {port}: HTTP {r.status}: {r.read()[:300]!r}")
        times = []
        for raw in r:
            line = raw.strip()
            if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                continue
            if any(ch.get("text") for ch in json.loads(line[5:]).get("choices", [])):
                times.append(time.perf_counter())
        return times
    finally:
        c.close()


def decode_rate(times: list, tokens: int) -> float:
    """Tokens per second after the first chunk (see the module doc)."""
    if len(times) < 2 or times[-1] <= times[0]:
        raise RuntimeError(f"a streamed completion of {tokens} tokens arrived in {len(times)} chunk(s)")
    return (tokens - 1) / (times[-1] - times[0])


def _wait(port: int, path: str, proc: subprocess.Popen, timeout: float = 300.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"the server on port {port} exited (code {proc.returncode}) before it was ready")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the server on port {port} was not ready after {timeout:.0f} s")


def servers(target: Path, threads: int, llama: Path | None, port: int) -> list:
    """(name, command, port, readiness path) of each server compared."""
    specd = [sys.executable, "-m", "specd", "serve", "--target", str(target), "--grpc-port", "0"]
    out = [
        ("specd serve (defaults)", [*specd, "--port", str(port)], port, "/readyz"),
        ("specd serve --spec-mode off", [*specd, "--port", str(port + 1), "--spec-mode", "off"], port + 1, "/readyz"),
    ]
    if llama is not None:
        cmd = [str(llama), "-m", str(target), "-t", str(threads), "-np", "1", "-c", "2048", "--no-webui"]
        out.append((f"llama-server -t {threads}", [*cmd, "--port", str(port + 2)], port + 2, "/health"))
    return out


def one_server(cmd: list, port: int, ready: str, body: dict, requests: int, threads: int) -> list:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait(port, ready, proc)
        stream_times(port, {**body, "max_tokens": 16})  # (untimed: first-request work)
        return [decode_rate(stream_times(port, body), body["max_tokens"]) for _ in range(requests)]
    finally:
        H.end_process(proc, 30)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", type=Path, required=True, help="a GGUF file")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=3, help="timed requests per server and round")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--port", type=int, default=8491, help="the first of three consecutive ports")
    ap.add_argument("--llama-tools", type=Path, default=LLAMA_TOOLS, help="llama.cpp's build (make bench-deps)")
    ap.add_argument("--no-llama", action="store_true", help="specd only")
    a = ap.parse_args(argv)
    if not a.target.is_file():
        ap.error(f"--target {a.target}: no such file")
    if min(a.threads, a.rounds, a.requests) < 1 or a.tokens < 2:
        ap.error("--threads, --rounds and --requests take 1 or more, --tokens 2 or more")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    llama = None if a.no_llama else a.llama_tools / "build" / "bin" / "llama-server"
    if llama is not None and not llama.exists():
        print(f"bench served: no {llama} (make bench-deps builds it; --no-llama: specd only)", file=sys.stderr)
        return 2
    body = {"model": a.target.stem, "prompt": PROMPT, "max_tokens": a.tokens, "temperature": 0, "ignore_eos": True}
    rates: dict = {}
    for rnd in range(a.rounds):
        for name, cmd, port, ready in servers(a.target, a.threads, llama, a.port):
            got = one_server(cmd, port, ready, body, a.requests, a.threads)
            rates.setdefault(name, []).extend(got)
            print(f"[round {rnd}] {name}: {[round(r, 2) for r in got]} tok/s", flush=True)
    print("\n| file | server | threads | median decode tok/s | requests |\n|---|---|---|---|---|")
    for name, rs in rates.items():
        print(f"| {a.target.name} | {name} | {a.threads} | {statistics.median(rs):.2f} | {len(rs)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
