"""deploy/nginx/specd.conf, run as shipped (only its ports changed) in front of two `specd serve` replicas.

- 20 two-turn conversations over the websocket protocol, each turn on a NEW connection carrying
  `X-Conversation-Id`: every second turn lands on the replica of its first turn (the replica whose
  finished-request counter moved on /metrics) and hits its prefix cache there (that replica's
  `specd_prefix_cache_hit_rate` rises: the first turns miss, the second turns reuse most of their prompt).
- Connections without a conversation go to the replica with fewer open connections (least_conn).
- Killing one replica mid-run loses only its in-flight requests (a closed stream or an error), the other
  replica's streams finish, and every new conversation goes to the survivor (nginx retries the upgrade
  on the next replica and marks the dead one down).
- Against two stand-in HTTP upstreams (no model): server-sent events pass through unbuffered, and the
  conversation header / `?conversation=` query pin plain HTTP requests to one upstream.

nginx is Debian's package (`make sysdeps`); the test installs it with apt-get when it runs as root and
nginx is missing, and skips (with the reason) only where it can be neither found nor installed.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import orjson
import pytest
from conftest import DRAFT, ROOT, TARGET, http_status, metrics_text, ws_collect
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

pytestmark = pytest.mark.timeout(240)

CONF = ROOT / "deploy" / "nginx" / "specd.conf"
SHIPPED_SERVERS = ("127.0.0.1:8801", "127.0.0.1:8802")
SHIPPED_LISTEN = "listen 8800;"
STORY = (
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the park with her "
    "big red ball. One day, she saw a small dog sitting under a tree."
)


# nginx ----------------------------------------------------------------------------------------------
def _find_nginx() -> str | None:
    exe = shutil.which("nginx")
    return exe or next((p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if os.access(p, os.X_OK)), None)


@pytest.fixture(scope="module")
def nginx_exe() -> str:
    exe = _find_nginx()
    if exe is None and os.geteuid() == 0 and shutil.which("apt-get"):
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        try:
            subprocess.run(["apt-get", "install", "-y", "-qq", "nginx"], env=env, capture_output=True, timeout=600)
        except (OSError, subprocess.TimeoutExpired):
            pass
        exe = _find_nginx()
    if exe is None:
        pytest.skip("nginx is not installed and could not be installed (needs root + apt-get: `make sysdeps`)")
    return exe


def free_ports(n: int) -> list:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def render_conf(listen: int, upstreams: list) -> str:
    """The shipped config with its listen port and its two replica addresses replaced (nothing else)."""
    text = CONF.read_text()
    assert text.count(SHIPPED_LISTEN) == 1, "deploy/nginx/specd.conf must have one `listen 8800;`"
    text = text.replace(SHIPPED_LISTEN, f"listen 127.0.0.1:{listen};")
    for shipped, port in zip(SHIPPED_SERVERS, upstreams):
        assert text.count(f"server {shipped} ") == 2, f"{shipped} must be listed in both upstream blocks"
        text = text.replace(f"server {shipped} ", f"server 127.0.0.1:{port} ")
    return text


class Nginx:
    """nginx in the foreground with its own prefix, pid, logs and temp paths; the shipped file included
    from a minimal main config (as Debian's /etc/nginx/nginx.conf includes conf.d/*.conf)."""

    def __init__(self, exe: str, workdir: Path, conf: str, port: int):
        self.dir, self.port = workdir, port
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / "specd.conf").write_text(conf)
        user = "user root root;\n" if os.geteuid() == 0 else ""
        temps = " ".join(f"{k}_temp_path {workdir / k};" for k in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
        (workdir / "nginx.conf").write_text(
            f"daemon off;\n{user}worker_processes 2;\npid {workdir / 'nginx.pid'};\n"
            f"error_log {workdir / 'error.log'} info;\nevents {{ worker_connections 1024; }}\n"
            f"http {{\n  access_log {workdir / 'access.log'};\n  {temps}\n  include {workdir / 'specd.conf'};\n}}\n"
        )
        args = [exe, "-p", str(workdir), "-c", str(workdir / "nginx.conf"), "-e", str(workdir / "error.log")]
        t = subprocess.run([*args, "-t"], capture_output=True, text=True, timeout=30)
        assert t.returncode == 0, f"nginx -t rejected the shipped config:\n{t.stderr}"
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        end = time.monotonic() + 15
        while http_status(port, "/nothing") is None:
            assert self.proc.poll() is None, f"nginx exited: {self.log()}"
            assert time.monotonic() < end, f"nginx did not open port {port}: {self.log()}"
            time.sleep(0.05)

    def log(self) -> str:
        p = self.dir / "error.log"
        return p.read_text()[-3000:] if p.exists() else ""

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


# replicas -------------------------------------------------------------------------------------------
class Replica:
    """`python -m specd serve` on the tiny pair, in its own session (its engine process included)."""

    def __init__(self, port: int, log: Path):
        self.port, self.log_path = port, log
        cmd = [sys.executable, "-m", "specd", "serve", "--target", str(TARGET), "--draft", str(DRAFT)]
        cmd += ["--device", "cpu", "--dtype", "float32", "--num-blocks", "256", "--host", "127.0.0.1"]
        cmd += ["--port", str(port), "--grpc-port", "0", "--log-level", "warning", "--drain-timeout", "2"]
        env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        with open(log, "wb") as f:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=f, start_new_session=True)

    def wait_ready(self, deadline: float) -> None:
        while http_status(self.port, "/readyz") != 200:
            assert self.proc.poll() is None, f"replica :{self.port} exited:\n{self.log_path.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"replica :{self.port} not ready:\n{self.log_path.read_text()[-3000:]}"
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, 9)  # its own session: the engine process too
        except ProcessLookupError:
            pass
        self.proc.wait(10)


