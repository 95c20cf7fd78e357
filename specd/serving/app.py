"""``specd serve``: load the models, serve HTTP + websockets (+ gRPC), drain on SIGTERM, exit 0.

Order of events:

1. listen on ``--host:--port`` (uvicorn + Starlette, ``specd.serving.http_server``): ``/healthz`` 200,
   ``/readyz`` 503 "loading", new requests get ``overloaded``;
2. load target + draft and run a short warm-up generation (in a worker thread, or in the engine
   process: ``specd.engine.links.ProcessLink``, ``specd.serving.engine_proc``, which ``specd serve``
   starts before importing this module, ``specd.engine.spawn``); the server's tokenizer loads
   meanwhile; the row timings that seed the cost model run later, while the engine is idle
   (``specd.engine.warmup.Seeding``), unless a previous start cached them;
3. start the engine client (``AsyncEngine``) and gRPC (``--grpc-port``, when ``specd.serving.grpc_server``
   is importable); ``/readyz`` turns 200; systemd gets ``READY=1``;
4. SIGTERM / SIGINT: ``STOPPING=1``, ``/readyz`` 503 at once, new requests get ``shutting_down``,
   running ones get ``--drain-timeout`` seconds to finish and are then cancelled; websockets close
   with 1001; exit status 0. A second signal cuts the drain short.

systemd watchdog: with ``WATCHDOG_USEC`` set, ``WATCHDOG=1`` goes out every ``WATCHDOG_USEC / 2``
while ``AsyncEngine.unhealthy_reason()`` is None (requests outstanding get answers within that
half-interval, fewer than ``--max-failed-steps`` failed steps in a row, queued work being served), so
a hung or failing engine gets restarted. Without systemd, an engine unhealthy for
``--unhealthy-exit-s`` stops the daemon with exit status 1 (``App.exit_code``). Logs are JSON lines on
stderr, one per finished request with its speculation stats.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys
import time
from pathlib import Path

import orjson
from starlette.routing import WebSocketRoute

from specd.engine.health import DEFAULT_MAX_FAILED_STEPS
from specd.engine.loop import DEFAULT_STREAM_INTERVAL_S
from specd.serving import notify
from specd.serving.asgi import build_app
from specd.serving.async_engine import AsyncEngine
from specd.serving.auth import Auth
from specd.serving.frontend import Frontend
from specd.serving.http_server import HttpServer
from specd.serving.logs import log_request, setup_logging
from specd.serving.metrics import Metrics
from specd.serving.openai_routes import OpenAIFront
from specd.serving.response_store import ResponseStore
from specd.serving.responses_api import ResponsesAPI
from specd.serving.responses_ws import ResponsesSocket
from specd.serving.ws import HARD_LIMIT_FACTOR, WSServer

log = logging.getLogger("specd.serve")

DEFAULT_WATCHDOG_TIMEOUT_S = 120.0  # engine "stuck" threshold without systemd (for /healthz)
DEFAULT_UNHEALTHY_EXIT_S = 60.0  # --unhealthy-exit-s


def stream_interval_s(args) -> float:
    """``--stream-interval-ms`` in seconds (the default where an args object lacks it; ``HandOff``
    refuses a negative one)."""
    ms = getattr(args, "stream_interval_ms", None)
    return DEFAULT_STREAM_INTERVAL_S if ms is None else ms / 1000.0


def served_model_name(args) -> str:
    """The model id of the OpenAI routes: the target's folder or GGUF file name, without ``.gguf``."""
    target = getattr(args, "target", None)
    if not target:
        return "specd"
    name = Path(str(target).rstrip("/")).name
    return name[: -len(".gguf")] if name.lower().endswith(".gguf") else name


def _frontend(args, metrics: Metrics) -> Frontend:
    return Frontend(
        auth=Auth(getattr(args, "api_key", None), getattr(args, "allowed_origins", "")),
        metrics=metrics,
        max_message_bytes=getattr(args, "max_message_bytes", 1 << 20),
        max_connections=getattr(args, "max_connections", 256),
        model_name=served_model_name(args),
        created=int(time.time()),
    )


