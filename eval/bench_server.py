"""Websocket delivery vs in-process engine: tokens/s and time to first token for the same requests.

    OMP_NUM_THREADS=1 .venv/bin/python eval/bench_server.py [--target DIR --draft DIR] [--max-tokens 128]
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
    from specd.engine.sampling import SamplingParams
    from specd.engine.sequence import SpecParams

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
    s0 = proc_cpu(pid)
    tps, ttft, toks = await run
    return tps, ttft, toks, (proc_cpu(pid) - s0) / sum(len(t) for t in toks) * 1000


async def over_ws(url, prompts_text, max_tokens, spec_mode, ws):
    t0 = time.monotonic()
    first, done, tokens = {}, {}, {}
    for i, p in enumerate(prompts_text):
        await ws.send(
            orjson.dumps(
                {
                    "type": "generate",
                    "id": str(i),
                    "prompt": p,
                    "max_tokens": max_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                    "speculation": {"mode": spec_mode},
                }
            ).decode()
        )
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


async def over_raw_ws(port, prompts_text, max_tokens, spec_mode):
    """Like ``over_ws`` with a lean client: a raw socket that only appends what arrives (and looks
    for the ends of requests); frames are parsed after the run. On a 2-CPU box the client shares
    the server's CPU and its per-message work (the websockets library, JSON per frame) competes with
    the system under test; real clients run elsewhere. A fresh connection per run (no pings)."""
    import base64

    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    key = base64.b64encode(os.urandom(16)).decode()
    writer.write(
        f"GET /ws HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n".encode()
    )
    head = await reader.readuntil(b"\r\n\r\n")
    if b" 101 " not in head.split(b"\r\n", 1)[0]:
        raise RuntimeError(f"websocket upgrade refused: {head[:200]!r}")
    n = len(prompts_text)
    t0 = time.monotonic()
    out = bytearray()
    for i, p in enumerate(prompts_text):
        payload = orjson.dumps(
            {
                "type": "generate",
                "id": str(i),
                "prompt": p,
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "speculation": {"mode": spec_mode},
            }
        )
        mask = os.urandom(4)
        ln = len(payload)
        hdr = bytes((0x81, 0x80 | ln)) if ln < 126 else b"\x81\xfe" + ln.to_bytes(2, "big")
        out += hdr + mask + bytes(b ^ mask[k % 4] for k, b in enumerate(payload))
    writer.write(bytes(out))
    chunks, ends, tail = [], 0, b""
    marks = (b'"type":"done"', b'"type":"error"')
    while ends < n:
        chunk = await reader.read(1 << 16)
        if not chunk:
            raise RuntimeError("connection closed by the server")
        chunks.append((time.monotonic(), chunk))
        scan = tail + chunk
        ends += sum(scan.count(m) for m in marks) - sum(tail.count(m) for m in marks)
        tail = scan[-16:]
    writer.close()
    first, done, tokens = {}, {}, {}
    buf = bytearray()
    for t, chunk in chunks:  # parse the frames, each stamped with its chunk's arrival time
        buf += chunk
        pos = 0
        while len(buf) - pos >= 2:
            ln = buf[pos + 1] & 0x7F
            hl = 2 if ln < 126 else (4 if ln == 126 else 10)
            if len(buf) - pos < hl:
                break
            if ln == 126:
                ln = int.from_bytes(buf[pos + 2 : pos + 4], "big")
            elif ln == 127:
                ln = int.from_bytes(buf[pos + 2 : pos + 10], "big")
            if len(buf) - pos - hl < ln:
                break
            op = buf[pos] & 0x0F
            body = bytes(buf[pos + hl : pos + hl + ln])
            pos += hl + ln
            if op != 1:
                continue
            m = orjson.loads(body)
            rid = m.get("id")
            if m["type"] == "delta":
                first.setdefault(rid, t)
                tokens.setdefault(rid, []).extend(m["token_ids"])
            elif m["type"] == "done":
                done[rid] = t
            else:
                raise RuntimeError(m)
        del buf[:pos]
    wall = max(done.values()) - t0
    ntok = sum(len(v) for v in tokens.values())
    ttft = [(first[str(i)] - t0) * 1000 for i in range(n)]
    return ntok / wall, statistics.mean(ttft), [tokens[str(i)] for i in range(n)]


def start_server(a):
    from specd.serving.app import ServerProcess

    sp = ServerProcess(
        [
            *engine_args(a),
            "--port",
            "0",
            "--grpc-port",
            "0",
            "--log-level",
            "info",
            "--max-queue",
            "1024",
            *(["--cpu-split"] if a.pin else []),
            *([] if a.stream_interval_ms is None else ["--stream-interval-ms", str(a.stream_interval_ms)]),
        ],
        cwd=ROOT,
    ).start()
    return sp.proc, sp.port


def cpu_layout(pin: bool):
    """(server CPUs, engine CPUs) as ``specd serve --cpu-split`` assigns them, or None unpinned."""
    if not pin or not hasattr(os, "sched_getaffinity"):
        return None
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None
    return set(cpus[:1]), set(cpus[1:])


class Baseline:
    """The in-process side in a fresh process of its own each round (``--baseline-worker``): an
    ``Engine`` stepped directly, no server, pinned to the engine's CPU. Fresh per round because the
    same engine runs at a different speed in each process (memory placement: up to ~1.5x apart for
    the demo pair on our VM), which one long-lived process would bake into every pair."""

    def __init__(self, a, cpus):
        import subprocess

        args = [
            sys.executable,
            str(Path(__file__).resolve()),
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
    from specd.engine.engine import Engine
    from specd.engine.warmup import warm_up
    from specd.options import engine_config, serve_parser

    engine = Engine(engine_config(serve_parser().parse_args([*engine_args(a)])))
    warm_up(engine)
    out = sys.stdout.buffer
    out.write(orjson.dumps({"device": str(engine.device)}) + b"\n")
    out.flush()
    for line in sys.stdin.buffer:
        q = orjson.loads(line)
        out.write(orjson.dumps(in_process(engine, q["ids"], q["max_tokens"], q["mode"])) + b"\n")
        out.flush()
    return 0


def main(argv=None) -> int:
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
    a = p.parse_args(argv)
    if a.baseline_worker:
        return baseline_worker(a)
    if a.rounds < 1 or a.repeats < 1:
        p.error("--rounds and --repeats must be >= 1")
    layout = cpu_layout(a.pin)
    a.pin = layout is not None
    conc = [int(x) for x in a.concurrency.split(",")]
    modes = a.modes.split(",")

    from specd.model.loader import load_tokenizer

    tok = load_tokenizer(Path(a.target))
    if layout:
        os.sched_setaffinity(0, layout[0])  # this process is the websocket client: beside the server's loop
    cells = {(mode, c): ([], [], []) for mode in modes for c in conc}  # in-process, websocket, A/A control
    device = "?"

    async def run_round(url, port, pid, base):
        from websockets.asyncio.client import connect

        async with connect(url, compression=None, max_size=None) as ws:
            await over_ws(url, PROMPTS[:2], 8, "tree", ws)  # warm the connection
            for mode in modes:
                for c in conc:
                    texts = [PROMPTS[i % len(PROMPTS)] for i in range(c)]
                    ids = [tok(x)["input_ids"] for x in texts]
                    ip, wsr, ctl = cells[mode, c]
                    for r in range(a.repeats):
                        for side in ("ip", "ws") if r % 2 == 0 else ("ws", "ip"):  # alternate who goes first
                            if side == "ip":
                                ip.append(base.run(ids, a.max_tokens, mode))
                                if a.control:  # A/A: the same in-process run again (the noise floor)
                                    ctl.append(base.run(ids, a.max_tokens, mode)[0] / ip[-1][0])
                            else:
                                run = (
                                    over_raw_ws(port, texts, a.max_tokens, mode)
                                    if a.client == "raw"
                                    else over_ws(url, texts, a.max_tokens, mode, ws)
                                )
                                wsr.append(await with_server_cpu(pid, run))

    for _ in range(a.rounds):
        base = Baseline(a, layout[1] if layout else None)
        proc, port = start_server(a)
        try:
            device = base.device
            asyncio.run(run_round(f"ws://127.0.0.1:{port}/ws", port, proc.pid, base))
        finally:
            proc.terminate()
            proc.wait(60)
            base.close()
    rows = []
    for (mode, c), (ip, wsr, ctl) in cells.items():
        same = all(x[2] == y[2] for x, y in zip(ip, wsr))
        rows.append(
            (
                mode,
                c,
                statistics.median(x[0] for x in ip),
                statistics.median(x[0] for x in wsr),
                statistics.median(y[0] / x[0] for x, y in zip(ip, wsr)),
                statistics.median(ctl) if ctl else None,
                statistics.median(x[1] for x in ip),
                statistics.median(x[1] for x in wsr),
                same,
                statistics.median(x[3] for x in ip),
                statistics.median(x[3] for x in wsr),
            )
        )
    dev = device
    print(
        f"\n`OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']} {' '.join([sys.executable.split('/')[-1], *sys.argv])}`\n"
    )
    load = " ".join(f"{x:.1f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "?"

    def short(x):
        if not x:
            return "-"
        x = Path(x).resolve()
        for base in (ROOT, ROOT.parent):
            if x.is_relative_to(base):
                return str(x.relative_to(base))
        return str(x)

    si = "serve's default" if a.stream_interval_ms is None else f"{a.stream_interval_ms:g} ms"
    place = f"pinned: engine CPU {sorted(layout[1])}, server + client CPU {sorted(layout[0])}" if layout else "unpinned"
    print(
        f"target `{short(a.target)}`, draft `{short(a.draft)}`, device {dev}, "
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