@pytest.fixture(scope="module")
def fleet(nginx_exe, tmp_path_factory):
    d = tmp_path_factory.mktemp("fleet")
    lb, *ports = free_ports(3)
    replicas = [Replica(p, d / f"replica-{p}.log") for p in ports]
    nginx = None
    try:
        deadline = time.monotonic() + 120
        for r in replicas:
            r.wait_ready(deadline)
        nginx = Nginx(nginx_exe, d / "nginx", render_conf(lb, ports), lb)
        assert http_status(lb, "/readyz") == 200
        yield SimpleNamespace(lb=lb, ports=ports, replicas=replicas, nginx=nginx)
    finally:
        if nginx is not None:
            nginx.stop()
        for r in replicas:
            r.stop()


# metrics --------------------------------------------------------------------------------------------
def scrape(port: int) -> dict:
    """One replica's samples (its own ``replica`` label checked and removed: see metrics_text)."""
    out = {}
    for line in metrics_text(port).splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


VERIFY = "specd_spec_decode_verify_steps_total"  # from the engine's snapshot, like the prefix-cache gauge
HIT_RATE = "specd_prefix_cache_hit_rate"


def finished(m: dict) -> float:
    """Finished requests of one replica (specd_requests_total over every finish reason)."""
    return sum(v for k, v in m.items() if k.startswith("specd_requests_total{"))


def landed(ports: list, before: list, steps: int, n: int = 1, timeout: float = 10.0) -> tuple:
    """(index of the replica whose finished count rose by ``n`` while the others' stayed, new scrapes).

    Waits until that replica's engine snapshot (the prefix-cache gauge, the speculation counters) also
    counts the requests' ``steps`` target steps: the engine sends it when it goes idle, just after the
    request's last output, so a scrape right after the ``done`` frame may still show the previous one.
    """
    end = time.monotonic() + timeout
    while True:
        now = [scrape(p) for p in ports]
        moved = [finished(a) - finished(b) for a, b in zip(now, before)]
        fresh = [a[VERIFY] - b[VERIFY] >= steps for a, b in zip(now, before)]
        if (sum(moved) >= n and all(f for f, d in zip(fresh, moved) if d)) or time.monotonic() > end:
            break
        time.sleep(0.02)
    winners = [i for i, d in enumerate(moved) if d]
    assert len(winners) == 1 and moved[winners[0]] == n, f"finished requests moved by {moved}, want {n} on one"
    assert fresh[winners[0]], "the replica's engine snapshot never counted the request's steps"
    return winners[0], now


# websocket client -----------------------------------------------------------------------------------
def open_ws(lb: int, conversation: str | None):
    headers = {"X-Conversation-Id": conversation} if conversation else {}
    return connect(f"ws://127.0.0.1:{lb}/ws", additional_headers=headers, open_timeout=15, close_timeout=2)


def generate(ws, rid: str, prompt: str, max_tokens: int, **kw) -> None:
    msg = {"type": "generate", "id": rid, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **kw}
    ws.send(orjson.dumps(msg).decode())


