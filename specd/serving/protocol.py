"""The websocket protocol's messages: parsing client messages, building server frames.

Pure functions (no I/O) so they are easy to test; the full protocol is in ``docs/protocol.md``.
Only the JSON side lives here (decoding frames, reading a ``generate``'s fields by name, the server
frames); what a request's fields may be (prompt, sampling / speculation params, priority, limits) is
checked in one place for every front end (``specd.serving.request_build``, ``specd.engine.requests``).
Every refusal is a ``ProtocolError(code, message)``; ``code`` is one of ``ERROR_CODES``.
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import orjson

from specd.engine.requests import SAMPLING_FIELDS, RequestError
from specd.engine.sequence import SpecParams
from specd.sampling.params import SamplingParams
from specd.serving import request_build as RB

ERROR_CODES = {
    "invalid_json": "the frame is not a JSON object",
    "invalid_request": "a field has a wrong type or value, or the frame is binary",
    "unknown_type": "the message type is not generate | cancel | auth",
    "too_long": "prompt tokens + max_tokens exceed the model's context or the KV cache",
    "overloaded": "too many requests queued or running; retry later",
    "shutting_down": "the server is draining (SIGTERM); no new requests",
    "unauthorized": "an API key is required (auth message or Authorization header) or the key is wrong",
    "duplicate_id": "a request with this id is still running on this connection",
    "message_too_large": "the frame is larger than --max-message-bytes",
    "internal": "the engine failed while running the request",
    # a constraint refused (specd.structured.GrammarError), before the request starts
    "invalid_response_format": "response_format / structured_outputs / guided_* is malformed",
    "invalid_schema": "the JSON schema is not one the grammar library accepts",
    "unsatisfiable_schema": "the schema or grammar admits no output",
    "invalid_regex": "the regex does not compile",
    "invalid_grammar": "the EBNF grammar (or choice) does not compile",
    "invalid_tools": "tools / tool_choice / parallel_tool_calls are malformed",
    "conflicting_constraints": "the reply is constrained two ways at once",
    "grammar_too_large": "the constraint is over a size bound (bytes, nesting, enum entries, tools)",
    "compile_timeout": "compiling the constraint took too long",
}


class ProtocolError(RequestError):
    """A refused client message; ``code`` is one of ``ERROR_CODES``."""


@dataclass(frozen=True)
class GenerateRequest:
    id: str
    messages: list | None  # [{"role": str, "content": str}] or None
    prompt: str | None
    max_tokens: int | None  # None: RB.default_max_tokens, min(256, context - prompt)
    params: SamplingParams  # validated; max_tokens 1 while ``max_tokens`` is None
    spec: SpecParams
    priority: str
    grammar: Any = None  # a specd.structured.GrammarSpec (response_format, tools, vLLM's), or None

    @property
    def tools(self):
        """The request's ``ToolCallSpec`` (its reply is parsed for calls), or None."""
        return RB.tools_of(self.grammar)

    def sampling(self, prompt_tokens: int, max_model_len: int) -> SamplingParams:
        """The request's ``SamplingParams`` once its prompt's length is known."""
        if self.max_tokens is not None:
            return self.params
        return dataclasses.replace(self.params, max_tokens=RB.default_max_tokens(prompt_tokens, max_model_len))


def _bad(msg: str) -> ProtocolError:
    return ProtocolError("invalid_request", msg)


@contextmanager
def _refused():
    """``request_build``'s refusals as ``ProtocolError`` (same code, message and field)."""
    try:
        yield
    except RequestError as e:
        raise ProtocolError(e.code, str(e), e.field) from None


def decode(frame) -> dict:
    """A text frame -> the message dict (with a string ``type``)."""
    if isinstance(frame, (bytes, bytearray, memoryview)):
        raise _bad("binary frames are not supported: send JSON text frames")
    try:
        msg = orjson.loads(frame)
    except orjson.JSONDecodeError as e:
        raise ProtocolError("invalid_json", f"invalid JSON: {e}") from None
    if not isinstance(msg, dict):
        raise ProtocolError("invalid_json", f"a message must be a JSON object, got {type(msg).__name__}")
    t = msg.get("type")
    if not isinstance(t, str):
        raise _bad("missing or non-string field 'type'")
    return msg


def message_id(msg: dict) -> str | None:
    """The message's ``id`` when it is a valid one (for error frames), else None."""
    i = msg.get("id")
    return i if isinstance(i, str) and 0 < len(i) <= RB.MAX_ID_CHARS else None


