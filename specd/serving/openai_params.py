"""OpenAI request bodies -> the shared request arguments (``specd.serving.request_build.build_request``).

The fields the engine takes are read by their names (every ``SamplingParams`` field, ``priority``,
``speculation``; OpenAI's ``max_completion_tokens`` / ``max_output_tokens`` and chat's
``top_logprobs`` are its names for ``max_tokens`` and ``logprobs``) and checked by the one request
validation (``request_build.check_fields``) as the body is parsed, a refusal naming the body's field
(``param``). Only OpenAI's own fields (``model``, ``stream``, messages' shapes, ...) are checked here.
Supported: chat (``messages``, with ``role: "tool"`` results and assistant ``tool_calls``), completions
(``prompt``: a string, a list of one string, token ids), responses (``input``: a string or message,
``function_call`` and ``function_call_output`` items, ``instructions``, ``previous_response_id``).
Constraints (``engine["grammar"]``, a ``specd.structured.GrammarSpec``): chat's ``response_format``,
``tools`` / ``tool_choice`` / ``parallel_tool_calls`` and vLLM's ``structured_outputs`` / ``guided_*``;
completions' ``response_format`` and vLLM's; responses' ``text.format`` and function ``tools``; a bad
one is a 400 with the grammar's code naming the field (``grammar_error``). Sampling:
``max_tokens`` / ``max_completion_tokens`` / ``max_output_tokens``, ``temperature``, ``top_p``,
``seed``, ``stop``, ``logit_bias``, ``presence_penalty``, ``frequency_penalty``, ``n`` (1-8 choices on
chat and completions, each an engine request of its own: seeds ``seed + i``), plus the
extensions ``top_k``, ``min_p``, ``repetition_penalty``, ``stop_token_ids``, ``ignore_eos``,
``priority`` and ``speculation`` ({mode: auto|off|chain|tree, max_draft_tokens}). Log-probabilities:
chat ``logprobs: true`` with ``top_logprobs`` 0..20, completions ``logprobs`` 0..20 (the engine's
``SamplingParams.logprobs``). Fields that would change the output in ways the engine cannot honour
(the deprecated ``functions``, ``n`` > 1 on responses, ``echo``, ``best_of``,
``suffix``, tools on completions; log-probabilities on ``/v1/responses``) are refused with 400 ``unsupported_parameter``
rather than silently ignored; unknown fields are ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specd.engine.requests import SAMPLING_FIELDS, RequestError
from specd.serving import request_build as RB
from specd.serving.openai_errors import APIError

__all__ = ["ParsedRequest", "check_model", "grammar_error", "parse_chat", "parse_completion", "parse_response"]

CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
INPUT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
TEXT_PARTS = {"text", "input_text", "output_text"}
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's documented default for /v1/completions
MAX_CHOICES = 8  # ``n`` on chat and completions


@dataclass
class ParsedRequest:
    """``engine``: ``build_request`` keyword arguments (``messages`` / ``prompt`` / ``prompt_ids`` and
    sampling); ``stream``; ``include_usage`` (``stream_options``); the Responses API's own fields."""

    engine: dict
    stream: bool = False
    include_usage: bool = False
    n: int = 1  # choices (chat, completions)
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    metadata: dict = field(default_factory=dict)
    echo: dict = field(default_factory=dict)  # request fields a response object repeats


def _bad(param: str, msg: str, code: str = "invalid_value") -> APIError:
    return APIError(400, msg, param=param, code=code)


def _unsupported(param: str, msg: str) -> APIError:
    return APIError(400, msg, param=param, code="unsupported_parameter")


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
    for key in ("functions", "function_call"):
        if b.get(key):
            raise _unsupported(key, f"'{key}' is not supported (use 'tools' and 'tool_choice')")


def _choices(b: dict) -> int:
    """``n``: how many choices (1..MAX_CHOICES; each its own engine request)."""
    n = _int(b, "n")
    if n is None:
        return 1
    if not 1 <= n <= MAX_CHOICES:
        raise _bad("n", f"'n' must be in [1, {MAX_CHOICES}], got {n}")
    return n


def grammar_error(e) -> APIError:
    """A ``GrammarError`` (a bad ``response_format`` / schema / tool list, or a grammar the compiler
    refused) as a 400 naming the field, with the grammar's code (``invalid_schema``, ...)."""
    return APIError(400, e.message, param=e.field, code=e.code)


def _grammar(b: dict, read=None):
    """The body's constraint (``specd.structured.grammar_spec``: ``response_format``, vLLM's
    ``structured_outputs`` / ``guided_*``, ``tools`` + ``tool_choice`` + ``parallel_tool_calls``), or None."""
    from specd.structured import GrammarError, grammar_spec

    try:
        return (read or grammar_spec)(b)
    except GrammarError as e:
        raise grammar_error(e) from None


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


def _message(m, where: str, roles: dict) -> dict:
    """One chat message: ``{"role", "content"}``, an assistant's ``tool_calls`` (its content may then
    be null), a tool result's ``tool_call_id``."""
    if not isinstance(m, dict):
        raise _bad(where, "each message must be an object with 'role' and 'content'")
    role = m.get("role")
    if role not in roles:
        raise _unsupported(f"{where}.role", f"role {role!r:.50} is not supported ({', '.join(roles)})")
    calls = m.get("tool_calls") if role == "assistant" else None
    if calls is not None and not isinstance(calls, list):
        raise _bad(f"{where}.tool_calls", "'tool_calls' must be a list of calls")
    content = m.get("content")
    out = {"role": roles[role], "content": None if content is None and calls else _content(content, f"{where}.content")}
    if calls:
        out["tool_calls"] = calls  # (their shape: request_build)
    if role == "tool":
        if not isinstance(m.get("tool_call_id"), str) or not m["tool_call_id"]:
            raise _bad(f"{where}.tool_call_id", "a 'tool' message needs the 'tool_call_id' of the call it answers")
        out["tool_call_id"] = m["tool_call_id"]
    return out


