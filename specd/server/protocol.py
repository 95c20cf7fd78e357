"""The websocket protocol's messages: parsing/validation of client messages, building server frames.

Pure functions (no I/O) so they are easy to test; the full protocol is in ``docs/protocol.md``.
Every refusal is a ``ProtocolError(code, message)``; ``code`` is one of ``ERROR_CODES``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import orjson

from specd.engine import RequestError
from specd.sampling import SamplingParams
from specd.sequence import PRIORITIES, SpecParams

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

MAX_ID_CHARS = 256
MAX_STOP = 16
DEFAULT_MAX_TOKENS = 256


class ProtocolError(RequestError):
    """A refused client message; ``code`` is one of ``ERROR_CODES``."""


@dataclass
class GenerateRequest:
    id: str
    messages: Optional[list]  # [{"role": str, "content": str}] or None
    prompt: Optional[str]
    max_tokens: Optional[int]  # None: min(256, context - prompt)
    sampling: dict  # SamplingParams kwargs except max_tokens
    spec: SpecParams
    priority: str


def _bad(msg: str) -> ProtocolError:
    return ProtocolError("invalid_request", msg)


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


def message_id(msg: dict) -> Optional[str]:
    """The message's ``id`` when it is a valid one (for error frames), else None."""
    i = msg.get("id")
    return i if isinstance(i, str) and 0 < len(i) <= MAX_ID_CHARS else None


def parse_id(msg: dict) -> str:
    i = msg.get("id")
    if not isinstance(i, str) or not i:
        raise _bad(f"id must be a non-empty string, got {i!r}")
    if len(i) > MAX_ID_CHARS:
        raise _bad(f"id is longer than {MAX_ID_CHARS} characters")
    return i


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
    if len(stop) > MAX_STOP or any(not s for s in stop):
        raise _bad(f"stop: at most {MAX_STOP} non-empty strings")
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
    sampling = dict(temperature=_number(msg, "temperature", 1.0), top_p=_number(msg, "top_p", 1.0),
                    top_k=_integer(msg, "top_k", 0), seed=seed, stop=stop, stop_token_ids=stop_ids,
                    ignore_eos=ignore_eos)
    priority = msg.get("priority", "interactive")
    if priority not in PRIORITIES:
        raise _bad(f"priority must be one of {', '.join(PRIORITIES)}, got {priority!r}")
    sp = msg.get("speculation")
    if sp is None:
        sp = {}
    if not isinstance(sp, dict):
        raise _bad("speculation must be an object {mode, max_draft_tokens}")
    try:
        spec = SpecParams(mode=sp.get("mode", "auto"), max_draft_tokens=sp.get("max_draft_tokens"))
    except (ValueError, TypeError) as e:
        raise _bad(str(e)) from None
    # validate the sampling fields now (max_tokens is settled once the prompt length is known)
    sampling_params(sampling, max_tokens or 1)
    return GenerateRequest(rid, messages, prompt, max_tokens, sampling, spec, priority)


def sampling_params(sampling: dict, max_tokens: int) -> SamplingParams:
    try:
        return SamplingParams(max_tokens=max_tokens, **sampling)
    except (ValueError, TypeError) as e:
        raise _bad(str(e)) from None


def prompt_chars(req: GenerateRequest) -> int:
    if req.prompt is not None:
        return len(req.prompt)
    return sum(len(m["content"]) for m in req.messages)


def messages_to_text(messages: list) -> str:
    """Chat messages for a model without a chat template: contents joined by newlines."""
    return "\n".join(m["content"] for m in messages)


def encode_prompt(tokenizer, req: GenerateRequest) -> list:
    """Token ids of the request's prompt: ``messages`` through the tokenizer's chat template
    (``add_generation_prompt=True``), or, for a ``prompt`` or a model without a template, the raw text."""
    if tokenizer is None:
        raise ProtocolError("internal", "the model has no tokenizer")
    if req.messages is not None and getattr(tokenizer, "chat_template", None):
        try:
            ids = tokenizer.apply_chat_template(req.messages, add_generation_prompt=True, tokenize=True,
                                                return_dict=False)
        except Exception as e:  # noqa: BLE001 - templates raise for e.g. bad role order
            raise _bad(f"chat template failed: {e}") from None
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)
    text = req.prompt if req.prompt is not None else messages_to_text(req.messages)
    return list(tokenizer(text)["input_ids"])


# server frames ---------------------------------------------------------------------------------
def delta(rid: str, seq: int, text: str, token_ids: list) -> bytes:
    return orjson.dumps({"type": "delta", "id": rid, "seq": seq, "text": text, "token_ids": token_ids})


def error(rid: Optional[str], code: str, message: str) -> bytes:
    m = {"type": "error", "code": code, "message": message}
    if rid is not None:
        m = {"type": "error", "id": rid, "code": code, "message": message}
    return orjson.dumps(m)


def _ms(a, b) -> Optional[float]:
    return None if a is None or b is None else round((b - a) * 1000.0, 3)


def done(rid: str, seq_obj, finish_reason: str, err: Optional[tuple] = None) -> bytes:
    """The final frame of a request from its engine Sequence (stats and timestamps)."""
    st = seq_obj.stats
    m = {
        "type": "done", "id": rid, "finish_reason": finish_reason,
        "usage": {"prompt_tokens": seq_obj.num_prompt, "completion_tokens": seq_obj.num_output},
        "spec": {"steps": st.steps, "draft_tokens": st.draft_tokens, "accepted_tokens": st.accepted_tokens,
                 "mean_accepted_length": round(st.mean_accepted_length, 4)},
        "timing": {"queue_ms": _ms(seq_obj.arrival, seq_obj.scheduled_time),
                   "ttft_ms": _ms(seq_obj.arrival, seq_obj.first_token_time),
                   "total_ms": _ms(seq_obj.arrival, seq_obj.finish_time)},
    }
    if err is not None:
        m["error"] = {"code": err[0], "message": err[1]}
    return orjson.dumps(m)


def done_empty(rid: str, finish_reason: str, prompt_tokens: int = 0, err: Optional[tuple] = None) -> bytes:
    """A ``done`` for a request that never reached the engine (cancelled while being tokenized)."""
    m = {"type": "done", "id": rid, "finish_reason": finish_reason,
         "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": 0},
         "spec": {"steps": 0, "draft_tokens": 0, "accepted_tokens": 0, "mean_accepted_length": 0.0},
         "timing": {"queue_ms": None, "ttft_ms": None, "total_ms": None}}
    if err is not None:
        m["error"] = {"code": err[0], "message": err[1]}
    return orjson.dumps(m)