def parse_id(msg: dict) -> str:
    i = msg.get("id")
    if not isinstance(i, str) or not i:
        raise _bad(f"id must be a non-empty string, got {i!r}")
    with _refused():
        return RB.check_id(i)


def parse_generate(msg: dict) -> GenerateRequest:
    """A ``generate`` message: every field read by its name (``SamplingParams``' fields included)
    and checked by the one request validation; unknown fields are ignored."""
    rid = parse_id(msg)
    with _refused():
        messages, prompt = RB.check_prompt(msg.get("messages"), msg.get("prompt"))
        sampling = {f: msg.get(f) for f in SAMPLING_FIELDS}
        params, spec, priority = RB.check_fields(msg.get("priority"), msg.get("speculation"), **sampling)
    grammar = parse_grammar(msg)
    return GenerateRequest(rid, messages, prompt, sampling["max_tokens"], params, spec, priority, grammar)


def parse_grammar(msg: dict):
    """The message's constraint (``response_format``, ``tools`` / ``tool_choice`` /
    ``parallel_tool_calls``, vLLM's ``structured_outputs`` / ``guided_*``), or None; a refusal is a
    ``ProtocolError`` with the grammar's code and field."""
    from specd.structured import GrammarError, grammar_spec

    try:
        return grammar_spec(msg)
    except GrammarError as e:
        raise ProtocolError(e.code, e.message, e.field) from None


def prompt_chars(req: GenerateRequest) -> int:
    if req.prompt is not None:
        return len(req.prompt)
    return RB.message_chars(req.messages)


# server frames ---------------------------------------------------------------------------------
def delta(rid: str, seq: int, text: str, token_ids: list, logprobs: list | None = None) -> bytes:
    """``logprobs`` (requests that asked for them): per token of ``token_ids``, ``[logprob, [[id,
    logprob], ...]]`` (the likeliest first)."""
    m = {"type": "delta", "id": rid, "seq": seq, "text": text, "token_ids": token_ids}
    if logprobs is not None:
        m["logprobs"] = logprobs
    return orjson.dumps(m)


def error(rid: str | None, code: str, message: str) -> bytes:
    m = {"type": "error", "code": code, "message": message}
    if rid is not None:
        m = {"type": "error", "id": rid, "code": code, "message": message}
    return orjson.dumps(m)


def _done(rid: str, finish_reason: str, summary: dict, err: tuple | None, extra: dict | None = None) -> bytes:
    m = {"type": "done", "id": rid, "finish_reason": finish_reason, **(extra or {}), **summary}
    if err is not None:
        m["error"] = {"code": err[0], "message": err[1]}
    return orjson.dumps(m)


def tool_reply(text: str, finish_reason: str, free_text: bool = True) -> tuple:
    """``(finish_reason, fields)`` of a reply parsed for tool calls: ``content`` (the text outside the
    calls, None when there is none), ``tool_calls`` (OpenAI's shape; a call the reply was cut short in
    last, its arguments as far as they got) and ``tool_calls`` as the finish reason when it ended (EOS)
    with calls, none cut short. ``free_text``: the request's ``ToolCallSpec.free_text``."""
    from specd.structured import parse_tool_calls

    content, calls = parse_tool_calls(text, free_text=free_text)
    if calls and calls[-1].complete and finish_reason == "stop":
        finish_reason = "tool_calls"
    return finish_reason, {"content": content, "tool_calls": [c.to_openai() for c in calls]}


def done(rid: str, seq_obj, finish_reason: str, err: tuple | None = None, extra: dict | None = None) -> bytes:
    """The final frame of a request from its engine Sequence (stats and timestamps; ``spec.by_proposer``
    when more than one proposer drafted for it; ``extra``: more fields, e.g. ``tool_calls``)."""
    summary = RB.summarize(seq_obj)
    by = seq_obj.stats.as_dict()["by_proposer"]
    if len(by) > 1:
        summary["spec"]["by_proposer"] = by
    return _done(rid, finish_reason, summary, err, extra)


def done_empty(rid: str, finish_reason: str, prompt_tokens: int = 0, err: tuple | None = None) -> bytes:
    """A ``done`` for a request that never reached the engine (cancelled while being tokenized)."""
    return _done(rid, finish_reason, RB.summarize_unstarted(prompt_tokens), err)
