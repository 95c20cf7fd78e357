"""Websocket delivery vs in-process engine: tokens/s and time to first token for the same requests.

    OMP_NUM_THREADS=1 .venv/bin/python -m eval load server [--target DIR --draft DIR] [--max-tokens 128]
        [--concurrency 1,8] [--spec tree] [--rounds 3] [--repeats 3] [--stream-interval-ms MS]

In one run: the same greedy requests go (a) straight to an ``Engine`` (``add_request`` + ``step()``
loop, timestamps from the engine's own clock; no server, no IPC) and (b) over a websocket to ``specd
serve`` started as a subprocess with the same engine settings (the client measures from sending
``generate`` to the first ``delta`` / the ``done``). Concurrency c = c requests submitted at once;
tokens/s = all generated tokens / wall time of the batch; CPU ms/token compares the work done (the
server process and its engine process vs the bare engine). The target is websocket tokens/s >= 95%
of in-process.

Method (each choice answers a noise source measured on our 2-vCPU VM):
- ``--rounds`` (default 3): every round starts a fresh server AND runs the in-process side in a fresh
  process of its own (``--baseline-worker``). The same engine runs at a different speed in each
  process (memory placement; for the memory-bound demo pair fresh processes measured 0.70-1.33 ms
  per token), so a single process pair would bake a random +-20% into every repeat.
- ``--repeats`` per cell and round, the two sides alternating who goes first; the ratio column is the
  median over all (in-process, websocket) pairs of each pair's ratio, so drift between pairs cancels.
  Tokens/s columns are the medians of each side.
- ``--pin`` (the default with 2+ CPUs): the deployment layout of a CPU host, ``specd serve
  --cpu-split`` (the engine owns one CPU, the server's event loop the other); the in-process side
  runs pinned to the same engine CPU and this benchmark's websocket client runs on the server's CPU.
  ``--no-pin`` leaves placement to the OS.
- The A/A control column runs the in-process side twice per repeat and reports that ratio the same
  way: two identical runs, i.e. what noise alone shows.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

import orjson

from eval import harness as H
from eval.harness import ROOT, median

COMMAND = "load server"  # python -m eval load server (this module's ``main``)
PROMPTS = H.STORY_PROMPTS[:8]


def engine_args(a) -> list:
    return [
        "--target",
        a.target,
        *(["--draft", a.draft] if a.draft else []),
        "--device",
        a.device,
        "--spec-mode",
        a.spec,
        "--num-blocks",
        str(a.num_blocks),
    ]


def in_process(engine, prompts, max_tokens, spec_mode):
    from specd.engine.sequence import SpecParams
    from specd.sampling.params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    c0 = time.process_time()
    t0 = time.monotonic()
    seqs = [engine.add_request(p, params, SpecParams(mode=spec_mode)) for p in prompts]
    while any(not s.finished for s in seqs):
        engine.step()
    wall = time.monotonic() - t0
    cpu = time.process_time() - c0
    toks = sum(s.num_output for s in seqs)
    ttft = [(s.first_token_time - t0) * 1000 for s in seqs]
    return toks / wall, statistics.mean(ttft), [s.output_ids for s in seqs], cpu / toks * 1000


async def with_server_cpu(pid, run):
    """Await ``run`` (a websocket run: tokens/s, TTFT, tokens) and add the server's CPU ms per token."""
    s0 = H.process_cpu_seconds(pid)
    tps, ttft, toks = await run
    return tps, ttft, toks, (H.process_cpu_seconds(pid) - s0) / sum(len(t) for t in toks) * 1000


async def over_ws(url, prompts_text, max_tokens, spec_mode, ws):
    t0 = time.monotonic()
    first, done, tokens = {}, {}, {}
    for i, p in enumerate(prompts_text):
        await ws.send(orjson.dumps(generate_msg(i, p, max_tokens, spec_mode)).decode())
    while len(done) < len(prompts_text):
        m = orjson.loads(await ws.recv())
        rid = m["id"]
        if m["type"] == "delta":
            first.setdefault(rid, time.monotonic())
            tokens.setdefault(rid, []).extend(m["token_ids"])
        elif m["type"] == "done":
            done[rid] = time.monotonic()
        else:
            raise RuntimeError(m)
    wall = max(done.values()) - t0
    n = sum(len(v) for v in tokens.values())
    ttft = [(first[str(i)] - t0) * 1000 for i in range(len(prompts_text))]
    return n / wall, statistics.mean(ttft), [tokens[str(i)] for i in range(len(prompts_text))]


def generate_msg(i: int, prompt: str, max_tokens: int, spec_mode: str) -> dict:
    """The greedy ``generate`` request ``i`` of a run (``ignore_eos``: every path makes the same tokens)."""
    return {
        "type": "generate",
        "id": str(i),
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "speculation": {"mode": spec_mode},
    }


