"""The serving surface over loopback: websocket streaming, HTTP routes, limits, auth, cancellation,
drain. One in-process server (background thread) on the shared stories260K pair; the engine is shared
by the servers started here (one at a time), and reference outputs come from the same engine in
process before the server owns it."""

from __future__ import annotations

import asyncio
import math
import socket
import time
import urllib.error
import urllib.request

import orjson
import pytest
from conftest import serve_args, serve_engine, ws_collect
from websockets.asyncio.client import connect as aconnect
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect

pytestmark = pytest.mark.timeout(120)

PROMPTS = ["Once upon a time", "The little dog", "Lily and Tom went to the park"]
MODES = ["off", "chain", "tree", "auto"]
N_TOK = 24


def make_args(**kw):
    return serve_args(num_blocks=512, log_level="warning", **kw)


@pytest.fixture(scope="module")
def engine(shared_pair):
    return serve_engine(shared_pair, num_blocks=512, log_level="warning")


@pytest.fixture(scope="module")
def reference(engine):
    """(prompt, mode) -> (output ids, text) from in-process Engine.generate (greedy)."""
    from specd.engine.sequence import SpecParams
    from specd.sampling.params import SamplingParams

    ref = {}
    for p in PROMPTS:
        ids = engine.tokenizer(p)["input_ids"]
        for mode in MODES:
            seq = engine.generate([ids], SamplingParams(temperature=0.0, max_tokens=N_TOK), SpecParams(mode=mode))[0]
            ref[p, mode] = (seq.output_ids, engine.output_text(seq), seq.finish_reason)
    return ref


@pytest.fixture
def make_server(engine, reference):
    """Start in-process servers on the shared engine (one at a time; stopped after the test)."""
    from specd.serving.app import ServerThread

    started = []

    def start(**kw):
        kw.setdefault("max_message_bytes", 4096)
        srv = ServerThread(make_args(**kw), engine).start()
        started.append(srv)
        return srv

    yield start
    engine.step_hook = None
    for srv in started:
        srv.stop()


@pytest.fixture
def server(make_server):
    return make_server()


def url(srv, path="/ws"):
    return f"ws://127.0.0.1:{srv.port}{path}"