def turn(lb: int, conversation: str | None, prompt: str, max_tokens: int = 12) -> tuple:
    """One turn on a new connection through the balancer: (reply text, target steps it took)."""
    with open_ws(lb, conversation) as ws:
        generate(ws, "t", prompt, max_tokens)
        deltas, end = ws_collect(ws, "t", timeout=60)
    assert end["type"] == "done" and end["finish_reason"] in ("length", "stop"), end
    return "".join(d["text"] for d in deltas), end["spec"]["steps"]


# tests with replicas --------------------------------------------------------------------------------
def test_conversation_affinity_and_prefix_hits(fleet):
    t0 = time.monotonic()
    ports, owners = fleet.ports, {}
    before = [scrape(p) for p in ports]
    for i in range(20):
        conv, prompt = f"conv-{i}", f"Story {i}: {STORY}"  # distinct first KV blocks: turn 1 misses
        reply, steps = turn(fleet.lb, conv, prompt)
        first, before = landed(ports, before, steps)
        rate0 = before[first][HIT_RATE]
        _, steps = turn(fleet.lb, conv, prompt + reply + " Then she", max_tokens=8)
        second, before = landed(ports, before, steps)
        assert second == first, f"{conv}: turn 1 on :{ports[first]}, turn 2 on :{ports[second]}"
        rate1 = before[second][HIT_RATE]
        assert rate1 > rate0, f"{conv}: no prefix-cache hit on :{ports[second]} (hit rate {rate0} -> {rate1})"
        owners[conv] = first
    assert len(set(owners.values())) == 2, f"the hash sent every conversation to one replica: {owners}"
    spread = [list(owners.values()).count(i) for i in (0, 1)]
    print(f"20 conversations in {time.monotonic() - t0:.1f}s; per replica: {spread}")


def test_least_conn_without_conversation(fleet):
    """While one connection stays open on replica X, the next three (each closed before the next) all
    go to the other replica: the one with fewer open connections (round-robin would alternate)."""
    before = [scrape(p) for p in fleet.ports]
    with open_ws(fleet.lb, None) as held:
        generate(held, "a", "Once upon a time", 4)
        end = ws_collect(held, "a")[1]
        assert end["type"] == "done"
        busy, before = landed(fleet.ports, before, end["spec"]["steps"])
        for i in range(3):
            _, steps = turn(fleet.lb, None, f"Story {i}: Once upon a time", 4)
            idx, before = landed(fleet.ports, before, steps)
            assert idx != busy, f"connection {i} went to the replica that already had one open"


def map_conversations(fleet, prefix: str, per_replica: int = 2) -> dict:
    """{replica index: [conversation ids]} for fresh ids, found with one short turn each."""
    found: dict = {0: [], 1: []}
    before = [scrape(p) for p in fleet.ports]
    for i in range(40):
        conv = f"{prefix}-{i}"
        _, steps = turn(fleet.lb, conv, "Once upon a time", 1)
        idx, before = landed(fleet.ports, before, steps)
        found[idx].append(conv)
        if min(len(v) for v in found.values()) >= per_replica:
            return {k: v[:per_replica] for k, v in found.items()}
    pytest.fail(f"40 conversations did not reach both replicas: {found}")


def _outcome(ws, rid: str, tokens: int) -> str:
    """'done:<finish_reason>:<tokens>', 'error:<code>' or 'closed' (the stream ended without an end frame);
    ``tokens``: those already read."""
    try:
        deltas, end = ws_collect(ws, rid, timeout=60)
    except ConnectionClosed:
        return "closed"
    if end["type"] == "error":
        return f"error:{end['code']}"
    return f"done:{end['finish_reason']}:{tokens + sum(len(d['token_ids']) for d in deltas)}"


LONG = 480  # tokens: a few seconds on the tiny model, so the kill lands mid-stream


