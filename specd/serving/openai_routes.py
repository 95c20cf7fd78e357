"""OpenAI-compatible HTTP: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``.

Each request: the API key (``Authorization: Bearer``, 401), the body (413 / 400), its fields
(``specd.serving.openai_params``: 400, 404 for another model), admission (503 while loading or
draining), then the shared request builder (tokenizing off the loop; 400 for bad values or a prompt
too long for the context), the compile of its grammar when it has one (``response_format``, tools,
vLLM's constraints: 400 with the grammar's code) and the engine client (429 when ``--max-queue``
requests are in). Only then does the answer start: a JSON body, or server-sent events ending with
``data: [DONE]``. A request with tools has its reply parsed for calls (``message.tool_calls``,
``finish_reason: "tool_calls"``; streamed as OpenAI's ``tool_calls`` deltas: ``tool_deltas``).
A client that disconnects cancels its request at once (``specd.serving.sse.until_disconnect``).
A request cut short by the drain deadline at shutdown ends with a 503 ``shutting_down`` error (an
``error`` event mid-stream); one the engine fails ends with a 500 (the same mid-stream).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from specd.engine.requests import RequestError
from specd.serving import openai_format as F
from specd.serving.async_engine import RequestStream
from specd.serving.frontend import Frontend
from specd.serving.logprobs import LogprobRenderer, TokenText
from specd.serving.openai_choices import merged_events, one_response
from specd.serving.openai_errors import APIError, error_response, from_request_error
from specd.serving.openai_params import ParsedRequest, grammar_error, parse_chat, parse_completion
from specd.serving.request_build import build_request, build_request_async, message_chars, tools_of
from specd.serving.routes import JSONResponse
from specd.serving.sse import ClientGone, EventStream, read_json, until_disconnect
from specd.serving.ws import INLINE_TOKENIZE_CHARS
from specd.structured.tool_parser import ToolCallParser, parse_tool_calls

__all__ = ["OpenAIFront", "collect", "cut_short", "tool_deltas", "tool_finish"]


def _prompt_chars(kw: dict) -> int:
    messages = kw.get("messages")
    if messages is not None:
        return message_chars(messages)
    prompt = kw.get("prompt")
    return len(prompt) if isinstance(prompt, str) else 0


def tool_finish(reason: str, calls: list, cut: bool = False) -> str:
    """OpenAI's finish reason of a reply parsed for tool calls: ``tool_calls`` when it ended (EOS)
    with calls, none of them cut short (``cut``, or a last call not ``complete``), else the engine's."""
    cut = cut or (bool(calls) and not calls[-1].complete)
    return F.TOOL_CALLS if calls and not cut and reason == "stop" else F.FINISH[reason]


def cut_short(reason: str | None) -> APIError | None:
    """A finish that is no answer (the drain deadline cancelled it) as the error to report."""
    if reason in F.FINISH:
        return None
    return APIError(503, "the server is shutting down: the request was cut short", "server_error", code="shutting_down")


async def collect(stream: RequestStream) -> tuple:
    """(text, last output, token ids, per-token logprobs or None) of a whole request; the stream is
    closed whatever happens."""
    parts, last, ids, lps = [], None, [], None
    try:
        async for out in stream:
            parts.append(out.text)
            ids += out.token_ids
            if out.logprobs is not None:
                lps = (lps or []) + out.logprobs
            last = out
    finally:
        stream.close()
    return "".join(parts), last, ids, lps


async def _collect_all(streams: list) -> list:
    """:func:`collect` of every stream; the first failure cancels the others (their streams close)."""
    tasks = [asyncio.ensure_future(collect(s)) for s in streams]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()