def http_get(srv, path, headers=None):
    req = urllib.request.Request(f"http://127.0.0.1:{srv.port}{path}", headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read(), r.headers  # (names are case-insensitive)
    except urllib.error.HTTPError as e:
        return e.code, e.read(), e.headers


def send(ws, **msg):
    ws.send(orjson.dumps(msg).decode())


def recv(ws, timeout=30.0):
    return orjson.loads(ws.recv(timeout=timeout))


collect = ws_collect


def wait_idle(engine, srv, timeout=20.0):
    """Until the engine has no requests and both caches hold zero blocks."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if not engine.has_work() and srv.app.ae.num_requests == 0 and engine.kv_blocks_used() == (0, 0):
            return True
        time.sleep(0.02)
    return False


# streaming ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_stream_equals_in_process_greedy(server, reference, mode):
    p = PROMPTS[0]
    with connect(url(server)) as ws:
        send(ws, type="generate", id="r1", prompt=p, max_tokens=N_TOK, temperature=0, speculation={"mode": mode})
        deltas, done = collect(ws, "r1")
    ids, text, reason = reference[p, mode]
    assert done["type"] == "done", done
    assert [d["seq"] for d in deltas] == list(range(len(deltas)))
    assert [t for d in deltas for t in d["token_ids"]] == ids
    assert "".join(d["text"] for d in deltas) == text
    assert done["finish_reason"] == reason
    assert done["usage"]["completion_tokens"] == len(ids)
    assert set(done["spec"]) == {"steps", "draft_tokens", "accepted_tokens", "mean_accepted_length"}
    assert set(done["timing"]) == {"queue_ms", "ttft_ms", "total_ms"}
    assert 0 <= done["timing"]["queue_ms"] <= done["timing"]["ttft_ms"] <= done["timing"]["total_ms"]
    if mode == "off":
        # one step per token; a delta per step, or fewer when steps outran the loop (merged)
        assert done["spec"]["draft_tokens"] == 0 and done["spec"]["steps"] == len(ids) >= len(deltas)
    if mode in ("chain", "tree"):
        assert done["spec"]["draft_tokens"] > 0 and len(deltas) < len(ids)  # several tokens per message


def test_messages_without_chat_template_are_a_raw_prompt(server, reference):
    """stories260K has no chat template: message contents are joined with newlines into a raw prompt."""
    with connect(url(server)) as ws:
        send(
            ws,
            type="generate",
            id="m",
            messages=[{"role": "user", "content": PROMPTS[1]}],
            max_tokens=N_TOK,
            temperature=0.0,
            speculation={"mode": "tree"},
        )
        deltas, done = collect(ws, "m")
    assert [t for d in deltas for t in d["token_ids"]] == reference[PROMPTS[1], "tree"][0]


def test_sixteen_concurrent_streams(server, engine, reference):
    async def one(ws, rid, prompt, mode, temperature, seed):
        msg = {
            "type": "generate",
            "id": rid,
            "prompt": prompt,
            "max_tokens": N_TOK,
            "temperature": temperature,
            "speculation": {"mode": mode},
        }
        if seed is not None:
            msg["seed"] = seed
        await ws.send(orjson.dumps(msg).decode())

    async def main():
        conns = [await aconnect(url(server), compression=None) for _ in range(4)]
        specs = []
        for i in range(16):
            p, mode = PROMPTS[i % 3], MODES[i % 4]
            greedy = i % 2 == 0
            specs.append((conns[i % 4], f"q{i}", p, mode, 0.0 if greedy else 0.8, None if greedy else i))
        results = {s[1]: {"deltas": [], "done": None} for s in specs}

        async def reader(ws):
            mine = {s[1] for s in specs if s[0] is ws}
            while any(results[r]["done"] is None for r in mine):
                m = orjson.loads(await asyncio.wait_for(ws.recv(), 60))
                r = results[m["id"]]
                if m["type"] == "delta":
                    r["deltas"].append(m)
                else:
                    r["done"] = m

        readers = [asyncio.ensure_future(reader(ws)) for ws in conns]
        await asyncio.gather(*(one(*s) for s in specs))
        await asyncio.gather(*readers)
        for ws in conns:
            await ws.close()
        return specs, results

    specs, results = asyncio.run(main())
    vocab = engine.vocab_size
    for _, rid, p, mode, temp, _ in specs:
        r = results[rid]
        done = r["done"]
        toks = [t for d in r["deltas"] for t in d["token_ids"]]
        assert done["type"] == "done" and done["finish_reason"] in ("stop", "length"), done
        assert done["usage"]["completion_tokens"] == len(toks) <= N_TOK
        assert all(0 <= t < vocab for t in toks)
        if temp == 0.0:
            assert toks == reference[p, mode][0], (rid, mode)
            assert "".join(d["text"] for d in r["deltas"]) == reference[p, mode][1]
    assert wait_idle(engine, server)


# cancellation and disconnects free the KV cache ---------------------------------------------------
def test_cancel_mid_stream_frees_kv(server, engine):
    with connect(url(server)) as ws:
        send(
            ws,
            type="generate",
            id="long",
            prompt=PROMPTS[0],
            max_tokens=400,
            ignore_eos=True,
            temperature=0.0,
            speculation={"mode": "off"},
        )
        first = recv(ws)
        assert first["type"] == "delta"
        send(ws, type="cancel", id="long")
        send(ws, type="cancel", id="never-existed")  # ignored
        deltas, done = collect(ws, "long")
        assert done["type"] == "done" and done["finish_reason"] == "cancelled"
        assert done["usage"]["completion_tokens"] < 400
        assert wait_idle(engine, server)
        # the id is free again and the connection still works
        send(ws, type="generate", id="long", prompt=PROMPTS[0], max_tokens=4, temperature=0.0)
        _, done = collect(ws, "long")
        assert done["finish_reason"] == "length"
    assert wait_idle(engine, server)


def test_disconnect_mid_stream_frees_kv(server, engine):
    ws = connect(url(server)).__enter__()
    for i in range(3):
        send(
            ws,
            type="generate",
            id=f"d{i}",
            prompt=PROMPTS[i],
            max_tokens=400,
            ignore_eos=True,
            temperature=0.7,
            seed=i,
            speculation={"mode": MODES[i]},
        )
    assert recv(ws)["type"] == "delta"
    ws.close()
    assert wait_idle(engine, server)
    with connect(url(server)) as ws2:  # the server is fine
        send(ws2, type="generate", id="after", prompt=PROMPTS[0], max_tokens=4, temperature=0.0)
        assert collect(ws2, "after")[1]["finish_reason"] == "length"


# malformed input -----------------------------------------------------------------------------------
BAD = [
    ("{not json", None, "invalid_json"),
    ("[1, 2]", None, "invalid_json"),
    ('{"type": "generate", "id": "n", "prompt": "x", "temperature": NaN}', None, "invalid_json"),
    ('{"id": "x"}', None, "invalid_request"),
    ('{"type": "nope", "id": "u"}', "u", "unknown_type"),
    ('{"type": "generate", "prompt": "x"}', None, "invalid_request"),
    ('{"type": "generate", "id": 5, "prompt": "x"}', None, "invalid_request"),
    ('{"type": "generate", "id": "a"}', "a", "invalid_request"),
    (
        '{"type": "generate", "id": "a", "prompt": "x", "messages": [{"role": "user", "content": "y"}]}',
        "a",
        "invalid_request",
    ),
    ('{"type": "generate", "id": "a", "prompt": 7}', "a", "invalid_request"),
    ('{"type": "generate", "id": "a", "messages": "hi"}', "a", "invalid_request"),
    ('{"type": "generate", "id": "a", "messages": [{"role": "user"}]}', "a", "invalid_request"),
    ('{"type": "generate", "id": "a", "prompt": "x", "temperature": "hot"}', "a", "invalid_request"),
    ('{"type": "generate", "id": "a", "prompt": "x", "temperature": -1}', "a", "invalid_request"),
    ('{"type": "generate", "id": "a", "prompt": "x", "max_tokens": -3}', "a", "invalid_request"),
    ('{"type": "generate", "id": "a", "prompt": "x", "max_tokens": 2.5}', "a", "invalid_request"),
    ('{"type": "generate", "id": "a", "prompt": "x", "max_tokens": true}', "a", "invalid_request"),
    ('{"type": "generate", "id": "a", "prompt": "x", "top_p": 0}', "a", "invalid_request"),
    ('{"type": "generate", "id": "a", "prompt": "x", "top_k": -5}', "a", "invalid_request"),
    ('{"type": "generate", "id": "a", "prompt": "x", "seed": "s"}', "a", "invalid_request"),
    ('{"type": "generate", "id": "a", "prompt": "x", "stop": 5}', "a", "invalid_request"),
    ('{"type": "generate", "id": "a", "prompt": "x", "stop": [""]}', "a", "invalid_request"),
    ('{"type": "generate", "id": "a", "prompt": "x", "priority": "urgent"}', "a", "invalid_request"),
    ('{"type": "generate", "id": "a", "prompt": "x", "speculation": {"mode": "wide"}}', "a", "invalid_request"),
    ('{"type": "generate", "id": "a", "prompt": "x", "speculation": {"max_draft_tokens": -1}}', "a", "invalid_request"),
    ('{"type": "generate", "id": "a", "prompt": "x", "speculation": "tree"}', "a", "invalid_request"),
    ('{"type": "generate", "id": "a", "prompt": "x", "max_tokens": 100000}', "a", "too_long"),
    ('{"type": "cancel"}', None, "invalid_request"),
]


def test_malformed_messages_get_errors_and_connection_survives(server):
    with connect(url(server)) as ws:
        for frame, rid, code in BAD:
            ws.send(frame)
            m = recv(ws)
            assert m["type"] == "error" and m["code"] == code, (frame, m)
            assert m.get("id") == rid, (frame, m)
            assert isinstance(m["message"], str) and m["message"]
        ws.send(b"\x00binary")
        m = recv(ws)
        assert (m["type"], m["code"]) == ("error", "invalid_request")
        send(ws, type="generate", id="ok", prompt=PROMPTS[0], max_tokens=3, temperature=0.0)
        assert collect(ws, "ok")[1]["type"] == "done"


def test_duplicate_live_id(server):
    with connect(url(server)) as ws:
        send(
            ws,
            type="generate",
            id="dup",
            prompt=PROMPTS[0],
            max_tokens=300,
            ignore_eos=True,
            temperature=0.0,
            speculation={"mode": "off"},
        )
        send(ws, type="generate", id="dup", prompt=PROMPTS[1], max_tokens=3)
        seen_err = None
        while True:
            m = recv(ws)
            if m["type"] == "error":
                seen_err = m
                send(ws, type="cancel", id="dup")
            elif m["type"] == "done":
                break
        assert seen_err is not None and seen_err["code"] == "duplicate_id" and seen_err["id"] == "dup"
        assert m["finish_reason"] == "cancelled"


def test_oversize_frames(server):
    """> --max-message-bytes: error message_too_large, connection usable; > 4x: close 1009."""
    with connect(url(server)) as ws, connect(url(server)) as other:
        send(ws, type="generate", id="big", prompt="x" * 5000, max_tokens=2)
        m = recv(ws)
        assert (m["type"], m["code"]) == ("error", "message_too_large")
        send(ws, type="generate", id="ok", prompt=PROMPTS[0], max_tokens=2, temperature=0.0)
        assert collect(ws, "ok")[1]["type"] == "done"
        ws.send("y" * (4 * 4096 + 70000))
        with pytest.raises(ConnectionClosed) as ei:
            while True:
                ws.recv(timeout=10)
        assert ei.value.rcvd is not None and ei.value.rcvd.code == 1009
        send(other, type="generate", id="ok", prompt=PROMPTS[0], max_tokens=2, temperature=0.0)
        assert collect(other, "ok")[1]["type"] == "done"


# HTTP ---------------------------------------------------------------------------------------------
def test_http_routes(server):
    assert http_get(server, "/healthz")[0] == 200
    assert http_get(server, "/readyz")[:2] == (200, b"ready\n")
    st, body, hdr = http_get(server, "/")
    assert st == 200 and b"<html" in body and hdr["Content-Type"].startswith("text/html")
    assert http_get(server, "/nope")[0] == 404
    # the websocket also upgrades on "/"
    with connect(url(server, "/")) as ws:
        send(ws, type="generate", id="root", prompt=PROMPTS[0], max_tokens=2, temperature=0.0)
        assert collect(ws, "root")[1]["type"] == "done"


def test_metrics_parse(server):
    from prometheus_client.parser import text_string_to_metric_families

    with connect(url(server)) as ws:  # make sure there is some traffic
        send(
            ws, type="generate", id="mx", prompt=PROMPTS[0], max_tokens=8, temperature=0.0, speculation={"mode": "tree"}
        )
        collect(ws, "mx")
        send(ws, type="bogus")
        recv(ws)
    st, body, hdr = http_get(server, "/metrics")
    assert st == 200 and hdr["Content-Type"].startswith("text/plain")
    fams = {f.name: f for f in text_string_to_metric_families(body.decode())}
    for name in (
        "specd_requests_running",
        "specd_requests_waiting",
        "specd_time_to_first_token_seconds",
        "specd_inter_token_latency_seconds",
        "specd_kv_blocks_used",
        "specd_kv_blocks_total",
        "specd_spec_decode_num_drafts",
        "specd_spec_decode_num_draft_tokens",
        "specd_spec_decode_num_accepted_tokens",
        "specd_spec_decode_num_accepted_tokens_per_pos",
        "specd_preemptions",
        "specd_spec_budget",
        "specd_requests",
        "specd_request_errors",
        "specd_prefix_cache_hit_rate",
        "specd_spec_depth",
        "specd_engine_step_errors",
        "specd_engine_healthy",
    ):
        assert name in fams, name
    replica = f"{socket.gethostname()}:{server.port}"
    assert all(s.labels.get("replica") == replica for f in fams.values() for s in f.samples)
    samples = {
        (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "replica"))): s.value
        for f in fams.values()
        for s in f.samples
    }
    assert samples[("specd_kv_blocks_total", (("cache", "target"),))] == 512
    assert samples[("specd_kv_blocks_total", (("cache", "draft"),))] == 512
    assert samples[("specd_time_to_first_token_seconds_count", ())] >= 1
    assert samples[("specd_spec_decode_num_draft_tokens_total", ())] > 0
    assert samples[("specd_requests_total", (("finish_reason", "length"),))] >= 1
    assert samples[("specd_request_errors_total", (("code", "unknown_type"),))] >= 1
    assert ("specd_spec_decode_num_accepted_tokens_per_pos_total", (("position", "0"),)) in samples
    assert ("specd_requests_waiting", (("priority", "batch"),)) in samples  # queue length per class
    assert 0.0 <= samples[("specd_prefix_cache_hit_rate", ())] <= 1.0
    queries, hits = samples[("specd_prefix_cache_queries_total", ())], samples[("specd_prefix_cache_hits_total", ())]
    assert queries > 0 and 0 <= hits <= queries
    assert samples[("specd_prefix_cache_hit_rate", ())] == pytest.approx(hits / queries)
    by = {k[1][0][1]: v for k, v in samples.items() if k[0] == "specd_spec_decode_proposer_draft_tokens_total"}
    assert by and sum(by.values()) == samples[("specd_spec_decode_num_draft_tokens_total", ())]
    assert fams["specd_time_to_first_token_seconds"].type == "histogram"
    for s in fams["specd_inter_token_latency_seconds"].samples:
        assert not math.isnan(s.value)


# limits, auth, origins, failures, drain -------------------------------------------------------------
def test_api_key(make_server):
    s = make_server(api_key="s3cret")
    assert http_get(s, "/healthz")[0] == 200 and http_get(s, "/readyz")[0] == 200
    assert http_get(s, "/metrics")[0] == 401
    assert http_get(s, "/metrics", {"Authorization": "Bearer nope"})[0] == 401
    assert http_get(s, "/metrics", {"Authorization": "Bearer s3cret"})[0] == 200
    with pytest.raises(InvalidStatus) as ei:
        connect(url(s), additional_headers={"Authorization": "Bearer wrong"}).__enter__()
    assert ei.value.response.status_code == 401
    with connect(url(s), additional_headers={"Authorization": "Bearer s3cret"}) as ws:
        send(ws, type="generate", id="h", prompt=PROMPTS[0], max_tokens=2, temperature=0.0)
        assert collect(ws, "h")[1]["type"] == "done"
    with connect(url(s)) as ws:  # browser style: auth message first
        send(ws, type="generate", id="g", prompt=PROMPTS[0], max_tokens=2)
        m = recv(ws)
        assert (m["code"], m["id"]) == ("unauthorized", "g")
        send(ws, type="auth", key="wrong")
        assert recv(ws)["code"] == "unauthorized"
        send(ws, type="auth", key="s3cret")
        assert recv(ws) == {"type": "auth_ok"}
        send(ws, type="generate", id="g", prompt=PROMPTS[0], max_tokens=2, temperature=0.0)
        assert collect(ws, "g")[1]["type"] == "done"
    with connect(url(s)) as ws:  # repeated failures close the connection (1008)
        with pytest.raises(ConnectionClosed) as ei:
            for _ in range(10):
                send(ws, type="auth", key="wrong")
                recv(ws)
        assert ei.value.rcvd.code == 1008


def test_origins_and_max_connections(make_server):
    s = make_server(max_connections=2)
    with pytest.raises(InvalidStatus) as ei:
        connect(url(s), origin="http://evil.example").__enter__()
    assert ei.value.response.status_code == 403
    a = connect(url(s), origin=f"http://127.0.0.1:{s.port}").__enter__()  # same host: allowed
    b = connect(url(s)).__enter__()
    with pytest.raises(InvalidStatus) as ei:
        connect(url(s)).__enter__()
    assert ei.value.response.status_code == 503
    a.close()
    end = time.monotonic() + 5
    while len(s.app.ws.conns) > 1 and time.monotonic() < end:
        time.sleep(0.01)
    with connect(url(s)) as c:
        send(c, type="generate", id="x", prompt=PROMPTS[0], max_tokens=2, temperature=0.0)
        assert collect(c, "x")[1]["type"] == "done"
    b.close()
    s2 = make_server(allowed_origins="https://chat.example.com")
    with connect(url(s2), origin="https://chat.example.com"):
        pass
    with pytest.raises(InvalidStatus):
        connect(url(s2), origin=f"http://127.0.0.1:{s2.port}").__enter__()


def test_overloaded_at_once(make_server, engine):
    s = make_server(max_queue=2)
    with connect(url(s)) as ws:
        for i in range(3):
            send(
                ws,
                type="generate",
                id=f"o{i}",
                prompt=PROMPTS[0],
                max_tokens=300,
                ignore_eos=True,
                temperature=0.0,
                speculation={"mode": "off"},
            )
        m = recv(ws)
        while m["type"] == "delta":
            m = recv(ws)
        assert (m["type"], m["id"], m["code"]) == ("error", "o2", "overloaded")
        for i in range(2):
            send(ws, type="cancel", id=f"o{i}")
        for i in range(2):
            assert collect(ws, f"o{i}")[1]["finish_reason"] == "cancelled"
    assert wait_idle(engine, s)


def test_engine_step_failure_fails_requests_and_recovers(make_server, engine):
    s = make_server()
    calls = {"n": 0}

    def hook(eng):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("simulated kernel failure")

    engine.step_hook = hook
    try:
        with connect(url(s)) as ws:
            send(
                ws,
                type="generate",
                id="f",
                prompt=PROMPTS[0],
                max_tokens=200,
                ignore_eos=True,
                temperature=0.0,
                speculation={"mode": "off"},
            )
            _, done = collect(ws, "f")
            assert done["type"] == "done" and done["finish_reason"] == "error"
            assert done["error"]["code"] == "internal" and "simulated" in done["error"]["message"]
            send(ws, type="generate", id="g", prompt=PROMPTS[0], max_tokens=4, temperature=0.0)
            assert collect(ws, "g")[1]["finish_reason"] == "length"
    finally:
        engine.step_hook = None
    assert wait_idle(engine, s)
    assert s.app.ae.num_step_errors == 1


def test_watchdog_and_healthz_when_a_step_hangs(make_server, engine):
    import threading

    s = make_server()
    s.app.ae.watchdog_timeout_s = 0.3
    release = threading.Event()
    engine.step_hook = lambda eng: release.wait(10)
    try:
        with connect(url(s)) as ws:
            send(ws, type="generate", id="w", prompt=PROMPTS[0], max_tokens=4, temperature=0.0)
            end = time.monotonic() + 5
            while s.app.ae.watchdog_ok() and time.monotonic() < end:
                time.sleep(0.05)
            assert not s.app.ae.watchdog_ok()
            assert http_get(s, "/healthz")[0] == 503
            engine.step_hook = None
            release.set()
            assert collect(ws, "w")[1]["finish_reason"] == "length"
        assert s.app.ae.watchdog_ok() and http_get(s, "/healthz")[0] == 200
    finally:
        engine.step_hook = None
        release.set()


def test_drain_readyz_503_and_shutting_down(make_server, engine):
    s = make_server(drain_timeout=30.0)
    with connect(url(s)) as ws:
        send(
            ws,
            type="generate",
            id="run",
            prompt=PROMPTS[0],
            max_tokens=60,
            ignore_eos=True,
            temperature=0.0,
            speculation={"mode": "off"},
        )
        assert recv(ws)["type"] == "delta"
        fut = __import__("concurrent.futures").futures.ThreadPoolExecutor(1).submit(s.call, s.app.shutdown, 60)
        end = time.monotonic() + 5
        while http_get(s, "/readyz")[0] != 503 and time.monotonic() < end:
            time.sleep(0.01)
        st, body, _ = http_get(s, "/readyz")
        assert (st, body) == (503, b"draining\n")
        for path in ("/ws", "/v1/responses"):  # new websockets are refused: a balancer retries elsewhere
            with pytest.raises(InvalidStatus) as ei:
                connect(url(s, path)).close()
            assert ei.value.response.status_code == 503 and ei.value.response.headers["Retry-After"] == "1"
        send(ws, type="generate", id="late", prompt=PROMPTS[0], max_tokens=2)
        got_err = done = None
        while done is None:
            m = recv(ws)
            if m["type"] == "error":
                got_err = m
            elif m["type"] == "done":
                done = m
        assert got_err is not None and (got_err["id"], got_err["code"]) == ("late", "shutting_down")
        assert done["id"] == "run" and done["finish_reason"] == "length"  # finished, not cancelled
        fut.result(60)
    assert engine.kv_blocks_used() == (0, 0)


def test_drain_deadline_cancels(make_server, engine):
    s = make_server(drain_timeout=0.3)
    with connect(url(s)) as ws:
        send(
            ws,
            type="generate",
            id="slow",
            prompt=PROMPTS[0],
            max_tokens=400,
            ignore_eos=True,
            temperature=0.0,
            speculation={"mode": "off"},
        )
        assert recv(ws)["type"] == "delta"
        engine.step_hook = lambda eng: time.sleep(0.02)
        try:
            fut = __import__("concurrent.futures").futures.ThreadPoolExecutor(1).submit(s.call, s.app.shutdown, 60)
            _, done = collect(ws, "slow")
            assert done["finish_reason"] == "cancelled"
            fut.result(60)
        finally:
            engine.step_hook = None
    assert engine.kv_blocks_used() == (0, 0)


def test_chat_client_once(server, reference, capsys):
    from argparse import Namespace

    from specd.serving.chat_client import run_chat

    args = Namespace(url=url(server), api_key=None, max_tokens=N_TOK, temperature=0.0, raw=True, once=PROMPTS[2])
    assert run_chat(args) == 0
    out = capsys.readouterr()
    assert out.out == reference[PROMPTS[2], "tree"][1] + "\n"
    assert "tokens" in out.err and "TTFT" in out.err
    bad = Namespace(
        url=f"ws://127.0.0.1:{server.port}/nope", api_key=None, max_tokens=4, temperature=0.0, raw=True, once="x"
    )
    assert run_chat(bad) == 2


def test_benchmark_raw_client_reads_the_same_stream(server, reference):
    """eval/bench_server.py's lean raw-socket client (frames parsed after the run) gets the same
    tokens as the in-process engine, for concurrent requests, with sane timings."""
    from eval import bench_server

    tps, ttft, toks = asyncio.run(bench_server.over_raw_ws(server.port, PROMPTS, N_TOK, "off"))
    for got, p in zip(toks, PROMPTS):  # (the client asks ignore_eos: the reference may stop earlier)
        ref = reference[p, "off"][0]
        assert got[: len(ref)] == ref and len(got) == N_TOK
    assert tps > 0 and ttft > 0
