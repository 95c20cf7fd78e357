"""Fuzzing the serving surface (loopback only) with hypothesis, against the real server on the shared
stories260K pair: malformed and adversarial websocket frames and JSON, raw bytes after the upgrade,
malformed protobuf bytes to gRPC Generate; random and hostile constraints (response_format, tools,
tool_choice, vLLM's structured_outputs / guided_*): a refusal naming the problem or a valid stream.

Oracle (docs/protocol.md), checked frame by frame on one long-lived connection:
- a binary frame -> one `error` invalid_request; a frame that is not a JSON object -> `invalid_json`;
  a frame over --max-message-bytes -> `message_too_large`; an object without a string `type` ->
  `invalid_request`; an unknown type -> `unknown_type` (with the id when it is valid);
- a `generate` with a valid id ends with exactly one terminal frame for that id: `error` with a
  documented code, or `done` after a well-formed stream (seq 0, 1, 2, ...; usage = tokens received);
  with an invalid id: one `error` without id;
- a `cancel` of an unknown id: no reply; `auth` on a server without a key: `auth_ok`;
- every `error` code is one listed in docs/protocol.md; nothing else is ever sent; no frame goes
  unanswered (a sentinel message after each frame bounds the wait: no hangs);
- afterwards the connection and the server still work and every KV block is free.
Text frames with invalid UTF-8 are a websocket protocol violation: the server closes the connection
(1007, RFC 6455) and keeps serving others.

The default run uses derandomized examples (stable CI); `-m slow` runs many more random ones.
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
import time

import orjson
import pytest
from conftest import DRAFT, ROOT, TARGET
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from specd.structured.errors import CODES as GRAMMAR_CODES

pytestmark = pytest.mark.timeout(300)

MAX_MESSAGE_BYTES = 16384
MAX_ID = 256
FAST = dict(deadline=None, suppress_health_check=list(HealthCheck), derandomize=True, database=None)
SLOW = dict(deadline=None, suppress_health_check=list(HealthCheck), database=None)
N_FAST = int(os.environ.get("SPECD_FUZZ_EXAMPLES", "300"))
N_SLOW = 2000


def documented_codes() -> set:
    """Error codes from the table in docs/protocol.md (rows "| `code` | when | connection |")."""
    text = (ROOT / "docs" / "protocol.md").read_text()
    section = text.split("Error codes", 1)[1]
    return set(re.findall(r"^\|\s*`([a-z_]+)`\s*\|", section, re.M))


CODES = documented_codes()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# server ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(shared_pair):
    from specd.cli import build_parser, engine_config
    from specd.engine.engine import Engine
    from specd.serving.app import ServerThread

    a = build_parser().parse_args(
        [
            "serve",
            "--target",
            str(TARGET),
            "--draft",
            str(DRAFT),
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--num-blocks",
            "256",
            "--port",
            "0",
            "--grpc-port",
            str(_free_port()),
            "--log-level",
            "error",
            "--max-message-bytes",
            str(MAX_MESSAGE_BYTES),
        ]
    )
    t, d = shared_pair
    engine = Engine(engine_config(a), target=t, draft=d)
    srv = ServerThread(a, engine).start()
    srv.grpc_port = a.grpc_port
    yield srv
    srv.stop()


def _idle(srv, timeout=20.0) -> bool:
    eng = srv.app.ae.engine
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if not eng.has_work() and srv.app.ae.num_requests == 0 and eng.kv_blocks_used() == (0, 0):
            return True
        time.sleep(0.02)
    return False


class Probe:
    """One websocket connection; ``exchange`` sends a frame and checks every reply against the oracle."""

    def __init__(self, srv):
        self.srv = srv
        self.ws = None
        self.n = 0
        self.stats = {"frames": 0, "errors": {}, "streams": 0, "constrained": 0}

    def _conn(self):
        if self.ws is None:
            self.ws = connect(
                f"ws://127.0.0.1:{self.srv.port}/ws", compression=None, max_size=None, open_timeout=30
            ).__enter__()
        return self.ws

    def close(self):
        if self.ws is not None:
            self.ws.close()
            self.ws = None

    def recv(self, timeout=30.0) -> dict:
        raw = self._conn().recv(timeout=timeout)
        assert isinstance(raw, str), f"server sent a binary frame: {raw[:100]!r}"
        m = orjson.loads(raw)
        assert isinstance(m, dict) and m.get("type") in ("delta", "done", "error", "auth_ok"), m
        if m["type"] == "error":
            assert m.get("code") in CODES, f"undocumented error code: {m}"
            assert isinstance(m.get("message"), str)
            self.stats["errors"][m["code"]] = self.stats["errors"].get(m["code"], 0) + 1
        return m

    def exchange(self, frame, binary: bool = False) -> list:
        """Send ``frame`` (str, or bytes when ``binary``), then a sentinel; check all replies."""
        ws = self._conn()
        self.n += 1
        self.stats["frames"] += 1
        sync_id = f"sync-{self.n}"
        expect = expectation(frame, binary)
        if binary:
            ws.send(frame, text=False)
        else:
            ws.send(frame)
        ws.send(orjson.dumps({"type": "__sync__", "id": sync_id}).decode())
        replies, synced = [], False
        gen = expect.get("generate")  # the generate id we await a terminal for
        terminal, deltas, cancelled = None, [], False
        deadline = time.monotonic() + 60
        while not synced or (gen is not None and terminal is None):
            assert time.monotonic() < deadline, f"no answer within 60 s for {str(frame)[:300]!r}: {replies}"
            m = self.recv(max(0.1, deadline - time.monotonic()))
            if m["type"] == "error" and m.get("id") == sync_id:
                assert m["code"] == "unknown_type", m
                self.stats["errors"]["unknown_type"] -= 1  # the sentinel's own answer
                synced = True
                continue
            replies.append(m)
            if gen is not None and m.get("id") == gen:
                assert terminal is None, f"frame after the terminal one: {m}"
                if m["type"] == "delta":
                    assert m["seq"] == len(deltas), (m, len(deltas))
                    assert isinstance(m["text"], str) and all(isinstance(t, int) for t in m["token_ids"])
                    deltas.append(m)
                    if not cancelled:  # bound the time: a fuzzed request may ask for many tokens
                        ws.send(orjson.dumps({"type": "cancel", "id": gen}).decode())
                        cancelled = True
                elif m["type"] in ("done", "error"):
                    terminal = m
                continue
        others = [m for m in replies if gen is None or m.get("id") != gen]
        if gen is not None:
            if terminal["type"] == "done":
                self.stats["streams"] += 1
                if any(k in orjson.loads(frame) for k in CONSTRAINT_FIELDS):
                    self.stats["constrained"] += 1
                assert terminal["finish_reason"] in ("stop", "length", "cancelled", "error", "tool_calls"), terminal
                got = sum(len(d["token_ids"]) for d in deltas)
                assert terminal["usage"]["completion_tokens"] == got, (terminal, got)
                if terminal["finish_reason"] == "error":
                    assert terminal["error"]["code"] in CODES
            else:
                assert not deltas, f"error after deltas: {terminal}"
            assert others == [], f"unexpected extra frames: {others}"
            return replies
        want = expect["reply"]
        if want is None:
            assert others == [], f"expected no reply to {str(frame)[:200]!r}, got {others}"
        elif want == "auth_ok":
            assert others == [{"type": "auth_ok"}], others
        else:
            code, rid = want
            assert len(others) == 1, f"expected one {code} for {str(frame)[:200]!r}, got {others}"
            m = others[0]
            assert m["type"] == "error" and m["code"] == code, (m, str(frame)[:300])
            assert m.get("id") == rid, (m, rid)
        return replies


def _valid_id(v) -> bool:
    return isinstance(v, str) and 0 < len(v) <= MAX_ID


def expectation(frame, binary: bool) -> dict:
    """What docs/protocol.md says the server answers to ``frame``."""
    size = len(frame) if binary else len(frame.encode("utf-8", "surrogatepass"))
    if size > MAX_MESSAGE_BYTES:
        return {"reply": ("message_too_large", None)}
    if binary:
        return {"reply": ("invalid_request", None)}
    try:
        msg = orjson.loads(frame)
    except orjson.JSONDecodeError:
        return {"reply": ("invalid_json", None)}
    if not isinstance(msg, dict):
        return {"reply": ("invalid_json", None)}
    t = msg.get("type")
    if not isinstance(t, str):
        return {"reply": ("invalid_request", None)}
    rid = msg.get("id")
    if t == "generate":
        return {"generate": rid} if _valid_id(rid) else {"reply": ("invalid_request", None)}
    if t == "cancel":
        return {"reply": None} if _valid_id(rid) else {"reply": ("invalid_request", None)}
    if t == "auth":
        return {"reply": "auth_ok"}
    return {"reply": ("unknown_type", rid if _valid_id(rid) else None)}


# strategies --------------------------------------------------------------------------------------
def _fresh_ids():
    n = iter(range(10**9))
    return st.builds(lambda: f"f{next(n)}")


json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, -1, 1, 2**31, 2**63, -(2**63), 2**64, 10**30]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=40),
    st.text(alphabet=st.characters(codec=None), max_size=10),  # includes lone surrogates
)
json_values = st.recursive(
    json_scalars, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4), max_leaves=12
)


def _maybe(valid, bad=json_values):
    return st.one_of(valid, valid, bad)


PROMPTS = ["Once upon a time", "The little dog", "Hi", "Lily and Tom went to the park"]
# constraints: small valid ones, and hostile ones (each a 400 / error naming the problem, never a hang)
_PET = {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}}, "required": ["kind"]}
_TOOL = {"type": "function", "function": {"name": "w", "parameters": {"type": "object", "properties": {}}}}


def _deep(n: int) -> dict:
    v: dict = {"type": "string"}
    for _ in range(n):
        v = {"type": "object", "properties": {"a": v}}
    return v


HOSTILE_CONSTRAINT = st.sampled_from(
    [
        {"type": "json_schema", "json_schema": {"name": "d", "schema": _deep(80)}},
        {"type": "json_schema", "json_schema": {"name": "e", "schema": {"enum": list(range(1500))}}},
        {"type": "json_schema", "json_schema": {"name": "t", "schema": {"type": "quaternion"}}},
        {
            "type": "json_schema",
            "json_schema": {"name": "u", "schema": {"type": "integer", "minimum": 3, "maximum": 1}},
        },
        {"type": "json_schema", "json_schema": {"name": "n", "schema": {"not": {}}}},
        [_TOOL] * 3,
        [{"type": "function", "function": {"name": f"f{i}"}} for i in range(200)],
        {"type": "function", "function": {"name": "nope"}},
        {"regex": "(("},
        {"choice": []},
        "((",
        ["a"] * 1500,
    ]
)
CONSTRAINT_FIELDS = {
    "response_format": st.sampled_from(
        [
            {"type": "text"},
            {"type": "json_object"},
            {"type": "json_schema", "json_schema": {"name": "pet", "schema": _PET, "strict": True}},
        ]
    ),
    "tools": st.sampled_from([[_TOOL], []]),
    "tool_choice": st.sampled_from(["none", "auto", "required", {"type": "function", "function": {"name": "w"}}]),
    "parallel_tool_calls": st.booleans(),
    "structured_outputs": st.sampled_from([{"choice": ["yes", "no"]}, {"regex": "[ab]{2,4}"}, {"json_object": True}]),
    "guided_regex": st.sampled_from(["x+", "[0-9]{3}"]),
    "guided_choice": st.sampled_from([["left", "right"]]),
}
gen_fields = {
    "prompt": _maybe(st.sampled_from(PROMPTS) | st.text(min_size=0, max_size=60)),
    "messages": _maybe(
        st.lists(
            st.fixed_dictionaries(
                {"role": st.sampled_from(["user", "system", "assistant"]), "content": st.text(max_size=40)}
            ),
            max_size=3,
        )
    ),
    "max_tokens": _maybe(
        st.integers(min_value=-5, max_value=40),
        st.sampled_from([0, -1, 10**6, 2**63, 1e20, 512, 511, "8", None, True, 8.0]),
    ),
    "temperature": _maybe(
        st.sampled_from([0, 0.0, 0.7, 1, 2.5]),
        st.sampled_from([-1, float("nan"), float("inf"), -float("inf"), 1e308, "0", True]),
    ),
    "top_p": _maybe(st.floats(min_value=0.01, max_value=1.0), st.sampled_from([0, -0.5, 1.5, float("nan"), "1"])),
    "top_k": _maybe(st.integers(min_value=-1, max_value=600), st.sampled_from([-2, 2**64, 1.5])),
    "seed": _maybe(st.integers(min_value=-(2**64), max_value=2**64), st.sampled_from([1.5, "7", 2**200])),
    "stop": _maybe(st.lists(st.text(min_size=1, max_size=5), max_size=3) | st.text(max_size=5)),
    "stop_token_ids": _maybe(st.lists(st.integers(min_value=-10, max_value=2**40), max_size=3)),
    "ignore_eos": _maybe(st.booleans()),
    "priority": _maybe(st.sampled_from(["interactive", "batch"]), st.sampled_from(["urgent", "", 1])),
    "speculation": _maybe(
        st.fixed_dictionaries(
            {},
            optional={
                "mode": st.sampled_from(["auto", "off", "chain", "tree", "static", "", None]),
                "max_draft_tokens": st.one_of(st.integers(min_value=-2, max_value=300), json_scalars),
            },
        )
    ),
    "unknown_field": json_values,
    **{k: _maybe(v, HOSTILE_CONSTRAINT | json_values) for k, v in CONSTRAINT_FIELDS.items()},
}


@st.composite
def generate_messages(draw):
    # "auth" is left to test_keyless_auth_without_key_field (5 refused auths close the connection)
    msg = {"type": draw(st.sampled_from(["generate"] * 8 + ["cancel", "Generate", "", "delta"]))}
    id_choice = draw(st.integers(0, 9))
    if id_choice <= 6:
        msg["id"] = draw(_fresh_ids())
    elif id_choice == 7:
        msg["id"] = draw(st.sampled_from(["", "x" * 257, "x" * 256]) | json_scalars)
    elif id_choice == 8:
        pass  # missing id
    else:
        msg["id"] = draw(json_values)
    which = draw(st.sampled_from(["prompt", "prompt", "messages", "both", "neither"]))
    keys = draw(st.sets(st.sampled_from(sorted(set(gen_fields) - {"prompt", "messages"})), max_size=6))
    if which in ("prompt", "both"):
        keys.add("prompt")
    if which in ("messages", "both"):
        keys.add("messages")
    for k in sorted(keys):
        msg[k] = draw(gen_fields[k])
    if "max_tokens" not in msg and draw(st.booleans()):
        msg["max_tokens"] = draw(st.integers(1, 12))
    # json.dumps writes NaN/Infinity tokens (invalid JSON: the server must say invalid_json)
    return json.dumps(msg, ensure_ascii=draw(st.booleans()) or _has_surrogate(msg), allow_nan=True)


@st.composite
def constrained_messages(draw):
    """A valid ``generate`` with one or two constraint fields, valid or hostile."""
    msg = {"type": "generate", "id": draw(_fresh_ids()), "prompt": draw(st.sampled_from(PROMPTS)), "max_tokens": 6}
    for k in sorted(draw(st.sets(st.sampled_from(sorted(CONSTRAINT_FIELDS)), min_size=1, max_size=2))):
        msg[k] = draw(gen_fields[k])
    return json.dumps(msg)


def _has_surrogate(obj) -> bool:
    if isinstance(obj, str):
        return any(0xD800 <= ord(c) <= 0xDFFF for c in obj)
    if isinstance(obj, dict):
        return any(_has_surrogate(k) or _has_surrogate(v) for k, v in obj.items())
    if isinstance(obj, list):
        return any(_has_surrogate(v) for v in obj)
    return False


raw_text_frames = st.one_of(
    st.text(max_size=200),
    st.sampled_from(
        [
            "",
            " ",
            "null",
            "[]",
            "{}",
            "0",
            '"generate"',
            "{",
            '{"type":',
            '{"type":null}',
            '{"type":"generate"}',
            '{"type":"generate","id":"a"}',
            '{"type":"cancel"}',
            '{"type":"generate","id":"n","prompt":"Hi","temperature":NaN}',
            '{"type":"generate","id":"i","prompt":"Hi","max_tokens":Infinity}',
            '{"type":"generate","id":"e","prompt":"Hi","max_tokens":1e999}',
            '{"type":"generate","id":"h","prompt":"Hi","max_tokens":123456789012345678901234567890}',
            '{"type":"generate","id":"d","id":"d2","prompt":"Hi","max_tokens":2}',
            '{"type":"generate","id":"z","prompt":"Hi\\u0000there","max_tokens":2}',
            '{"type":"generate","id":"s","prompt":"\\ud800","max_tokens":2}',
            '\ufeff{"type":"auth"}',
            '{"type":"auth","key":"k"}',
        ]
    ),
    st.integers(1, 5000).map(lambda n: "[" * n + "]" * n),
    st.integers(1, 5000).map(lambda n: '{"a":' * n + "1" + "}" * n),
    st.integers(1, 3000).map(lambda n: '{"type":"generate","id":"deep","prompt":' + "[" * n + "]" * n + "}"),
    st.integers(MAX_MESSAGE_BYTES - 64, MAX_MESSAGE_BYTES * 2).map(
        lambda n: '{"type":"generate","id":"big","max_tokens":2,"prompt":"' + "a" * n + '"}'
    ),
    st.integers(1, 3000).map(
        lambda n: '{"type":"generate","id":"long","max_tokens":4,"prompt":"' + "Once upon a time " * n + '"}'
    ),
    json_values.map(lambda v: json.dumps(v, allow_nan=True)),
)


# tests -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def probe(server):
    p = Probe(server)
    yield p
    p.close()


def _check_after(probe, srv):
    """The connection still serves a normal request, and the server is idle with no KV held."""
    replies = probe.exchange(
        orjson.dumps(
            {"type": "generate", "id": f"ok{probe.n}", "prompt": "Once upon a time", "max_tokens": 3, "temperature": 0}
        ).decode()
    )
    assert replies and replies[-1]["type"] == "done", replies
    assert _idle(srv), f"KV blocks still held: {srv.app.ae.engine.kv_blocks_used()}"


def _run_json_fuzz(probe, server, n, opts):
    @settings(max_examples=n, **opts)
    @given(frame=st.one_of(generate_messages(), raw_text_frames, constrained_messages()))
    def run(frame):
        probe.exchange(frame)

    run()
    _check_after(probe, server)


def _run_binary_fuzz(probe, server, n, opts):
    @settings(max_examples=n, **opts)
    @given(
        frame=st.one_of(
            st.binary(max_size=300),
            st.just(b""),
            st.sampled_from([b'{"type":"generate","id":"b","prompt":"Hi"}', b"\x00" * 1000]),
            st.integers(MAX_MESSAGE_BYTES - 8, MAX_MESSAGE_BYTES + 8).map(lambda k: b"x" * k),
        )
    )
    def run(frame):
        probe.exchange(frame, binary=True)

    run()
    _check_after(probe, server)


def test_fuzz_json_frames(probe, server):
    _run_json_fuzz(probe, server, N_FAST, FAST)
    assert probe.stats["streams"] > 0 and len(probe.stats["errors"]) >= 3, probe.stats
    # constraints were exercised both ways: refused with their codes, and streamed
    assert set(probe.stats["errors"]) & set(GRAMMAR_CODES) and probe.stats["constrained"] > 0, probe.stats


def test_fuzz_binary_frames(probe, server):
    _run_binary_fuzz(probe, server, max(20, N_FAST // 4), FAST)


@pytest.mark.slow
def test_fuzz_json_frames_long(probe, server):
    _run_json_fuzz(probe, server, N_SLOW, SLOW)
    _run_binary_fuzz(probe, server, N_SLOW // 4, SLOW)
    _run_raw_fuzz(server, N_SLOW // 10, SLOW)
    _run_grpc_fuzz(server, N_SLOW // 2, SLOW)
    _run_http_fuzz(server, N_SLOW // 2, SLOW)


def test_keyless_auth_without_key_field(probe):
    """docs/protocol.md: "On a server without a key every `auth` is answered with `auth_ok`"."""
    for frame in ['{"type":"auth"}', '{"type":"auth","key":null}', '{"type":"auth","key":7}'] * 2:
        # 6 > MAX_AUTH_FAILURES: a keyless server must not count these as failures and close (1008)
        assert probe.exchange(frame) == [{"type": "auth_ok"}]


def test_invalid_utf8_text_frame_closes_1007_and_server_survives(server):
    for payload in (b"\xff\xfe", b'{"type":"generate","id":"u","prompt":"\xc3\x28"}', b"\xed\xa0\x80"):
        with connect(f"ws://127.0.0.1:{server.port}/ws", compression=None) as ws:
            ws.send(payload, text=True)
            with pytest.raises(ConnectionClosed) as ei:
                ws.recv(timeout=10)
            rcvd = ei.value.rcvd
            assert rcvd is not None and rcvd.code == 1007, ei.value
    p = Probe(server)
    try:
        _check_after(p, server)
    finally:
        p.close()


def _raw_ws(port) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(
        b"GET /ws HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
    )
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = s.recv(4096)
        assert chunk, "closed during the handshake"
        buf += chunk
    assert buf.startswith(b"HTTP/1.1 101"), buf[:200]
    return s


@st.composite
def raw_frames(draw):
    """Arbitrary bytes, or frame headers with bad opcodes / reserved bits / lengths / no mask."""
    kind = draw(st.integers(0, 3))
    if kind == 0:
        return draw(st.binary(min_size=1, max_size=200))
    b0 = draw(st.integers(0, 255))
    masked = draw(st.booleans())
    n = draw(st.sampled_from([0, 1, 125, 126, 127]))
    hdr = bytes([b0, (0x80 if masked else 0) | n])
    if n == 126:
        hdr += draw(st.integers(0, 0xFFFF)).to_bytes(2, "big")
    elif n == 127:
        hdr += draw(st.integers(0, 2**63 - 1)).to_bytes(8, "big")
    if masked:
        hdr += draw(st.binary(min_size=4, max_size=4))
    return hdr + draw(st.binary(max_size=64))


def test_fuzz_raw_bytes_after_upgrade(server):
    """Garbage at the websocket framing layer: the server closes or keeps waiting for the rest of the
    frame; it never crashes, never sends anything but a close, and keeps serving others."""
    _run_raw_fuzz(server, max(15, N_FAST // 6), FAST)


def _run_raw_fuzz(server, n, opts):
    # the connections open before (the module's probe; an earlier test's, maybe still closing): the
    # garbage connections are the ones not among them
    before = server.call(lambda: set(server.app.ws.conns))
    left = lambda: server.call(lambda: set(server.app.ws.conns) - before)

    @settings(max_examples=n, **opts)
    @given(data=raw_frames())
    def run(data):
        s = _raw_ws(server.port)
        try:
            s.sendall(data)
            s.settimeout(0.3)
            try:
                reply = s.recv(65536)
            except TimeoutError:
                reply = None  # an incomplete frame: the server waits for the rest
            except ConnectionResetError:
                reply = b""
            if reply:
                # a close frame from the server: opcode 0x8, unmasked
                assert reply[0] & 0x0F == 0x8, reply[:20]
        finally:
            s.close()

    run()
    p = Probe(server)
    try:
        _check_after(p, server)
    finally:
        p.close()
    assert _idle(server)
    end = time.monotonic() + 20  # every garbage connection was closed by one side or the other
    while left() and time.monotonic() < end:
        time.sleep(0.05)
    assert not left()


def test_fuzz_grpc_malformed_bytes(server):
    _run_grpc_fuzz(server, max(30, N_FAST // 2), FAST)


def _run_grpc_fuzz(server, n, opts):
    import grpc

    from specd.serving.proto.specd.v1 import specd_pb2 as pb

    allowed = {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.OUT_OF_RANGE,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.CANCELLED,
    }
    valid = pb.GenerateRequest(id="g", prompt="Once upon a time", max_tokens=4, temperature=0.0).SerializeToString()
    seen = {}
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as ch:
        call = ch.unary_stream("/specd.v1.Specd/Generate", request_serializer=None, response_deserializer=None)

        def once(raw: bytes) -> None:
            stream = call(raw, timeout=30)
            try:
                for i, resp in enumerate(stream):
                    r = pb.GenerateResponse.FromString(resp)
                    assert r.WhichOneof("event") in ("delta", "done"), r
                    if i == 0:
                        stream.cancel()  # bound the time; cancelling must free the request's KV
                seen["OK"] = seen.get("OK", 0) + 1
            except grpc.RpcError as e:
                code = e.code()
                assert code in allowed, (code, e.details(), raw[:80])
                if code != grpc.StatusCode.CANCELLED:
                    assert re.match(r"^[a-z_]+: ", e.details() or ""), e.details()
                    assert e.details().split(":")[0] in CODES, e.details()
                seen[code.name] = seen.get(code.name, 0) + 1

        @settings(max_examples=n, **opts)
        @given(
            raw=st.one_of(
                st.binary(max_size=200),
                st.tuples(st.integers(0, len(valid) - 1), st.integers(0, 255)).map(
                    lambda t: valid[: t[0]] + bytes([t[1]]) + valid[t[0] + 1 :]
                ),
                st.integers(0, len(valid) - 1).map(lambda k: valid[:k]),
                st.sampled_from(
                    [
                        b"\xff" * 20,
                        b"\x0a\xff\xff\xff\xff\x0f",
                        b"\x12\x80\x80\x80\x80\x80\x80\x80\x80\x80\x01",
                        b"\x12\x02\xc3\x28",
                        b"\x08" + b"\xff" * 10 + b"\x01",
                    ]
                ),
            )
        )
        def run(raw):
            once(raw)

        run()
        # still serving
        out = list(
            ch.unary_stream(
                "/specd.v1.Specd/Generate",
                request_serializer=None,
                response_deserializer=pb.GenerateResponse.FromString,
            )(valid, timeout=30)
        )
        assert out and out[-1].WhichOneof("event") == "done" and out[-1].done.finish_reason == "length", out
    assert seen.get("INVALID_ARGUMENT", 0) > 0, seen
    assert _idle(server)


def test_nonfinite_floats_in_the_oracle():
    """Sanity of the oracle: the JSON the fuzzer writes for NaN/Infinity is refused as invalid_json."""
    f = json.dumps({"type": "generate", "id": "x", "prompt": "Hi", "temperature": math.nan}, allow_nan=True)
    assert expectation(f, False) == {"reply": ("invalid_json", None)}
    assert CODES >= {
        "invalid_json",
        "invalid_request",
        "unknown_type",
        "too_long",
        "overloaded",
        "internal",
        "message_too_large",
    }


# the OpenAI-compatible HTTP routes and the Responses WebSocket mode ---------------------------------
OAI_CODES = {
    "invalid_json",
    "invalid_value",
    "unsupported_parameter",
    "context_length_exceeded",
    "invalid_api_key",
    "model_not_found",
    "response_not_found",
    "previous_response_not_found",
    "request_too_large",
    "overloaded",
    "model_loading",
    "shutting_down",
    "internal",
    "response_already_in_flight",
    "unknown_event_type",
    "unknown_url",
    *GRAMMAR_CODES,  # a constraint refused
}
MODEL = "stories260K"
ROUTES = ["/v1/chat/completions", "/v1/completions", "/v1/responses"]


def test_openai_error_codes_are_documented():
    text = (ROOT / "docs" / "protocol.md").read_text()
    for code in OAI_CODES:
        assert f"`{code}`" in text, code


_role = st.sampled_from(["user", "system", "assistant", "developer", "tool", "", "x"])
_part = st.fixed_dictionaries({"type": st.sampled_from(["text", "input_text", "image_url", 3]), "text": json_scalars})
oai_fields = {
    "model": _maybe(st.just(MODEL), st.sampled_from(["gpt-4o", "", MODEL.lower()]) | json_values),
    "messages": _maybe(
        st.lists(st.fixed_dictionaries({"role": _role, "content": st.text(max_size=30) | st.lists(_part, max_size=2)}))
    ),
    "prompt": _maybe(st.sampled_from(PROMPTS) | st.lists(st.integers(-3, 600), max_size=6) | st.just([PROMPTS[0]])),
    "input": _maybe(
        st.sampled_from(PROMPTS)
        | st.lists(
            st.fixed_dictionaries({"role": _role, "content": st.text(max_size=20)}, optional={"type": json_scalars})
        )
    ),
    "instructions": _maybe(st.text(max_size=20)),
    "previous_response_id": _maybe(st.sampled_from(["resp_nope", ""]) | st.text(max_size=8)),
    "max_tokens": _maybe(st.integers(1, 12), st.sampled_from([0, -1, 10**6, 2**63, 1.5, "8", True])),
    "max_completion_tokens": _maybe(st.integers(1, 12), st.sampled_from([0, 10**6, "8"])),
    "max_output_tokens": _maybe(st.integers(1, 12), st.sampled_from([0, 10**6, 2.5])),
    "temperature": gen_fields["temperature"],
    "top_p": gen_fields["top_p"],
    "top_k": gen_fields["top_k"],
    "seed": gen_fields["seed"],
    "stop": gen_fields["stop"],
    "n": _maybe(st.sampled_from([1, 2, 0, "1"])),
    "logprobs": _maybe(st.booleans()),
    "presence_penalty": _maybe(st.sampled_from([0, 0.5, -2, 3, "x"])),
    "frequency_penalty": _maybe(st.sampled_from([0, 1.5, -2.5, None])),
    "repetition_penalty": _maybe(st.sampled_from([1, 1.3, 0, 11, "x"])),
    "min_p": _maybe(st.sampled_from([0, 0.1, 1, 1.5])),
    "stream": _maybe(st.booleans()),
    "stream_options": _maybe(st.fixed_dictionaries({"include_usage": st.booleans()})),
    "store": _maybe(st.booleans()),
    "metadata": _maybe(st.dictionaries(st.text(max_size=4), st.text(max_size=4), max_size=2)),
    "speculation": gen_fields["speculation"],
    "unknown_field": json_values,
    **{k: gen_fields[k] for k in CONSTRAINT_FIELDS},
    "text": _maybe(st.fixed_dictionaries({"format": st.sampled_from([{"type": "json_object"}, {"type": "text"}])})),
}


REQUIRED = {"/v1/chat/completions": "messages", "/v1/completions": "prompt", "/v1/responses": "input"}


@st.composite
def oai_bodies(draw, path: str = "/v1/responses") -> bytes:
    """A body for ``path``: its required field (usually present), the model, a few other fields."""
    keys = draw(st.sets(st.sampled_from(sorted(oai_fields)), max_size=5))
    if draw(st.integers(0, 9)) < 8:
        keys.add(REQUIRED[path])
    body = {k: draw(oai_fields[k]) for k in sorted(keys | {"model"})}
    for k in ("max_tokens", "max_completion_tokens", "max_output_tokens"):  # bound a valid request's time
        body.setdefault(k, draw(st.integers(1, 8)))
    return json.dumps(body, ensure_ascii=draw(st.booleans()) or _has_surrogate(body), allow_nan=True).encode(
        "utf-8", "surrogatepass"
    )


@st.composite
def constrained_bodies(draw, path: str) -> bytes:
    """A valid body for ``path`` with one or two constraint fields (valid or hostile)."""
    body = {"model": MODEL, "max_tokens": 6, "max_output_tokens": 6, "temperature": 0}
    body[REQUIRED[path]] = [{"role": "user", "content": "Hi"}] if path == "/v1/chat/completions" else "Hi"
    keys = sorted(CONSTRAINT_FIELDS) + (["text"] if path == "/v1/responses" else [])
    for k in sorted(draw(st.sets(st.sampled_from(keys), min_size=1, max_size=2))):
        body[k] = draw(oai_fields[k])
    body["stream"] = draw(st.booleans())
    return json.dumps(body).encode()


raw_bodies = st.one_of(
    st.binary(max_size=200),
    st.sampled_from(
        [b"", b"{", b"[]", b"null", b'{"model":"stories260K","messages":[{"role":"user","content":"\xff"}]}']
    ),
    st.integers(MAX_MESSAGE_BYTES - 64, MAX_MESSAGE_BYTES * 2).map(
        lambda n: b'{"model":"stories260K","prompt":"' + b"a" * n + b'","max_tokens":2}'
    ),
)


def _post_raw(port: int, path: str, body: bytes, read_events: int | None) -> tuple:
    """(status, JSON body or the SSE data lines) of a POST; a stream is read whole, or only its first
    ``read_events`` events before the connection is dropped."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        if not r.getheader("Content-Type", "").startswith("text/event-stream"):
            return r.status, orjson.loads(r.read())
        events = []
        while read_events is None or len(events) < read_events:
            line = r.readline()
            if not line:
                break
            if line.startswith(b"data: "):
                events.append(line[6:].strip())
        return r.status, events
    finally:
        conn.close()


