"""OpenAI request bodies -> the shared request arguments (``specd.serving.request_build.build_request``).

The fields the engine takes are read by their names (every ``SamplingParams`` field, ``priority``,
``speculation``; OpenAI's ``max_completion_tokens`` / ``max_output_tokens`` and chat's
``top_logprobs`` are its names for ``max_tokens`` and ``logprobs``) and checked by the one request
validation (``request_build.check_fields``) as the body is parsed, a refusal naming the body's field
(``param``). Only OpenAI's own fields (``model``, ``stream``, messages' shapes, ...) are checked here.
Supported: chat (``messages``), completions (``prompt``: a string, a list of one string, token ids),
responses (``input``: a string or message items, ``instructions``, ``previous_response_id``). Sampling:
``max_tokens`` / ``max_completion_tokens`` / ``max_output_tokens``, ``temperature``, ``top_p``,
``seed``, ``stop``, ``logit_bias``, ``n`` = 1, plus the extensions ``top_k``, ``stop_token_ids``,
``ignore_eos``, ``priority`` and ``speculation`` ({mode: auto|off|chain|tree, max_draft_tokens}). Log-probabilities:
chat ``logprobs: true`` with ``top_logprobs`` 0..20, completions ``logprobs`` 0..20 (the engine's
``SamplingParams.logprobs``). Fields that would change the output in ways the engine cannot honour
(penalties, tools, JSON response formats, ``n`` > 1, ``echo``, ``best_of``,
``suffix``; log-probabilities on ``/v1/responses``) are refused with 400 ``unsupported_parameter``
rather than silently ignored; unknown fields are ignored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from specd.engine.requests import SAMPLING_FIELDS, RequestError
from specd.serving import request_build as RB
from specd.serving.openai_errors import APIError

__all__ = ["ParsedRequest", "check_model", "parse_chat", "parse_completion", "parse_response"]

CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
TEXT_PARTS = {"text", "input_text", "output_text"}
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's documented default for /v1/completions


@dataclass
class ParsedRequest:
    """``engine``: ``build_request`` keyword arguments (``messages`` / ``prompt`` / ``prompt_ids`` and
    sampling); ``stream``; ``include_usage`` (``stream_options``); the Responses API's own fields."""

    engine: dict
    stream: bool = False
    include_usage: bool = False
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    metadata: dict = field(default_factory=dict)
    echo: dict = field(default_factory=dict)  # request fields a response object repeats


def _bad(param: str, msg: str, code: str = "invalid_value") -> APIError:
    return APIError(400, msg, param=param, code=code)


def _unsupported(param: str, msg: str) -> APIError:
    return APIError(400, msg, param=param, code="unsupported_parameter")


def _number(b: dict, key: str) -> float | None:
    v = b.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise _bad(key, f"'{key}' must be a number, got {v!r}"[:300])
    return float(v)


def _float(v) -> float | None:
    return None if v is None else float(v)


def _int(b: dict, key: str) -> int | None:
    v = b.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise _bad(key, f"'{key}' must be an integer, got {v!r}"[:300])
    return v


def _bool(b: dict, key: str, default: bool | None = None) -> bool | None:
    v = b.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _bad(key, f"'{key}' must be a boolean, got {v!r}"[:300])
    return v


def _str(b: dict, key: str) -> str | None:
    v = b.get(key)
    if v is not None and not isinstance(v, str):
        raise _bad(key, f"'{key}' must be a string, got {v!r}"[:300])
    return v


