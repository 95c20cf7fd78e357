"""Websocket server (``/ws``, also ``/`` with an Upgrade) and the HTTP routes on the same port.

HTTP (answered in websockets' ``process_request`` hook, before any upgrade):
``/healthz`` 200 while the engine completes steps (503 with the reason when the engine thread or
process died, one step has been stuck longer than the watchdog timeout, ``--max-failed-steps`` steps
in a row failed, or queued work saw no step complete within the watchdog timeout); ``/readyz`` 200
when serving and healthy, 503 while loading, draining or unhealthy; ``/metrics`` Prometheus text (needs the API key
when one is set); ``/`` and
``/index.html`` the web chat page. Other paths: 404.

One ``Conn`` per websocket connection multiplexes requests by their client ``id``; every request has
a task that admits it and waits for its end; its ``delta`` frames and exactly one ``done`` (or an
``error`` when the request is refused before it starts) are written by the connection, which sends
each event-loop pass's frames in one socket write. Protocol: ``docs/protocol.md``.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed
from websockets.protocol import State

from specd.engine.engine import RequestError
from specd.serving import protocol as P
from specd.serving import request_build as RB
from specd.serving.engine_client import AsyncEngine, merge_outputs
from specd.serving.metrics import Metrics

log = logging.getLogger("specd.ws")

STATIC = Path(__file__).with_name("static")
WS_PATHS = ("/ws", "/")
MAX_AUTH_FAILURES = 5  # failed auth messages before the connection is closed (1008)
INLINE_TOKENIZE_CHARS = 8192  # longer prompts are tokenized in a worker thread
HARD_LIMIT_FACTOR = 4  # frames above max_message_bytes * this are refused by closing with 1009


class WSServer:
    """The websocket + HTTP front end. ``ae`` is set once the engine is loaded (None while loading)."""

    def __init__(
        self,
        *,
        api_key: str | None = None,
        allowed_origins: str = "",
        max_connections: int = 256,
        max_message_bytes: int = 1 << 20,
        metrics: Metrics | None = None,
    ):
        self.api_key = api_key or None
        origins = [o.strip().rstrip("/") for o in (allowed_origins or "").split(",") if o.strip()]
        self.any_origin = "*" in origins
        self.origins = set(origins) - {"*"}
        self.max_connections = max_connections
        self.max_message_bytes = max_message_bytes
        self.ae: AsyncEngine | None = None
        self.draining = False
        self.conns: set = set()
        self.metrics = metrics or Metrics(lambda: self.ae)
        self._serial = itertools.count()
        self._page: bytes | None = None
        # long prompts are tokenized in this one worker thread (the loop tokenizes short ones itself)
        self.tok_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specd-tokenize")
        self.server = None
        self._tcp: set = set()

    # lifecycle -----------------------------------------------------------------------------------
    async def listen(self, host: str, port: int):
        hard = self.max_message_bytes * HARD_LIMIT_FACTOR + 65536
        tcp = self._tcp

        class Tracked(ServerConnection):  # every TCP connection, handshaking ones included
            def connection_made(self, transport):
                super().connection_made(transport)
                tcp.add(self)

            def connection_lost(self, exc):
                super().connection_lost(exc)
                tcp.discard(self)

        self.server = await serve(
            self.handler,
            host,
            port,
            process_request=self.process_request,
            compression=None,
            max_size=hard,
            server_header="specd",
            ping_interval=20,
            ping_timeout=20,
            create_connection=Tracked,
        )
        return self.server

    @property
    def port(self) -> int:
        return self.server.sockets[0].getsockname()[1]

    @property
    def ready(self) -> bool:
        return self.ae is not None and self.ae.ready and not self.draining

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()  # closes open connections with 1001 (going away)
            for c in list(self._tcp):
                if c.protocol.state is State.CONNECTING and c.transport is not None:
                    c.transport.abort()  # idle pre-connected sockets (browsers) would hold us open_timeout
            await self.server.wait_closed()
        self.tok_pool.shutdown(wait=False)

    # HTTP ----------------------------------------------------------------------------------------
    def _key_ok(self, key: str | None) -> bool:
        if self.api_key is None:
            return True
        return key is not None and hmac.compare_digest(key.encode(), self.api_key.encode())

    @staticmethod
    def _bearer(request) -> str | None:
        h = request.headers.get("Authorization")
        if h is None:
            return None
        scheme, _, token = h.partition(" ")
        return token.strip() if scheme.lower() == "bearer" else ""

    def _origin_ok(self, request) -> bool:
        origin = request.headers.get("Origin")
        if origin is None or self.any_origin:
            return True  # not a browser (browsers always send Origin on websockets)
        origin = origin.rstrip("/")
        if origin in self.origins:
            return True
        if self.origins:
            return False
        # default: same host only (the page this server serves)
        try:
            u = urlsplit(origin)
        except ValueError:
            return False
        host = (request.headers.get("Host") or "").lower()
        net = (u.netloc or "").lower()
        default = {"http": ":80", "https": ":443"}.get(u.scheme, "")
        return bool(net) and (net == host or net + default == host or net == host + default)

    def _respond(
        self,
        conn: ServerConnection,
        status: int,
        body: bytes,
        ctype: str = "text/plain; charset=utf-8",
        extra: dict | None = None,
    ):
        r = conn.respond(status, "")
        r.body = body
        h = r.headers  # websockets' Headers: item assignment appends, so delete first
        for k, v in {
            "Content-Length": str(len(body)),
            "Content-Type": ctype,
            "Cache-Control": "no-store",
            "X-Content-Type-Options": "nosniff",
            **(extra or {}),
        }.items():
            if k in h:
                del h[k]
            h[k] = v
        return r

    def process_request(self, conn: ServerConnection, request):
        path = request.path.split("?", 1)[0]
        upgrade = "websocket" in request.headers.get("Upgrade", "").lower()
        if upgrade and path in WS_PATHS:
            return self._check_upgrade(conn, request)
        if path in ("/healthz", "/readyz"):
            return self._health(conn, path)
        if path == "/metrics":
            if not self._key_ok(self._bearer(request)):
                return self._respond(conn, 401, b"unauthorized\n", extra={"WWW-Authenticate": "Bearer"})
            return self._respond(conn, 200, self.metrics.render(), "text/plain; version=0.0.4; charset=utf-8")
        if path in ("/", "/index.html"):
            return self._respond(
                conn,
                200,
                self.page(),
                "text/html; charset=utf-8",
                extra={
                    "Content-Security-Policy": "default-src 'none'; script-src 'unsafe-inline'; style-src "
                    "'unsafe-inline'; connect-src 'self' ws: wss:; img-src data:",
                    "Referrer-Policy": "no-referrer",
                },
            )
        if upgrade:
            return self._respond(conn, 404, b"websocket endpoint is /ws\n")
        return self._respond(conn, 404, b"not found\n")

    def _health(self, conn: ServerConnection, path: str):
        """``/healthz``: 503 once the engine cannot complete steps (dead, stuck, failing); ``/readyz``:
        200 only while serving AND healthy, else 503 with the reason (loading, draining, unhealthy)."""
        sick = self.ae.unhealthy_reason() if self.ae is not None else None
        if path == "/healthz":
            return (
                self._respond(conn, 503, f"unhealthy: {sick}\n".encode()) if sick else self._respond(conn, 200, b"ok\n")
            )
        if self.ready and sick is None:
            return self._respond(conn, 200, b"ready\n")
        if self.draining or (self.ae is not None and self.ae.draining):
            return self._respond(conn, 503, b"draining\n")
        return self._respond(conn, 503, f"unhealthy: {sick}\n".encode() if sick else b"loading\n")

    def _check_upgrade(self, conn: ServerConnection, request):
        if not self._origin_ok(request):
            self.metrics.count_error("forbidden_origin")
            return self._respond(conn, 403, b"origin not allowed (see --allowed-origins)\n")
        key = self._bearer(request)
        if key is not None and not self._key_ok(key):
            self.metrics.count_error("unauthorized")
            return self._respond(conn, 401, b"unauthorized\n", extra={"WWW-Authenticate": "Bearer"})
        if len(self.conns) >= self.max_connections:
            self.metrics.count_error("too_many_connections")
            return self._respond(conn, 503, b"too many connections\n", extra={"Retry-After": "1"})
        conn.specd_authed = self.api_key is None or key is not None
        return None

    def page(self) -> bytes:
        if self._page is None:
            self._page = (STATIC / "index.html").read_bytes()
        return self._page

    # websocket -----------------------------------------------------------------------------------
    async def handler(self, ws: ServerConnection) -> None:
        if len(self.conns) >= self.max_connections:  # lost the race with another handshake
            await ws.close(1013, "too many connections")
            return
        c = Conn(self, ws, getattr(ws, "specd_authed", self.api_key is None), next(self._serial))
        self.conns.add(c)
        try:
            await c.run()
        finally:
            self.conns.discard(c)
            await c.cancel_all()


def _text_frame(payload: bytes) -> bytes:
    """A final, unmasked text frame (server to client)."""
    n = len(payload)
    if n < 126:
        return b"\x81" + bytes((n,)) + payload
    if n < 65536:
        return b"\x81\x7e" + n.to_bytes(2, "big") + payload
    return b"\x81\x7f" + n.to_bytes(8, "big") + payload


class _Req:
    __slots__ = ("id", "engine_id", "task", "cancelled", "done", "n", "last", "out", "err")

    def __init__(self, rid: str, engine_id: str):
        self.id, self.engine_id = rid, engine_id
        self.task: asyncio.Task | None = None
        self.cancelled = False
        self.done: asyncio.Future | None = None  # set once the final frame is out (admitted requests)
        self.n = 0  # deltas sent
        self.last = None  # last RequestOutput sent (its seq carries the stats for a done(error))
        self.out = None  # output not sent yet (merged while the connection could not keep up)
        self.err: BaseException | None = None  # an admitted error not sent yet


class Conn:
    """One websocket connection: its auth state and its live requests by client id.

    Outputs are pushed by the engine loop (``AsyncEngine.submit``) into ``pending``; once per event
    loop pass every pending request gets one ``delta`` (the outputs of all steps since the last
    flush, merged) and, at the end, its ``done``, and the frames go out in ONE socket write. While a
    slow client's write buffer is full, outputs keep merging instead of queueing frames."""

    HIGH_WATER = 1 << 16  # bytes buffered for the client above which frames wait (and merge)

    def __init__(self, srv: WSServer, ws: ServerConnection, authed: bool, serial: int):
        self.srv, self.ws, self.authed, self.serial = srv, ws, authed, serial
        self.live: dict = {}
        self.auth_failures = 0
        self.pending: dict = {}  # client id -> _Req with output or error to send
        self._flush_at: asyncio.Handle | None = None
        self._waiting_drain = False

    async def send(self, data: bytes) -> None:
        await self.ws.send(data, text=True)

    # pushed outputs ------------------------------------------------------------------------------
    def _deliver(self, r: _Req, item) -> None:
        """Engine output (or admitted error) for ``r``; called on the loop by the AsyncEngine."""
        if isinstance(item, BaseException):
            r.err = item
        else:
            r.out = item if r.out is None else merge_outputs(r.out, item)
        self.pending[r.id] = r
        if self._flush_at is None and not self._waiting_drain:
            self._flush_at = asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_at = None
        ws = self.ws
        if ws.protocol.state is not State.OPEN:  # client gone: nothing can be sent, free the KV
            ae = self.srv.ae
            for r in self.pending.values():
                ended = r.err is not None or (r.out is not None and r.out.finished)
                if not ended and ae is not None:
                    ae.abort(r.engine_id)
                if r.done is not None and not r.done.done():
                    r.done.set_result(None)
            self.pending.clear()
            return
        if ws.transport.get_write_buffer_size() > self.HIGH_WATER:  # slow client: merge until it drains
            self._waiting_drain = True
            asyncio.get_running_loop().create_task(self._after_drain())
            return
        frames, finished = [], []
        for r in self.pending.values():
            out, err = r.out, r.err
            r.out = r.err = None
            if out is not None:
                r.last = out
                if out.token_ids or out.text:
                    frames.append(P.delta(r.id, r.n, out.text, out.token_ids))
                    r.n += 1
                if out.finished:
                    frames.append(P.done(r.id, out.seq, out.finish_reason))
                    finished.append(r)
                    continue
            if err is not None:
                code = getattr(err, "code", "internal")
                self.srv.metrics.count_error(code)
                e = (code, str(err))
                seq = getattr(err, "seq", None) or (r.last.seq if r.last is not None else None)
                frames.append(P.done(r.id, seq, "error", e) if seq is not None else P.done_empty(r.id, "error", err=e))
                finished.append(r)
        self.pending.clear()
        if frames:
            # the pass's frames for this connection in one write; server frames are unmasked and,
            # with compression off, a text frame is just its header + the UTF-8 payload (RFC 6455 5.2)
            queued = ws.protocol.data_to_send()  # anything websockets queued first (e.g. a pong)
            ws.transport.write(b"".join(queued + [_text_frame(f) for f in frames]))
        for r in finished:
            if r.done is not None and not r.done.done():
                r.done.set_result(None)

    async def _after_drain(self) -> None:
        ws = self.ws
        try:
            while ws.protocol.state is State.OPEN and ws.transport.get_write_buffer_size() > self.HIGH_WATER:
                await ws.drain()  # waits while the transport is paused (above its own high-water mark)
                if ws.transport.get_write_buffer_size() > self.HIGH_WATER:
                    await asyncio.sleep(0.005)  # (not paused yet above ours: never spin)
        except Exception:  # noqa: BLE001 - closed: _flush resolves the requests
            pass
        self._waiting_drain = False
        if self._flush_at is None:
            self._flush()

    async def error(self, rid: str | None, code: str, message: str) -> None:
        self.srv.metrics.count_error(code)
        await self.send(P.error(rid, code, message))

    async def run(self) -> None:
        try:
            async for frame in self.ws:
                await self.on_frame(frame)
        except ConnectionClosed:
            pass

    def _too_large(self, frame) -> bool:
        limit = self.srv.max_message_bytes
        n = len(frame)
        if n > limit:
            return True
        if isinstance(frame, str) and n * 4 > limit:
            return len(frame.encode()) > limit
        return False

    async def on_frame(self, frame) -> None:
        if self._too_large(frame):
            await self.error(None, "message_too_large", f"message larger than {self.srv.max_message_bytes} bytes")
            return
        try:
            msg = P.decode(frame)
        except P.ProtocolError as e:
            await self.error(None, e.code, str(e))
            return
        t = msg["type"]
        if t == "auth":
            await self.on_auth(msg)
            return
        if not self.authed:
            await self.error(
                P.message_id(msg),
                "unauthorized",
                'send {"type":"auth","key":...} first (or an Authorization: Bearer header)',
            )
            return
        if t == "generate":
            await self.on_generate(msg)
        elif t == "cancel":
            try:
                rid = P.parse_id(msg)
            except P.ProtocolError as e:
                await self.error(None, e.code, str(e))
                return
            r = self.live.get(rid)
            if r is not None and not r.cancelled:  # unknown / finished ids: ignored (races are normal)
                r.cancelled = True
                if self.srv.ae is not None:
                    self.srv.ae.abort(r.engine_id)
        else:
            await self.error(
                P.message_id(msg), "unknown_type", f"unknown message type {t!r} (generate | cancel | auth)"
            )

    async def on_auth(self, msg: dict) -> None:
        if self.srv.api_key is None:  # no key configured: every auth succeeds (docs/protocol.md)
            self.authed = True
            await self.send(b'{"type":"auth_ok"}')
            return
        key = msg.get("key")
        if not isinstance(key, str) or not self.srv._key_ok(key):
            self.auth_failures += 1
            await self.error(None, "unauthorized", "wrong API key")
            if self.auth_failures >= MAX_AUTH_FAILURES:
                await self.ws.close(1008, "too many failed auth attempts")
            return
        self.authed = True
        await self.send(b'{"type":"auth_ok"}')

    async def on_generate(self, msg: dict) -> None:
        try:
            req = P.parse_generate(msg)
        except P.ProtocolError as e:
            await self.error(P.message_id(msg), e.code, str(e))
            return
        if req.id in self.live:
            await self.error(req.id, "duplicate_id", f"request {req.id!r} is still running on this connection")
            return
        ae = self.srv.ae
        if self.srv.draining or (ae is not None and ae.draining):
            await self.error(req.id, "shutting_down", "the server is shutting down")
            return
        if ae is None or not ae.ready:
            await self.error(req.id, "overloaded", "the server is not ready yet (models loading); retry later")
            return
        r = _Req(req.id, f"ws{self.serial}:{req.id}")
        self.live[req.id] = r
        r.task = asyncio.get_running_loop().create_task(self._serve(r, req, ae))

    async def _serve(self, r: _Req, req: P.GenerateRequest, ae: AsyncEngine) -> None:
        submitted = False
        try:
            tok = ae.tokenizer
            loop = asyncio.get_running_loop()
            if P.prompt_chars(req) <= INLINE_TOKENIZE_CHARS:  # cheap: no thread hand-off
                ids = RB.encode_prompt(tok, req.messages, req.prompt)
            else:  # long prompts must not stall the event loop
                try:
                    ids = await loop.run_in_executor(self.srv.tok_pool, RB.encode_prompt, tok, req.messages, req.prompt)
                except RuntimeError as e:  # the pool is shut down (server closing)
                    raise RequestError("shutting_down", str(e)) from None
            if r.cancelled:
                await self.send(P.done_empty(r.id, "cancelled", len(ids)))
                return
            max_tokens = (
                req.max_tokens if req.max_tokens is not None else RB.default_max_tokens(len(ids), ae.max_model_len)
            )
            params = RB.sampling_params(max_tokens, **req.sampling)
            r.done = loop.create_future()
            # outputs are pushed to _deliver and flushed per loop pass (no per-output task wake-ups)
            ae.submit(ids, params, req.spec, req.priority, r.engine_id, lambda item: self._deliver(r, item))
            submitted = True
            await r.done
        except RequestError as e:  # refused before admission (admitted errors arrive via _deliver)
            await self.error(r.id, e.code, str(e))
        except ConnectionClosed:
            pass
        except Exception as e:  # noqa: BLE001 - never let one request take the connection down
            log.exception("request %s failed", r.engine_id)
            try:
                await self.error(r.id, "internal", f"{type(e).__name__}: {e}")
            except ConnectionClosed:
                pass
        finally:
            if submitted and not r.done.done():  # task cancelled (client gone): free the engine's KV
                ae.abort(r.engine_id)
            self.pending.pop(r.id, None)
            if self.live.get(r.id) is r:
                del self.live[r.id]

    async def cancel_all(self) -> None:
        """Client went away: cancel its requests (each aborts in the engine, freeing its KV)."""
        tasks = [r.task for r in self.live.values() if r.task is not None]
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        self.live.clear()
