"""The engine in its own process (the default of `specd serve`): same streams as the in-process engine,
cancellation and disconnects free the child's KV blocks, /metrics reports the child's state, and a
child that dies fails its requests and turns /healthz red while the server stays up."""

from __future__ import annotations

import os
import signal
import time

import orjson
import pytest
from conftest import http_get, metrics_text, serve_args, ws_collect
from websockets.sync.client import connect

pytestmark = pytest.mark.timeout(180)

PROMPTS = ["Once upon a time", "The little dog", "Lily and Tom went to the park"]


def _idle_kv(server, timeout=20.0):
    """Until no request is outstanding and the engine process reports zero KV blocks in use."""
    ae = server.app.ae
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if ae.num_requests == 0 and server.call(ae.refresh_snapshot).kv_used == (0, 0):
            return True
        time.sleep(0.05)
    return False


@pytest.fixture(scope="module")
def server():
    from specd.serving.app import ServerThread

    a = serve_args(num_blocks=256, log_level="warning")
    assert a.engine_thread is False  # the default: an engine process
    srv = ServerThread(a).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def reference(shared_pair):
    from specd.cli import engine_config
    from specd.engine.engine import Engine
    from specd.engine.sequence import SpecParams
    from specd.sampling.params import SamplingParams

    t, d = shared_pair
    eng = Engine(engine_config(serve_args(num_blocks=256)), target=t, draft=d)
    out = {}
    for p in PROMPTS:
        ids = eng.tokenizer(p)["input_ids"]
        for mode in ("off", "tree"):
            s = eng.generate([ids], SamplingParams(temperature=0.0, max_tokens=32), SpecParams(mode=mode))[0]
            out[p, mode] = (s.output_ids, eng.output_text(s))
    return out


def test_streams_equal_the_in_process_engine(server, reference):
    from specd.engine.links import ProcessLink

    remote = server.app.ae.link
    assert isinstance(remote, ProcessLink) and remote.pid != os.getpid() and remote.alive
    with connect(f"ws://127.0.0.1:{server.port}/ws") as ws:
        for i, p in enumerate(PROMPTS):  # concurrent requests, speculation off and on
            for mode in ("off", "tree"):
                ws.send(
                    orjson.dumps(
                        {
                            "type": "generate",
                            "id": f"{mode}{i}",
                            "prompt": p,
                            "max_tokens": 32,
                            "temperature": 0,
                            "speculation": {"mode": mode},
                        }
                    ).decode()
                )
        frames: dict = {}
        end = time.monotonic() + 60
        while sum(1 for v in frames.values() if v and v[-1]["type"] != "delta") < 2 * len(PROMPTS):
            m = orjson.loads(ws.recv(timeout=max(0.1, end - time.monotonic())))
            frames.setdefault(m["id"], []).append(m)
        for i, p in enumerate(PROMPTS):
            for mode in ("off", "tree"):
                *deltas, done = frames[f"{mode}{i}"]
                assert all(d["type"] == "delta" for d in deltas)
                ids, text = reference[p, mode]
                assert done["type"] == "done" and done["finish_reason"] == "length", done
                assert [t for d in deltas for t in d["token_ids"]] == ids
                assert "".join(d["text"] for d in deltas) == text
                assert done["usage"]["completion_tokens"] == len(ids)
                assert done["spec"]["steps"] >= 1 and done["timing"]["ttft_ms"] is not None
                if mode == "tree":
                    assert done["spec"]["draft_tokens"] > 0
    assert _idle_kv(server)
    # the child's state reaches /metrics
    text = metrics_text(server.port)
    assert 'specd_kv_blocks_total{cache="target"} 256' in text
    assert 'specd_kv_blocks_used{cache="target"} 0' in text
    accepted = [ln for ln in text.splitlines() if ln.startswith("specd_spec_decode_num_draft_tokens_total")]
    assert accepted and float(accepted[0].split()[-1]) > 0


