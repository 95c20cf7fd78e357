"""`specd serve` as a subprocess under a fake systemd: the sd_notify protocol as systemd sees it.

NOTIFY_SOCKET points at a test AF_UNIX datagram socket and WATCHDOG_USEC is small, like
`Type=notify` + `WatchdogSec=` would set them. Checked:

- READY=1 arrives only once the server is ready: at the moment it is received, /readyz answers 200,
  and every /readyz poll before the daemon's "ready" log line answered 503;
- WATCHDOG=1 keeps arriving, never more than WATCHDOG_USEC apart, while idle and while streaming;
- SIGTERM: STOPPING=1, then exit status 0;
- an engine step that hangs stops the watchdog pings (systemd would kill and restart the service),
  /healthz turns 503, and SIGABRT (systemd's WatchdogSignal) dumps every thread's stack to stderr
  (PYTHONFAULTHANDLER=1, as the unit sets it).

The hang is injected without any daemon support: the subprocess runs a small bootstrap that wraps
``Engine.__init__`` to install ``Engine.step_hook`` (the engine's test hook), which blocks forever in
the engine thread ("specd-engine"; the warm-up runs in another thread, so readiness is unaffected).
"""

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

pytestmark = pytest.mark.timeout(180)

WATCHDOG_USEC = 2_000_000  # pings every 1 s; a step running > 1 s counts as stuck

HANG_BOOTSTRAP = """
import sys, threading
import specd.engine.engine as E

_init = E.Engine.__init__

def _init_with_hang(self, *a, **k):
    _init(self, *a, **k)
    def hang(eng):
        if threading.current_thread().name == "specd-engine":
            print('{"msg":"test-hang"}', file=sys.stderr, flush=True)
            threading.Event().wait()
    self.step_hook = hang

E.Engine.__init__ = _init_with_hang
from specd.cli import main
sys.exit(main(sys.argv[1:]))
"""


class FakeSystemd:
    """The notify socket plus the daemon subprocess and its JSON log lines."""

    def __init__(self, tmp_path, hang: bool = False):
        self.sock_path = str(tmp_path / "notify.sock")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.sock_path)
        self.sock.settimeout(0.05)
        self.msgs: list = []  # (monotonic time, state line)
        self.ready_readyz = None  # /readyz status fetched the moment READY=1 arrived
        self.logs: list = []
        self.recs: list = []  # (monotonic time, parsed JSON log record)
        self.port = None
        self.listening = threading.Event()
        self.ready_logged = threading.Event()
        self.stop = threading.Event()
        env = {k: v for k, v in os.environ.items() if not k.startswith("SPECD_") and k != "WATCHDOG_PID"}
        env.update(
            NOTIFY_SOCKET=self.sock_path,
            WATCHDOG_USEC=str(WATCHDOG_USEC),
            OMP_NUM_THREADS="1",
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            PYTHONUNBUFFERED="1",
            PYTHONFAULTHANDLER="1",
        )
        args = [
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
            "0",
            "--drain-timeout",
            "10",
        ]
        # the hang is injected into an Engine in the server process (--engine-thread); a stuck engine
        # process is covered in test_engine_process.py
        cmd = (
            [sys.executable, "-c", HANG_BOOTSTRAP, *args, "--engine-thread"]
            if hang
            else [sys.executable, "-m", "specd", *args]
        )
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True
        )
        self.threads = [threading.Thread(target=f, daemon=True) for f in (self._read_logs, self._read_notify)]
        for t in self.threads:
            t.start()

    def _read_logs(self):
        for line in self.proc.stderr:
            self.logs.append(line)
            try:
                rec = orjson.loads(line)
            except orjson.JSONDecodeError:
                continue
            if not isinstance(rec, dict):
                continue
            self.recs.append((time.monotonic(), rec))
            if rec.get("msg") == "listening":
                self.port = rec["port"]
                self.listening.set()
            elif rec.get("msg") == "ready":
                self.ready_logged.set()

    def _read_notify(self):
        while not self.stop.is_set():
            try:
                data = self.sock.recv(4096).decode()
            except (TimeoutError, BlockingIOError):
                continue
            except OSError:
                return
            now = time.monotonic()
            for state in data.split("\n"):
                self.msgs.append((now, state))
                if state == "READY=1" and self.port is not None:
                    self.ready_readyz = _http(self.port, "/readyz")  # what systemd's dependants would see

    def states(self) -> list:
        return [s for _, s in self.msgs]

    def times(self, state: str, since: float = 0.0, until: float = float("inf")) -> list:
        return [t for t, s in self.msgs if s == state and since <= t <= until]

    def wait_state(self, state: str, timeout: float) -> float:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            t = self.times(state)
            if t:
                return t[0]
            if self.proc.poll() is not None:
                break
            time.sleep(0.02)
        raise AssertionError(f"no {state} within {timeout} s; got {self.states()}\n" + "".join(self.logs[-30:]))

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        self.stop.set()
        for t in self.threads:
            t.join(10)
        self.sock.close()


def _max_gap(times: list, start: float, end: float) -> float:
    pts = [start] + [t for t in times if start <= t <= end] + [end]
    return max(b - a for a, b in zip(pts, pts[1:]))