def _expected_http(path: str, body: bytes) -> set:
    """The statuses docs/protocol.md allows for ``body`` (200 only when it can be a valid request)."""
    if len(body) > MAX_MESSAGE_BYTES:
        return {413}
    try:
        msg = orjson.loads(body)
    except orjson.JSONDecodeError:
        return {400}
    if not isinstance(msg, dict) or not isinstance(msg.get("model"), str) or not msg["model"]:
        return {400}
    if msg["model"] != MODEL:
        return {404}
    return {200, 400, 404} if path == "/v1/responses" else {200, 400}


def _check_http(port: int, path: str, body: bytes, drop_after: int | None, stats: dict) -> None:
    status, got = _post_raw(port, path, body, drop_after)
    allowed = _expected_http(path, body)
    assert status in allowed, (status, allowed, path, body[:300], got)
    stats[status] = stats.get(status, 0) + 1
    if status != 200:
        assert set(got) == {"error"} and set(got["error"]) == {"message", "type", "param", "code"}, got
        assert got["error"]["code"] in OAI_CODES, got
        stats[got["error"]["code"]] = stats.get(got["error"]["code"], 0) + 1
        return
    if isinstance(got, dict):
        assert got["object"] in ("chat.completion", "text_completion", "response"), got
        return
    events = [e for e in got if e != b"[DONE]"]
    assert all(isinstance(orjson.loads(e), dict) for e in events)
    if drop_after is None:  # read to the end: a proper ending
        last = orjson.loads(events[-1])
        if path == "/v1/responses":
            assert last["type"] in ("response.completed", "response.incomplete"), last
        else:
            assert got[-1] == b"[DONE]", got[-3:]


