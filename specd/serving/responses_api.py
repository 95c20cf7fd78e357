"""OpenAI's Responses API over HTTP: ``POST /v1/responses`` (JSON or server-sent events),
``GET /v1/responses/{id}``, ``DELETE /v1/responses/{id}``; and the turn logic its WebSocket mode
(``specd.serving.responses_ws``) shares.

A turn: the new ``input`` messages, after the conversation that ``previous_response_id`` ends (its
messages and reply; ``instructions`` are not carried over, as OpenAI's), after this request's
``instructions`` as a system message, go through the chat template. A continued conversation's
prompt therefore starts with the previous prompt and reply token for token, and the engine's prefix
cache serves those blocks: ``usage.input_tokens_details.cached_tokens`` says how many tokens it did
not recompute. Streaming events, in order: ``response.created``, ``response.in_progress``,
``response.output_item.added``, ``response.content_part.added``, ``response.output_text.delta``...,
``response.output_text.done``, ``response.content_part.done``, ``response.output_item.done``, then
``response.completed`` (EOS or a stop), ``response.incomplete`` (``max_output_tokens`` or the context:
reason ``max_output_tokens``; cancelled: reason ``cancelled``) or ``response.failed`` (the engine
failed). Each event has a ``sequence_number``. With function ``tools`` the reply is parsed for calls:
``function_call`` items and their events (``specd.serving.responses_items``), the message only when
there is text; ``function_call`` / ``function_call_output`` input items continue the conversation.
Finished responses with ``store`` (the default) are kept in the ``ResponseStore`` under the caller's key.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from specd.engine.requests import RequestError
from specd.serving import openai_format as F
from specd.serving.async_engine import RequestStream
from specd.serving.openai_errors import APIError, from_request_error
from specd.serving.openai_params import ParsedRequest, parse_response
from specd.serving.openai_routes import OpenAIFront, collect
from specd.serving.request_build import tools_of
from specd.serving.response_store import ResponseStore, StoredResponse
from specd.serving.responses_items import OutputItems
from specd.serving.routes import JSONResponse
from specd.serving.sse import ClientGone, EventStream, until_disconnect

__all__ = ["ResponsesAPI", "Turn"]


@dataclass
class Turn:
    """One response being produced: its ids, request, conversation so far and event counter."""

    id: str
    msg_id: str
    created: int
    model: str
    parsed: ParsedRequest
    ns: str
    history: tuple  # the conversation up to and including this turn's input (no instructions)
    seq: int = 0
    stored: StoredResponse | None = field(default=None)

    def event(self, kind: str, **fields) -> dict:
        e = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return e


def _usage(seq) -> dict:
    p, c = seq.num_prompt, seq.num_output
    return {
        "input_tokens": p,
        "input_tokens_details": {"cached_tokens": int(getattr(seq, "cached_prefix_tokens", 0) or 0)},
        "output_tokens": c,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": p + c,
        "speculation": F.speculation(seq),
    }


def response_object(turn: Turn, status: str, output: list, use: dict | None = None, **extra) -> dict:
    obj = {
        "id": turn.id,
        "object": "response",
        "created_at": turn.created,
        "status": status,
        "error": None,
        "incomplete_details": None,
        "model": turn.model,
        "output": output,
        "parallel_tool_calls": False,
        "reasoning": {"effort": None, "summary": None},
        "text": {"format": {"type": "text"}},
        "tool_choice": "auto",
        "tools": [],
        "truncation": "disabled",
        "usage": use,
        **turn.parsed.echo,
    }
    obj.update(extra)
    return obj


def _outcome(reason: str | None) -> tuple:
    """(status, final event, incomplete_details) of an engine finish reason."""
    if reason == "stop":
        return "completed", "response.completed", None
    if reason == "length":
        return "incomplete", "response.incomplete", {"reason": "max_output_tokens"}
    return "incomplete", "response.incomplete", {"reason": "cancelled"}


class ResponsesAPI:
    """The Responses API over an ``OpenAIFront`` and a ``ResponseStore``."""

    def __init__(self, oai: OpenAIFront, store: ResponseStore):
        self.oai, self.store = oai, store

    def routes(self) -> list:
        return [
            Route("/v1/responses", self.create, methods=["POST"]),
            Route("/v1/responses/{rid}", self.retrieve, methods=["GET"]),
            Route("/v1/responses/{rid}", self.delete, methods=["DELETE"]),
        ]

    # turns (HTTP and websocket) ------------------------------------------------------------------
    def conversation(self, p: ParsedRequest, ns: str, local: StoredResponse | None = None) -> tuple:
        """The messages before and including this turn's input (``previous_response_id`` resolved in
        the connection's own last response first, then in the store under ``ns``)."""
        base: tuple = ()
        prev_id = p.previous_response_id
        if prev_id is not None:
            prev = local if local is not None and local.id == prev_id else self.store.get(ns, prev_id)
            if prev is None:
                raise APIError(
                    404,
                    f"Previous response with id '{prev_id[:100]}' not found.",
                    param="previous_response_id",
                    code="previous_response_not_found",
                )
            base = prev.history
        return base + tuple(p.engine["messages"])

    async def start(self, p: ParsedRequest, key: str | None, local: StoredResponse | None = None) -> tuple:
        """(Turn, its admitted RequestStream), or APIError. ``key``: the caller's API key (its
        namespace holds its stored responses; its tenant scopes drafting)."""
        ns = self.oai.front.auth.namespace(key)
        history = self.conversation(p, ns, local)
        system = ({"role": "system", "content": p.instructions},) if p.instructions else ()
        turn = Turn(
            "resp_" + uuid.uuid4().hex,
            "msg_" + uuid.uuid4().hex,
            int(time.time()),
            self.oai.front.model_name,
            p,
            ns,
            history,
        )
        stream = await self.oai.start({**p.engine, "messages": list(system + history)}, turn.id, key)
        return turn, stream

    def items(self, turn: Turn, event=None) -> OutputItems:
        """The turn's output items (``event``: the event maker; None: events are not kept)."""
        return OutputItems(turn.msg_id, event or (lambda kind, **fields: None), tools_of(turn.parsed.engine["grammar"]))

    def finish(self, turn: Turn, items: OutputItems, last) -> dict:
        """The final response object of a turn that ended with ``last``; kept when it should be."""
        status, _, incomplete = _outcome(last.finish_reason)
        obj = response_object(turn, status, items.output(status), _usage(last.seq), incomplete_details=incomplete)
        turn.stored = StoredResponse(turn.id, obj, turn.history + (items.history(),))
        if turn.parsed.store:
            self.store.put(turn.ns, turn.stored)
        return obj

    async def events(self, turn: Turn, stream: RequestStream) -> AsyncIterator[dict]:
        """The turn's streaming events (see the module docstring); closes the stream."""
        yield turn.event("response.created", response=response_object(turn, "in_progress", []))
        yield turn.event("response.in_progress", response=response_object(turn, "in_progress", []))
        items = self.items(turn, turn.event)
        for e in items.start():
            yield e
        last = None
        try:
            async for out in stream:
                for e in items.step(out.text, out.finished):
                    yield e
                last = out
        except RequestError as e:  # the engine failed the request
            err = {"code": "server_error", "message": str(e)}
            yield turn.event("response.failed", response=response_object(turn, "failed", [], error=err))
            return
        finally:
            stream.close()
        for e in items.finish(_outcome(last.finish_reason)[0]):
            yield e
        yield turn.event(_outcome(last.finish_reason)[1], response=self.finish(turn, items, last))

    # HTTP ----------------------------------------------------------------------------------------
    async def create(self, request: Request) -> Response:
        try:
            p, key = await self.oai.prepare(request, parse_response)
            turn, stream = await self.start(p, key)
        except APIError as e:
            return self.oai.fail(e)
        except ClientGone:
            return Response(status_code=499)
        if p.stream:
            return EventStream(_as_sse(self.events(turn, stream)))
        try:
            text, last, _, _ = await until_disconnect(request.receive, collect(stream))
        except ClientGone:
            return Response(status_code=499)
        except RequestError as e:
            return self.oai.fail(from_request_error(e))
        items = self.items(turn)
        items.step(text, last=True)
        return JSONResponse(self.finish(turn, items, last))

    def _lookup(self, request: Request) -> tuple:
        key = self.oai.authorize(request.headers)
        return self.oai.front.auth.namespace(key), request.path_params["rid"]

    async def retrieve(self, request: Request) -> Response:
        try:
            ns, rid = self._lookup(request)
        except APIError as e:
            return self.oai.fail(e)
        entry = self.store.get(ns, rid)
        if entry is None:
            return self.oai.fail(_not_found(rid))
        return JSONResponse(entry.obj)

    async def delete(self, request: Request) -> Response:
        try:
            ns, rid = self._lookup(request)
        except APIError as e:
            return self.oai.fail(e)
        if not self.store.delete(ns, rid):
            return self.oai.fail(_not_found(rid))
        return JSONResponse({"id": rid, "object": "response", "deleted": True})


def _not_found(rid: str) -> APIError:
    return APIError(404, f"Response with id '{rid[:100]}' not found.", param="response_id", code="response_not_found")


async def _as_sse(events: AsyncIterator[dict]) -> AsyncIterator[bytes]:
    try:
        async for e in events:
            yield F.sse(e, e["type"])
    finally:
        await events.aclose()
