"""Delivery over OpenAI's HTTP (SSE), specd's websocket and the Responses WebSocket vs in-process, and the
second turn of a conversation via ``previous_response_id`` (issue 17).

    OMP_NUM_THREADS=1 .venv/bin/python -m eval load http [--target GGUF|DIR --draft DIR] [--max-tokens 64]
        [--concurrency 1,8] [--repeats 3] [--mode off] [--history-tokens 1000] [--turns 3]
        [--out eval/out/bench_http]

In one run, on the built-in pair by default (``make run``'s model): the same greedy chat requests
(``ignore_eos``, so every path generates the same number of tokens) go (a) straight to an ``Engine`` in
a process of its own (``eval.bench_server.Baseline``: ``add_request`` + ``step()``, the engine's own clock)
and, to ``specd serve`` started as a subprocess with the same engine settings, (b) over
``POST /v1/chat/completions`` with server-sent events, (c) over ``/ws`` (specd's protocol, one
connection carrying the concurrent requests) and (d) over the Responses WebSocket (``/v1/responses``,
one connection per concurrent response: one in flight per connection). Concurrency c = c requests at
once; tokens/s = generated tokens / wall time from the first send to the last end; TTFT = send to the
first text. The clients are lean raw-socket readers that stamp what arrives and parse it after the run
(on a 2-CPU box the client shares the server's CPU). Layout as ``specd serve --cpu-split``: the engine
process (and the in-process baseline) on one CPU, the server and this client on the other. The paths
alternate who goes first in each repeat; ratios are medians of each repeat's ratio to its in-process
run; the A/A control runs the in-process side twice (what noise alone shows). CPU ms/token: the CPU
time of the processes doing the work per generated token (the baseline process; the server process
and its engine process), which other load on a shared machine moves far less than tokens/s.

Second turn: for each of ``--turns`` distinct ~``--history-tokens``-token passages (tinyshakespeare),
turn 1 asks about the passage, turn 2 continues it with ``previous_response_id`` and a short question,
over the Responses WebSocket and over HTTP (SSE); the table gives both turns' TTFT, their ratio and
the prompt tokens the prefix cache served on turn 2. Goals (issue 17): each path >= 98% of in-process
tokens/s, HTTP TTFT within 5 ms of in-process, turn 2's TTFT <= half of turn 1's.
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

from eval import bench_server as B
from eval import harness as H
from eval.harness import ROOT

COMMAND = "load http"  # python -m eval load http (this module's ``main``)
FINAL = (b'"type":"response.completed"', b'"type":"response.incomplete"', b'"type":"response.failed"')


# results ------------------------------------------------------------------------------------------
def _result(t0: float, first: list, done: list, texts: list, toks: list) -> dict:
    n = sum(len(t) if isinstance(t, list) else t for t in toks)
    return {
        "tps": n / (max(done) - t0),
        "ttft_ms": statistics.mean((f - t0) * 1000 for f in first),
        "texts": texts,
        "tokens": toks,
    }


def _dechunk(chunks: list) -> list:
    """[(time, SSE data payload)] from ``[(time, bytes)]`` reads of a chunked HTTP response (the
    server sends each event as one body message: one HTTP chunk)."""
    raw = b"".join(c for _, c in chunks)
    ends, acc = [], 0
    for t, c in chunks:
        acc += len(c)
        ends.append((acc, t))
    off = raw.index(b"\r\n\r\n") + 4
    out, pos, k = [], off, 0
    while pos < len(raw):
        eol = raw.index(b"\r\n", pos)
        size = int(raw[pos:eol], 16)
        if size == 0:
            break
        start, stop = eol + 2, eol + 2 + size
        while ends[k][0] < stop:
            k += 1
        out += [(ends[k][1], line[6:]) for line in raw[start:stop].split(b"\n") if line.startswith(b"data: ")]
        pos = stop + 2
    return out


class Client:
    """The three network paths to one server (``model``: its id), greedy, ``ignore_eos``."""

    def __init__(self, port: int, model: str, max_tokens: int, mode: str):
        self.port, self.model, self.max_tokens, self.mode = port, model, max_tokens, mode

    def _common(self) -> dict:
        return {"model": self.model, "temperature": 0, "ignore_eos": True, "speculation": {"mode": self.mode}}

    async def ws(self, convs: list) -> dict:
        """specd's websocket: one connection, every request at once."""
        reader, writer = await H.ws_open(self.port, "/ws")
        msgs = [
            {**self._common(), "type": "generate", "id": str(i), "messages": m, "max_tokens": self.max_tokens}
            for i, m in enumerate(convs)
        ]
        t0 = time.monotonic()
        writer.write(b"".join(H.masked_frame(orjson.dumps(m)) for m in msgs))
        marks = lambda b: b.count(b'"type":"done"') + b.count(b'"type":"error"')  # noqa: E731
        chunks = await H.read_until(reader, marks, len(convs))
        writer.close()
        first, done, text, toks = {}, {}, {}, {}
        for t, m in H.ws_frames(chunks):
            rid = m.get("id")
            if m["type"] == "delta":
                if m["text"]:
                    first.setdefault(rid, t)
                text[rid] = text.get(rid, "") + m["text"]
                toks.setdefault(rid, []).extend(m["token_ids"])
            elif m["type"] == "done":
                done[rid] = t
            else:
                raise RuntimeError(m)
        k = [str(i) for i in range(len(convs))]
        return _result(t0, [first[i] for i in k], [done[i] for i in k], [text[i] for i in k], [toks[i] for i in k])

    def create(self, messages: list, prev: str | None = None, max_tokens: int | None = None) -> dict:
        body = {**self._common(), "type": "response.create", "input": messages}
        body["max_output_tokens"] = max_tokens or self.max_tokens
        if prev is not None:
            body["previous_response_id"] = prev
        return body

    async def one_response(self, body: dict, conn=None) -> tuple:
        """(first text time, end time, text, usage, response id) of one response over a Responses
        websocket (``conn``: an open (reader, writer), else a new one)."""
        reader, writer = conn or await H.ws_open(self.port, "/v1/responses")
        writer.write(H.masked_frame(orjson.dumps(body)))
        chunks = await H.read_until(reader, lambda b: sum(b.count(m) for m in FINAL), 1)
        if conn is None:
            writer.close()
        first, parts, final = None, [], None
        for t, m in H.ws_frames(chunks):
            if m["type"] == "response.output_text.delta":
                first = first or t
                parts.append(m["delta"])
            elif m["type"] in ("response.completed", "response.incomplete"):
                final = (t, m["response"])
            elif m["type"] in ("error", "response.failed"):
                raise RuntimeError(m)
        return first, final[0], "".join(parts), final[1]["usage"], final[1]["id"]

    async def responses_ws(self, convs: list) -> dict:
        """The Responses WebSocket: one connection per concurrent response (one in flight each)."""
        conns = [await H.ws_open(self.port, "/v1/responses") for _ in convs]
        t0 = time.monotonic()
        got = await asyncio.gather(*(self.one_response(self.create(m), c) for m, c in zip(convs, conns)))
        for _, w in conns:
            w.close()
        toks = [g[3]["output_tokens"] for g in got]
        return _result(t0, [g[0] for g in got], [g[1] for g in got], [g[2] for g in got], toks)

    async def post_stream(self, path: str, body: dict, conn=None) -> list:
        """[(time, data payload)] of a streamed POST (``conn``: an open connection, else a new one)."""
        reader, writer = conn or await asyncio.open_connection("127.0.0.1", self.port)
        data = orjson.dumps(body)
        head = (
            f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
        )
        writer.write(head.encode() + data)
        if path == "/v1/responses":
            marks = lambda b: sum(b.count(m) for m in FINAL)  # noqa: E731
        else:
            marks = lambda b: b.count(b"data: [DONE]")  # noqa: E731
        chunks = await H.read_until(reader, marks, 1)
        writer.close()
        return _dechunk(chunks)

    async def sse(self, convs: list) -> dict:
        """``POST /v1/chat/completions`` streaming (``include_usage``), a connection per request,
        opened beforehand (HTTP clients pool their connections; the websockets are open too)."""
        opts = {"stream": True, "stream_options": {"include_usage": True}, "max_tokens": self.max_tokens}
        conns = [await asyncio.open_connection("127.0.0.1", self.port) for _ in convs]
        t0 = time.monotonic()
        got = await asyncio.gather(
            *(
                self.post_stream("/v1/chat/completions", {**self._common(), **opts, "messages": m}, c)
                for m, c in zip(convs, conns)
            )
        )
        first, done, texts, toks = [], [], [], []
        for events in got:
            parts, f, n = [], None, 0
            for t, payload in events:
                m = orjson.loads(payload) if payload != b"[DONE]" else {}
                n = (m.get("usage") or {}).get("completion_tokens", n)
                for ch in m.get("choices", []):
                    if ch["delta"].get("content"):
                        f = f or t
                        parts.append(ch["delta"]["content"])
            first.append(f)
            done.append(events[-1][0])
            texts.append("".join(parts))
            toks.append(n)
        return _result(t0, first, done, texts, toks)