async def over_raw_ws(port, prompts_text, max_tokens, spec_mode):
    """Like ``over_ws`` with a lean client (``harness.ws_open``: a raw socket that only appends what
    arrives and looks for the ends of requests; frames parsed after the run). On a 2-CPU box the
    client shares the server's CPU and its per-message work (the websockets library, JSON per frame)
    competes with the system under test; real clients run elsewhere. A fresh connection per run."""
    reader, writer = await H.ws_open(port, "/ws")
    n = len(prompts_text)
    t0 = time.monotonic()
    frames = (
        H.masked_frame(orjson.dumps(generate_msg(i, p, max_tokens, spec_mode))) for i, p in enumerate(prompts_text)
    )
    writer.write(b"".join(frames))
    ends = lambda b: b.count(b'"type":"done"') + b.count(b'"type":"error"')  # noqa: E731
    chunks = await H.read_until(reader, ends, n)
    writer.close()
    first, done, tokens = {}, {}, {}
    for t, m in H.ws_frames(chunks):
        rid = m.get("id")
        if m["type"] == "delta":
            first.setdefault(rid, t)
            tokens.setdefault(rid, []).extend(m["token_ids"])
        elif m["type"] == "done":
            done[rid] = t
        else:
            raise RuntimeError(m)
    wall = max(done.values()) - t0
    ttft = [(first[str(i)] - t0) * 1000 for i in range(n)]
    return sum(len(v) for v in tokens.values()) / wall, statistics.mean(ttft), [tokens[str(i)] for i in range(n)]


def start_server(a) -> H.Daemon:
    """``specd serve`` with the benchmark's engine settings, as a child process (``harness.start_daemon``)."""
    return H.start_daemon(
        [
            *engine_args(a),
            "--max-queue",
            "1024",
            *(["--cpu-split"] if a.pin else []),
            *([] if a.stream_interval_ms is None else ["--stream-interval-ms", str(a.stream_interval_ms)]),
        ],
        child=True,
    )


class Baseline:
    """The in-process side in a fresh process of its own each round (``--baseline-worker``): an
    ``Engine`` stepped directly, no server, pinned to the engine's CPU. Fresh per round because the
    same engine runs at a different speed in each process (memory placement: up to ~1.5x apart for
    the demo pair on our VM), which one long-lived process would bake into every pair."""

    def __init__(self, a, cpus):
        import subprocess

        args = [
            sys.executable,
            "-m",
            "eval.bench_server",
            "--baseline-worker",
            "--target",
            a.target,
            *(["--draft", a.draft] if a.draft else []),
            "--device",
            a.device,
            "--spec",
            a.spec,
            "--num-blocks",
            str(a.num_blocks),
        ]
        self.proc = subprocess.Popen(
            args,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=ROOT,
            preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
        )
        self.device = orjson.loads(self.proc.stdout.readline())["device"]

    def run(self, ids, max_tokens, mode):
        self.proc.stdin.write(orjson.dumps({"ids": ids, "max_tokens": max_tokens, "mode": mode}) + b"\n")
        self.proc.stdin.flush()
        return tuple(orjson.loads(self.proc.stdout.readline()))

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(60)


def baseline_worker(a) -> int:
    engine = H.engine_from_flags(engine_args(a), warm=True)
    out = sys.stdout.buffer
    out.write(orjson.dumps({"device": str(engine.device)}) + b"\n")
    out.flush()
    for line in sys.stdin.buffer:
        q = orjson.loads(line)
        out.write(orjson.dumps(in_process(engine, q["ids"], q["max_tokens"], q["mode"])) + b"\n")
        out.flush()
    return 0


def build_parser() -> argparse.ArgumentParser:
    from specd.options import demo_pair

    t, d = demo_pair()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", default=t)
    p.add_argument("--draft", default=d)
    p.add_argument("--device", default="auto")
    p.add_argument("--spec", default="tree", help="engine default speculation (serve --spec-mode)")
    p.add_argument("--modes", default="tree,off", help="request speculation modes to measure")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--concurrency", default="1,8")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--num-blocks", type=int, default=1024)
    p.add_argument(
        "--pin",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="deployment layout: serve --cpu-split; baseline on the engine CPU, client on the server CPU",
    )
    p.add_argument(
        "--stream-interval-ms", type=float, default=None, help="serve --stream-interval-ms (default: serve's)"
    )
    p.add_argument(
        "--control",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="A/A control: each repeat runs the in-process side twice; their ratio is the noise floor",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="fresh server and fresh baseline process per round (process-to-process speed varies)",
    )
    p.add_argument(
        "--client",
        choices=["websockets", "raw"],
        default="websockets",
        help="websocket client: the websockets library, or a lean raw-socket reader that parses "
        "frames after the run (less client work beside the server on a small box)",
    )
    p.add_argument("--baseline-worker", action="store_true", help=argparse.SUPPRESS)
    return p


def main(argv=None) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    if a.baseline_worker:
        return baseline_worker(a)
    if a.rounds < 1 or a.repeats < 1:
        p.error("--rounds and --repeats must be >= 1")
    layout = H.cpu_layout(a.pin)
    a.pin = layout is not None
    cells, device = measure(a, layout)
    print_report(a, table_rows(cells), layout, device)
    return 0