def _messages(v, param: str) -> list:
    if not isinstance(v, list) or not v:
        raise _bad(param, f"'{param}' must be a non-empty list of messages")
    out = []
    for i, m in enumerate(v):
        if isinstance(m, dict) and m.get("type") not in (None, "message"):
            raise _unsupported(f"{param}[{i}].type", f"input items of type {m.get('type')!r:.50} are not supported")
        out.append(_message(m, f"{param}[{i}]", CHAT_ROLES))
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
    engine["grammar"] = _grammar(body)
    return ParsedRequest(engine, stream, _stream_options(body, stream), n=_choices(body))


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
    if body.get("tools") or body.get("tool_choice") is not None:
        raise _unsupported("tools", "tools are a chat feature (/v1/chat/completions, /v1/responses)")
    stream = bool(_bool(body, "stream", False))
    engine, names = _sampling(body, "max_tokens")
    if engine["max_tokens"] is None:
        engine["max_tokens"] = COMPLETIONS_DEFAULT_MAX_TOKENS
    engine["logprobs"] = body.get("logprobs")  # how many alternatives per token (null = off)
    _checked(engine, names)
    engine.update(_prompt(body.get("prompt")))
    engine["grammar"] = _grammar(body)
    return ParsedRequest(engine, stream, _stream_options(body, stream), n=_choices(body))


def _call_item(m: dict, where: str) -> dict:
    """A ``function_call`` input item as an OpenAI chat tool call."""
    for key in ("call_id", "name", "arguments"):
        if not isinstance(m.get(key), str):
            raise _bad(f"{where}.{key}", f"a function_call item needs a string '{key}'")
    return {"id": m["call_id"], "type": "function", "function": {"name": m["name"], "arguments": m["arguments"]}}


def _output_item(m: dict, where: str) -> dict:
    """A ``function_call_output`` input item as a tool message."""
    if not isinstance(m.get("call_id"), str) or not m["call_id"]:
        raise _bad(f"{where}.call_id", "a function_call_output item needs the 'call_id' of its call")
    return {"role": "tool", "content": _content(m.get("output"), f"{where}.output"), "tool_call_id": m["call_id"]}


def _response_item(out: list, m, where: str) -> None:
    """Append one input item to the chat messages ``out``: a message; a ``function_call`` (joins the
    assistant message just before it: a reply's text and its calls are one turn); a ``function_call_output``."""
    kind = m.get("type") if isinstance(m, dict) else None
    if kind == "function_call":
        call = _call_item(m, where)
        if out and out[-1]["role"] == "assistant":
            out[-1].setdefault("tool_calls", []).append(call)
        else:
            out.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        out.append(_output_item(m, where))
    elif kind in (None, "message"):
        out.append(_message(m, where, INPUT_ROLES))
    else:
        raise _unsupported(f"{where}.type", f"input items of type {kind!r:.50} are not supported")


def _response_input(v) -> list:
    if isinstance(v, str):
        if not v:
            raise _bad("input", "'input' is empty")
        return [{"role": "user", "content": v}]
    if not isinstance(v, list) or not v:
        raise _bad("input", "'input' must be a string or a non-empty list of items")
    out: list = []
    for i, m in enumerate(v):
        _response_item(out, m, f"input[{i}]")
    return out


def _response_grammar(b: dict):
    """The Responses API's constraint: ``text.format`` (a json_schema format's fields flat) or function
    ``tools`` (flat: ``{"type": "function", "name", "parameters"}``) with ``tool_choice`` and
    ``parallel_tool_calls``; both at once are refused (``conflicting_constraints``)."""
    from specd.structured import GrammarError, GrammarSpec, text_format_spec
    from specd.structured.tools import tool_call_spec

    text = b.get("text")
    if text is not None and not isinstance(text, dict):
        raise GrammarError("invalid_response_format", "'text' must be an object", "text")
    fmt = text_format_spec((text or {}).get("format"))
    tools = tool_call_spec(b.get("tools"), b.get("tool_choice"), b.get("parallel_tool_calls"))
    if fmt is not None and tools is not None:
        msg = "the reply is constrained twice (text.format and tools); use one"
        raise GrammarError("conflicting_constraints", msg, "tools")
    return fmt if tools is None else GrammarSpec("tool_calls", tools, "tools")


def parse_response(body: dict, served: str) -> ParsedRequest:
    """``POST /v1/responses`` (and a websocket ``response.create``: ``stream`` is then implied)."""
    check_model(body, served)
    _refuse_unsupported(body)
    _no_logprobs(body)
    if body.get("background"):
        raise _unsupported("background", "'background' is not supported")
    meta = body.get("metadata")
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise _bad("metadata", "'metadata' must be an object of strings")
    engine, names = _sampling(body, "max_output_tokens")
    _checked(engine, names)
    engine["messages"] = _response_input(body.get("input"))
    engine["grammar"] = _grammar(body, _response_grammar)
    if _choices(body) != 1:
        raise _unsupported("n", "the Responses API has one output (n = 1)")
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
        **_tool_echo(body),
    }
    return p


def _tool_echo(b: dict) -> dict:
    """The constraint fields a response object repeats (as the request gave them; OpenAI's defaults)."""
    text = b.get("text") if isinstance(b.get("text"), dict) else {}
    return {
        "text": {"format": text.get("format") or {"type": "text"}},
        "tools": list(b.get("tools") or []),
        "tool_choice": b.get("tool_choice") or "auto",
        "parallel_tool_calls": b.get("parallel_tool_calls") is not False,
    }
