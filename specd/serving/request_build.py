"""Turn a client's generate request into engine inputs, and a finished sequence into its summary.

The one owner of the transport-independent request logic, shared by the websocket
(``specd.serving.protocol``), OpenAI (``specd.serving.openai_params``) and gRPC front ends so that
all validate the same way, render chat messages the same way and report the same numbers: the
prompt (``check_prompt``, ``encode_prompt``), the default ``max_tokens``, the id limit and the
``done`` summary. The fields' own checks are ``specd.engine.requests`` (``sampling_params``: every
``SamplingParams`` field by its name, ``spec_params``, ``check_priority``); the front ends only read
their wire (names, JSON or proto types) into keyword arguments of the same names. Everything raises
``RequestError("invalid_request", ...)`` (a ``ValueError``, with the refused ``field``) for bad
input; ``too_long`` and ``overloaded`` come later, from the engine client.

    req = build_request(engine.tokenizer, messages=[{"role": "user", "content": "Hi"}],
                        max_tokens=64, temperature=0.7, speculation={"mode": "tree"})
    async for out in async_engine.generate(req.submit(request_id)):
        ...
    done = summarize(out.seq)  # {"usage": {...}, "spec": {...}, "timing": {...}}

On the event loop use ``await build_request_async(...)``: same thing, run on one shared tokenizer
thread, so that a long prompt (a megabyte of text takes seconds to tokenize) never stalls the loop
that streams everyone else's tokens.

Chat messages go through the tokenizer's own chat template with ``add_generation_prompt=True``. A
tokenizer without a chat template (base models such as the tiny stories pair) gets the messages'
contents joined by newlines as raw text, the way ``specd generate`` falls back to the raw prompt.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from specd.engine.commands import Submit
from specd.engine.requests import RequestError, check_priority, sampling_params, spec_params
from specd.engine.sequence import SpecParams
from specd.sampling.params import MAX_STOP, SamplingParams
from specd.serving import chat_render as CR

__all__ = [
    "MAX_ID_CHARS",
    "MAX_STOP",
    "DEFAULT_MAX_TOKENS",
    "BuiltRequest",
    "build_request",
    "build_request_async",
    "check_fields",
    "check_prompt",
    "prompt_ids_from",
    "encode_prompt",
    "message_chars",
    "sampling_params",
    "speculation_params",
    "check_priority",
    "check_id",
    "default_max_tokens",
    "summarize",
    "summarize_unstarted",
    "tools_of",
]

MAX_MESSAGES = 1024
MAX_CALLS = 128  # tool calls in one assistant message
MAX_ID_CHARS = 256
DEFAULT_MAX_TOKENS = 256  # cap of the default max_tokens: min(256, context - prompt)
speculation_params = spec_params  # (the name the front ends knew it by)


def _bad(msg: str, field: str | None = None) -> RequestError:
    return RequestError("invalid_request", msg, field)


@dataclass(frozen=True)
class BuiltRequest:
    prompt_ids: list
    params: SamplingParams
    spec: SpecParams
    priority: str
    grammar: Any = None  # a specd.structured.GrammarSpec, or None

    def submit(self, request_id: str, tenant: str | None = None) -> Submit:
        """The engine's ``Submit`` for this request."""
        return Submit(request_id, self.prompt_ids, self.params, self.spec, self.priority, tenant, self.grammar)

    @property
    def tools(self):
        """The request's ``ToolCallSpec`` (its reply is parsed for tool calls), or None."""
        return tools_of(self.grammar)


def tools_of(grammar):
    """A grammar's ``ToolCallSpec`` when it constrains tool calls, else None."""
    return grammar.value if grammar is not None and grammar.kind == "tool_calls" else None


def check_id(rid: str) -> str:
    """A client request id within ``MAX_ID_CHARS`` (the front ends check its type)."""
    if len(rid) > MAX_ID_CHARS:
        raise _bad(f"id is longer than {MAX_ID_CHARS} characters", "id")
    return rid


def _require_tokenizer(tokenizer) -> None:
    if tokenizer is None:
        raise RequestError("internal", "the model has no tokenizer")


def _apply_template(tokenizer, messages: list, tools) -> list:
    kw = {}
    if CR.renders_tools(tokenizer):
        messages, functions = CR.template_messages(messages, tools)
        if functions:
            kw["tools"] = functions
    else:
        messages = CR.text_messages(messages, tools)
    try:
        ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False, **kw
        )
    except Exception as e:  # noqa: BLE001 - jinja errors: roles out of order, unsupported role, ...
        raise _bad(f"chat template rejected the messages: {e}", "messages") from None
    return ids["input_ids"] if hasattr(ids, "keys") else ids  # (a dict / BatchEncoding)


