"""Abuse over loopback against the real server on the shared stories260K pair: connection churn with
disconnects at random points, slow readers that never read, and overload beyond --max-queue.

Invariants: afterwards no request is left in the engine, both KV caches hold zero blocks
(``engine.kv_blocks_used() == (0, 0)``), no websocket connection and no asyncio task is left behind on
the server's loop; other clients keep getting complete streams; refusals are immediate ``overloaded``
errors and service resumes once the load drops.
"""

from __future__ import annotations

import asyncio
import os
import random
import socket
import time

import orjson
import pytest
from conftest import serve_args, serve_engine
from websockets.asyncio.client import connect as aconnect
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

pytestmark = pytest.mark.timeout(300)

PROMPTS = ["Once upon a time", "The little dog", "Lily and Tom went to the park", "One day, a bird"]
CYCLES = int(os.environ.get("SPECD_ABUSE_CYCLES", "1000"))
CONCURRENCY = 20


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_args(**kw):
    return serve_args(num_blocks=1024, log_level="error", **kw)


@pytest.fixture(scope="module")
def engine(shared_pair):
    return serve_engine(shared_pair, num_blocks=1024, log_level="error")


@pytest.fixture
def make_server(engine):
    from specd.serving.app import ServerThread

    started = []

    def start(**kw):
        srv = ServerThread(make_args(**kw), engine).start()
        started.append(srv)
        return srv

    yield start
    for srv in started:
        srv.stop()


def n_tasks(srv) -> int:
    """asyncio tasks alive on the server loop (including the one ``call`` uses to ask)."""
    return srv.call(lambda: len(asyncio.all_tasks()))


def wait_clean(srv, tasks_before: int, timeout: float = 30.0) -> dict:
    """Wait until the server holds nothing: returns what is left when the time runs out."""
    eng = srv.app.ae.engine
    end = time.monotonic() + timeout
    while True:
        left = {
            "engine_work": eng.has_work(),
            "requests": srv.app.ae.num_requests,
            "kv_blocks": eng.kv_blocks_used(),
            "connections": srv.call(lambda: len(srv.app.ws.conns)),
            "extra_tasks": n_tasks(srv) - tasks_before,
        }
        if (
            not left["engine_work"]
            and left["requests"] == 0
            and left["kv_blocks"] == (0, 0)
            and left["connections"] == 0
            and left["extra_tasks"] <= 0
        ):
            return {}
        if time.monotonic() > end:
            return left
        time.sleep(0.05)


def gen(rid, prompt, max_tokens, **kw) -> str:
    return orjson.dumps(
        {"type": "generate", "id": rid, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, **kw}
    ).decode()


# churn -------------------------------------------------------------------------------------------
async def _cycle(port: int, rng: random.Random, stats: dict) -> None:
    """One connect / generate / disconnect-at-a-random-point cycle."""
    action = rng.randrange(9)
    stats[action] = stats.get(action, 0) + 1
    if action == 0:  # TCP connect, then close before (or during) the handshake
        r, w = await asyncio.open_connection("127.0.0.1", port)
        if rng.random() < 0.5:
            w.write(b"GET /ws HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\n")
        w.transport.abort() if rng.random() < 0.5 else w.close()
        return
    ws = await aconnect(f"ws://127.0.0.1:{port}/ws", compression=None, open_timeout=30, close_timeout=2)
    try:
        n_req = 1 if action < 7 else rng.randint(2, 4)
        ids = [f"c{k}" for k in range(n_req)]
        if action >= 1:
            for rid in ids:
                await ws.send(
                    gen(
                        rid,
                        rng.choice(PROMPTS),
                        rng.randint(1, 12),
                        ignore_eos=rng.random() < 0.5,
                        speculation={"mode": rng.choice(["off", "chain", "tree", "auto"])},
                    )
                )
        if action in (1, 2):  # close (or drop) right after sending
            if action == 2:
                ws.transport.abort()
            return
        if action in (3, 4):  # after the first frame: close, or drop the TCP connection
            await asyncio.wait_for(ws.recv(), 30)
            if action == 4:
                ws.transport.abort()
            return
        if action in (5, 6):  # read the whole stream, check it, then close
            deltas = []
            while True:
                m = orjson.loads(await asyncio.wait_for(ws.recv(), 30))
                if m["type"] == "delta":
                    assert m["seq"] == len(deltas)
                    deltas.append(m)
                    if action == 6 and len(deltas) == 1:
                        await ws.send(orjson.dumps({"type": "cancel", "id": ids[0]}).decode())
                    continue
                assert m["type"] == "done", m
                assert m["usage"]["completion_tokens"] == sum(len(d["token_ids"]) for d in deltas)
                stats["done"] = stats.get("done", 0) + 1
                return
        # several requests: cancel some, read a random number of frames, then leave
        for rid in ids[: rng.randint(0, n_req)]:
            await ws.send(orjson.dumps({"type": "cancel", "id": rid}).decode())
        open_ids = set(ids)
        for _ in range(rng.randint(0, 6)):
            if not open_ids:
                break
            m = orjson.loads(await asyncio.wait_for(ws.recv(), 30))
            if m["type"] != "delta":
                open_ids.discard(m["id"])
        if action == 8:
            ws.transport.abort()
    except ConnectionClosed:
        pass
    finally:
        await ws.close()


