"""The websocket protocol's messages: parsing/validation of client messages, building server frames.

Pure functions (no I/O) so they are easy to test; the full protocol is in ``docs/protocol.md``.
Only the JSON side lives here (decoding frames, the JSON fields' types, the server frames); what a
request means (sampling / speculation params, priority, limits, prompt encoding, the ``done``
numbers) is ``specd.serving.request_build``'s, shared with the gRPC front end.
Every refusal is a ``ProtocolError(code, message)``; ``code`` is one of ``ERROR_CODES``.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import orjson

from specd.engine.engine import RequestError
from specd.engine.sequence import SpecParams
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
}


class ProtocolError(RequestError):
    """A refused client message; ``code`` is one of ``ERROR_CODES``."""


@dataclass
class GenerateRequest:
    id: str
    messages: list | None  # [{"role": str, "content": str}] or None
    prompt: str | None
    max_tokens: int | None  # None: RB.default_max_tokens, min(256, context - prompt)
    sampling: dict  # RB.sampling_params kwargs except max_tokens
    spec: SpecParams
    priority: str


def _bad(msg: str) -> ProtocolError:
    return ProtocolError("invalid_request", msg)


@contextmanager
def _refused():
    """``request_build``'s refusals as ``ProtocolError`` (same code and message)."""
    try:
        yield
    except RequestError as e:
        raise ProtocolError(e.code, str(e)) from None


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(msg: dict, key: str, default: float) -> float:
    v = msg.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise _bad(f"{key} must be a finite number, got {v!r}")
    return float(v)


def _integer(msg: dict, key: str, default):
    v = msg.get(key)
    if v is None:
        return default
    if not _is_int(v):
        raise _bad(f"{key} must be an integer, got {v!r}")
    return v


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
    rid = parse_id(msg)
    messages, prompt = msg.get("messages"), msg.get("prompt")
    if (messages is None) == (prompt is None):
        raise _bad("exactly one of 'messages' or 'prompt' is required")
    if prompt is not None:
        if not isinstance(prompt, str) or not prompt:
            raise _bad("prompt must be a non-empty string")
    else:
        if not isinstance(messages, list) or not messages:
            raise _bad("messages must be a non-empty list of {role, content} objects")
        clean = []
        for k, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise _bad(f"messages[{k}] must be an object with string 'role' and 'content'")
            clean.append({"role": m["role"], "content": m["content"]})
        messages = clean
    max_tokens = _integer(msg, "max_tokens", None)
    if max_tokens is not None and max_tokens < 1:
        raise _bad(f"max_tokens must be >= 1, got {max_tokens}")
    stop = msg.get("stop")
    if stop is None:
        stop = ()
    elif isinstance(stop, str):
        stop = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stop = tuple(stop)
    else:
        raise _bad("stop must be a string or a list of strings")
    stop_ids = msg.get("stop_token_ids")
    if stop_ids is None:
        stop_ids = ()
    elif isinstance(stop_ids, list) and all(_is_int(t) for t in stop_ids):
        stop_ids = tuple(stop_ids)
    else:
        raise _bad("stop_token_ids must be a list of integers")
    ignore_eos = msg.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise _bad("ignore_eos must be a boolean")
    seed = _integer(msg, "seed", None)
    logprobs = _integer(msg, "logprobs", None)
    sampling = dict(
        temperature=_number(msg, "temperature", 1.0),
        top_p=_number(msg, "top_p", 1.0),
        top_k=_integer(msg, "top_k", 0),
        seed=seed,
        stop=stop,
        stop_token_ids=stop_ids,
        ignore_eos=ignore_eos,
        logprobs=logprobs,
    )
    with _refused():
        priority = RB.check_priority(msg.get("priority", "interactive"))
        spec = RB.speculation_params(msg.get("speculation"))
        # validate the sampling fields now (max_tokens is settled once the prompt length is known)
        RB.sampling_params(max_tokens or 1, **sampling)
    return GenerateRequest(rid, messages, prompt, max_tokens, sampling, spec, priority)


def prompt_chars(req: GenerateRequest) -> int:
    if req.prompt is not None:
        return len(req.prompt)
    return sum(len(m["content"]) for m in req.messages)


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


def _done(rid: str, finish_reason: str, summary: dict, err: tuple | None) -> bytes:
    m = {"type": "done", "id": rid, "finish_reason": finish_reason, **summary}
    if err is not None:
        m["error"] = {"code": err[0], "message": err[1]}
    return orjson.dumps(m)


def done(rid: str, seq_obj, finish_reason: str, err: tuple | None = None) -> bytes:
    """The final frame of a request from its engine Sequence (stats and timestamps; ``spec.by_proposer``
    when more than one proposer drafted for it)."""
    summary = RB.summarize(seq_obj)
    by = seq_obj.stats.as_dict()["by_proposer"]
    if len(by) > 1:
        summary["spec"]["by_proposer"] = by
    return _done(rid, finish_reason, summary, err)


def done_empty(rid: str, finish_reason: str, prompt_tokens: int = 0, err: tuple | None = None) -> bytes:
    """A ``done`` for a request that never reached the engine (cancelled while being tokenized)."""
    return _done(rid, finish_reason, RB.summarize_unstarted(prompt_tokens), err)