# the second turn of a conversation --------------------------------------------------------------------
def passages(tok, n: int, tokens: int) -> list:
    """``n`` distinct passages of ``tokens`` tokens (tinyshakespeare windows far apart)."""
    text = H.PASSAGES.read_text()
    step = max(1, (len(text) - 8 * tokens) // max(1, n))
    out = []
    for k in range(n):
        ids = tok(text[k * step : k * step + 8 * tokens])["input_ids"]
        out.append(tok.decode(ids[:tokens], skip_special_tokens=True))
    return out


async def second_turn_ws(cl: Client, passage: str) -> dict:
    """Turn 1 on a passage, turn 2 by ``previous_response_id``, over one Responses websocket."""
    conn = await H.ws_open(cl.port, "/v1/responses")
    q1 = [{"role": "user", "content": passage + "\n\nWho speaks first in this scene?"}]
    t0 = time.monotonic()
    f1, _, _, u1, rid = await cl.one_response(cl.create(q1, max_tokens=16), conn)
    t1 = time.monotonic()
    f2, _, _, u2, _ = await cl.one_response(
        cl.create([{"role": "user", "content": "And who speaks last?"}], rid, 16), conn
    )
    conn[1].close()
    return _turns(f1 - t0, f2 - t1, u1, u2)


async def second_turn_sse(cl: Client, passage: str) -> dict:
    """The same over ``POST /v1/responses`` with ``stream: true``."""

    async def turn(messages, prev=None):
        body = {k: v for k, v in cl.create(messages, prev, 16).items() if k != "type"}
        t0 = time.monotonic()
        events = [(t, orjson.loads(p)) for t, p in await cl.post_stream("/v1/responses", {**body, "stream": True})]
        first = next(t for t, e in events if e["type"] == "response.output_text.delta")
        final = events[-1][1]["response"]
        return first - t0, final["usage"], final["id"]

    d1, u1, rid = await turn([{"role": "user", "content": passage + "\n\nWho speaks first in this scene?"}])
    d2, u2, _ = await turn([{"role": "user", "content": "And who speaks last?"}], rid)
    return _turns(d1, d2, u1, u2)


def _turns(d1: float, d2: float, u1: dict, u2: dict) -> dict:
    return {
        "ttft1_ms": d1 * 1000,
        "ttft2_ms": d2 * 1000,
        "input1": u1["input_tokens"],
        "input2": u2["input_tokens"],
        "cached2": u2["input_tokens_details"]["cached_tokens"],
    }


# the run ------------------------------------------------------------------------------------------
def conversations(n: int) -> list:
    qs = [orjson.loads(line)["turns"][0] for line in H.MT_BENCH.read_text().splitlines() if line.strip()]
    return [[{"role": "user", "content": qs[i % len(qs)]}] for i in range(n)]


def _served_model(port: int) -> str:
    return orjson.loads(H.http_get(port, "/v1/models", timeout=30))["data"][0]["id"]


PATHS = ("sse", "ws", "responses_ws")


async def _cells(cl: Client, base, a, tok, cells: dict, server_pid: int) -> None:
    """Every path and the in-process baseline per concurrency and repeat (who goes first rotates);
    CPU ms per token: the baseline process's, and the server's (its engine process included)."""
    from specd.serving.request_build import build_request

    await cl.ws(conversations(2))  # warm every path
    await cl.sse(conversations(2))
    await cl.responses_ws(conversations(2))
    for c in a.concurrency:
        convs = conversations(c)
        ids = [build_request(tok, messages=m, max_tokens=1).prompt_ids for m in convs]
        for r in range(a.repeats):
            order = ["ip", *PATHS]
            order = order[r % len(order) :] + order[: r % len(order)]
            for side in order:
                cell = cells.setdefault((side, c), [])
                if side == "ip":
                    tps, ttft, out_ids, cpu = base.run(ids, a.max_tokens, a.mode)
                    cell.append({"tps": tps, "ttft_ms": ttft, "ids": out_ids, "cpu_ms": cpu})
                    if a.control:
                        cells.setdefault(("aa", c), []).append(base.run(ids, a.max_tokens, a.mode)[0] / tps)
                else:
                    c0 = H.process_cpu_seconds(server_pid)
                    r = await getattr(cl, side)(convs)
                    n = sum(len(t) if isinstance(t, list) else t for t in r["tokens"])
                    cell.append({**r, "cpu_ms": (H.process_cpu_seconds(server_pid) - c0) / n * 1000})


def run(a) -> dict:
    from specd.model.loader import load_tokenizer

    layout = H.cpu_layout(a.pin)
    a.pin = layout is not None
    tok = load_tokenizer(Path(a.target))
    base = B.Baseline(a, layout[1] if layout else None)
    daemon = B.start_server(a)
    cells: dict = {}
    try:
        if layout:
            os.sched_setaffinity(0, layout[0])  # this process is the client: beside the server's loop
        cl = Client(daemon.port, _served_model(daemon.port), a.max_tokens, a.mode)
        asyncio.run(_cells(cl, base, a, tok, cells, daemon.pid))
        hist = passages(tok, 2 * a.turns, a.history_tokens)
        turns = {
            "responses_ws": [asyncio.run(second_turn_ws(cl, p)) for p in hist[: a.turns]],
            "sse": [asyncio.run(second_turn_sse(cl, p)) for p in hist[a.turns :]],
        }
    finally:
        daemon.stop()
        base.close()
    return {"cells": cells, "turns": turns, "layout": layout, "device": base.device, "model": cl.model}


# the report -------------------------------------------------------------------------------------------
def _same(path: str, xs: list, ip: list, ws: list) -> bool:
    """Each repeat's output equals the in-process tokens (specd's websocket carries token ids) or,
    for the text-only paths, that repeat's websocket text."""
    if path == "ws":
        return all(x["tokens"] == y["ids"] for x, y in zip(xs, ip))
    return all(x["texts"] == w["texts"] for x, w in zip(xs, ws))


def delivery_rows(a, cells: dict) -> list:
    rows = []
    for c in a.concurrency:
        ip, ws = cells[("ip", c)], cells[("ws", c)]
        aa = cells.get(("aa", c))
        med = lambda f, xs: statistics.median(f(x) for x in xs)  # noqa: E731
        rows.append(("in-process", c, med(lambda x: x["tps"], ip), 1.0, med(lambda x: x, aa) if aa else None))
        rows[-1] += (med(lambda x: x["ttft_ms"], ip), 0.0, med(lambda x: x["cpu_ms"], ip), True)
        for path in PATHS:
            xs = cells[(path, c)]
            ratio = statistics.median(x["tps"] / y["tps"] for x, y in zip(xs, ip))
            dttft = statistics.median(x["ttft_ms"] - y["ttft_ms"] for x, y in zip(xs, ip))
            rows.append((path, c, med(lambda x: x["tps"], xs), ratio, None, med(lambda x: x["ttft_ms"], xs), dttft))
            rows[-1] += (med(lambda x: x["cpu_ms"], xs), _same(path, xs, ip, ws))
    return rows


NAMES = {"in-process": "in-process", "sse": "HTTP SSE (chat completions)", "ws": "specd websocket (/ws)"}
NAMES["responses_ws"] = "Responses WebSocket"


def markdown(a, res: dict) -> str:
    meta = res["meta"]
    out = [f"`OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']} {meta['command']}`", ""]
    v = meta["versions"]
    out.append(
        f"{meta['date']}, commit {meta['git_commit']}, {meta['cpu']} ({meta['cpu_count']} CPUs), "
        f"Python {v['python']}, torch {v['torch']}, transformers {v['transformers']}"
    )
    out.append("")
    lay = res["layout"]
    place = f"engine CPU {sorted(lay[1])}, server + client CPU {sorted(lay[0])}" if lay else "unpinned"
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    out.append(
        f"model `{res['model']}` (draft: {'yes' if a.draft else 'none'}), device {res['device']}, greedy, request "
        f"speculation `{a.mode}`, {a.max_tokens} tokens per request (ignore_eos), medians of {a.repeats} repeats; "
        f"{place}; load average {load}"
    )
    out += [
        "",
        "| path | streams | tok/s | / in-process | A/A control | TTFT ms | TTFT - in-process ms | CPU ms/token "
        "| same output |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for path, c, tps, ratio, aa, ttft, dt, cpu, same in delivery_rows(a, res["cells"]):
        aa_s = f"{100 * aa:.1f}%" if aa is not None else "-"
        out.append(
            f"| {NAMES[path]} | {c} | {tps:.1f} | {100 * ratio:.1f}% | {aa_s} | {ttft:.1f} | {dt:+.1f} | {cpu:.1f} "
            f"| {'yes' if same else 'NO'} |"
        )
    out += [
        "",
        "| second turn via previous_response_id | history tokens | turn-1 TTFT ms | turn-2 TTFT ms | "
        "turn 2 / turn 1 | turn-2 prompt tokens | of them from the prefix cache |",
        "|---|---|---|---|---|---|---|",
    ]
    for path, runs in res["turns"].items():
        med = lambda k: statistics.median(r[k] for r in runs)  # noqa: E731, B023
        ratio = statistics.median(r["ttft2_ms"] / r["ttft1_ms"] for r in runs)
        out.append(
            f"| {NAMES[path]} | {med('input1'):.0f} | {med('ttft1_ms'):.1f} | {med('ttft2_ms'):.1f} | "
            f"{100 * ratio:.1f}% | {med('input2'):.0f} | {med('cached2'):.0f} |"
        )
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    from specd.model import builtin

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", default=str(builtin.builtin_gguf()))
    p.add_argument("--draft", default=str(builtin.draft_path()) if builtin.draft_path() else None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--spec", default="tree", help="the engine's default speculation (serve --spec-mode)")
    p.add_argument("--mode", default="off", help="each request's speculation mode (off | auto | chain | tree)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--concurrency", default="1,8")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--num-blocks", type=int, default=1024)
    p.add_argument("--history-tokens", type=int, default=1000)
    p.add_argument("--turns", type=int, default=3, help="conversations per path for the second-turn figure")
    p.add_argument("--pin", action=argparse.BooleanOptionalAction, default=True, help="serve --cpu-split layout")
    p.add_argument("--control", action=argparse.BooleanOptionalAction, default=True, help="A/A control runs")
    p.add_argument("--stream-interval-ms", type=float, default=None)
    p.add_argument("--out", default=str(ROOT / "eval" / "out" / "bench_http"))
    a = p.parse_args(argv)
    a.concurrency = [int(x) for x in a.concurrency.split(",")]
    if a.repeats < 1 or a.turns < 1:
        p.error("--repeats and --turns must be >= 1")
    res = run(a)
    res["meta"] = H.run_meta(COMMAND, argv)
    text = markdown(a, res)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.md").write_text(text)
    cells = {
        f"{k[0]}@{k[1]}": [
            {x: y for x, y in v.items() if x in ("tps", "ttft_ms")} if isinstance(v, dict) else v for v in vs
        ]
        for k, vs in res["cells"].items()
    }
    report = {"meta": res["meta"], "cells": cells, "turns": res["turns"]}
    (out / "report.json").write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