class OpenAIFront:
    """The ``/v1`` routes over one ``Frontend`` (``routes()``); ``prepare`` / ``start`` are shared with
    the Responses API."""

    def __init__(self, front: Frontend):
        self.front = front
        self._token_text: TokenText | None = None

    def renderer(self, p: ParsedRequest, chat: bool) -> LogprobRenderer | None:
        """The request's logprobs maker, None when it asked for none."""
        if p.engine.get("logprobs") is None:
            return None
        tok = self.front.ae.tokenizer
        if self._token_text is None or self._token_text.tok is not tok:
            self._token_text = TokenText(tok)
        return LogprobRenderer(self._token_text, chat)

    def authorize(self, headers) -> str | None:
        """The presented key (None without one); APIError 401 when the server's key is not it."""
        auth = self.front.auth
        key = auth.bearer(headers)
        if not auth.key_ok(key):
            what = "You didn't provide an API key" if not key else "Incorrect API key provided"
            raise APIError(401, f"{what} (Authorization: Bearer KEY).", code="invalid_api_key")
        return key

    def admit(self) -> None:
        refusal = self.front.admission()
        if refusal is not None:
            raise self.refused(refusal)

    def refused(self, e: RequestError) -> APIError:
        return from_request_error(e)

    def fail(self, e: APIError) -> Response:
        """The error response, counted in ``specd_request_errors_total`` by its code."""
        self.front.metrics.count_error(e.code or e.type)
        return error_response(e)

    async def prepare(self, request: Request, parse: Callable[[dict, str], ParsedRequest]) -> tuple:
        """(parsed request, presented key) of an HTTP request, or APIError."""
        key = self.authorize(request.headers)
        body = await read_json(request, self.front.max_message_bytes)
        parsed = parse(body, self.front.model_name)
        self.admit()
        return parsed, key

    async def start(self, engine_kwargs: dict, request_id: str, key: str | None = None) -> RequestStream:
        """Tokenize and admit a request; APIError when it is refused. Short prompts are tokenized on
        the loop (as the websocket does: no thread hand-off), long ones on the tokenizer thread.
        ``key``: the caller's API key (its tenant scopes what the engine may draft from)."""
        ae = self.front.ae
        kw = dict(engine_kwargs, max_model_len=ae.max_model_len)
        try:
            if _prompt_chars(engine_kwargs) <= INLINE_TOKENIZE_CHARS:
                built = build_request(ae.tokenizer, **kw)
            else:
                built = await build_request_async(ae.tokenizer, **kw)
            if built.grammar is not None:
                await self.check_grammar(built.grammar)
            return ae.stream(built.submit(request_id, self.front.auth.tenant(key)))
        except RequestError as e:
            raise self.refused(e) from None

    async def check_grammar(self, spec) -> None:
        """Compile the request's grammar before its answer starts: a refusal is a 400 naming the field."""
        from specd.structured import GrammarError

        try:
            await self.front.ae.check_grammar(spec)
        except GrammarError as e:
            raise grammar_error(e) from None

    def routes(self) -> list:
        return [
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{model:path}", self.model, methods=["GET"]),
        ]

    def fallback(self) -> list:
        """Any other ``/v1`` path: 404 in OpenAI's shape (after every other route)."""
        return [Route("/v1/{path:path}", self.unknown, methods=["GET", "POST", "PUT", "PATCH", "DELETE"])]

    async def unknown(self, request: Request) -> Response:
        what = f"Unknown request URL: {request.method} {request.url.path[:200]}"
        return self.fail(APIError(404, what, code="unknown_url"))

    # routes --------------------------------------------------------------------------------------
    async def models(self, request: Request) -> Response:
        try:
            self.authorize(request.headers)
        except APIError as e:
            return self.fail(e)
        return JSONResponse({"object": "list", "data": [self._model_object()]})

    async def model(self, request: Request) -> Response:
        try:
            self.authorize(request.headers)
        except APIError as e:
            return self.fail(e)
        name = request.path_params["model"]
        if name != self.front.model_name:
            return self.fail(APIError(404, f"The model '{name[:200]}' does not exist", code="model_not_found"))
        return JSONResponse(self._model_object())

    def _model_object(self) -> dict:
        ae = self.front.ae
        return F.model_object(self.front.model_name, self.front.created, ae.max_model_len if ae else None)

    async def chat(self, request: Request) -> Response:
        return await self._run(request, parse_chat, "chatcmpl-", _chat_events, _chat_whole)

    async def completions(self, request: Request) -> Response:
        return await self._run(request, parse_completion, "cmpl-", _completion_events, _completion_whole)

    async def _run(self, request: Request, parse, prefix: str, events, whole) -> Response:
        rid, created = prefix + uuid.uuid4().hex, int(time.time())
        try:
            p, key = await self.prepare(request, parse)
            streams = await self._start_choices(p, rid, key)
        except APIError as e:
            return self.fail(e)
        except ClientGone:
            return Response(status_code=499)
        head = (rid, created, self.front.model_name)
        chat = whole is _chat_whole
        tools = tools_of(p.engine.get("grammar"))
        if p.stream:
            return EventStream(self._events(events, streams, p, head, chat, tools))
        try:
            got = await until_disconnect(request.receive, _collect_all(streams))
        except ClientGone:
            return Response(status_code=499)  # (nobody reads it)
        except RequestError as e:  # the engine failed the request (or refused its grammar: a 400)
            return self.fail(from_request_error(e))
        finally:
            for s in streams:
                s.close()
        bodies = []
        for text, last, ids, lps in got:
            err = cut_short(last.finish_reason)
            if err is not None:
                return self.fail(err)
            render = self.renderer(p, chat)
            bodies.append(whole(head, text, last, render(ids, lps) if render is not None else None, tools))
        return JSONResponse(bodies[0] if len(bodies) == 1 else one_response(bodies))

    def _events(self, events, streams: list, p: ParsedRequest, head: tuple, chat: bool, tools) -> AsyncIterator:
        """The server-sent events of the request's one stream, or of its ``n`` choices merged."""
        if len(streams) == 1:
            return events(streams[0], head, p.include_usage, self.renderer(p, chat), tools)
        uses: list = []
        gens = [events(s, head, p.include_usage, self.renderer(p, chat), tools, i, uses) for i, s in enumerate(streams)]
        obj = "chat.completion.chunk" if chat else "text_completion"
        return merged_events(gens, head, p.include_usage, obj, uses)

    async def _start_choices(self, p: ParsedRequest, rid: str, key: str | None) -> list:
        """The request's engine streams: one, or ``p.n`` choices (``openai_choices``); APIError when one
        is refused (the others are closed)."""
        if p.n == 1:
            return [await self.start(p.engine, rid, key)]
        seed = p.engine.get("seed")
        streams: list = []
        try:
            for i in range(p.n):
                kw = dict(p.engine, seed=None if seed is None else seed + i)
                streams.append(await self.start(kw, f"{rid}-{i}", key))
        except BaseException:
            for s in streams:
                s.close()
            raise
        return streams