class _Canary:
    """Greedy chat completions in a background thread while the fuzzer runs: each must be exact."""

    def __init__(self, port: int):
        import threading

        self.port, self.results, self.stop = port, [], threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.body = orjson.dumps(
            {"model": MODEL, "messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": 24, "temperature": 0}
        )

    def _run(self):
        while not self.stop.is_set():
            status, got = _post_raw(self.port, "/v1/chat/completions", self.body, None)
            self.results.append((status, got["choices"][0]["message"]["content"] if status == 200 else got))

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(60)


def _run_http_fuzz(server, n, opts):
    stats: dict = {}
    with _Canary(server.port) as canary:

        @settings(max_examples=n, **opts)
        @given(data=st.data(), path=st.sampled_from(ROUTES), drop=st.sampled_from([None, None, 1, 2]))
        def run(data, path, drop):
            body = data.draw(st.one_of(oai_bodies(path), oai_bodies(path), raw_bodies, constrained_bodies(path)))
            _check_http(server.port, path, body, drop, stats)

        run()
    texts = {t for s, t in canary.results}
    assert canary.results and all(s == 200 for s, _ in canary.results) and len(texts) == 1, canary.results[:3]
    assert _idle(server), f"KV blocks still held: {server.app.ae.engine.kv_blocks_used()}"
    return stats