class App:
    """The daemon. ``engine``: an already built Engine (tests); else built from ``args``, in the engine
    process ``spawned`` when given (``specd.engine.spawn``: started before the server's imports)."""

    def __init__(self, args, engine=None, spawned=None):
        self.args = args
        self._engine = engine
        self._spawned = spawned
        self.ae: AsyncEngine | None = None
        self.grpc = None
        self.metrics = Metrics(
            lambda: self.ae,
            ready_getter=lambda: self.front.ready,
            connections_getter=lambda: self.front.open_websockets,
            log_request=log_request,
            replica_getter=self._replica,
        )
        self.front = _frontend(args, self.metrics)
        self.ws = WSServer(self.front)
        hard = self.front.max_message_bytes * HARD_LIMIT_FACTOR + 65536
        self.openai = OpenAIFront(self.front)
        self.responses = ResponsesAPI(self.openai, ResponseStore())
        self.responses_ws = ResponsesSocket(self.responses)
        routes = self.openai.routes() + self.responses.routes() + self.openai.fallback()
        ws_routes = [WebSocketRoute("/v1/responses", self.responses_ws)]
        self.http = HttpServer(build_app(self.ws, routes, ws_routes), ws_max_size=hard)
        self.stop_requested: asyncio.Event | None = None
        self.force: asyncio.Event | None = None
        self._watchdog_task: asyncio.Task | None = None
        self._health_task: asyncio.Task | None = None
        self.exit_code = 0  # 1 after the engine stayed unhealthy past --unhealthy-exit-s
        self.port: int | None = None
        self._shut_down = False
        self.stopped_while_loading = False
        self._link = None  # the ProcessLink being loaded, until an AsyncEngine owns it

    def _replica(self) -> str | None:
        """This daemon's ``replica`` label: ``--replica``, else ``<hostname>:<port>`` once listening."""
        name = getattr(self.args, "replica", None)
        if name:
            return name
        return f"{socket.gethostname()}:{self.port}" if self.port else None

    # start ----------------------------------------------------------------------------------------
    async def start(self) -> None:
        a = self.args
        if self.stop_requested is None:
            self.stop_requested = asyncio.Event()
            self.force = asyncio.Event()
        await self.http.listen(a.host, a.port)
        self.port = self.http.port
        log.info(
            "listening", extra={"fields": {"host": a.host, "port": self.port, "ws": f"ws://{a.host}:{self.port}/ws"}}
        )
        wd = notify.watchdog_interval()
        if wd is not None:
            self._watchdog_task = asyncio.get_running_loop().create_task(self._watchdog(wd))
        t0 = time.monotonic()
        engine = self._engine
        if engine is None:
            engine = await self._load_in_thread()
        ae = await self._start_engine(engine, wd)
        await self._start_grpc(ae)
        lim = ae.limits
        fields = {"load_s": round(time.monotonic() - t0, 3), "max_model_len": lim.max_model_len}
        fields.update(kv_blocks=lim.num_blocks, draft=lim.has_draft, model=self.front.model_name)
        log.info("ready", extra={"fields": fields})
        notify.notify("READY=1\nSTATUS=serving")

    async def _start_engine(self, engine, wd: float | None) -> AsyncEngine:
        a = self.args
        ae = AsyncEngine(
            engine,
            max_queue=getattr(a, "max_queue", 256),
            watchdog_timeout_s=wd / 2 if wd else DEFAULT_WATCHDOG_TIMEOUT_S,
            stream_interval_s=stream_interval_s(a),
            max_failed_steps=getattr(a, "max_failed_steps", DEFAULT_MAX_FAILED_STEPS),
        )
        ae.listeners.append(self.metrics.on_step)
        await ae.start()
        self._link = None  # (ae.stop() closes it now)
        self.ae = self.front.ae = ae
        self._health_task = asyncio.get_running_loop().create_task(
            self._health_monitor(float(getattr(a, "unhealthy_exit_s", DEFAULT_UNHEALTHY_EXIT_S)))
        )
        return ae

    async def _start_grpc(self, ae: AsyncEngine) -> None:
        a = self.args
        grpc_port = getattr(a, "grpc_port", 0)
        if not grpc_port:
            return
        try:
            from specd.serving.grpc_server import start_grpc_server
        except ImportError as e:
            log.warning("gRPC disabled: %s", e)
            return
        self.grpc = await start_grpc_server(
            ae,
            a.host,
            grpc_port,
            api_key=getattr(a, "api_key", None),
            max_message_bytes=getattr(a, "max_message_bytes", 1 << 20),
        )
        log.info("grpc listening", extra={"fields": {"host": a.host, "port": grpc_port}})

    async def _load_in_thread(self):
        """``_load`` in a daemon thread: a signal during a long load can exit without waiting for it."""
        import threading

        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        def work():
            try:
                r = self._load()
            except BaseException as e:  # noqa: BLE001
                loop.call_soon_threadsafe(lambda err=e: fut.done() or fut.set_exception(err))
            else:
                loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(r))

        threading.Thread(target=work, name="specd-load", daemon=True).start()
        return await fut

    def _load(self):
        from specd.options import engine_config

        a = self.args
        in_thread = getattr(a, "engine_thread", True)
        log.info(
            "loading models",
            extra={"fields": {"target": a.target, "draft": a.draft, "engine": "thread" if in_thread else "process"}},
        )
        if not in_thread:  # the default for `specd serve`: the engine steps in its own process
            from specd.engine.links import ProcessLink
            from specd.serving.engine_proc import ENTRY

            spawned, self._spawned = self._spawned, None
            self._link = ProcessLink(
                engine_config(a),
                split_cpus=getattr(a, "cpu_split", False),
                stream_interval_s=stream_interval_s(a),
                entry=ENTRY,
                spawned=spawned,
            )
            return self._link
        from specd.engine.engine import Engine  # (the engine's imports: torch, the model; not in this branch above)
        from specd.engine.links import ThreadLink
        from specd.engine.warmup import CostCache, warm_up
        from specd.model.cpu import set_threads

        cfg = engine_config(a)
        set_threads(cfg.threads)
        engine = Engine(cfg)
        seeding = warm_up(engine, defer=True, cache=CostCache.for_engine(engine, cfg.target))
        # (the row timings run in the engine thread's idle moments, after ready)
        return ThreadLink(engine, stream_interval_s(a), idle=seeding.step if seeding is not None else None)

    async def _watchdog(self, interval: float) -> None:
        """WATCHDOG=1 every interval/2 while loading (bounded by systemd's start timeout) or while the
        engine completes steps; a stuck or failing engine stops the pings and systemd restarts us."""
        while True:
            sick = self.ae.unhealthy_reason() if self.ae is not None else None
            if sick is None:
                notify.notify("WATCHDOG=1")
            else:
                log.error("engine unhealthy (%s): withholding the systemd watchdog ping", sick)
            await asyncio.sleep(interval / 2)

    async def _health_monitor(self, exit_after_s: float) -> None:
        """Logs when the engine turns unhealthy and when it recovers; once it has been unhealthy for
        ``exit_after_s`` (``--unhealthy-exit-s``; 0 = never), stops the daemon with exit status 1 so
        that the service manager restarts it."""
        since = None
        while True:
            sick = self.ae.unhealthy_reason() if self.ae is not None and not self.ae.draining else None
            now = time.monotonic()
            if sick is not None and since is None:
                since = now
                log.error("engine unhealthy: %s", sick)
            elif sick is None and since is not None:
                log.warning("engine healthy again after %.1f s", now - since)
                since = None
            if sick is not None and exit_after_s > 0 and not self.ae.link.alive:
                # the engine process / thread is gone (e.g. a tensor-parallel rank died): it will not recover
                log.critical("engine stopped (%s): exiting for the service manager to restart", sick)
                self.exit_code = 1
                self.request_stop(force=True)
                return
            if since is not None and exit_after_s > 0 and now - since >= exit_after_s:
                log.critical(
                    "engine unhealthy for %.0f s (%s): exiting for the service manager to restart", now - since, sick
                )
                self.exit_code = 1
                self.request_stop(force=True)
                return
            await asyncio.sleep(min(0.5, exit_after_s / 4) if exit_after_s > 0 else 0.5)

    # stop -----------------------------------------------------------------------------------------
    def request_stop(self, force: bool = False) -> None:
        """Thread-unsafe (call on the loop); a second call (or force) cuts the drain short."""
        if self.stop_requested.is_set() or force:
            self.force.set()
        self.stop_requested.set()
        self.front.draining = True

    async def _drain(self, ae: AsyncEngine) -> None:
        timeout = float(getattr(self.args, "drain_timeout", 30.0))
        log.info("draining", extra={"fields": {"requests": ae.num_requests, "timeout_s": timeout}})
        drain = asyncio.ensure_future(ae.drain(timeout))
        force = asyncio.ensure_future(self.force.wait())
        await asyncio.wait([drain, force], return_when=asyncio.FIRST_COMPLETED)
        if not drain.done():
            await ae.drain(0.0)
            drain.cancel()
        force.cancel()
        await asyncio.gather(drain, force, return_exceptions=True)

    async def _close_front(self) -> None:
        """Websockets close with 1001 (going away); then the HTTP server stops."""
        await self.ws.close(1001)
        await self.responses_ws.close(1001)
        await self.http.close()

    async def shutdown(self) -> None:
        if self._shut_down:
            return
        self._shut_down = True
        notify.notify("STOPPING=1\nSTATUS=draining")
        self.front.draining = True
        ae = self.ae
        if ae is not None:
            await self._drain(ae)
        if self.grpc is not None:
            try:
                await self.grpc.stop(1.0)
            except Exception:  # noqa: BLE001
                log.exception("gRPC stop failed")
        await self._close_front()
        if ae is not None:
            await ae.stop()
        await self._close_link()
        for task in (self._watchdog_task, self._health_task):
            if task is not None and task is not asyncio.current_task():
                task.cancel()
        log.info("stopped")

    async def _close_link(self) -> None:
        """An engine process no AsyncEngine took over (startup failed or was interrupted)."""
        link, self._link = self._link, None
        spawned, self._spawned = self._spawned, None
        for closing in (link, spawned):
            if closing is not None:
                await asyncio.get_running_loop().run_in_executor(None, closing.close)

    async def main(self) -> int:
        loop = asyncio.get_running_loop()
        self.stop_requested = asyncio.Event()
        self.force = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)
        starter = asyncio.ensure_future(self.start())
        stopper = asyncio.ensure_future(self.stop_requested.wait())
        await asyncio.wait([starter, stopper], return_when=asyncio.FIRST_COMPLETED)
        if not starter.done():  # signal while loading: nothing to drain; the loader is a daemon thread
            starter.cancel()
            await asyncio.gather(starter, return_exceptions=True)
            notify.notify("STOPPING=1")
            await self._close_front()
            if self.ae is not None:
                await self.ae.stop()
            await self._close_link()
            log.info("stopped while loading")
            self.stopped_while_loading = True
            return 0
        if starter.exception() is not None:
            e = starter.exception()
            log.error("startup failed: %s", e, exc_info=e if not isinstance(e, (OSError, ValueError)) else None)
            stopper.cancel()
            await self._close_front()
            await self._close_link()
            return 1
        await stopper
        await self.shutdown()
        return self.exit_code

    def _on_signal(self, sig) -> None:
        log.info("signal", extra={"fields": {"signal": signal.Signals(sig).name}})
        self.request_stop()