async def _churn(port: int, cycles: int, concurrency: int, seed: int) -> dict:
    rng = random.Random(seed)
    stats: dict = {}
    sem = asyncio.Semaphore(concurrency)

    async def one(k):
        async with sem:
            await _cycle(port, random.Random(rng.random() + k), stats)

    await asyncio.gather(*(one(k) for k in range(cycles)))
    return stats


def _run_churn(make_server, engine, cycles):
    srv = make_server()
    tasks_before = n_tasks(srv)
    t0 = time.monotonic()
    stats = asyncio.run(_churn(srv.port, cycles, CONCURRENCY, seed=1234))
    dt = time.monotonic() - t0
    assert sum(v for k, v in stats.items() if isinstance(k, int)) == cycles
    left = wait_clean(srv, tasks_before)
    assert left == {}, f"left behind after {cycles} cycles: {left}"
    assert stats.get("done", 0) > 0
    # still serving
    with connect(f"ws://127.0.0.1:{srv.port}/ws") as ws:
        ws.send(gen("after", PROMPTS[0], 8))
        m = orjson.loads(ws.recv(timeout=30))
        while m["type"] == "delta":
            m = orjson.loads(ws.recv(timeout=30))
        assert m["type"] == "done" and m["finish_reason"] == "length"
    assert wait_clean(srv, tasks_before) == {}
    print(f"{cycles} cycles in {dt:.1f} s: {stats}")


def test_connect_generate_disconnect_cycles(make_server, engine):
    _run_churn(make_server, engine, CYCLES)


@pytest.mark.slow
def test_connect_generate_disconnect_cycles_long(make_server, engine):
    _run_churn(make_server, engine, 10 * CYCLES)