def measure(a, layout) -> tuple:
    """``--rounds`` rounds, each with a fresh server and a fresh baseline process. Returns the cells
    ((mode, concurrency) -> (in-process runs, websocket runs, A/A control ratios)) and the device."""
    from specd.model.loader import load_tokenizer

    tok = load_tokenizer(Path(a.target))
    if layout:
        os.sched_setaffinity(0, layout[0])  # this process is the websocket client: beside the server's loop
    conc = [int(x) for x in a.concurrency.split(",")]
    cells = {(mode, c): ([], [], []) for mode in a.modes.split(",") for c in conc}
    device = "?"
    for _ in range(a.rounds):
        base = Baseline(a, layout[1] if layout else None)
        srv = start_server(a)
        try:
            device = base.device
            asyncio.run(run_round(a, srv, base, tok, cells))
        finally:
            srv.stop()
            base.close()
    return cells, device


async def run_round(a, srv: H.Daemon, base, tok, cells: dict) -> None:
    """Every cell's ``--repeats`` pairs of runs (in process, websocket), the two sides alternating
    who goes first."""
    from websockets.asyncio.client import connect

    async with connect(srv.url, compression=None, max_size=None) as ws:
        await over_ws(srv.url, PROMPTS[:2], 8, "tree", ws)  # warm the connection
        for (mode, c), (ip, wsr, ctl) in cells.items():
            texts = [PROMPTS[i % len(PROMPTS)] for i in range(c)]
            ids = [tok(x)["input_ids"] for x in texts]
            for r in range(a.repeats):
                for side in ("ip", "ws") if r % 2 == 0 else ("ws", "ip"):  # alternate who goes first
                    if side == "ip":
                        ip.append(base.run(ids, a.max_tokens, mode))
                        if a.control:  # A/A: the same in-process run again (the noise floor)
                            ctl.append(base.run(ids, a.max_tokens, mode)[0] / ip[-1][0])
                    else:
                        run = (
                            over_raw_ws(srv.port, texts, a.max_tokens, mode)
                            if a.client == "raw"
                            else over_ws(srv.url, texts, a.max_tokens, mode, ws)
                        )
                        wsr.append(await with_server_cpu(srv.pid, run))


def table_rows(cells: dict) -> list:
    """Per cell: medians of tokens/s (each side), of the paired ratios and of the A/A control,
    TTFT and CPU ms/token (each side), and whether the tokens were the same."""
    rows = []
    for (mode, c), (ip, wsr, ctl) in cells.items():
        rows.append(
            (
                mode,
                c,
                median(x[0] for x in ip),
                median(x[0] for x in wsr),
                median(y[0] / x[0] for x, y in zip(ip, wsr)),
                median(ctl),
                median(x[1] for x in ip),
                median(x[1] for x in wsr),
                all(x[2] == y[2] for x, y in zip(ip, wsr)),
                median(x[3] for x in ip),
                median(x[3] for x in wsr),
            )
        )
    return rows


def print_report(a, rows: list, layout, device: str) -> None:
    print(f"\n`OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']} {H.command_line(COMMAND, None)}`\n")
    load = " ".join(f"{x:.1f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "?"
    si = "serve's default" if a.stream_interval_ms is None else f"{a.stream_interval_ms:g} ms"
    place = f"pinned: engine CPU {sorted(layout[1])}, server + client CPU {sorted(layout[0])}" if layout else "unpinned"
    print(
        f"target `{H.short_path(a.target)}`, draft `{H.short_path(a.draft)}`, device {device}, "
        f"greedy, {a.max_tokens} tokens per request (ignore_eos), medians of {a.rounds} rounds x {a.repeats} runs, "
        f"{os.cpu_count()} CPUs ({place}), stream interval {si}, {a.client} client, load average {load}\n"
    )
    print(
        "| spec | concurrency | in-process tok/s | websocket tok/s | ws / in-process | A/A control | "
        "in-process TTFT ms | websocket TTFT ms | in-process CPU ms/token | server CPU ms/token | same tokens |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for mode, c, a1, a2, r, aa, t1, t2, same, c1, c2 in rows:
        aa = f"{100 * aa:.1f}%" if aa is not None else "-"
        print(
            f"| {mode} | {c} | {a1:.0f} | {a2:.0f} | {100 * r:.1f}% | {aa} | {t1:.1f} | {t2:.1f} | {c1:.2f} | "
            f"{c2:.2f} | {'yes' if same else 'NO'} |"
        )
    print(
        "\nws / in-process: median over the repeats of each pair's ratio (the two sides alternate who goes "
        "first). A/A control: the same in-process run twice in a row, median ratio - what this machine's noise "
        "alone shows for two identical runs. CPU ms/token: CPU time of the processes doing the work (for websocket: "
        "the server process and "
        "its engine process), per generated token; robust to other load on the machine, unlike tok/s."
    )


if __name__ == "__main__":
    sys.exit(main())
