"""OpenAI response objects and stream chunks, built from engine outputs (pure functions).

``usage`` adds two things no peer reports: ``prompt_tokens_details.cached_tokens`` is the prompt's
share served from the prefix cache (what the engine did not recompute), and ``speculation`` is the
request's speculative decoding: ``steps`` (target verification steps), ``draft_tokens`` proposed,
``accepted_tokens``, ``mean_accepted_length`` = tokens per target forward pass.
"""

from __future__ import annotations

import orjson

from specd.serving.request_build import summarize

__all__ = [
    "FINISH",
    "chat_chunk",
    "chat_completion",
    "completion",
    "completion_chunk",
    "model_object",
    "speculation",
    "sse",
    "usage",
    "usage_chunk",
]

# engine finish reasons -> OpenAI's (a cancelled request never reaches a client as a finish: the
# drain deadline ends it with an error instead, see openai_routes)
FINISH = {"stop": "stop", "length": "length"}
TOOL_CALLS = "tool_calls"  # a reply that ended (EOS) with tool calls
DONE = b"data: [DONE]\n\n"


def sse(obj, event: str | None = None) -> bytes:
    """One server-sent event (``event:`` line when named) with a JSON ``data:`` line."""
    data = b"data: " + orjson.dumps(obj) + b"\n\n"
    return data if event is None else b"event: " + event.encode() + b"\n" + data


def speculation(seq) -> dict:
    """A request's speculative decoding: totals, and ``by_proposer`` (the draft model, prompt lookup,
    earlier requests, ...) when more than one proposed for it."""
    spec = summarize(seq)["spec"]
    by = seq.stats.as_dict()["by_proposer"]
    if len(by) > 1:
        spec["by_proposer"] = by
    return spec


def usage(seq) -> dict:
    """Chat / completions usage of a finished request (``seq``: its engine sequence or stand-in)."""
    p, c = seq.num_prompt, seq.num_output
    return {
        "prompt_tokens": p,
        "completion_tokens": c,
        "total_tokens": p + c,
        "prompt_tokens_details": {"cached_tokens": int(getattr(seq, "cached_prefix_tokens", 0) or 0)},
        "speculation": speculation(seq),
    }


def model_object(name: str, created: int, max_model_len: int | None = None) -> dict:
    m = {"id": name, "object": "model", "created": created, "owned_by": "specd"}
    if max_model_len is not None:
        m["max_model_len"] = max_model_len
    return m


def chat_completion(
    rid: str,
    created: int,
    model: str,
    text: str | None,
    finish: str,
    use: dict,
    logprobs: dict | None = None,
    tool_calls: list | None = None,
) -> dict:
    """``tool_calls``: the reply's calls (``ToolCall``s; OpenAI's ``message.tool_calls``), when it has any."""
    message = {"role": "assistant", "content": text, "refusal": None}
    if tool_calls:
        message["tool_calls"] = [c.to_openai() for c in tool_calls]
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish}],
        "usage": use,
        "system_fingerprint": None,
    }


def chat_chunk(
    rid: str,
    created: int,
    model: str,
    delta: dict,
    finish: str | None,
    with_usage: bool,
    logprobs: dict | None = None,
    index: int = 0,
) -> dict:
    c = {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}],
        "system_fingerprint": None,
    }
    if with_usage:
        c["usage"] = None  # (OpenAI: null on every chunk but the last, which has empty choices)
    return c


def completion(
    rid: str,
    created: int,
    model: str,
    text: str,
    finish: str | None,
    use: dict | None,
    logprobs: dict | None = None,
    index: int = 0,
) -> dict:
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}],
        "usage": use,
        "system_fingerprint": None,
    }


def completion_chunk(
    rid: str,
    created: int,
    model: str,
    text: str,
    finish: str | None,
    with_usage: bool,
    logprobs: dict | None = None,
    index: int = 0,
) -> dict:
    c = completion(rid, created, model, text, finish, None, logprobs, index)
    if not with_usage:
        del c["usage"]
    return c


def usage_chunk(rid: str, created: int, model: str, obj: str, use: dict) -> dict:
    """The last chunk of a stream with ``stream_options.include_usage``: no choices, the usage."""
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": use}