# slow readers ------------------------------------------------------------------------------------
def _raw_client(port: int, rcvbuf: int = 2048) -> socket.socket:
    """A websocket client on a raw socket with a tiny receive buffer, which will never read again."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.settimeout(10)
    s.connect(("127.0.0.1", port))
    s.sendall(
        b"GET /ws HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
    )
    buf = b""
    while b"\r\n\r\n" not in buf:
        buf += s.recv(1)  # byte by byte: leave nothing of the first frames consumed
    assert buf.startswith(b"HTTP/1.1 101"), buf
    return s


def _ws_text_frame(text: str) -> bytes:
    """A masked client text frame (mask 0: payload unchanged)."""
    data = text.encode()
    n = len(data)
    hdr = bytes([0x81]) + (bytes([0x80 | n]) if n < 126 else bytes([0x80 | 126]) + n.to_bytes(2, "big"))
    return hdr + b"\0\0\0\0" + data


def _ws_transports(srv) -> dict:
    """Client port -> the server's transport of each open websocket (uvicorn's connections)."""
    return {c.client[1]: c.transport for c in srv.app.http.connections if c.client and hasattr(c, "conn")}


def _shrink_sndbuf(srv, client_port: int, size: int = 4096) -> int:
    n = 0
    for port, transport in _ws_transports(srv).items():
        if port == client_port:
            transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, size)
            n += 1
    return n


def _timed_stream(port, rid, max_tokens) -> tuple:
    t0 = time.monotonic()
    with connect(f"ws://127.0.0.1:{port}/ws") as ws:
        ws.send(gen(rid, PROMPTS[0], max_tokens, ignore_eos=True, speculation={"mode": "off"}))
        toks = 0
        while True:
            m = orjson.loads(ws.recv(timeout=120))
            if m["type"] == "delta":
                toks += len(m["token_ids"])
            else:
                break
    return time.monotonic() - t0, toks, m


def test_slow_readers_do_not_stall_others(make_server, engine):
    srv = make_server()
    tasks_before = n_tasks(srv)
    base, toks, m = _timed_stream(srv.port, "base", 64)
    assert toks == 64 and m["finish_reason"] == "length"
    slow = []
    try:
        for _ in range(4):
            s = _raw_client(srv.port)
            # a slow link: shrink the server side's send buffer too (loopback buffers are megabytes)
            end = time.monotonic() + 10  # the server registers the connection just after the 101
            while srv.call(lambda s=s: _shrink_sndbuf(srv, s.getsockname()[1])) != 1:
                assert time.monotonic() < end, "the slow reader's connection never showed up"
                time.sleep(0.02)
            for j in range(12):
                s.sendall(
                    _ws_text_frame(gen(f"s{j}", PROMPTS[j % 4], 400, ignore_eos=True, speculation={"mode": "off"}))
                )
            slow.append(s)
        # wait until the server is really blocked on them: bytes queued in the writers' buffers
        end = time.monotonic() + 60
        blocked = 0
        while time.monotonic() < end:
            blocked = srv.call(lambda: sum(1 for t in _ws_transports(srv).values() if t.get_write_buffer_size() > 0))
            if blocked == len(slow):
                break
            time.sleep(0.1)
        assert blocked == len(slow), f"only {blocked} slow readers back-pressured the server"
        # a normal client still gets its full stream, promptly
        t, toks, m = _timed_stream(srv.port, "normal", 64)
        assert toks == 64 and m["type"] == "done" and m["finish_reason"] == "length", m
        assert t < max(20 * base, 15.0), f"normal client took {t:.2f} s next to slow readers (alone: {base:.2f} s)"
        print(f"64-token stream: {base:.2f} s alone, {t:.2f} s next to {len(slow)} blocked slow readers")
        # the engine keeps stepping (it never waits for a socket)
        steps = engine.num_steps
        time.sleep(0.5)
        assert engine.num_steps > steps or not engine.has_work()
    finally:
        for s in slow:
            s.close()
    assert wait_clean(srv, tasks_before, timeout=60) == {}


@pytest.mark.slow
def test_reader_that_never_reads_is_dropped_by_keepalive(make_server, engine):
    """The server pings every 20 s and drops a client that does not answer within 20 s."""
    srv = make_server()
    tasks_before = n_tasks(srv)
    s = _raw_client(srv.port)
    try:
        for j in range(12):
            s.sendall(_ws_text_frame(gen(f"s{j}", PROMPTS[0], 400, ignore_eos=True)))
        end = time.monotonic() + 90
        while srv.call(lambda: len(srv.app.ws.conns)) and time.monotonic() < end:
            time.sleep(0.5)
        assert srv.call(lambda: len(srv.app.ws.conns)) == 0, "a client that never reads was not dropped"
        assert wait_clean(srv, tasks_before) == {}
    finally:
        s.close()


# overload ----------------------------------------------------------------------------------------
def _grpc_generate_status(port: int):
    import grpc

    from specd.serving.proto.specd.v1 import specd_pb2 as pb

    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        call = ch.unary_stream(
            "/specd.v1.Specd/Generate",
            request_serializer=pb.GenerateRequest.SerializeToString,
            response_deserializer=pb.GenerateResponse.FromString,
        )
        try:
            list(call(pb.GenerateRequest(id="g", prompt="Hi", max_tokens=4), timeout=30))
            return grpc.StatusCode.OK
        except grpc.RpcError as e:
            return e.code()


def test_overload_refused_at_once_and_service_resumes(make_server, engine):
    import grpc

    grpc_port = _free_port()
    srv = make_server(max_queue=6, grpc_port=grpc_port)
    tasks_before = n_tasks(srv)

    async def flood():
        conns = [await aconnect(f"ws://127.0.0.1:{srv.port}/ws", compression=None) for _ in range(5)]
        sent = {}
        results = {}  # (conn, id) -> [first frame kind, seconds from send to first frame, got done]

        async def reader(k, ws):
            try:
                async for raw in ws:
                    m = orjson.loads(raw)
                    key = (k, m["id"])
                    if key not in results:
                        kind = "admitted" if m["type"] == "delta" else m.get("code", m["type"])
                        results[key] = [kind, time.monotonic() - sent[key], False]
                    if m["type"] == "done":
                        results[key][2] = True
            except ConnectionClosed:
                pass

        readers = [asyncio.create_task(reader(k, ws)) for k, ws in enumerate(conns)]
        for j in range(6):
            for k, ws in enumerate(conns):
                sent[(k, f"o{j}")] = time.monotonic()
                await ws.send(gen(f"o{j}", PROMPTS[j % 4], 300, ignore_eos=True, speculation={"mode": "off"}))
        end = time.monotonic() + 60
        while len(results) < len(sent) and time.monotonic() < end:
            await asyncio.sleep(0.02)
        snapshot = {k: tuple(v[:2]) for k, v in results.items()}
        # gRPC is refused the same way while the queue is full
        loop = asyncio.get_running_loop()
        grpc_code = await loop.run_in_executor(None, _grpc_generate_status, grpc_port)
        # load drops: cancel everything admitted, wait for their done frames
        for (k, rid), v in snapshot.items():
            if v[0] == "admitted":
                await conns[k].send(orjson.dumps({"type": "cancel", "id": rid}).decode())
        end = time.monotonic() + 60
        while not all(v[2] for v in results.values() if v[0] == "admitted") and time.monotonic() < end:
            await asyncio.sleep(0.02)
        for ws in conns:
            await ws.close()
        await asyncio.wait_for(asyncio.gather(*readers), 30)
        return snapshot, results, grpc_code

    # steps slowed down while the queue is full, so the admitted requests are still running when
    # gRPC is tried (a fast engine could finish all 6 x 300 tokens first)
    engine.step_hook = lambda e: time.sleep(0.004)
    try:
        snapshot, results, grpc_code = asyncio.run(flood())
    finally:
        engine.step_hook = None
    kinds = [v[0] for v in snapshot.values()]
    assert len(snapshot) == 30, snapshot
    assert kinds.count("admitted") == 6 and kinds.count("overloaded") == 24, sorted(kinds)
    slowest_refusal = max(v[1] for v in snapshot.values() if v[0] == "overloaded")
    assert slowest_refusal < 2.0, f"an overloaded refusal took {slowest_refusal:.2f} s"
    assert grpc_code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert all(v[2] for v in results.values() if v[0] == "admitted")  # each admitted one got its done
    assert wait_clean(srv, tasks_before) == {}
    # service resumes: a full queue's worth of requests is admitted and completes
    with connect(f"ws://127.0.0.1:{srv.port}/ws") as ws:
        for j in range(6):
            ws.send(gen(f"r{j}", PROMPTS[j % 4], 8, ignore_eos=True))
        done = set()
        while len(done) < 6:
            m = orjson.loads(ws.recv(timeout=60))
            assert m["type"] in ("delta", "done"), m
            if m["type"] == "done":
                assert m["finish_reason"] == "length"
                done.add(m["id"])
    assert wait_clean(srv, tasks_before) == {}


# keys --------------------------------------------------------------------------------------------
def test_api_key_enforced_on_every_surface(make_server, engine):
    """With --api-key, nothing but the health routes answers without the key: websocket (header or
    `auth`), /metrics and gRPC Generate."""
    import urllib.error
    import urllib.request

    import grpc
    from websockets.exceptions import InvalidStatus

    from specd.serving.proto.specd.v1 import specd_pb2 as pb

    key = "s3cret-key"
    grpc_port = _free_port()
    srv = make_server(api_key=key, grpc_port=grpc_port)
    tasks_before = n_tasks(srv)

    def http(path, headers=None):
        req = urllib.request.Request(f"http://127.0.0.1:{srv.port}{path}", headers=headers or {})
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code

    assert http("/healthz") == 200 and http("/readyz") == 200
    assert http("/metrics") == 401 and http("/metrics", {"Authorization": "Bearer nope"}) == 401
    assert http("/metrics", {"Authorization": f"Bearer {key}"}) == 200
    with pytest.raises(InvalidStatus) as ei:
        connect(f"ws://127.0.0.1:{srv.port}/ws", additional_headers={"Authorization": "Bearer nope"}).__enter__()
    assert ei.value.response.status_code == 401
    with connect(f"ws://127.0.0.1:{srv.port}/ws") as ws:  # no header: every message but auth is refused
        ws.send(gen("x", PROMPTS[0], 4))
        m = orjson.loads(ws.recv(timeout=10))
        assert (m["type"], m.get("id"), m["code"]) == ("error", "x", "unauthorized")
        ws.send(orjson.dumps({"type": "auth", "key": key}).decode())
        assert orjson.loads(ws.recv(timeout=10)) == {"type": "auth_ok"}
        ws.send(gen("y", PROMPTS[0], 4))
        m = orjson.loads(ws.recv(timeout=30))
        while m["type"] == "delta":
            m = orjson.loads(ws.recv(timeout=30))
        assert m["type"] == "done" and m["finish_reason"] == "length"
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as ch:
        call = ch.unary_stream(
            "/specd.v1.Specd/Generate",
            request_serializer=pb.GenerateRequest.SerializeToString,
            response_deserializer=pb.GenerateResponse.FromString,
        )
        req = pb.GenerateRequest(id="g", prompt="Hi", max_tokens=4)
        for md in (None, (("authorization", "Bearer nope"),)):
            with pytest.raises(grpc.RpcError) as ei:
                list(call(req, timeout=30, metadata=md))
            assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
        out = list(call(req, timeout=30, metadata=(("authorization", f"Bearer {key}"),)))
        assert out[-1].WhichOneof("event") == "done"
    assert wait_clean(srv, tasks_before) == {}


# hostile constraints -----------------------------------------------------------------------------
def _nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def _rf(schema) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}


def _tool(name: str, params) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": params}}


RECURSIVE = {  # a list that nests through $ref: legal, compiled; max_tokens bounds the reply
    "$defs": {"n": {"type": "object", "properties": {"n": {"type": "array", "items": {"$ref": "#/$defs/n"}}}}},
    "$ref": "#/$defs/n",
}
HOSTILE = [  # (fields, the refusal's code; None: accepted, the reply then valid under the grammar)
    (_rf(_nested(100)), "grammar_too_large"),
    (_rf({"enum": list(range(100_000))}), "grammar_too_large"),
    (_rf({"type": "object", "properties": {"a": {"type": "quaternion"}}}), "invalid_schema"),
    (_rf({"type": ["object"], "minProperties": 3, "maxProperties": 1}), "invalid_schema"),
    (_rf({"type": "integer", "minimum": 5, "maximum": 1}), "unsatisfiable_schema"),
    (_rf({"allOf": [{"type": "string"}, {"type": "integer"}]}), "unsatisfiable_schema"),
    (_rf({"type": "string", "pattern": "a{1,2}(("}), "invalid_schema"),
    (_rf(RECURSIVE), None),
    ({"tools": [_tool(f"f{i}", {"type": "object"}) for i in range(2000)]}, "grammar_too_large"),
    (
        {"tools": [_tool("f", {"type": "object"})], "tool_choice": {"type": "function", "function": {"name": "g"}}},
        "invalid_tools",
    ),
    ({"tools": [_tool("f", {"type": "object"})], "tool_choice": "sometimes"}, "invalid_tools"),
    (
        {"tools": [_tool("f", {"type": "object", "properties": {"x": {"type": "nope"}}})], "tool_choice": "required"},
        "invalid_tools",
    ),
    ({"tools": [_tool("f", _nested(100))]}, "grammar_too_large"),
    ({"tools": [_tool("f", {}), _tool("f", {})]}, "invalid_tools"),
    ({"structured_outputs": {"choice": [str(i) for i in range(5000)]}}, "grammar_too_large"),
    ({"guided_grammar": "root ::= root"}, "unsatisfiable_schema"),
]


def test_hostile_constraints_are_refused_at_once_and_others_keep_streaming(make_server, engine):
    """Deep nesting, a 100k-entry enum, invalid types, unsatisfiable schemas, a huge tool list, wrong
    tool_choice names: each a 400 naming the problem within a few seconds, over HTTP and the websocket,
    while a long stream on another connection goes on undisturbed; health stays green and no KV block
    is held after."""
    import urllib.error
    import urllib.request

    # (the reference before the server: its loop thread steps the engine whenever it has work, a request
    # generate() added included, and two threads stepping one engine corrupt both requests)
    ref = engine.generate([engine.tokenizer(PROMPTS[2])["input_ids"]], *_canary_params())[0].output_ids
    srv = make_server(max_message_bytes=4 << 20)
    tasks_before = n_tasks(srv)
    with connect(f"ws://127.0.0.1:{srv.port}/ws") as canary, connect(f"ws://127.0.0.1:{srv.port}/ws") as ws:
        canary.send(gen("long", PROMPTS[2], 200, ignore_eos=True))
        for i, (fields, code) in enumerate(HOSTILE):
            body = {
                "model": srv.app.front.model_name,
                "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 40,
            }
            req = urllib.request.Request(
                f"http://127.0.0.1:{srv.port}/v1/chat/completions",
                orjson.dumps({**body, **fields}),
                {"Content-Type": "application/json"},
            )
            t0 = time.monotonic()
            try:
                with urllib.request.urlopen(req, timeout=60) as r:
                    status, got = r.status, orjson.loads(r.read())
            except urllib.error.HTTPError as e:
                status, got = e.code, orjson.loads(e.read())
            took = time.monotonic() - t0
            if code is None:
                assert status == 200 and got["choices"][0]["message"]["content"].startswith("{"), got
            else:
                assert (status, got["error"]["code"]) == (400, code), (i, status, got)
                assert got["error"]["param"] and got["error"]["message"]
                assert took < 12.0, f"refusal {i} took {took:.1f} s"
                ws.send(
                    orjson.dumps(
                        {"type": "generate", "id": f"h{i}", "prompt": "Hi", "max_tokens": 4, **fields}
                    ).decode()
                )
                m = orjson.loads(ws.recv(timeout=60))
                assert (m["type"], m["id"], m["code"]) == ("error", f"h{i}", code), m
            assert srv.app.ae.healthy()
        deltas, done = _collect(canary, "long")
    assert done["finish_reason"] == "length" and [t for d in deltas for t in d["token_ids"]] == ref
    assert wait_clean(srv, tasks_before) == {}
    assert srv.app.ae.healthy()


def _canary_params() -> tuple:
    from specd.engine.sequence import SpecParams
    from specd.sampling.params import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True), SpecParams()


def _collect(ws, rid) -> tuple:
    deltas = []
    while True:
        m = orjson.loads(ws.recv(timeout=120))
        if m.get("id") != rid:
            continue
        if m["type"] != "delta":
            return deltas, m
        deltas.append(m)