def test_fuzz_openai_http(server):
    stats = _run_http_fuzz(server, max(60, N_FAST // 3), FAST)
    assert stats.get(200, 0) > 0 and stats.get(400, 0) > 0 and stats.get(404, 0) > 0, stats
    assert set(stats) & set(GRAMMAR_CODES), stats  # constraints refused with their codes


# the Responses WebSocket mode ---------------------------------------------------------------------------
def _responses_ws(port):
    return connect(f"ws://127.0.0.1:{port}/v1/responses", compression=None, max_size=None, open_timeout=30)


def _ws_exchange(ws, frame, binary: bool) -> list:
    """Send a frame, then a sentinel; every reply until the sentinel's error (and, when a response
    started, until its final event; it is cancelled after its first delta to bound the time)."""
    ws.send(frame, text=not binary)
    ws.send('{"type": "__sync__"}')
    replies, synced, open_response, end = [], False, False, time.monotonic() + 60
    while not synced or open_response:
        assert time.monotonic() < end, f"no answer within 60 s to {str(frame)[:200]!r}: {replies[-3:]}"
        m = orjson.loads(ws.recv(timeout=60))
        assert isinstance(m, dict) and isinstance(m.get("type"), str), m
        if m["type"] == "error":
            assert set(m) >= {"status", "error"} and m["error"]["code"] in OAI_CODES, m
            assert m["status"] in (400, 404, 413, 429, 503), m
            if m["error"]["code"] == "unknown_event_type" and not synced and "__sync__" in m["error"]["message"]:
                synced = True
                continue
        elif m["type"] == "response.created":
            open_response = True
        elif m["type"] == "response.output_text.delta":
            ws.send('{"type": "response.cancel"}')
        elif m["type"] in ("response.completed", "response.incomplete", "response.failed"):
            open_response = False
        replies.append(m)
    return replies


ws_events = st.one_of(
    st.builds(
        lambda body, kind: json.dumps({**orjson.loads(body), "type": kind}, allow_nan=True),
        oai_bodies("/v1/responses"),
        st.sampled_from(["response.create"] * 6 + ["response.cancel", "response.steer", "", "response.created"]),
    ),
    raw_text_frames,
    st.sampled_from(['{"type":"response.cancel"}', '{"type":"response.cancel","response_id":"x"}']),
)


def test_fuzz_responses_websocket(server):
    opts = dict(FAST)

    @settings(max_examples=max(40, N_FAST // 5), **opts)
    @given(frame=st.one_of(ws_events, st.binary(max_size=50)))
    def run(frame):
        with _responses_ws(server.port) as ws:
            _ws_exchange(ws, frame, isinstance(frame, bytes))
            # the connection still serves a normal response afterwards
            ok = {"type": "response.create", "model": MODEL, "input": "Hi", "max_output_tokens": 2, "temperature": 0}
            ws.send(orjson.dumps(ok).decode())
            while (m := orjson.loads(ws.recv(timeout=30)))["type"] not in ("response.completed", "response.incomplete"):
                assert m["type"] != "error", m

    run()
    assert _idle(server)


def test_responses_websocket_invalid_utf8_closes_1007(server):
    with _responses_ws(server.port) as ws:
        ws.send(b'{"type":"response.create","input":"\xc3\x28"}', text=True)
        with pytest.raises(ConnectionClosed) as ei:
            ws.recv(timeout=10)
        assert ei.value.rcvd is not None and ei.value.rcvd.code == 1007
    with _responses_ws(server.port) as ws:
        assert _ws_exchange(ws, '{"type":"response.cancel"}', False) == []
