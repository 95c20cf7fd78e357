"""Clients that go away mid-stream, on every surface (SSE chat / completions / responses, a JSON request
waiting for its answer, specd's websocket, the Responses WebSocket): each cancels its request within
one engine step of the server seeing the disconnect, and after hundreds of random ones the engine
holds no request and zero KV blocks, and the server no connection and no stray task."""

from __future__ import annotations

import asyncio
import os
import random
import time

import orjson
import pytest
from conftest import serve_args, serve_engine
from websockets.asyncio.client import connect as aconnect

pytestmark = pytest.mark.timeout(300)

MODEL = "stories260K"
PROMPTS = ["Once upon a time", "The little dog", "Lily and Tom went to the park", "One day, a bird"]
CYCLES = int(os.environ.get("SPECD_DISCONNECT_CYCLES", "200"))


@pytest.fixture(scope="module")
def engine(shared_pair):
    return serve_engine(shared_pair, num_blocks=1024, log_level="error")


@pytest.fixture
def server(engine):
    from specd.serving.app import ServerThread

    srv = ServerThread(serve_args(num_blocks=1024, log_level="error", max_queue=512), engine).start()
    yield srv
    engine.step_hook = None
    srv.stop()


def _left(srv, tasks_before: int) -> dict:
    eng, ae = srv.app.ae.engine, srv.app.ae
    left = {
        "engine_work": eng.has_work(),
        "requests": ae.num_requests,
        "kv_blocks": eng.kv_blocks_used(),
        "websockets": srv.call(lambda: srv.app.front.open_websockets),
        "connections": srv.call(lambda: len(srv.app.http.connections)),
        "extra_tasks": srv.call(lambda: len(asyncio.all_tasks())) - tasks_before,
    }
    ok = not left["engine_work"] and left["requests"] == 0 and left["kv_blocks"] == (0, 0)
    return {} if ok and left["websockets"] == 0 and left["connections"] == 0 and left["extra_tasks"] <= 0 else left


def wait_clean(srv, tasks_before: int, timeout: float = 30.0) -> dict:
    end = time.monotonic() + timeout
    while (left := _left(srv, tasks_before)) and time.monotonic() < end:
        time.sleep(0.05)
    return left


def _body(path: str, rng: random.Random, stream: bool) -> bytes:
    common = {"model": MODEL, "temperature": rng.choice([0, 0.8]), "ignore_eos": True, "stream": stream}
    common["speculation"] = {"mode": rng.choice(["off", "chain", "tree", "auto"])}
    n = rng.randint(20, 200)
    p = rng.choice(PROMPTS)
    if path == "/v1/chat/completions":
        return orjson.dumps({**common, "messages": [{"role": "user", "content": p}], "max_tokens": n})
    if path == "/v1/completions":
        return orjson.dumps({**common, "prompt": p, "max_tokens": n})
    return orjson.dumps({**common, "input": p, "max_output_tokens": n})


async def _http_cycle(port: int, rng: random.Random) -> str:
    """POST, read a random number of bytes of the answer (maybe none), then drop or close."""
    path = rng.choice(["/v1/chat/completions", "/v1/completions", "/v1/responses"])
    stream = rng.random() < 0.75
    body = _body(path, rng, stream)
    r, w = await asyncio.open_connection("127.0.0.1", port)
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    w.write(head.encode() + body)
    await w.drain()
    want = rng.choice([0, 1, 200, 2000])
    got = b""
    while len(got) < want:
        chunk = await asyncio.wait_for(r.read(want - len(got)), 30)
        if not chunk:
            break
        got += chunk
    if want == 0:
        await asyncio.sleep(rng.random() * 0.02)
    w.transport.abort() if rng.random() < 0.5 else w.close()
    return "http"


async def _ws_cycle(port: int, rng: random.Random) -> str:
    """specd's websocket or the Responses WebSocket: start, read some frames, drop or close."""
    responses = rng.random() < 0.5
    ws = await aconnect(f"ws://127.0.0.1:{port}/{'v1/responses' if responses else 'ws'}", compression=None)
    p, n = rng.choice(PROMPTS), rng.randint(20, 200)
    if responses:
        msg = {"type": "response.create", "model": MODEL, "input": p, "max_output_tokens": n, "ignore_eos": True}
    else:
        msg = {"type": "generate", "id": "d", "prompt": p, "max_tokens": n, "ignore_eos": True}
    await ws.send(orjson.dumps(msg).decode())
    for _ in range(rng.randint(0, 4)):
        await asyncio.wait_for(ws.recv(), 30)
    ws.transport.abort() if rng.random() < 0.5 else await ws.close()
    return "responses_ws" if responses else "ws"


