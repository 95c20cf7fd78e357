"""Turn a client's generate request into engine inputs, and a finished sequence into its summary.

Shared by the websocket and gRPC front ends so that both validate the same way, render chat
messages the same way and report the same numbers. Everything raises
``RequestError("invalid_request", ...)`` (a ``ValueError``) for bad input; ``too_long`` and
``overloaded`` come later, from the engine.

    req = build_request(engine.tokenizer, messages=[{"role": "user", "content": "Hi"}],
                        max_tokens=64, temperature=0.7, speculation={"mode": "tree"})
    async for out in async_engine.generate(req.prompt_ids, req.params, req.spec, req.priority, rid):
        ...
    done = summarize(out.seq)  # {"usage": {...}, "spec": {...}, "timing": {...}}

Chat messages go through the tokenizer's own chat template with ``add_generation_prompt=True``. A
tokenizer without a chat template (base models such as the tiny stories pair) gets the messages'
contents joined by newlines as raw text, the way ``specd generate`` falls back to the raw prompt.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

from specd.engine import RequestError
from specd.sampling import SamplingParams
from specd.sequence import PRIORITIES, SpecParams

__all__ = ["BuiltRequest", "build_request", "prompt_ids_from", "sampling_params", "spec_params",
           "check_priority", "summarize"]

MAX_MESSAGES = 1024


def _bad(msg: str) -> RequestError:
    return RequestError("invalid_request", msg)


@dataclass(frozen=True)
class BuiltRequest:
    prompt_ids: list
    params: SamplingParams
    spec: SpecParams
    priority: str


def prompt_ids_from(tokenizer, messages: Optional[Sequence[Mapping[str, Any]]] = None,
                    prompt: Optional[str] = None) -> list:
    """Token ids of exactly one of ``messages`` (chat template) or ``prompt`` (raw text)."""
    if (messages is None) == (prompt is None):
        raise _bad("give exactly one of 'messages' and 'prompt'")
    if tokenizer is None:
        raise RequestError("internal", "the model has no tokenizer")
    if prompt is not None:
        if not isinstance(prompt, str):
            raise _bad(f"'prompt' must be a string, got {type(prompt).__name__}")
        if not prompt:
            raise _bad("prompt is empty")
        ids = tokenizer(prompt)["input_ids"]
    else:
        msgs = _check_messages(messages)
        if getattr(tokenizer, "chat_template", None):
            try:
                ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                                    return_dict=False)
            except Exception as e:  # jinja errors: roles out of order, unsupported role, ...
                raise _bad(f"chat template rejected the messages: {e}") from None
            if isinstance(ids, Mapping):
                ids = ids["input_ids"]
        else:
            ids = tokenizer("\n".join(m["content"] for m in msgs))["input_ids"]
    ids = [int(t) for t in ids]
    if not ids:
        raise _bad("prompt is empty")
    return ids


def _check_messages(messages) -> list:
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        raise _bad("'messages' must be a list of {role, content} objects")
    if not messages:
        raise _bad("'messages' is empty")
    if len(messages) > MAX_MESSAGES:
        raise _bad(f"too many messages ({len(messages)} > {MAX_MESSAGES})")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise _bad(f"messages[{i}] must be an object with 'role' and 'content'")
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str) or not role:
            raise _bad(f"messages[{i}].role must be a non-empty string")
        if not isinstance(content, str):
            raise _bad(f"messages[{i}].content must be a string")
        out.append({"role": role, "content": content})
    return out


def sampling_params(max_tokens=None, temperature=None, top_p=None, top_k=None, seed=None,
                    stop=None) -> SamplingParams:
    """``SamplingParams`` from optional fields (None = the default); ValueError -> invalid_request."""
    kw = {k: v for k, v in (("max_tokens", max_tokens), ("temperature", temperature), ("top_p", top_p),
                            ("top_k", top_k), ("seed", seed)) if v is not None}
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, Sequence) or isinstance(stop, (bytes, Mapping)):
            raise _bad("'stop' must be a string or a list of strings")
        kw["stop"] = tuple(stop)
    try:
        return SamplingParams(**kw)
    except (TypeError, ValueError) as e:
        raise _bad(str(e)) from None


def spec_params(mode=None, max_draft_tokens=None) -> SpecParams:
    try:
        return SpecParams(mode="auto" if mode is None else mode, max_draft_tokens=max_draft_tokens)
    except (TypeError, ValueError) as e:
        raise _bad(str(e)) from None


def check_priority(priority=None) -> str:
    if priority is None:
        return "interactive"
    if priority not in PRIORITIES:
        raise _bad(f"priority must be one of {'|'.join(PRIORITIES)}, got {priority!r}")
    return priority


def build_request(tokenizer, *, messages=None, prompt=None, max_tokens=None, temperature=None,
                  top_p=None, top_k=None, seed=None, stop=None, priority=None,
                  speculation: Optional[Mapping[str, Any]] = None) -> BuiltRequest:
    """Validate everything cheap first, then tokenize. ``speculation``: {mode, max_draft_tokens}."""
    params = sampling_params(max_tokens, temperature, top_p, top_k, seed, stop)
    if speculation is None:
        speculation = {}
    if not isinstance(speculation, Mapping):
        raise _bad("'speculation' must be an object {mode, max_draft_tokens}")
    unknown = set(speculation) - {"mode", "max_draft_tokens"}
    if unknown:
        raise _bad(f"unknown speculation field(s): {', '.join(sorted(unknown))}")
    spec = spec_params(speculation.get("mode"), speculation.get("max_draft_tokens"))
    prio = check_priority(priority)
    ids = prompt_ids_from(tokenizer, messages, prompt)
    return BuiltRequest(ids, params, spec, prio)


def _ms(t0: Optional[float], t1: Optional[float]) -> float:
    return round(max(0.0, (t1 - t0) * 1000.0), 3) if t0 is not None and t1 is not None else 0.0


def summarize(seq) -> dict:
    """The ``done`` message's usage / spec / timing of a finished ``Sequence`` (milliseconds from the
    request's arrival in the engine; 0 for an event that never happened, e.g. cancelled in queue)."""
    st = seq.stats.as_dict()
    return {
        "usage": {"prompt_tokens": seq.num_prompt, "completion_tokens": seq.num_output},
        "spec": {k: st[k] for k in ("steps", "draft_tokens", "accepted_tokens", "mean_accepted_length")},
        "timing": {"queue_ms": _ms(seq.arrival, seq.scheduled_time),
                   "ttft_ms": _ms(seq.arrival, seq.first_token_time),
                   "total_ms": _ms(seq.arrival, seq.finish_time)},
    }