def test_logprobs_cross_from_the_engine_process(server, shared_pair):
    """Log-probabilities travel back from the child with their tokens, equal to the in-process
    engine's (tree speculation, so rows come from verification-tree paths)."""
    import urllib.request

    from specd.cli import engine_config
    from specd.engine.engine import Engine
    from specd.engine.sequence import SpecParams
    from specd.sampling.params import SamplingParams

    t, d = shared_pair
    eng = Engine(engine_config(serve_args(num_blocks=256)), target=t, draft=d)
    ids = eng.tokenizer(PROMPTS[2])["input_ids"]
    params = SamplingParams(temperature=0.0, max_tokens=16, logprobs=2)
    ref = eng.generate([ids], params, SpecParams(mode="tree"))[0]
    body = {"model": "stories260K", "prompt": PROMPTS[2], "max_tokens": 16, "temperature": 0, "logprobs": 2}
    body["speculation"] = {"mode": "tree"}
    req = urllib.request.Request(
        f"http://127.0.0.1:{server.port}/v1/completions", data=orjson.dumps(body), method="POST"
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        got = orjson.loads(r.read())["choices"][0]["logprobs"]
    assert ref.logprobs is not None and got["token_logprobs"] == pytest.approx([lp for lp, _ in ref.logprobs], abs=1e-5)
    assert [list(top.values()) for top in got["top_logprobs"]] == [
        pytest.approx([v for _, v in alts], abs=1e-5) for _, alts in ref.logprobs
    ]
    assert _idle_kv(server)


def test_too_long_is_refused_by_the_server_process(server):
    with connect(f"ws://127.0.0.1:{server.port}/ws") as ws:
        ws.send(
            orjson.dumps({"type": "generate", "id": "big", "prompt": "Once upon a time", "max_tokens": 100000}).decode()
        )
        m = orjson.loads(ws.recv(timeout=10))
    assert m["type"] == "error" and m["code"] == "too_long", m


def test_cancel_and_disconnect_free_the_childs_kv(server):
    with connect(f"ws://127.0.0.1:{server.port}/ws") as ws:
        ws.send(
            orjson.dumps(
                {"type": "generate", "id": "c", "prompt": PROMPTS[0], "max_tokens": 400, "ignore_eos": True}
            ).decode()
        )
        first = orjson.loads(ws.recv(timeout=30))
        assert first["type"] == "delta"
        ws.send(orjson.dumps({"type": "cancel", "id": "c"}).decode())
        deltas, done = ws_collect(ws, "c")
        assert done["finish_reason"] == "cancelled"
    assert _idle_kv(server)
    with connect(f"ws://127.0.0.1:{server.port}/ws") as ws:
        ws.send(
            orjson.dumps(
                {"type": "generate", "id": "d", "prompt": PROMPTS[1], "max_tokens": 400, "ignore_eos": True}
            ).decode()
        )
        assert orjson.loads(ws.recv(timeout=30))["type"] == "delta"
    # (the connection closed mid-stream)
    assert _idle_kv(server)


def test_a_request_the_child_cannot_run_fails_alone(server, reference):
    """A value validation missed (forced past it here) reaches the engine process: that request
    ends with `internal` naming the failed stage, one beside it streams its exact tokens, the
    child's KV is free afterwards and /metrics counts the failure by stage; health stays green."""
    import asyncio

    from specd.engine.commands import Submit
    from specd.engine.engine import RequestError
    from specd.engine.sequence import SpecParams
    from specd.sampling.params import SamplingParams

    ae = server.app.ae
    ids = ae.tokenizer(PROMPTS[0])["input_ids"]
    bad = SamplingParams(temperature=1.0, max_tokens=8)
    object.__setattr__(bad, "top_k", -(2**63) - 1)  # (pickled to the child as is)
    good = SamplingParams(temperature=0.0, max_tokens=32)

    async def both():
        async def run(params, rid):
            try:
                return [
                    t
                    for o in [o async for o in server.app.ae.generate(Submit(rid, ids, params, SpecParams("tree")))]
                    for t in o.token_ids
                ]
            except RequestError as e:
                return e

        return await asyncio.gather(run(bad, "hostile"), run(good, "beside"))

    err, toks = server.call(both)
    assert isinstance(err, RequestError) and err.code == "internal" and "failed" in str(err), err
    assert toks == reference[PROMPTS[0], "tree"][0]
    assert _idle_kv(server)
    status, body = http_get(server.port, "/metrics")
    assert status == 200 and b"specd_engine_failed_requests_total" in body
    assert sum(ae.snapshot().health["failed_requests"].values()) >= 1
    assert http_get(server.port, "/readyz")[0] == 200


def test_a_stuck_engine_process_turns_health_red_until_it_resumes(server):
    """A step that does not return (the child stopped) is a stuck engine for /healthz and the systemd
    watchdog; once the child runs again, health recovers and the stream completes."""
    remote = server.app.ae.link
    ae = server.app.ae
    old = ae.watchdog_timeout_s
    ae.watchdog_timeout_s = 0.5
    try:
        with connect(f"ws://127.0.0.1:{server.port}/ws") as ws:
            ws.send(
                orjson.dumps(
                    {
                        "type": "generate",
                        "id": "s",
                        "prompt": PROMPTS[0],
                        "max_tokens": 300,
                        "ignore_eos": True,
                        "speculation": {"mode": "off"},
                    }
                ).decode()
            )
            assert orjson.loads(ws.recv(timeout=30))["type"] == "delta"
            os.kill(remote.pid, signal.SIGSTOP)
            try:
                end = time.monotonic() + 10
                while http_get(server.port, "/healthz")[0] != 503 and time.monotonic() < end:
                    time.sleep(0.05)
                assert http_get(server.port, "/healthz")[0] == 503
            finally:
                os.kill(remote.pid, signal.SIGCONT)
            deltas, done = ws_collect(ws, "s")
            assert done["finish_reason"] == "length"
        assert http_get(server.port, "/healthz")[0] == 200
    finally:
        ae.watchdog_timeout_s = old


def test_a_dead_engine_process_fails_requests_and_health(shared_pair):
    """Runs last (kills its own server's child)."""
    from specd.serving.app import ServerThread

    srv = ServerThread(serve_args(num_blocks=128, log_level="error")).start()
    try:
        remote = srv.app.ae.link
        with connect(f"ws://127.0.0.1:{srv.port}/ws") as ws:
            ws.send(
                orjson.dumps(
                    {"type": "generate", "id": "k", "prompt": PROMPTS[0], "max_tokens": 400, "ignore_eos": True}
                ).decode()
            )
            assert orjson.loads(ws.recv(timeout=30))["type"] == "delta"
            os.kill(remote.pid, signal.SIGKILL)
            deltas, done = ws_collect(ws, "k")
            assert done["type"] == "done" and done["finish_reason"] == "error", done
            assert done["error"]["code"] == "internal"
            # the server itself stays up: health says the engine is gone, new requests are refused
            end = time.monotonic() + 10
            while http_get(srv.port, "/healthz")[0] != 503 and time.monotonic() < end:
                time.sleep(0.05)
            assert http_get(srv.port, "/healthz")[0] == 503
            ws.send(orjson.dumps({"type": "generate", "id": "k2", "prompt": PROMPTS[0]}).decode())
            m = orjson.loads(ws.recv(timeout=10))
            assert m["type"] == "error" and m["code"] in ("shutting_down", "internal", "overloaded"), m
    finally:
        srv.stop()


def test_cpu_split_pins_the_server_to_the_first_cpu_and_the_engine_to_the_rest():
    """--cpu-split (in a subprocess, so the test process keeps its own affinity)."""
    import subprocess
    import sys

    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs 2+ CPUs")
    code = (
        "import os, subprocess, sys, threading\n"
        "from specd.engine.links import _split_cpus\n"
        "t = threading.Thread(target=lambda: None); t.start(); t.join()\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)'])\n"
        "_split_cpus(p.pid)\n"
        "print(sorted(os.sched_getaffinity(0)))\nprint(sorted(os.sched_getaffinity(p.pid)))\n"
        "p.kill()\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    server, engine = (orjson.loads(x) for x in out.stdout.splitlines())
    assert server == cpus[:1] and engine == cpus[1:], out.stdout


def _drive(link, prompts_ids, max_tokens, tag):
    """Run requests on a ProcessLink by hand: (each pipe message with steps as a list of steps, each
    step a list of (request id, tokens, first token?, finished?); tokens per request)."""
    import select

    from specd.engine.commands import Submit
    from specd.engine.sequence import SpecParams
    from specd.sampling.params import SamplingParams

    msgs, toks, done = [], {}, set()
    for i, ids in enumerate(prompts_ids):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        link.send(Submit(f"{tag}{i}", ids, params, SpecParams(mode="off")))
    end = time.monotonic() + 60
    while len(done) < len(prompts_ids) and time.monotonic() < end:
        select.select([link.fileno()], [], [], 1.0)
        for m in link.read_raw():
            steps = []
            for st in link.decode(m).steps:
                first = [bool(o.token_ids) and not toks.get(o.request_id) for o in st.outputs]
                steps.append([(o.request_id, o.token_ids, f, o.finished) for o, f in zip(st.outputs, first)])
                for o in st.outputs:
                    toks.setdefault(o.request_id, []).extend(o.token_ids)
                    if o.finished:
                        done.add(o.request_id)
            if steps:
                msgs.append(steps)
    assert len(done) == len(prompts_ids)
    return msgs, toks


def test_stream_interval_holds_short_steps_but_never_first_or_last_tokens(shared_pair, reference):
    """HandOff in the engine process: with a 50 ms interval the child sends several steps per pipe
    message (each step still arrives as its own record, in order), but a request's first token and its
    finish go out at once; with 0 every step is its own message. Tokens equal the in-process engine's."""
    from specd.cli import engine_config
    from specd.engine.links import ProcessLink

    tok = shared_pair[0].tokenizer
    ids = [tok(p)["input_ids"] for p in PROMPTS]
    for interval in (0.05, 0.0):
        link = ProcessLink(engine_config(serve_args(num_blocks=256)), stream_interval_s=interval)
        try:
            msgs, toks = _drive(link, ids, 32, f"i{interval}-")
        finally:
            link.close()
        for i, p in enumerate(PROMPTS):
            ref = reference[p, "off"][0]
            assert toks[f"i{interval}-{i}"] == ref
            per_step = [len(t) for m in msgs for st in m for rid, t, _, _ in st if rid == f"i{interval}-{i}"]
            assert per_step == [1] * len(ref)  # speculation off: one record per step, one token each
        per_msg = [len(m) for m in msgs]
        assert sum(per_msg) >= max(len(reference[p, "off"][0]) for p in PROMPTS)
        if interval == 0.0:
            assert max(per_msg) == 1
            continue
        assert len(msgs) < sum(per_msg) / 2, per_msg  # sub-millisecond steps: several per message
        firsts = [m for m in msgs if any(first and not fin for st in m for _, _, first, fin in st)]
        lasts = [m for m in msgs if any(fin for st in m for *_, fin in st)]
        assert firsts and lasts
        for m in firsts + lasts:  # urgent outputs end their message: nothing after them was held back
            assert any(first or fin for _, _, first, fin in m[-1])
