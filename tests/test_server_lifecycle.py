"""`specd serve` as a real process: systemd notifications, SIGTERM drains running requests, exit 0."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import orjson
import pytest
from conftest import DRAFT, ROOT, TARGET
from conftest import http_status as _http
from websockets.sync.client import connect

from specd.serving.app import ServerProcess

pytestmark = pytest.mark.timeout(150)


def _dgram_socket(name: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(name)
    s.settimeout(0.05)
    return s


def _drain(s: socket.socket) -> list:
    out = []
    while True:
        try:
            out.append(s.recv(4096).decode())
        except (TimeoutError, BlockingIOError):
            return out


def test_notify_abstract_and_path(tmp_path, monkeypatch):
    from specd.serving.notify import notify, watchdog_interval

    name = f"specd-test-{os.getpid()}-{time.monotonic_ns()}"
    s = _dgram_socket("\0" + name)
    monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
    assert notify("READY=1")
    assert _drain(s) == ["READY=1"]
    p = str(tmp_path / "notify.sock")
    s2 = _dgram_socket(p)
    monkeypatch.setenv("NOTIFY_SOCKET", p)
    assert notify("WATCHDOG=1")
    assert _drain(s2) == ["WATCHDOG=1"]
    t0 = time.monotonic()  # nobody reads: the queue fills up, notify must not block
    sent = [notify("WATCHDOG=1") for _ in range(200)]
    assert time.monotonic() - t0 < 2 and sent[0] and not all(sent)
    monkeypatch.delenv("NOTIFY_SOCKET")
    assert notify("READY=1") is False
    monkeypatch.setenv("WATCHDOG_USEC", "2000000")
    assert watchdog_interval() == 2.0
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid() + 1))
    assert watchdog_interval() is None
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    assert watchdog_interval() == 2.0


def test_sigterm_drains_streaming_request_and_exits_0():
    name = f"specd-test-{os.getpid()}-{time.monotonic_ns()}"
    ns = _dgram_socket("\0" + name)
    env = dict(
        os.environ,
        NOTIFY_SOCKET="@" + name,
        WATCHDOG_USEC="1000000",
        OMP_NUM_THREADS="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        PYTHONUNBUFFERED="1",
    )
    env.pop("SPECD_API_KEY", None)
    cmd = [
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
        "0",
        "--drain-timeout",
        "60",
    ]
    sp = ServerProcess(cmd, env=env, cwd=ROOT).launch()
    proc, logs = sp.proc, sp.logs
    msgs: list = []
    stop_reader = threading.Event()

    def read_notify():  # systemd reads continuously (the queue holds only ~10 datagrams)
        while not stop_reader.is_set():
            msgs.extend(_drain(ns))

    tn = threading.Thread(target=read_notify, daemon=True)
    tn.start()
    try:
        port = sp.wait_ready(90).port
        assert _http(port, "/readyz") == 200 and _http(port, "/healthz") == 200
        with connect(f"ws://127.0.0.1:{port}/ws") as ws:
            ws.send(
                orjson.dumps(
                    {
                        "type": "generate",
                        "id": "s",
                        "prompt": "Once upon a time",
                        "max_tokens": 300,
                        "ignore_eos": True,
                        "temperature": 0.0,
                        "speculation": {"mode": "off"},
                    }
                ).decode()
            )
            first = orjson.loads(ws.recv(timeout=30))
            assert first["type"] == "delta"
            proc.send_signal(signal.SIGTERM)
            tokens = len(first["token_ids"])
            while True:
                m = orjson.loads(ws.recv(timeout=60))
                if m["type"] == "delta":
                    tokens += len(m["token_ids"])
                else:
                    break
            assert m["type"] == "done" and m["finish_reason"] == "length", m  # drained, not cancelled
            assert tokens == 300
        assert proc.wait(60) == 0, "".join(logs)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    sp.reader.join(5)
    stop_reader.set()
    tn.join(5)
    msgs.extend(_drain(ns))
    states = [ln for m in msgs for ln in m.split("\n")]
    assert "READY=1" in states and "STOPPING=1" in states
    assert states.index("READY=1") < states.index("STOPPING=1")
    assert "WATCHDOG=1" in states
    recs = [orjson.loads(ln) for ln in logs if ln.startswith("{")]
    req = [r for r in recs if r.get("msg") == "request"]
    assert len(req) == 1 and req[0]["completion_tokens"] == 300 and "spec" in req[0] and "timing" in req[0]
    assert any(r.get("msg") == "draining" for r in recs) and recs[-1]["msg"] == "stopped"


def test_serve_with_a_bad_model_exits_with_a_clear_error(tmp_path):
    """A load failure must end the process with a one-line error, never hang."""
    bad = tmp_path / "bad-model"
    bad.mkdir()
    (bad / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}')
    proc = subprocess.run(
        [sys.executable, "-m", "specd", "serve", "--target", str(bad), "--port", "0", "--grpc-port", "0"],
        capture_output=True,
        text=True,
        timeout=20,
        env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"},
    )
    assert proc.returncode != 0
    assert "unsupported architecture 'GPT2LMHeadModel'" in proc.stderr + proc.stdout
