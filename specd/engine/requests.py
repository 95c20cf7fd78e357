"""The one validation of a request: every check a request's fields get, each field in exactly one place,
shared by every front end (websocket, OpenAI HTTP, gRPC), the engine client and the engine.

- sampling fields: ``SamplingParams`` (``specd.sampling.params``) checks each one; ``sampling_params``
  here is the one way in from a wire format (None = the default, a JSON string ``stop`` is one stop
  string, an object is never a list) and names the refused field (``RequestError.field``), so each
  protocol can point at its own name for it (OpenAI's ``param``);
- speculation: ``SpecParams``, reached through ``spec_params`` (an object ``{mode, max_draft_tokens}``);
- priority: ``check_priority``;
- the request against the model: ``validate_request`` (not empty, prompt + ``max_tokens`` within the
  context and the KV cache, token ids and stop token ids within the vocabulary; ``Engine.validate``
  and ``EngineLimits.validate`` are this function with their own limits).

A field a new sampling parameter adds to ``SamplingParams`` is read from every wire by its name
(``SAMPLING_FIELDS``) and checked by ``SamplingParams`` alone: nothing here changes for it.
Every refusal is a ``RequestError(code, message, field)``; ``code`` is the protocol's error code.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from specd.engine.sequence import PRIORITIES, SpecParams
from specd.sampling.params import SamplingParams

__all__ = [
    "SAMPLING_FIELDS",
    "SPECULATION_FIELDS",
    "RequestError",
    "check_priority",
    "normalize_params",
    "sampling_params",
    "spec_params",
    "validate_request",
]

SAMPLING_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams))
SPECULATION_FIELDS = tuple(f.name for f in dataclasses.fields(SpecParams))


class RequestError(ValueError):
    """A request the engine refuses; ``code`` is the protocol error code, ``field`` the request field
    at fault when there is one (``SamplingParams`` / ``SpecParams`` names, ``priority``, ...)."""

    def __init__(self, code: str, message: str, field: str | None = None):
        super().__init__(message)
        self.code = code
        self.field = field


def _bad(msg: str, field: str | None = None) -> RequestError:
    return RequestError("invalid_request", msg, field)


def _as_list(name: str, v, what: str) -> tuple:
    """A JSON list as a tuple (a string, bytes or an object is no list of ``what``)."""
    if isinstance(v, (str, bytes, Mapping)) or not isinstance(v, Sequence):
        raise _bad(f"'{name}' must be a list of {what}", name)
    return tuple(v)


def sampling_params(**fields) -> SamplingParams:
    """``SamplingParams`` from wire values by field name (None or absent = the default); a string
    ``stop`` is one stop string. A refusal is ``RequestError("invalid_request")`` naming the field."""
    unknown = set(fields) - set(SAMPLING_FIELDS)
    if unknown:  # (a caller's bug, not the client's)
        raise TypeError(f"not SamplingParams fields: {', '.join(sorted(unknown))}")
    kw = {k: v for k, v in fields.items() if v is not None}
    if "stop" in kw:
        stop = kw["stop"]
        kw["stop"] = (stop,) if isinstance(stop, str) else _as_list("stop", stop, "strings")
    if "stop_token_ids" in kw:
        kw["stop_token_ids"] = _as_list("stop_token_ids", kw["stop_token_ids"], "integers")
    try:
        return SamplingParams(**kw)
    except (TypeError, ValueError) as e:
        raise _bad(str(e), _culprit(kw)) from None


def _culprit(kw: dict) -> str | None:
    """The first field ``SamplingParams`` refuses on its own (fields are checked independently)."""
    for k, v in kw.items():
        try:
            SamplingParams(**{k: v})
        except (TypeError, ValueError):
            return k
    return None


def spec_params(speculation: Mapping | None = None) -> SpecParams:
    """``SpecParams`` from a wire object ``{mode, max_draft_tokens}`` (None, or a field None or
    absent = the default); unknown fields are refused."""
    if speculation is None:
        return SpecParams()
    if not isinstance(speculation, Mapping):
        raise _bad("speculation must be an object {mode, max_draft_tokens}", "speculation")
    unknown = set(speculation) - set(SPECULATION_FIELDS)
    if unknown:
        raise _bad(f"unknown speculation field(s): {', '.join(sorted(map(str, unknown)))}", "speculation")
    try:
        return SpecParams(**{k: v for k, v in speculation.items() if v is not None})
    except (TypeError, ValueError) as e:
        raise _bad(str(e), "speculation") from None


def check_priority(priority) -> str:
    """``interactive`` or ``batch``."""
    if not isinstance(priority, str) or priority not in PRIORITIES:  # unhashable values must not raise TypeError
        raise _bad(f"priority must be one of {', '.join(PRIORITIES)}, got {priority!r:.80}", "priority")
    return priority


def validate_request(
    prompt_ids: Sequence[int],
    params: SamplingParams,
    max_model_len: int,
    block_size: int,
    num_blocks: int,
    vocab_size: int,
) -> None:
    """Refuse (RequestError) a request that can never run: empty, too long for the context or the KV
    cache, token ids outside the vocabulary. Before any compute (the engine, and
    the server process through ``EngineLimits``, which has no engine of its own)."""
    n = len(prompt_ids)
    if n == 0:
        raise _bad("prompt is empty", "prompt")
    if n + params.max_tokens > max_model_len:
        raise RequestError(
            "too_long", f"prompt ({n}) + max_tokens ({params.max_tokens}) > context {max_model_len}", "max_tokens"
        )
    if -(-(n + params.max_tokens + 1) // block_size) > num_blocks:
        raise RequestError(
            "too_long",
            f"prompt ({n}) + max_tokens ({params.max_tokens}) exceeds the KV cache ({num_blocks * block_size} tokens)",
            "max_tokens",
        )
    bad = next((t for t in prompt_ids if not (0 <= t < vocab_size)), None)
    if bad is not None:
        raise _bad(f"token id {bad} outside the vocabulary (0..{vocab_size - 1})", "prompt")
    bad = next((t for t in params.stop_token_ids if not (0 <= t < vocab_size)), None)
    if bad is not None:
        raise _bad(f"stop_token_ids: {bad} is outside the vocabulary (0..{vocab_size - 1})", "stop_token_ids")
    bad = next((t for t, _ in params.logit_bias if not (0 <= t < vocab_size)), None)
    if bad is not None:
        raise _bad(f"logit_bias: token {bad} is outside the vocabulary (0..{vocab_size - 1})", "logit_bias")


def normalize_params(params: SamplingParams, vocab_size: int) -> SamplingParams:
    """``top_k`` at or above the vocabulary keeps every token: the same as off (0)."""
    if params.top_k >= vocab_size:
        return dataclasses.replace(params, top_k=0)
    return params