async def _churn(port: int, cycles: int, seed: int) -> dict:
    rng = random.Random(seed)
    sem = asyncio.Semaphore(16)
    stats: dict = {}

    async def one(k):
        async with sem:
            r = random.Random(rng.random() + k)
            kind = await (_http_cycle(port, r) if r.random() < 0.6 else _ws_cycle(port, r))
            stats[kind] = stats.get(kind, 0) + 1

    await asyncio.gather(*(one(k) for k in range(cycles)))
    return stats


def test_random_mid_stream_disconnects_leak_nothing(server, engine):
    tasks_before = server.call(lambda: len(asyncio.all_tasks()))
    stats = asyncio.run(_churn(server.port, CYCLES, seed=17))
    assert sum(stats.values()) == CYCLES and min(stats.values()) > 0, stats
    assert wait_clean(server, tasks_before) == {}
    cancelled = server.app.metrics.finished.get("cancelled", 0)
    assert cancelled >= CYCLES // 4, server.app.metrics.finished  # (most were cut short, not finished)


@pytest.mark.slow
def test_random_mid_stream_disconnects_leak_nothing_long(server, engine):
    tasks_before = server.call(lambda: len(asyncio.all_tasks()))
    asyncio.run(_churn(server.port, 10 * CYCLES, seed=18))
    assert wait_clean(server, tasks_before) == {}


# within one engine step -------------------------------------------------------------------------------
class _Steps:
    """Per request: the monotonic times of its token-bearing outputs, and of its end (listener)."""

    def __init__(self):
        self.tokens: dict = {}
        self.ended: dict = {}

    def __call__(self, outs, dt):
        now = time.monotonic()
        for o in outs:
            if o.token_ids:
                self.tokens.setdefault(o.request_id, []).append(now)
            if o.finished:
                self.ended[o.request_id] = (now, o.finish_reason)


async def _sse_first_then_drop(port: int, path: str) -> tuple:
    """(request id, monotonic time of the drop) after the first event with an id."""
    body = _body(path, random.Random(1), True)
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    rid = None
    while True:
        line = await asyncio.wait_for(r.readline(), 30)
        assert line, "the stream ended before its first token"
        if line.startswith(b"data: "):
            m = orjson.loads(line[6:])
            rid = rid or m.get("id") or (m.get("response") or {}).get("id")
            if rid and (m.get("choices") or m.get("type") == "response.output_text.delta"):
                break
    w.transport.abort()
    return rid, time.monotonic()


async def _ws_first_then_drop(port: int, responses: bool) -> tuple:
    ws = await aconnect(f"ws://127.0.0.1:{port}/{'v1/responses' if responses else 'ws'}", compression=None)
    if responses:
        msg = {
            "type": "response.create",
            "model": MODEL,
            "input": PROMPTS[0],
            "max_output_tokens": 300,
            "ignore_eos": True,
        }
    else:
        msg = {"type": "generate", "id": "w", "prompt": PROMPTS[0], "max_tokens": 300, "ignore_eos": True}
    await ws.send(orjson.dumps(msg).decode())
    rid = None
    while True:
        m = orjson.loads(await asyncio.wait_for(ws.recv(), 30))
        rid = rid or (m.get("response") or {}).get("id")
        if m["type"] in ("delta", "response.output_text.delta"):
            break
    ws.transport.abort()
    return rid or ":w", time.monotonic()


@pytest.mark.parametrize("surface", ["chat_sse", "responses_sse", "ws", "responses_ws"])
def test_a_disconnect_cancels_within_one_engine_step(server, engine, surface):
    steps = _Steps()
    server.call(lambda: server.app.ae.listeners.append(steps))
    engine.step_hook = lambda e: time.sleep(0.02)  # 20 ms steps: each step's output is its own
    try:
        if surface.endswith("_sse"):
            path = "/v1/chat/completions" if surface == "chat_sse" else "/v1/responses"
            rid, t_drop = asyncio.run(_sse_first_then_drop(server.port, path))
        else:
            rid, t_drop = asyncio.run(_ws_first_then_drop(server.port, surface == "responses_ws"))
        end = time.monotonic() + 10
        while not any(k.endswith(rid) for k in steps.ended) and time.monotonic() < end:
            time.sleep(0.01)
    finally:
        engine.step_hook = None
        server.call(lambda: server.app.ae.listeners.remove(steps))
    key = next(k for k in steps.ended if k.endswith(rid))
    t_end, reason = steps.ended[key]
    late = [t for t in steps.tokens.get(key, []) if t > t_drop]
    assert reason == "cancelled" and len(late) <= 1, (surface, reason, len(late))  # (the step in flight)
    assert t_end - t_drop < 0.2, t_end - t_drop
    assert wait_clean(server, server.call(lambda: len(asyncio.all_tasks()))) == {}
