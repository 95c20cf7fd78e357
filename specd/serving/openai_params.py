"""OpenAI request bodies -> the shared request arguments (``specd.serving.request_build.build_request``).

Only the JSON types are checked here, field by field, with OpenAI's error shape naming the field
(``param``); ranges and limits are ``request_build``'s and the engine's, the same for every front end.
Supported: chat (``messages``), completions (``prompt``: a string, a list of one string, token ids),
responses (``input``: a string or message items, ``instructions``, ``previous_response_id``). Sampling:
``max_tokens`` / ``max_completion_tokens`` / ``max_output_tokens``, ``temperature``, ``top_p``,
``seed``, ``stop``, ``n`` = 1, plus the extensions ``top_k``, ``stop_token_ids``, ``ignore_eos``,
``priority`` and ``speculation`` ({mode: auto|off|chain|tree, max_draft_tokens}). Log-probabilities:
chat ``logprobs: true`` with ``top_logprobs`` 0..20, completions ``logprobs`` 0..20 (the engine's
``SamplingParams.logprobs``). Fields that would change the output in ways the engine cannot honour
(penalties, ``logit_bias``, tools, JSON response formats, ``n`` > 1, ``echo``, ``best_of``,
``suffix``; log-probabilities on ``/v1/responses``) are refused with 400 ``unsupported_parameter``
rather than silently ignored; unknown fields are ignored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from specd.sampling.params import MAX_LOGPROBS
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


def _int(b: dict, key: str, minimum: int | None = None) -> int | None:
    v = b.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise _bad(key, f"'{key}' must be an integer, got {v!r}"[:300])
    if minimum is not None and v < minimum:
        raise _bad(key, f"'{key}' must be >= {minimum}, got {v}")
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


def _stop(b: dict):
    v = b.get("stop")
    if v is None or isinstance(v, str):
        return v
    if isinstance(v, list) and all(isinstance(s, str) for s in v):
        return v
    raise _bad("stop", "'stop' must be a string or a list of strings")


def _int_list(b: dict, key: str):
    v = b.get(key)
    if v is None:
        return None
    if not isinstance(v, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        raise _bad(key, f"'{key}' must be a list of integers")
    return v


def _refuse_unsupported(b: dict) -> None:
    """Fields whose effect the engine cannot honour: refused, not ignored."""
    for key in ("presence_penalty", "frequency_penalty"):
        if _number(b, key) not in (None, 0.0):
            raise _unsupported(key, f"'{key}' is not supported (only 0)")
    for key in ("logit_bias", "tools", "functions"):
        if b.get(key):
            raise _unsupported(key, f"'{key}' is not supported")
    if _int(b, "n") not in (None, 1):
        raise _unsupported("n", "only n=1 is supported")
    fmt = b.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise _unsupported("response_format", "only response_format {'type': 'text'} is supported")


def _chat_logprobs(b: dict) -> int | None:
    """Chat: ``logprobs`` (bool) and ``top_logprobs`` (0..20, only with ``logprobs: true``)."""
    top = _int(b, "top_logprobs", 0)
    if top is not None and top > MAX_LOGPROBS:
        raise _bad("top_logprobs", f"'top_logprobs' must be <= {MAX_LOGPROBS}, got {top}")
    if not _bool(b, "logprobs", False):
        if top:
            raise _bad("top_logprobs", "'top_logprobs' requires 'logprobs': true")
        return None
    return top or 0


def _completion_logprobs(b: dict) -> int | None:
    """Completions: ``logprobs`` = how many alternatives per token (0..20; null = off)."""
    n = _int(b, "logprobs", 0)
    if n is not None and n > MAX_LOGPROBS:
        raise _bad("logprobs", f"'logprobs' must be <= {MAX_LOGPROBS}, got {n}")
    return n


def _no_logprobs(b: dict) -> None:
    for key in ("logprobs", "top_logprobs"):
        if b.get(key) not in (None, False, 0):
            raise _unsupported(key, f"'{key}' is not supported on /v1/responses (use /v1/chat/completions)")


def _sampling(b: dict, max_key: str, alt_max_key: str | None = None) -> dict:
    """Sampling and extension fields as ``build_request`` arguments."""
    spec = b.get("speculation")
    if spec is not None and not isinstance(spec, dict):
        raise _bad("speculation", "'speculation' must be an object {mode, max_draft_tokens}")
    max_tokens = _int(b, max_key, 1)
    if max_tokens is None and alt_max_key is not None:
        max_tokens = _int(b, alt_max_key, 1)
    return dict(
        max_tokens=max_tokens,
        temperature=_number(b, "temperature"),
        top_p=_number(b, "top_p"),
        top_k=_int(b, "top_k"),
        seed=_int(b, "seed"),
        stop=_stop(b),
        stop_token_ids=_int_list(b, "stop_token_ids"),
        ignore_eos=_bool(b, "ignore_eos"),
        priority=_str(b, "priority"),
        speculation=spec,
    )


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
    engine = _sampling(body, "max_completion_tokens", "max_tokens")
    engine["logprobs"] = _chat_logprobs(body)
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
    engine = _sampling(body, "max_tokens")
    if engine["max_tokens"] is None:
        engine["max_tokens"] = COMPLETIONS_DEFAULT_MAX_TOKENS
    engine["logprobs"] = _completion_logprobs(body)
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
    engine = _sampling(body, "max_output_tokens")
    engine["messages"] = _response_input(body.get("input"))
    p = ParsedRequest(engine, bool(_bool(body, "stream", False)))
    p.instructions = _str(body, "instructions")
    p.previous_response_id = _str(body, "previous_response_id")
    p.store = bool(_bool(body, "store", True))
    p.metadata = dict(meta or {})
    p.echo = {
        "instructions": p.instructions,
        "max_output_tokens": engine["max_tokens"],
        "temperature": engine["temperature"],
        "top_p": engine["top_p"],
        "store": p.store,
        "previous_response_id": p.previous_response_id,
        "metadata": p.metadata,
        "user": _str(body, "user"),
    }
    return p