def encode_prompt(tokenizer, messages: list | None = None, prompt: str | None = None, tools=None) -> list:
    """Token ids of already-checked ``messages`` (chat template, or their contents joined by newlines
    for a tokenizer without one) or else ``prompt`` (raw text). ``tools``: the request's
    ``ToolCallSpec`` (``specd.serving.chat_render``: through the template when it renders tools, else
    as a system message; calls and tool results in messages likewise)."""
    _require_tokenizer(tokenizer)
    if messages is not None and getattr(tokenizer, "chat_template", None):
        ids = _apply_template(tokenizer, messages, tools)
    else:
        text = prompt if messages is None else "\n".join(m["content"] for m in CR.text_messages(messages, tools))
        ids = tokenizer(text)["input_ids"]
    return [int(t) for t in ids]


def check_prompt(messages=None, prompt=None) -> tuple:
    """``(messages, prompt)``: exactly one of chat ``messages`` (``[{role, content}]``, returned with
    only those keys) or a non-empty raw ``prompt`` string."""
    if (messages is None) == (prompt is None):
        raise _bad("give exactly one of 'messages' and 'prompt'", "prompt")
    if prompt is not None:
        if not isinstance(prompt, str):
            raise _bad(f"'prompt' must be a string, got {type(prompt).__name__}", "prompt")
        if not prompt:
            raise _bad("prompt is empty", "prompt")
        return None, prompt
    return _check_messages(messages), None


def prompt_ids_from(
    tokenizer, messages: Sequence[Mapping] | None = None, prompt: str | None = None, tools=None
) -> list:
    """Token ids of exactly one of ``messages`` (chat template) or ``prompt`` (raw text)."""
    messages, prompt = check_prompt(messages, prompt)
    _require_tokenizer(tokenizer)
    ids = encode_prompt(tokenizer, messages, prompt, tools)
    if not ids:
        raise _bad("prompt is empty", "prompt")
    return ids


def _check_ids(ids) -> list:
    if isinstance(ids, (str, bytes, Mapping)) or not isinstance(ids, Sequence):
        raise _bad("prompt token ids must be a list of integers", "prompt")
    if not ids:
        raise _bad("prompt is empty", "prompt")
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise _bad("prompt token ids must be integers", "prompt")
    return list(ids)


def _check_calls(calls, where: str) -> list:
    """An assistant message's ``tool_calls``: ``[{"id", "type": "function", "function": {"name",
    "arguments" (JSON text)}}]``, returned with only those keys."""
    if isinstance(calls, (str, bytes, Mapping)) or not isinstance(calls, Sequence) or len(calls) > MAX_CALLS:
        raise _bad(f"{where}.tool_calls must be a list of at most {MAX_CALLS} calls", "messages")
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, Mapping) else None
        if not isinstance(fn, Mapping) or c.get("type", "function") != "function":
            raise _bad(f"{where}.tool_calls[{j}] must be {{type: function, function: {{name, arguments}}}}", "messages")
        cid, name, args = c.get("id", ""), fn.get("name"), fn.get("arguments", "{}")
        if not isinstance(cid, str) or not isinstance(name, str) or not name or not isinstance(args, str):
            raise _bad(f"{where}.tool_calls[{j}]: id, function.name and function.arguments must be strings", "messages")
        out.append({"id": cid, "type": "function", "function": {"name": name, "arguments": args}})
    return out


def _check_message(i: int, m) -> dict:
    if not isinstance(m, Mapping):
        raise _bad(f"messages[{i}] must be an object with 'role' and 'content'", "messages")
    role, content = m.get("role"), m.get("content")
    if not isinstance(role, str) or not role:
        raise _bad(f"messages[{i}].role must be a non-empty string", "messages")
    calls = m.get("tool_calls")
    if calls is not None and role != "assistant":
        raise _bad(f"messages[{i}].tool_calls: only assistant messages have tool calls", "messages")
    if not isinstance(content, str) and not (content is None and calls):
        raise _bad(f"messages[{i}].content must be a string", "messages")
    out = {"role": role, "content": content}
    if calls is not None:
        out["tool_calls"] = _check_calls(calls, f"messages[{i}]")
    if m.get("tool_call_id") is not None:
        if role != "tool" or not isinstance(m["tool_call_id"], str):
            raise _bad(f"messages[{i}].tool_call_id must be a string, on a message of role 'tool'", "messages")
        out["tool_call_id"] = m["tool_call_id"]
    return out


def _check_messages(messages) -> list:
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        raise _bad("'messages' must be a list of {role, content} objects", "messages")
    if not messages:
        raise _bad("'messages' is empty", "messages")
    if len(messages) > MAX_MESSAGES:
        raise _bad(f"too many messages ({len(messages)} > {MAX_MESSAGES})", "messages")
    return [_check_message(i, m) for i, m in enumerate(messages)]


