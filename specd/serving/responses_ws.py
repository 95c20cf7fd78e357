"""OpenAI's Responses API WebSocket mode: ``GET /v1/responses`` upgraded to a websocket.

The client sends JSON text messages: ``{"type": "response.create", ...}`` with the body of a
``POST /v1/responses`` (``stream`` and ``background`` do not apply: every response streams), and
``{"type": "response.cancel"}`` to cancel the response in flight (it ends with ``response.incomplete``,
reason ``cancelled``). The server sends the same events as the HTTP stream, one per message, and
``{"type": "error", "status": N, "error": {"type", "code", "message", "param"}}`` for a refused
message (the HTTP status and error the same request would get; the connection stays open).

One response is in flight per connection, as OpenAI's: a ``response.create`` meanwhile gets
``response_already_in_flight``. ``previous_response_id`` continues the connection's last response
(kept for the connection even with ``store: false``) or a stored one of the same key; the new turn's
prompt then starts with the previous prompt and reply, which the prefix cache serves.

At the upgrade: a browser ``Origin`` must be allowed (403), a server with an API key requires
``Authorization: Bearer KEY`` (401), and ``--max-connections`` websockets (both kinds) at most (503).
Closing the connection cancels the response in flight (its KV blocks are freed in the next step).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import orjson
from starlette.datastructures import Headers

from specd.serving.openai_errors import APIError
from specd.serving.openai_params import parse_response
from specd.serving.responses_api import ResponsesAPI
from specd.serving.ws import Disconnected, deny

log = logging.getLogger("specd.responses_ws")

__all__ = ["ResponsesSocket"]

FINAL = ("response.completed", "response.incomplete", "response.failed")


def _error(e: APIError) -> bytes:
    err = {"type": e.type, "code": e.code, "message": str(e), "param": e.param}
    return orjson.dumps({"type": "error", "status": e.status, "error": err})


class ResponsesSocket:
    """The ``/v1/responses`` websocket endpoint (a raw ASGI app); ``conns`` its open connections."""

    def __init__(self, api: ResponsesAPI):
        self.api = api
        self.front = api.oai.front
        self.conns: set = set()
        self.front.ws_sets.append(self.conns)

    async def __call__(self, scope, receive, send) -> None:
        if (await receive())["type"] != "websocket.connect":
            return
        headers = Headers(scope=scope)
        refused = self.front.upgrade_refusal(headers, key_required=True)
        if refused is not None:
            await deny(send, *refused)
            return
        c = _Conn(self, send, self.front.auth.bearer(headers))
        self.conns.add(c)
        try:
            await send({"type": "websocket.accept"})
            while True:
                msg = await receive()
                if msg["type"] != "websocket.receive":
                    break
                await c.on_message(msg.get("text"), msg.get("bytes"))
        except Disconnected:
            pass
        finally:
            self.conns.discard(c)
            await c.stop()

    async def close(self, code: int = 1001) -> None:
        await asyncio.gather(*(c.close(code) for c in list(self.conns)), return_exceptions=True)


class _Conn:
    """One Responses websocket: the response in flight and the last one (for chaining)."""

    def __init__(self, srv: ResponsesSocket, send, key: str | None):
        self.srv, self._send, self.key = srv, send, key  # (the key names its stores and tenant)
        self.task: asyncio.Task | None = None
        self.stream = None  # the in-flight response's RequestStream
        self.last = None  # StoredResponse of the last finished response
        self.open = True

    async def send(self, data: bytes) -> None:
        try:
            await self._send({"type": "websocket.send", "text": data.decode()})
        except OSError as e:  # (uvicorn's ClientDisconnected)
            self.open = False
            raise Disconnected() from e

    async def close(self, code: int) -> None:
        if self.open:
            self.open = False
            try:
                await self._send({"type": "websocket.close", "code": code})
            except (OSError, RuntimeError):
                pass

    async def refuse(self, e: APIError) -> None:
        self.srv.front.metrics.count_error(e.code or e.type)
        await self.send(_error(e))

    async def on_message(self, text: str | None, data: bytes | None) -> None:
        try:
            msg = self._decode(text, data)
            kind = msg["type"]
            if kind == "response.create":
                await self._create(msg)
            elif kind == "response.cancel":
                if self.stream is not None:
                    self.srv.front.ae.abort(self.stream.request_id)
            else:
                raise APIError(
                    400,
                    f"unknown event type {kind!r:.60} (response.create | response.cancel)",
                    param="type",
                    code="unknown_event_type",
                )
        except APIError as e:
            await self.refuse(e)

    def _decode(self, text: str | None, data: bytes | None) -> dict:
        limit = self.srv.front.max_message_bytes
        if text is None:
            raise APIError(400, "binary messages are not supported: send JSON text", code="invalid_json")
        if len(text) > limit or (len(text) * 4 > limit and len(text.encode("utf-8", "surrogatepass")) > limit):
            raise APIError(413, f"message larger than {limit} bytes", code="request_too_large")
        try:
            msg = orjson.loads(text)
        except orjson.JSONDecodeError as e:
            raise APIError(400, f"invalid JSON: {e}", code="invalid_json") from None
        if not isinstance(msg, dict) or not isinstance(msg.get("type"), str):
            raise APIError(
                400, "a message must be a JSON object with a string 'type'", param="type", code="invalid_json"
            )
        return msg

    async def _create(self, msg: dict) -> None:
        if self.stream is not None:
            raise APIError(400, "a response is already in flight on this connection", code="response_already_in_flight")
        body = {k: v for k, v in msg.items() if k not in ("type", "stream", "background")}
        p = parse_response(body, self.srv.front.model_name)
        self.srv.api.oai.admit()
        turn, stream = await self.srv.api.start(p, self.key, self.last)
        events = self.srv.api.events(turn, stream)
        self.stream = stream
        try:  # response.created goes out before the next message is read: events follow messages
            await self.send(orjson.dumps(await events.__anext__()))
        except BaseException:
            await events.aclose()
            self.stream = None
            raise
        self.task = asyncio.get_running_loop().create_task(self._run(turn, stream, events))

    async def _run(self, turn, stream, events) -> None:
        me = asyncio.current_task()
        try:
            async with contextlib.aclosing(events):
                async for event in events:
                    if event["type"] in FINAL:  # the next response.create may come as soon as this is out
                        self.last = turn.stored or self.last
                        self.stream = self.task = None
                    await self.send(orjson.dumps(event))
        except Disconnected:
            pass
        except Exception:  # noqa: BLE001 - one response must not take the connection down
            log.exception("response %s failed", turn.id)
        finally:
            stream.close()
            if self.task is me:
                self.stream = self.task = None

    async def stop(self) -> None:
        """The connection ended: cancel the response in flight (its stream closes: abort)."""
        self.open = False
        t = self.task
        if t is not None:
            t.cancel()
            await asyncio.gather(t, return_exceptions=True)