def run_serve(args, spawned=None) -> int:
    """``specd serve`` with ``args``; ``spawned``: its engine process, started already."""
    setup_logging(getattr(args, "log_level", "info"))
    app = App(args, spawned=spawned)
    try:
        import uvloop

        rc = uvloop.run(app.main())
    except ImportError:  # pragma: no cover
        rc = asyncio.run(app.main())
    if app.stopped_while_loading:  # don't wait for the loader thread (interpreter exit would)
        logging.shutdown()
        sys.stdout.flush()
        os._exit(rc)
    return rc


class ServerProcess:
    """``python -m specd serve ARGS`` as a child process (tests, benchmarks, soak).

    ``launch()`` starts it and a thread that keeps its stderr (``.logs``) and reads the JSON log:
    ``.port`` from the "listening" line, ``.ready`` set on the "ready" line. ``wait_ready()`` waits for
    that (killing the child and raising with the log tail if it dies or times out); ``start()`` = both.
    """

    def __init__(self, serve_args, env=None, cwd=None):
        self.cmd = [sys.executable, "-m", "specd", "serve", *serve_args]
        self.env, self.cwd = env, cwd
        self.logs: list = []
        self.port: int | None = None
        self.proc = None
        self.reader = None
        import threading

        self.ready = threading.Event()

    def launch(self) -> ServerProcess:
        import subprocess
        import threading

        self.proc = subprocess.Popen(
            self.cmd, cwd=self.cwd, env=self.env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True
        )
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        return self

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.logs.append(line)
            try:
                rec = orjson.loads(line)
            except orjson.JSONDecodeError:
                continue
            if isinstance(rec, dict):
                if rec.get("msg") == "listening":
                    self.port = rec["port"]
                elif rec.get("msg") == "ready":
                    self.ready.set()

    def wait_ready(self, timeout: float = 300.0) -> ServerProcess:
        end = time.monotonic() + timeout
        while not self.ready.wait(0.2):
            if self.proc.poll() is not None or time.monotonic() > end:
                self.proc.kill()
                raise RuntimeError(f"specd serve did not get ready: {' '.join(self.cmd)}\n" + "".join(self.logs[-50:]))
        return self

    def start(self, timeout: float = 300.0) -> ServerProcess:
        return self.launch().wait_ready(timeout)