def _chat_whole(head: tuple, text: str, last, lp, tools) -> dict:
    """The ``chat.completion`` of a finished reply (parsed for tool calls when the request has tools)."""
    if tools is None:
        return F.chat_completion(*head, text, F.FINISH[last.finish_reason], F.usage(last.seq), lp)
    content, calls = parse_tool_calls(text, free_text=tools.free_text)
    return F.chat_completion(*head, content, tool_finish(last.finish_reason, calls), F.usage(last.seq), lp, calls)


def _completion_whole(head: tuple, text: str, last, lp, tools) -> dict:
    return F.completion(*head, text, F.FINISH[last.finish_reason], F.usage(last.seq), lp)


def _step_logprobs(render: LogprobRenderer | None, out) -> dict | None:
    """A step's logprobs (None when not asked for, or when the step emitted no token)."""
    return render(out.token_ids, out.logprobs) if render is not None and out.token_ids else None


def tool_deltas(d) -> list:
    """One parse step's chat deltas as OpenAI streams tool calls: the content first, then each call's
    first delta alone (``index``, ``id``, ``type``, ``function.name``, ``arguments: ""``), then its
    argument fragments (``index`` and ``function.arguments`` only; one step's fragments merged)."""
    out = [{"content": d.content}] if d.content else []
    for c in d.tool_calls:
        prev = out[-1]["tool_calls"][0] if out and "tool_calls" in out[-1] else None
        if c.id is None and prev is not None and prev["index"] == c.index and "id" not in prev:
            prev["function"]["arguments"] += c.arguments
        else:
            out.append({"tool_calls": [c.to_openai()]})
    return out


