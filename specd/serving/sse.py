"""HTTP plumbing for the ``/v1`` routes: bounded JSON bodies, and work that stops when the client goes.

``until_disconnect(receive, coro)`` runs ``coro`` while watching the connection: when the client
disconnects first, ``coro`` is cancelled at once (an engine request it was waiting on is aborted in
its ``finally``, and its KV blocks are freed in the engine's next step) and ``ClientGone`` is raised.
``EventStream`` sends server-sent events that way; non-streaming handlers await their result that way.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable

import orjson
from starlette.requests import ClientDisconnect, Request

from specd.serving.openai_errors import APIError

__all__ = ["ClientGone", "EventStream", "read_json", "until_disconnect"]


class ClientGone(Exception):
    """The HTTP client disconnected before the work was done."""


async def _disconnected(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(receive, coro: Awaitable):
    """``await coro``, unless the client disconnects first (then ``coro`` is cancelled: ClientGone)."""
    work = asyncio.ensure_future(coro)
    watch = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait((work, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()
        await asyncio.gather(work, watch, return_exceptions=True)
    if work.cancelled():
        raise ClientGone()
    return work.result()


class EventStream:
    """200 ``text/event-stream`` from an async iterator of ready-made event bytes (an ASGI app a route
    may return). Each event is sent as the iterator yields it; a client that disconnects cancels the
    iterator at once and closes it (its ``finally`` runs)."""

    def __init__(self, events: AsyncIterator[bytes]):
        self.events = events

    async def __call__(self, scope, receive, send) -> None:
        headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"x-accel-buffering", b"no")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})

        async def produce() -> None:
            async with contextlib.aclosing(self.events) as events:
                async for chunk in events:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        with contextlib.suppress(ClientGone, OSError):  # (OSError: uvicorn's ClientDisconnected)
            await until_disconnect(receive, produce())


async def read_json(request: Request, limit: int) -> dict:
    """The request body as a JSON object: 413 over ``limit`` bytes (checked before reading it all),
    400 ``invalid_json`` for anything else than a JSON object."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"request body larger than {limit} bytes", code="request_too_large")
    chunks, n = [], 0
    try:
        async for chunk in request.stream():
            n += len(chunk)
            if n > limit:
                raise APIError(413, f"request body larger than {limit} bytes", code="request_too_large")
            chunks.append(chunk)
    except ClientDisconnect:
        raise ClientGone() from None
    try:
        body = orjson.loads(b"".join(chunks))
    except orjson.JSONDecodeError as e:
        raise APIError(400, f"the body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "the body must be a JSON object", code="invalid_json")
    return body