def check_model(body: dict, served: str) -> None:
    """``model`` names the served model (404 ``model_not_found`` otherwise)."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("model", "'model' is required: a string (GET /v1/models lists the served model)")
    if model != served:
        raise APIError(
            404,
            f"The model '{model[:200]}' does not exist; this server serves '{served}'.",
            param="model",
            code="model_not_found",
        )


def _refuse_unsupported(b: dict) -> None:
    """Fields whose effect the engine cannot honour: refused, not ignored."""
    for key in ("presence_penalty", "frequency_penalty"):
        if _number(b, key) not in (None, 0.0):
            raise _unsupported(key, f"'{key}' is not supported (only 0)")
    for key in ("tools", "functions"):
        if b.get(key):
            raise _unsupported(key, f"'{key}' is not supported")
    if _int(b, "n") not in (None, 1):
        raise _unsupported("n", "only n=1 is supported")
    fmt = b.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise _unsupported("response_format", "only response_format {'type': 'text'} is supported")


def _chat_logprobs(b: dict):
    """Chat: ``logprobs`` (bool) and ``top_logprobs`` (the engine's ``logprobs``, only with
    ``logprobs: true``)."""
    top = b.get("top_logprobs")
    if not _bool(b, "logprobs", False):
        if top:
            raise _bad("top_logprobs", "'top_logprobs' requires 'logprobs': true")
        return None
    return 0 if top is None else top


def _no_logprobs(b: dict) -> None:
    for key in ("logprobs", "top_logprobs"):
        if b.get(key) not in (None, False, 0):
            raise _unsupported(key, f"'{key}' is not supported on /v1/responses (use /v1/chat/completions)")


def _sampling(b: dict, max_key: str, alt_max_key: str | None = None) -> tuple:
    """(``build_request`` arguments read by name, engine field -> the body's name where they differ)."""
    if b.get(max_key) is None and alt_max_key is not None:
        max_key = alt_max_key
    engine = {f: b.get(f) for f in SAMPLING_FIELDS}
    engine.update(max_tokens=b.get(max_key), logprobs=None, priority=b.get("priority"))
    engine["speculation"] = b.get("speculation")
    return engine, {"max_tokens": max_key}


def _checked(engine: dict, names: dict) -> dict:
    """``engine`` once the one request validation accepts its fields; else 400 naming the body's field."""
    try:
        RB.check_fields(**{k: engine[k] for k in (*SAMPLING_FIELDS, "priority", "speculation")})
    except RequestError as e:
        param = names.get(e.field, e.field)
        raise _bad(param, str(e) if param == e.field else f"'{param}': {e}") from None
    return engine


def _stream_options(b: dict, stream: bool) -> bool:
    so = b.get("stream_options")
    if so is None:
        return False
    if not isinstance(so, dict):
        raise _bad("stream_options", "'stream_options' must be an object")
    if not stream:
        raise _bad("stream_options", "'stream_options' is only allowed with 'stream': true")
    return bool(_bool(so, "include_usage", False))


def _content(v, param: str) -> str:
    """A message's content: a string or a list of text parts, as one string."""
    if isinstance(v, str):
        return v
    if isinstance(v, list):
        texts = []
        for part in v:
            if (
                not isinstance(part, dict)
                or part.get("type") not in TEXT_PARTS
                or not isinstance(part.get("text"), str)
            ):
                raise _unsupported(param, "only text content parts ({'type': 'text', 'text': ...}) are supported")
            texts.append(part["text"])
        return "".join(texts)
    raise _bad(param, "content must be a string or a list of text parts")


def _messages(v, param: str) -> list:
    if not isinstance(v, list) or not v:
        raise _bad(param, f"'{param}' must be a non-empty list of messages")
    out = []
    for i, m in enumerate(v):
        if not isinstance(m, dict):
            raise _bad(f"{param}[{i}]", "each message must be an object with 'role' and 'content'")
        if m.get("type") not in (None, "message"):
            raise _unsupported(f"{param}[{i}].type", f"input items of type {m.get('type')!r:.50} are not supported")
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise _unsupported(
                f"{param}[{i}].role", f"role {role!r:.50} is not supported (system, developer, user, assistant)"
            )
        out.append({"role": CHAT_ROLES[role], "content": _content(m.get("content"), f"{param}[{i}].content")})
    return out


def parse_chat(body: dict, served: str) -> ParsedRequest:
    """``POST /v1/chat/completions``."""
    check_model(body, served)
    _refuse_unsupported(body)
    stream = bool(_bool(body, "stream", False))
    engine, names = _sampling(body, "max_completion_tokens", "max_tokens")
    engine["logprobs"] = _chat_logprobs(body)
    _checked(engine, {**names, "logprobs": "top_logprobs"})
    engine["messages"] = _messages(body.get("messages"), "messages")
    return ParsedRequest(engine, stream, _stream_options(body, stream))


def _prompt(v) -> dict:
    if isinstance(v, list) and len(v) == 1 and isinstance(v[0], (str, list)):
        v = v[0]  # a batch of one
    if isinstance(v, str):
        return {"prompt": v}
    if isinstance(v, list) and v and all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        return {"prompt_ids": v}
    raise _bad("prompt", "'prompt' must be a string, a list of token ids, or a list of one of those (n=1, no batches)")


def parse_completion(body: dict, served: str) -> ParsedRequest:
    """``POST /v1/completions``."""
    check_model(body, served)
    _refuse_unsupported(body)
    if body.get("echo"):
        raise _unsupported("echo", "'echo' is not supported")
    if body.get("suffix") is not None:
        raise _unsupported("suffix", "'suffix' is not supported")
    if _int(body, "best_of") not in (None, 1):
        raise _unsupported("best_of", "only best_of=1 is supported")
    stream = bool(_bool(body, "stream", False))
    engine, names = _sampling(body, "max_tokens")
    if engine["max_tokens"] is None:
        engine["max_tokens"] = COMPLETIONS_DEFAULT_MAX_TOKENS
    engine["logprobs"] = body.get("logprobs")  # how many alternatives per token (null = off)
    _checked(engine, names)
    engine.update(_prompt(body.get("prompt")))
    return ParsedRequest(engine, stream, _stream_options(body, stream))


def _response_input(v) -> list:
    if isinstance(v, str):
        if not v:
            raise _bad("input", "'input' is empty")
        return [{"role": "user", "content": v}]
    return _messages(v, "input")


def parse_response(body: dict, served: str) -> ParsedRequest:
    """``POST /v1/responses`` (and a websocket ``response.create``: ``stream`` is then implied)."""
    check_model(body, served)
    _refuse_unsupported(body)
    _no_logprobs(body)
    if body.get("background"):
        raise _unsupported("background", "'background' is not supported")
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    if fmt not in (None, {"type": "text"}):
        raise _unsupported("text.format", "only the text format {'type': 'text'} is supported")
    meta = body.get("metadata")
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise _bad("metadata", "'metadata' must be an object of strings")
    engine, names = _sampling(body, "max_output_tokens")
    _checked(engine, names)
    engine["messages"] = _response_input(body.get("input"))
    p = ParsedRequest(engine, bool(_bool(body, "stream", False)))
    p.instructions = _str(body, "instructions")
    p.previous_response_id = _str(body, "previous_response_id")
    p.store = bool(_bool(body, "store", True))
    p.metadata = dict(meta or {})
    p.echo = {
        "instructions": p.instructions,
        "max_output_tokens": engine["max_tokens"],
        "temperature": _float(engine["temperature"]),
        "top_p": _float(engine["top_p"]),
        "store": p.store,
        "previous_response_id": p.previous_response_id,
        "metadata": p.metadata,
        "user": _str(body, "user"),
    }
    return p