def _stream(port, prompt, max_tokens, seconds):
    """Stream greedy requests back to back for at least ``seconds``; returns tokens received."""
    tokens, end = 0, time.monotonic() + seconds
    with connect(f"ws://127.0.0.1:{port}/ws") as ws:
        n = 0
        while time.monotonic() < end:
            rid = f"s{n}"
            n += 1
            ws.send(
                orjson.dumps(
                    {
                        "type": "generate",
                        "id": rid,
                        "prompt": prompt,
                        "max_tokens": max_tokens,
                        "ignore_eos": True,
                        "temperature": 0.0,
                        "speculation": {"mode": "off"},
                    }
                ).decode()
            )
            while True:
                m = orjson.loads(ws.recv(timeout=60))
                if m["type"] == "delta":
                    tokens += len(m["token_ids"])
                    continue
                assert m["type"] == "done" and m["finish_reason"] == "length", m
                break
    return tokens


@pytest.fixture(scope="module")
def daemons(tmp_path_factory):
    """Both daemons start at once (their start-up, mostly imports, overlaps): {"plain": ..., "hang": ...}."""
    d = {name: FakeSystemd(tmp_path_factory.mktemp(name), hang=name == "hang") for name in ("plain", "hang")}
    yield d
    for sd in d.values():
        sd.close()


def test_ready_watchdog_stopping(daemons):
    sd = daemons["plain"]
    polls: list = []  # (monotonic time, /readyz status) before READY=1

    def poll_readyz():
        sd.listening.wait(120)
        while not sd.times("READY=1") and sd.proc.poll() is None:
            polls.append((time.monotonic(), _http(sd.port, "/readyz")))
            time.sleep(0.02)

    poller = threading.Thread(target=poll_readyz, daemon=True)
    poller.start()
    try:
        t_ready = sd.wait_state("READY=1", 120)
        poller.join(10)
        assert sd.ready_readyz == 200, f"READY=1 sent while /readyz answered {sd.ready_readyz}"
        t_ready_log = next(t for t, r in sd.recs if r.get("msg") == "ready")
        t_listen = next(t for t, r in sd.recs if r.get("msg") == "listening")
        assert t_listen <= t_ready
        # before the daemon logged "ready", /readyz never claimed readiness (the port opens first: 503 loading)
        early = [st for t, st in polls if t < t_ready_log - 0.05]
        assert all(st in (503, None) for st in early), early
        assert sd.states().count("READY=1") == 1
        assert _http(sd.port, "/healthz") == 200

        interval = WATCHDOG_USEC / 1e6
        # idle
        t0 = time.monotonic()
        time.sleep(2.5)
        t1 = time.monotonic()
        idle_pings = sd.times("WATCHDOG=1", t0, t1)
        assert len(idle_pings) >= 2, sd.states()
        assert _max_gap(idle_pings, t0, t1) < interval, idle_pings
        # streaming
        t0 = time.monotonic()
        tokens = _stream(sd.port, "Once upon a time", 200, seconds=2.5)
        t1 = time.monotonic()
        busy_pings = sd.times("WATCHDOG=1", t0, t1)
        assert tokens >= 200 and len(busy_pings) >= 2, (tokens, sd.states())
        assert _max_gap(busy_pings, t0, t1) < interval, busy_pings
        # SIGTERM: STOPPING=1 and a clean exit
        t_term = time.monotonic()
        sd.proc.send_signal(signal.SIGTERM)
        t_stop = sd.wait_state("STOPPING=1", 30)
        assert t_stop >= t_term
        assert sd.proc.wait(60) == 0, "".join(sd.logs[-30:])
        states = sd.states()
        assert states.index("READY=1") < states.index("STOPPING=1")
        assert "READY=1" not in states[states.index("STOPPING=1") :]
    finally:
        sd.close()


def test_engine_hang_stops_watchdog(daemons):
    sd = daemons["hang"]
    try:
        sd.wait_state("READY=1", 120)
        assert sd.ready_readyz == 200
        interval = WATCHDOG_USEC / 1e6
        time.sleep(1.5)
        assert sd.times("WATCHDOG=1", time.monotonic() - 1.5), "no watchdog pings before the hang"
        with connect(f"ws://127.0.0.1:{sd.port}/ws") as ws:
            ws.send(
                orjson.dumps({"type": "generate", "id": "h", "prompt": "Once upon a time", "max_tokens": 8}).decode()
            )
            end = time.monotonic() + 30
            while not any(r.get("msg") == "test-hang" for _, r in list(sd.recs)):
                assert time.monotonic() < end, "the engine step never started"
                time.sleep(0.02)
            t_hang = next(t for t, r in list(sd.recs) if r.get("msg") == "test-hang")
            # a step counts as stuck after interval/2; a ping already in flight may still land after that
            quiet_from = t_hang + interval / 2 + interval / 2 + 0.7
            time.sleep(max(0.0, quiet_from - time.monotonic()) + 2 * interval)
            late = sd.times("WATCHDOG=1", quiet_from)
            assert late == [], f"watchdog pings kept coming after the engine hung: {late}"
            assert _http(sd.port, "/healthz") == 503
            # systemd's WatchdogSignal (SIGABRT): faulthandler dumps the stuck thread's stack
            sd.proc.send_signal(signal.SIGABRT)
            assert sd.proc.wait(30) == -signal.SIGABRT
        for t in sd.threads[:1]:
            t.join(10)
        dump = "".join(sd.logs)
        assert "Fatal Python error: Aborted" in dump and "in hang" in dump, dump[-3000:]
        assert "STOPPING=1" not in sd.states()
    finally:
        sd.close()
