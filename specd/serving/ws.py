"""specd's websocket protocol (``/ws``; an upgrade on ``/`` works too) as a raw ASGI endpoint.

At the upgrade: a disallowed ``Origin`` gets HTTP 403, a wrong ``Authorization: Bearer`` key 401,
``--max-connections`` open connections 503 (``Retry-After: 1``). One ``Conn`` per connection
multiplexes requests by their client ``id``; every request has a task that tokenizes and admits it
and waits for its end. Outputs are pushed by the engine client into ``Conn.pending`` and written by
the connection's writer task: each pending request gets one ``delta`` (the outputs of all steps since
its last one, merged) and, at its end, one ``done``. While a slow client's socket is full the
writer's send waits and outputs keep merging instead of queueing frames. Protocol: ``docs/protocol.md``.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from concurrent.futures import ThreadPoolExecutor

from starlette.datastructures import Headers

from specd.engine.commands import Submit
from specd.engine.requests import RequestError
from specd.serving import protocol as P
from specd.serving import request_build as RB
from specd.serving.async_engine import AsyncEngine, merge_outputs
from specd.serving.frontend import Frontend

log = logging.getLogger("specd.ws")

__all__ = ["WSServer", "Conn", "deny", "HARD_LIMIT_FACTOR"]

MAX_AUTH_FAILURES = 5  # failed auth messages before the connection is closed (1008)
INLINE_TOKENIZE_CHARS = 8192  # longer prompts are tokenized in a worker thread
HARD_LIMIT_FACTOR = 4  # frames above max_message_bytes * this are refused by closing with 1009


class Disconnected(Exception):
    """The client is gone (a send failed or the connection closed)."""


async def deny(send, status: int, body: str, headers: dict | None = None) -> None:
    """Refuse a websocket upgrade with an HTTP answer (ASGI's websocket.http.response extension)."""
    hdrs = [(b"content-type", b"text/plain; charset=utf-8")]
    hdrs += [(k.lower().encode(), str(v).encode()) for k, v in (headers or {}).items()]
    await send({"type": "websocket.http.response.start", "status": status, "headers": hdrs})
    await send({"type": "websocket.http.response.body", "body": body.encode()})


class WSServer:
    """The websocket front end: an ASGI app for websocket scopes; ``conns`` its open connections."""

    def __init__(self, front: Frontend):
        self.front = front
        self.conns: set = set()
        front.ws_sets.append(self.conns)
        self._serial = itertools.count()
        # long prompts are tokenized in this one worker thread (the loop tokenizes short ones itself)
        self.tok_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specd-tokenize")

    async def __call__(self, scope, receive, send) -> None:
        if (await receive())["type"] != "websocket.connect":
            return
        headers = Headers(scope=scope)
        refused = self.front.upgrade_refusal(headers, key_required=False)
        if refused is not None:
            await deny(send, *refused)
            return
        key = self.front.auth.bearer(headers)
        c = Conn(self, receive, send, self.front.auth.api_key is None or key is not None, next(self._serial))
        c.tenant = self.front.auth.tenant(key)
        self.conns.add(c)  # (before the accept's await: racing upgrades see it)
        try:
            await send({"type": "websocket.accept"})
            await c.run()
        finally:
            self.conns.discard(c)
            await c.cancel_all()

    async def close(self, code: int = 1001) -> None:
        """Close every connection (1001 going away at shutdown); their requests are cancelled."""
        await asyncio.gather(*(c.close(code) for c in list(self.conns)), return_exceptions=True)
        self.tok_pool.shutdown(wait=False)


class _Req:
    __slots__ = ("id", "engine_id", "task", "cancelled", "done", "n", "last", "out", "err", "text", "free_text")

    def __init__(self, rid: str, engine_id: str):
        self.id, self.engine_id = rid, engine_id
        self.text: list | None = None  # the reply's text so far, when it is parsed for tool calls
        self.free_text = True  # (parsed for calls) it may hold text outside them: ToolCallSpec.free_text
        self.task: asyncio.Task | None = None
        self.cancelled = False
        self.done: asyncio.Future | None = None  # set once the final frame is out (admitted requests)
        self.n = 0  # deltas sent
        self.last = None  # last RequestOutput sent (its seq carries the stats for a done(error))
        self.out = None  # output not sent yet (merged while the writer was busy)
        self.err: BaseException | None = None  # an admitted error not sent yet


class Conn:
    """One websocket connection: its auth state, its live requests by client id, its writer."""

    def __init__(self, srv: WSServer, receive, send, authed: bool, serial: int):
        self.srv, self._receive, self._send = srv, receive, send
        self.authed, self.serial = authed, serial
        self.tenant: str | None = None  # the key's tenant (header or auth message): what drafting may read
        self.live: dict = {}
        self.auth_failures = 0
        self.pending: dict = {}  # client id -> _Req with output or error to send
        self.open = True
        self._wake = asyncio.Event()
        self._writer: asyncio.Task | None = None

    async def send(self, data: bytes) -> None:
        try:
            await self._send({"type": "websocket.send", "text": data.decode()})
        except OSError as e:  # (uvicorn's ClientDisconnected)
            self.open = False
            raise Disconnected() from e

    async def close(self, code: int, reason: str = "") -> None:
        if self.open:
            self.open = False
            try:
                await self._send({"type": "websocket.close", "code": code, "reason": reason})
            except (OSError, RuntimeError):
                pass

    async def run(self) -> None:
        self._writer = asyncio.get_running_loop().create_task(self._write_loop())
        try:
            while True:
                msg = await self._receive()
                if msg["type"] != "websocket.receive":
                    break  # websocket.disconnect
                frame = msg.get("text")
                await self.on_frame(frame if frame is not None else msg.get("bytes") or b"")
        except Disconnected:
            pass
        finally:
            self.open = False
            self._writer.cancel()
            await asyncio.gather(self._writer, return_exceptions=True)

    # pushed outputs ------------------------------------------------------------------------------
    def _deliver(self, r: _Req, item) -> None:
        """Engine output (or admitted error) for ``r``; called on the loop by the engine client."""
        if isinstance(item, BaseException):
            r.err = item
        else:
            r.out = item if r.out is None else merge_outputs(r.out, item)
        self.pending[r.id] = r
        self._wake.set()

    async def _write_loop(self) -> None:
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                frames, finished = self._frames()
                for f in frames:
                    await self.send(f)  # waits while the socket is full: outputs merge meanwhile
                for r in finished:
                    if r.done is not None and not r.done.done():
                        r.done.set_result(None)
        finally:  # client gone or connection ending: nothing more can be sent, free the KV
            self._abandon()

    def _frames(self) -> tuple:
        """The pending requests' frames (one delta each, then a done when it ended)."""
        frames, finished = [], []
        for r in self.pending.values():
            out, err = r.out, r.err
            r.out = r.err = None
            if out is not None:
                r.last = out
                if out.token_ids or out.text:
                    frames.append(P.delta(r.id, r.n, out.text, out.token_ids, out.logprobs))
                    r.n += 1
                if r.text is not None:
                    r.text.append(out.text)
                if out.finished:
                    frames.append(self._done(r, out))
                    finished.append(r)
                    continue
            if err is not None:
                frames.append(self._error_done(r, err))
                finished.append(r)
        self.pending.clear()
        return frames, finished

    @staticmethod
    def _done(r: _Req, out) -> bytes:
        """A finished request's ``done`` (with its tool calls parsed when it has tools)."""
        if r.text is None or out.finish_reason not in ("stop", "length"):
            return P.done(r.id, out.seq, out.finish_reason)
        reason, fields = P.tool_reply("".join(r.text), out.finish_reason, r.free_text)
        return P.done(r.id, out.seq, reason, extra=fields)

    def _error_done(self, r: _Req, err: BaseException) -> bytes:
        code = getattr(err, "code", "internal")
        self.srv.front.metrics.count_error(code)
        e = (code, str(err))
        seq = getattr(err, "seq", None) or (r.last.seq if r.last is not None else None)
        return P.done(r.id, seq, "error", e) if seq is not None else P.done_empty(r.id, "error", err=e)

    def _abandon(self) -> None:
        ae = self.srv.front.ae
        for r in list(self.pending.values()) + list(self.live.values()):
            ended = r.err is not None or (r.out is not None and r.out.finished)
            if not ended and r.done is not None and ae is not None:
                ae.abort(r.engine_id)
            if r.done is not None and not r.done.done():
                r.done.set_result(None)
        self.pending.clear()

    # client messages -----------------------------------------------------------------------------
    async def error(self, rid: str | None, code: str, message: str) -> None:
        self.srv.front.metrics.count_error(code)
        await self.send(P.error(rid, code, message))

    def _too_large(self, frame) -> bool:
        limit = self.srv.front.max_message_bytes
        n = len(frame)
        if n > limit:
            return True
        if isinstance(frame, str) and n * 4 > limit:
            return len(frame.encode("utf-8", "surrogatepass")) > limit
        return False

    async def on_frame(self, frame) -> None:
        if self._too_large(frame):
            limit = self.srv.front.max_message_bytes
            await self.error(None, "message_too_large", f"message larger than {limit} bytes")
            return
        try:
            msg = P.decode(frame)
        except P.ProtocolError as e:
            await self.error(None, e.code, str(e))
            return
        t = msg["type"]
        if t == "auth":
            await self.on_auth(msg)
        elif not self.authed:
            hint = 'send {"type":"auth","key":...} first (or an Authorization: Bearer header)'
            await self.error(P.message_id(msg), "unauthorized", hint)
        elif t == "generate":
            await self.on_generate(msg)
        elif t == "cancel":
            await self.on_cancel(msg)
        else:
            await self.error(
                P.message_id(msg), "unknown_type", f"unknown message type {t!r} (generate | cancel | auth)"
            )

    async def on_cancel(self, msg: dict) -> None:
        try:
            rid = P.parse_id(msg)
        except P.ProtocolError as e:
            await self.error(None, e.code, str(e))
            return
        r = self.live.get(rid)
        if r is not None and not r.cancelled:  # unknown / finished ids: ignored (races are normal)
            r.cancelled = True
            if self.srv.front.ae is not None:
                self.srv.front.ae.abort(r.engine_id)

    async def on_auth(self, msg: dict) -> None:
        auth = self.srv.front.auth
        if auth.api_key is None:  # no key configured: every auth succeeds (docs/protocol.md)
            self.authed = True
            key = msg.get("key")
            self.tenant = auth.tenant(key) if isinstance(key, str) else self.tenant
            await self.send(b'{"type":"auth_ok"}')
            return
        key = msg.get("key")
        if not isinstance(key, str) or not auth.key_ok(key):
            self.auth_failures += 1
            await self.error(None, "unauthorized", "wrong API key")
            if self.auth_failures >= MAX_AUTH_FAILURES:
                await self.close(1008, "too many failed auth attempts")
                raise Disconnected()
            return
        self.authed = True
        self.tenant = auth.tenant(key)
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
        refused = self.srv.front.admission()
        if refused is not None:
            await self.error(req.id, refused.code, str(refused))
            return
        r = _Req(req.id, f"ws{self.serial}:{req.id}")
        self.live[req.id] = r
        r.task = asyncio.get_running_loop().create_task(self._serve(r, req, self.srv.front.ae))

    async def _tokenize(self, ae: AsyncEngine, req: P.GenerateRequest) -> list:
        if P.prompt_chars(req) <= INLINE_TOKENIZE_CHARS:  # cheap: no thread hand-off
            return RB.encode_prompt(ae.tokenizer, req.messages, req.prompt, req.tools)
        try:  # long prompts must not stall the event loop
            return await asyncio.get_running_loop().run_in_executor(
                self.srv.tok_pool, RB.encode_prompt, ae.tokenizer, req.messages, req.prompt, req.tools
            )
        except RuntimeError as e:  # the pool is shut down (server closing)
            raise RequestError("shutting_down", str(e)) from None

    @staticmethod
    async def _check_grammar(ae: AsyncEngine, req: P.GenerateRequest) -> None:
        """Compile the request's grammar before it starts: a refusal is its ``error`` frame."""
        from specd.structured import GrammarError

        try:
            await ae.check_grammar(req.grammar)
        except GrammarError as e:
            raise RequestError(e.code, e.message, e.field) from None

    async def _serve(self, r: _Req, req: P.GenerateRequest, ae: AsyncEngine) -> None:
        submitted = False
        try:
            ids = await self._tokenize(ae, req)
            if r.cancelled:
                await self.send(P.done_empty(r.id, "cancelled", len(ids)))
                return
            params = req.sampling(len(ids), ae.max_model_len)
            if req.grammar is not None:
                await self._check_grammar(ae, req)
                r.text = [] if req.tools is not None else None
                r.free_text = req.tools is None or req.tools.free_text
                if r.cancelled:
                    await self.send(P.done_empty(r.id, "cancelled", len(ids)))
                    return
            r.done = asyncio.get_running_loop().create_future()
            sink = lambda item: self._deliver(r, item)  # noqa: E731
            ae.submit(Submit(r.engine_id, ids, params, req.spec, req.priority, self.tenant, req.grammar), sink)
            submitted = True
            await r.done
        except RequestError as e:  # refused before admission (admitted errors arrive via _deliver)
            await self._safe_error(r.id, e.code, str(e))
        except Disconnected:
            pass
        except Exception as e:  # noqa: BLE001 - never let one request take the connection down
            log.exception("request %s failed", r.engine_id)
            await self._safe_error(r.id, "internal", f"{type(e).__name__}: {e}")
        finally:
            if submitted and not r.done.done():  # task cancelled (client gone): free the engine's KV
                ae.abort(r.engine_id)
            self.pending.pop(r.id, None)
            if self.live.get(r.id) is r:
                del self.live[r.id]

    async def _safe_error(self, rid: str, code: str, message: str) -> None:
        try:
            await self.error(rid, code, message)
        except Disconnected:
            pass

    async def cancel_all(self) -> None:
        """Client went away: cancel its requests (each aborts in the engine, freeing its KV)."""
        tasks = [r.task for r in self.live.values() if r.task is not None]
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        self.live.clear()