def test_stop_one_replica_mid_run(fleet):
    """Runs last: kills replica 0. Its streams end closed (or with an error), replica 1's finish, and
    every new conversation goes to replica 1."""
    convs = map_conversations(fleet, "inflight")
    done_before = finished(scrape(fleet.ports[0]))
    with contextlib.ExitStack() as stack:
        conns = {c: stack.enter_context(open_ws(fleet.lb, c)) for group in convs.values() for c in group}
        for c, ws in conns.items():
            generate(ws, c, "Once upon a time", LONG, ignore_eos=True)
        first = {}
        for c, ws in conns.items():  # every request is streaming before the kill
            m = orjson.loads(ws.recv(timeout=30))
            assert m["type"] == "delta", m
            first[c] = len(m["token_ids"])
        done_at_kill = finished(scrape(fleet.ports[0]))  # counted as each request ends (server side)
        victim = fleet.replicas[0]
        victim.proc.kill()  # SIGKILL, a crash: no drain (its engine process exits when it sees it gone)
        victim.proc.wait(10)
        outcomes = {c: _outcome(ws, c, first[c]) for c, ws in conns.items()}
    assert done_at_kill == done_before, "replica 0's requests ended before the kill (make LONG longer)"
    for c in convs[0]:
        assert outcomes[c] == "closed" or outcomes[c].startswith(("error:", "done:error")), outcomes
    for c in convs[1]:
        assert outcomes[c] == f"done:length:{LONG}", f"the surviving replica's stream was lost: {outcomes}"
    assert http_status(fleet.ports[0], "/readyz") is None, "the killed replica still answers"
    survivor = fleet.ports[1]
    before = finished(scrape(survivor))
    for conv in [*convs[0], *(f"after-{i}" for i in range(8))]:  # the dead replica's conversations too
        turn(fleet.lb, conv, f"{conv}: {STORY}", 4)
    assert finished(scrape(survivor)) == before + 10, "a conversation was not served by the survivor"
    assert "connect() failed" in fleet.nginx.log(), "nginx never tried the dead replica"


# tests with stand-in upstreams (no model) -----------------------------------------------------------
class _SSEHandler(BaseHTTPRequestHandler):
    """POST /v1/chat/completions: an event, then (until the test releases it) nothing, then [DONE]."""

    protocol_version = "HTTP/1.0"
    release: threading.Event

    def do_POST(self):  # noqa: N802 - http.server's naming
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()
        self.wfile.write(b'data: {"first": true}\n\n')
        self.wfile.flush()
        self.server.release.wait(20)
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()

    def do_GET(self):  # noqa: N802
        body = str(self.server.server_port).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a):
        pass


@pytest.fixture(scope="module")
def stand_ins(nginx_exe, tmp_path_factory):
    servers = []
    for _ in range(2):
        s = ThreadingHTTPServer(("127.0.0.1", 0), _SSEHandler)
        s.daemon_threads = True
        s.release = threading.Event()
        threading.Thread(target=s.serve_forever, daemon=True).start()
        servers.append(s)
    (lb,) = free_ports(1)
    conf = render_conf(lb, [s.server_port for s in servers])
    nginx = Nginx(nginx_exe, tmp_path_factory.mktemp("nginx-sse"), conf, lb)
    yield SimpleNamespace(lb=lb, servers=servers)
    nginx.stop()
    for s in servers:
        s.release.set()
        s.shutdown()


def test_sse_is_not_buffered(stand_ins):
    """The first event reaches the client while the upstream still holds the stream open."""
    body = b'{"stream": true}'
    with socket.create_connection(("127.0.0.1", stand_ins.lb), timeout=5) as s:
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: lb\r\nContent-Type: application/json\r\n"
            b"X-Conversation-Id: sse-1\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        got = b""
        while b'{"first": true}' not in got:
            chunk = s.recv(65536)  # socket timeout 5 s: buffering would hold the event until [DONE]
            assert chunk, got
            got += chunk
        assert b"[DONE]" not in got
        for srv in stand_ins.servers:
            srv.release.set()
        while b"[DONE]" not in got:
            chunk = s.recv(65536)
            assert chunk, got
            got += chunk
    head = got.split(b"\r\n\r\n", 1)[0].decode().lower()
    assert "200 ok" in head and "text/event-stream" in head and "x-specd-upstream: 127.0.0.1:" in head


def test_http_conversation_affinity(stand_ins):
    """Plain HTTP: one conversation id (header or ?conversation=) always reaches the same upstream,
    and the ids spread over both."""
    import urllib.request

    def upstream(conv: str, via_query: bool) -> str:
        url = f"http://127.0.0.1:{stand_ins.lb}/v1/models" + (f"?conversation={conv}" if via_query else "")
        req = urllib.request.Request(url, headers={} if via_query else {"X-Conversation-Id": conv})
        with urllib.request.urlopen(req, timeout=10) as r:
            assert r.headers["X-Specd-Upstream"].endswith(":" + r.read().decode())
            return r.headers["X-Specd-Upstream"]

    seen = {}
    for i in range(16):
        got = {upstream(f"c{i}", q) for q in (False, True, False, True)}
        assert len(got) == 1, f"conversation c{i} reached {got}"
        seen[f"c{i}"] = got.pop()
    assert len(set(seen.values())) == 2, f"every conversation hashed to one upstream: {seen}"
