"""Daemons: ``specd serve`` started for a measurement, in this process or as a child process, with one
``stop()``; and what a daemon tells over HTTP (``/metrics`` values, KV blocks in use, readiness).
"""

from __future__ import annotations

import os
import re
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from eval.harness.engines import StepLog, engine_from_flags
from eval.harness.machine import ROOT


def clean_env() -> dict:
    """This process's environment without what would change a child daemon's behaviour: ``SPECD_*``
    settings (an API key, paths) and systemd's notify/watchdog variables."""
    return {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("SPECD_") and k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC")
    }


def end_process(proc: subprocess.Popen, timeout: float = 60.0) -> int:
    """SIGTERM ``proc``, SIGKILL it if it has not exited after ``timeout`` seconds; its exit status."""
    proc.terminate()
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


@dataclass
class Daemon:
    """A running ``specd serve`` on a free loopback port: in this process (``thread``: a
    ``ServerThread``; ``engine`` and ``steplog`` its engine and the :class:`StepLog` following its steps)
    or a child process (``process``: a ``ServerProcess``; ``logs`` its stderr lines)."""

    port: int
    flags: list
    thread: Any = None
    process: Any = None
    engine: Any = None
    steplog: StepLog | None = None
    exit_status: int | None = field(default=None, init=False)

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/ws"

    @property
    def pid(self) -> int:
        """The process serving (this one when in process): measure its CPU and memory."""
        return self.process.proc.pid if self.process is not None else os.getpid()

    @property
    def app(self):
        return self.thread.app

    @property
    def logs(self) -> list:
        return self.process.logs if self.process is not None else []

    def stop(self, timeout: float = 60.0) -> int | None:
        """Drain and stop. A child gets SIGTERM (killed after ``timeout`` seconds); its exit status
        is returned (and kept in ``exit_status``); in process: None."""
        if self.thread is not None:
            self.thread.stop(timeout)
            return None
        self.exit_status = end_process(self.process.proc, timeout)
        return self.exit_status


def start_daemon(
    flags: list, *, child: bool = False, target=None, draft=None, env: dict | None = None, timeout: float = 300.0
) -> Daemon:
    """Start ``specd serve FLAGS`` on a free port (``--port 0 --grpc-port 0`` are added) and return
    once it is ready.

    In process (default): an ``Engine`` sharing ``target``/``draft`` when given, warmed up like the
    server's, served by a ``ServerThread`` (log level warning unless FLAGS say otherwise) with a
    :class:`StepLog` following its steps. ``child=True``: ``python -m specd serve`` as a child process
    in the repository root, with :func:`clean_env` unless ``env`` is given (log level info: its
    "listening"/"ready" lines are how readiness is seen)."""
    base = ["--port", "0", "--grpc-port", "0"]
    if child:
        from specd.serving.app import ServerProcess

        args = [*base, "--log-level", "info", *flags]
        sp = ServerProcess(args, env=clean_env() if env is None else env, cwd=ROOT).start(timeout)
        assert sp.port is not None  # known once ready
        return Daemon(sp.port, list(flags), process=sp)
    from specd.options import serve_parser
    from specd.serving.app import ServerThread

    args = [*base, "--log-level", "warning", *flags]
    eng = engine_from_flags(args, target, draft, warm=True)
    steplog = StepLog(eng).follow()  # (before the server's engine thread steps it)
    srv = ServerThread(serve_parser().parse_args(args), eng).start(timeout)
    return Daemon(srv.port, list(flags), thread=srv, engine=eng, steplog=steplog)


# what a daemon tells over HTTP ------------------------------------------------------------------
def http_base(ws_url: str) -> str:
    """``ws://host:port/ws`` -> ``http://host:port`` (wss -> https)."""
    u = urlsplit(ws_url)
    return f"{'https' if u.scheme == 'wss' else 'http'}://{u.netloc}"


def http_get(port: int, path: str, timeout: float = 10.0) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as r:
        return r.read().decode()


def metric_value(text: str, name: str) -> float | None:
    """The first sample of metric ``name`` in Prometheus text, None when absent."""
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return None


def kv_blocks_used(ws_url: str, api_key):
    """(target, draft) from /metrics' specd_kv_blocks_used, or None."""
    req = urllib.request.Request(
        http_base(ws_url) + "/metrics", headers={"Authorization": f"Bearer {api_key}"} if api_key else {}
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            text = r.read().decode()
    except (OSError, urllib.error.HTTPError):
        return None
    got = dict(re.findall(r'^specd_kv_blocks_used\{[^}]*cache="(\w+)"[^}]*\}\s+(\S+)$', text, re.M))
    if not got:
        return None
    return int(float(got.get("target", 0))), int(float(got.get("draft", 0)))


def wait_kv_freed(url: str, api_key, timeout: float = 30.0):
    """``specd_kv_blocks_used`` (target, draft) once it reads (0, 0), or its last value after ``timeout``."""
    kv, end = None, time.monotonic() + timeout
    while time.monotonic() < end:
        kv = kv_blocks_used(url, api_key)
        if kv == (0, 0):
            break
        time.sleep(0.2)
    return kv