class ServerThread:
    """Run an ``App`` on its own event loop in a background thread (tests, benchmarks).

    ``ServerThread(args, engine).start()`` returns once the server is ready; ``.port``, ``.app``,
    ``.call(coro_fn)`` (run a coroutine function on the server loop), ``.stop()`` drains and stops.
    """

    def __init__(self, args, engine=None):
        import threading

        self.app = App(args, engine)
        self.loop = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="specd-server", daemon=True)

    def _run(self) -> None:
        try:
            import uvloop

            self.loop = uvloop.new_event_loop()
        except ImportError:  # pragma: no cover
            self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self.app.start())
        except BaseException as e:  # noqa: BLE001
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        self.loop.run_forever()
        self.loop.run_until_complete(self.loop.shutdown_asyncgens())
        self.loop.close()

    def start(self, timeout: float = 120.0) -> ServerThread:
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError("server did not start")
        if self._error is not None:
            raise self._error
        return self

    @property
    def port(self) -> int:
        return self.app.port

    def call(self, fn, timeout: float = 60.0):
        """Run ``fn()`` (a coroutine function or a plain function) on the server loop; its result."""

        async def wrap():
            r = fn()
            if asyncio.iscoroutine(r):
                r = await r
            return r

        return asyncio.run_coroutine_threadsafe(wrap(), self.loop).result(timeout)

    def stop(self, timeout: float = 60.0) -> None:
        if not self._thread.is_alive():
            return
        self.call(self.app.shutdown, timeout)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)
