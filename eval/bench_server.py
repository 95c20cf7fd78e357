"""Websocket delivery vs in-process engine: tokens/s and time to first token for the same requests.

    OMP_NUM_THREADS=1 .venv/bin/python eval/bench_server.py [--target DIR --draft DIR] [--max-tokens 128]
        [--concurrency 1,8] [--spec tree] [--repeats 3]

In one run: the same greedy requests go (a) straight to an in-process ``Engine`` (``add_request`` +
``step()`` loop, timestamps from the engine's own clock) and (b) over a websocket to ``specd serve``
started as a subprocess with the same engine settings (the client measures from sending ``generate``
to the first ``delta`` / the ``done``). Concurrency c = c requests submitted at once; tokens/s = all
generated tokens / wall time of the batch; CPU ms/token compares the work done (the server's engine
thread + event loop vs the bare engine), which other load on the machine does not distort. Each (mode, concurrency) cell alternates in-process and
websocket runs ``--repeats`` times and reports the medians. Prints a Markdown table and the command.
The target is websocket tokens/s >= 95% of in-process.
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import argparse  # noqa: E402
import asyncio  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import orjson  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "eval"))

from common import child_pids  # noqa: E402

PROMPTS = ["Once upon a time", "The little dog", "Lily and Tom went to the park", "One day, a big bird",
           "There was a girl named Sue", "The sun was hot and", "Tim had a red ball", "Mom said to Ben"]


def engine_args(a) -> list:
    return ["--target", a.target, *(["--draft", a.draft] if a.draft else []), "--device", a.device,
            "--spec-mode", a.spec, "--num-blocks", str(a.num_blocks)]


def proc_cpu(pid) -> float:
    """CPU seconds (user + system) of a process and its live descendants (the engine process of
    ``specd serve``), from /proc (Linux); 0 elsewhere."""
    try:
        f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        own = (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0
    return own + sum(proc_cpu(c) for c in child_pids(pid))


def in_process(engine, prompts, max_tokens, spec_mode):
    from specd.sampling import SamplingParams
    from specd.sequence import SpecParams

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


async def over_ws_cpu(url, prompts_text, max_tokens, spec_mode, ws, pid):
    s0 = proc_cpu(pid)
    tps, ttft, toks = await over_ws(url, prompts_text, max_tokens, spec_mode, ws)
    n = sum(len(t) for t in toks)
    return tps, ttft, toks, (proc_cpu(pid) - s0) / n * 1000


async def over_ws(url, prompts_text, max_tokens, spec_mode, ws):
    t0 = time.monotonic()
    first, done, tokens = {}, {}, {}
    for i, p in enumerate(prompts_text):
        await ws.send(orjson.dumps({"type": "generate", "id": str(i), "prompt": p, "max_tokens": max_tokens,
                                    "temperature": 0, "ignore_eos": True, "speculation": {"mode": spec_mode}}).decode())
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


def start_server(a):
    from specd.server.app import ServerProcess

    sp = ServerProcess([*engine_args(a), "--port", "0", "--grpc-port", "0", "--log-level", "info",
                        "--max-queue", "1024"], cwd=ROOT).start()
    return sp.proc, sp.port


def main(argv=None) -> int:
    from specd.cli import build_parser, default_pair, engine_config

    t, d = default_pair()
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
    a = p.parse_args(argv)
    conc = [int(x) for x in a.concurrency.split(",")]
    modes = a.modes.split(",")

    from specd.engine import Engine
    from specd.server.app import warm_up

    sargs = build_parser().parse_args(["serve", *engine_args(a)])
    engine = Engine(engine_config(sargs))
    warm_up(engine)
    tok = engine.tokenizer
    proc, port = start_server(a)
    url = f"ws://127.0.0.1:{port}/ws"
    rows = []

    async def run_all():
        from websockets.asyncio.client import connect

        async with connect(url, compression=None, max_size=None) as ws:
            await over_ws(url, PROMPTS[:2], 8, "tree", ws)  # warm the connection
            for mode in modes:
                for c in conc:
                    texts = [PROMPTS[i % len(PROMPTS)] for i in range(c)]
                    ids = [tok(x)["input_ids"] for x in texts]
                    ip, wsr = [], []
                    for _ in range(a.repeats):
                        ip.append(in_process(engine, ids, a.max_tokens, mode))
                        wsr.append(await over_ws_cpu(url, texts, a.max_tokens, mode, ws, proc.pid))
                    same = all(x[2] == y[2] for x, y in zip(ip, wsr))
                    tps_ip = statistics.median(x[0] for x in ip)
                    tps_ws = statistics.median(x[0] for x in wsr)
                    rows.append((mode, c, tps_ip, tps_ws, statistics.median(x[1] for x in ip),
                                 statistics.median(x[1] for x in wsr), same, statistics.median(x[3] for x in ip),
                                 statistics.median(x[3] for x in wsr)))

    try:
        asyncio.run(run_all())
    finally:
        proc.terminate()
        proc.wait(60)
    dev = str(engine.device)
    print(f"\n`OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']} {' '.join([sys.executable.split('/')[-1], *sys.argv])}`\n")
    load = " ".join(f"{x:.1f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "?"
    def short(x):
        if not x:
            return "-"
        x = Path(x).resolve()
        for base in (ROOT, ROOT.parent):
            if x.is_relative_to(base):
                return str(x.relative_to(base))
        return str(x)

    print(f"target `{short(a.target)}`, draft `{short(a.draft)}`, device {dev}, "
          f"greedy, {a.max_tokens} tokens per request (ignore_eos), medians of {a.repeats} runs, "
          f"{os.cpu_count()} CPUs, load average {load}\n")
    print("| spec | concurrency | in-process tok/s | websocket tok/s | ws / in-process | in-process TTFT ms | "
          "websocket TTFT ms | in-process CPU ms/token | server CPU ms/token | same tokens |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for mode, c, a1, a2, t1, t2, same, c1, c2 in rows:
        print(f"| {mode} | {c} | {a1:.0f} | {a2:.0f} | {100 * a2 / a1:.1f}% | {t1:.1f} | {t2:.1f} | {c1:.2f} | "
              f"{c2:.2f} | {'yes' if same else 'NO'} |")
    print("\nCPU ms/token: CPU time of the processes doing the work (for websocket: the server process and "
          "its engine process), per generated token; robust to other load on the machine, unlike tok/s.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