def _step_deltas(out, parser: ToolCallParser | None) -> list:
    """A step's chat deltas: its text, or, parsed for tool calls, content and call pieces (the end's
    held-back text included on the last)."""
    if parser is None:
        return [{"content": out.text}] if out.text else []
    deltas = tool_deltas(parser.feed(out.text))
    if out.finished:
        deltas += tool_deltas(parser.finish())
    return deltas


async def _chat_events(
    stream: RequestStream,
    head: tuple,
    with_usage: bool,
    render: LogprobRenderer | None,
    tools=None,
    choice: int = 0,
    uses: list | None = None,
) -> AsyncIterator:
    """One choice's chunks (``index`` ``choice``); ``uses`` (one of ``n`` choices: ``openai_choices``):
    its usage goes there, and no usage chunk or ``[DONE]`` of its own."""

    def chunk(delta, finish=None, lp=None):
        return F.sse(F.chat_chunk(*head, delta, finish, with_usage, lp, choice))

    parser = ToolCallParser(free_text=tools.free_text) if tools is not None else None
    try:
        yield chunk({"role": "assistant", "content": ""})
        async for out in stream:
            lp = _step_logprobs(render, out)
            deltas = _step_deltas(out, parser)
            if lp is not None and not deltas:  # (a held-back stop-string prefix still has its logprobs)
                deltas = [{"content": ""}]
            for i, delta in enumerate(deltas):
                yield chunk(delta, lp=lp if i == 0 else None)
            if out.finished:
                err = cut_short(out.finish_reason)
                if err is not None:
                    yield F.sse(err.body())
                    break
                calls, cut = (parser.calls, parser.cut) if parser is not None else ([], False)
                yield chunk({}, tool_finish(out.finish_reason, calls, cut))
                if uses is not None:
                    uses.append(F.usage(out.seq))
                elif with_usage:
                    yield F.sse(F.usage_chunk(*head, "chat.completion.chunk", F.usage(out.seq)))
    except RequestError as e:  # the engine failed the request mid-stream
        yield F.sse(from_request_error(e).body())
    finally:
        stream.close()
    if uses is None:
        yield F.DONE


async def _completion_events(
    stream: RequestStream,
    head: tuple,
    with_usage: bool,
    render: LogprobRenderer | None,
    tools=None,
    choice: int = 0,
    uses: list | None = None,
):
    """As :func:`_chat_events`, for ``/v1/completions``."""
    rid, created, model = head

    def chunk(text, finish=None, lp=None):
        return F.sse(F.completion_chunk(rid, created, model, text, finish, with_usage, lp, choice))

    try:
        async for out in stream:
            lp = _step_logprobs(render, out)
            if out.text or lp is not None:
                yield chunk(out.text, lp=lp)
            if out.finished:
                err = cut_short(out.finish_reason)
                if err is not None:
                    yield F.sse(err.body())
                    break
                yield chunk("", F.FINISH[out.finish_reason])
                if uses is not None:
                    uses.append(F.usage(out.seq))
                elif with_usage:
                    yield F.sse(F.usage_chunk(rid, created, model, "text_completion", F.usage(out.seq)))
    except RequestError as e:
        yield F.sse(from_request_error(e).body())
    finally:
        stream.close()
    if uses is None:
        yield F.DONE