def message_chars(messages: list) -> int:
    """Characters of checked messages (contents and calls): what tokenizing them costs."""
    n = 0
    for m in messages:
        n += len(m.get("content") or "")
        for c in m.get("tool_calls", ()):
            n += len(c["function"]["arguments"]) + len(c["function"]["name"])
    return n


def default_max_tokens(prompt_tokens: int, max_model_len: int | None = None) -> int:
    """``min(DEFAULT_MAX_TOKENS, max_model_len - prompt_tokens)`` (``DEFAULT_MAX_TOKENS`` without
    ``max_model_len``); ``too_long`` when the prompt leaves no room."""
    room = DEFAULT_MAX_TOKENS if max_model_len is None else max_model_len - prompt_tokens
    if room < 1:
        raise RequestError(
            "too_long", f"prompt ({prompt_tokens} tokens) fills the context ({max_model_len})", "max_tokens"
        )
    return min(DEFAULT_MAX_TOKENS, room)


def check_fields(priority=None, speculation=None, **sampling) -> tuple:
    """``(SamplingParams, SpecParams, priority)`` of a request's fields (None = the default; a
    missing ``max_tokens`` validates as 1 until the prompt's length settles it)."""
    if sampling.get("max_tokens") is None:
        sampling["max_tokens"] = 1
    params = sampling_params(**sampling)
    return params, spec_params(speculation), check_priority("interactive" if priority is None else priority)


def build_request(
    tokenizer,
    *,
    messages=None,
    prompt=None,
    prompt_ids=None,
    priority=None,
    speculation: Mapping | None = None,
    max_model_len: int | None = None,
    grammar=None,
    **sampling,
) -> BuiltRequest:
    """Validate everything cheap first, then tokenize. ``sampling``: ``SamplingParams`` fields by
    name (None = the default); ``speculation``: {mode, max_draft_tokens}. ``prompt_ids`` (token ids,
    the OpenAI completions API's other prompt form) replaces ``messages`` / ``prompt``; the engine
    limits check them against the vocabulary. ``grammar``: the reply's ``GrammarSpec`` (read by
    ``specd.structured.grammar_spec``); a tool-call grammar's tools are rendered into the prompt.

    ``max_tokens`` None: ``default_max_tokens(prompt tokens, max_model_len)``.
    """
    default_max = sampling.get("max_tokens") is None
    params, spec, prio = check_fields(priority, speculation, **sampling)
    if prompt_ids is not None:
        if messages is not None or prompt is not None:
            raise _bad("give exactly one of 'messages', 'prompt' and 'prompt_ids'", "prompt")
        ids = _check_ids(prompt_ids)
    else:
        ids = prompt_ids_from(tokenizer, messages, prompt, tools_of(grammar))
    if default_max:
        params = dataclasses.replace(params, max_tokens=default_max_tokens(len(ids), max_model_len))
    return BuiltRequest(ids, params, spec, prio, grammar)


_TOKENIZER_POOL = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specd-tokenize")


async def build_request_async(tokenizer, **kw) -> BuiltRequest:
    """``build_request`` off the event loop, on the one shared tokenizer thread (requests are
    tokenized one at a time, in arrival order)."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_TOKENIZER_POOL, functools.partial(build_request, tokenizer, **kw))


def _ms(t0: float | None, t1: float | None) -> float | None:
    return None if t0 is None or t1 is None else round((t1 - t0) * 1000.0, 3)


def summarize(seq) -> dict:
    """The ``done`` message's usage / spec / timing of a finished ``Sequence`` (milliseconds from the
    request's arrival in the engine; None for an event that never happened, e.g. cancelled in queue)."""
    st = seq.stats
    return {
        "usage": {"prompt_tokens": seq.num_prompt, "completion_tokens": seq.num_output},
        "spec": {
            "steps": st.steps,
            "draft_tokens": st.draft_tokens,
            "accepted_tokens": st.accepted_tokens,
            "mean_accepted_length": round(st.mean_accepted_length, 4),
        },
        "timing": {
            "queue_ms": _ms(seq.arrival, seq.scheduled_time),
            "ttft_ms": _ms(seq.arrival, seq.first_token_time),
            "total_ms": _ms(seq.arrival, seq.finish_time),
        },
    }


def summarize_unstarted(prompt_tokens: int = 0) -> dict:
    """``summarize``'s shape for a request that never reached the engine (e.g. cancelled while being
    tokenized): nothing generated, no timings."""
    return {
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": 0},
        "spec": {"steps": 0, "draft_tokens": 0, "accepted_tokens": 0, "mean_accepted_length": 0.0},
        "timing": {"queue_ms": None, "ttft_ms": None, "total_ms": None},
    }
