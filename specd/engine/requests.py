"""Admission checks: what makes the engine refuse a request before any compute (also used by the
server process, which has no engine of its own)."""

from __future__ import annotations

import dataclasses

from specd.sampling.params import SamplingParams


class RequestError(ValueError):
    """A request the engine refuses; ``code`` is the protocol error code."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


def validate_request(
    prompt_ids: list, params: SamplingParams, max_model_len: int, block_size: int, num_blocks: int, vocab_size: int
) -> None:
    """Refuse (RequestError) a request that can never run: empty, too long for the context or the KV
    cache, token ids outside the vocabulary. Before any compute (also used by the server process)."""
    n = len(prompt_ids)
    if n == 0:
        raise RequestError("invalid_request", "prompt is empty")
    if n + params.max_tokens > max_model_len:
        raise RequestError("too_long", f"prompt ({n}) + max_tokens ({params.max_tokens}) > context {max_model_len}")
    if -(-(n + params.max_tokens + 1) // block_size) > num_blocks:
        raise RequestError(
            "too_long",
            f"prompt ({n}) + max_tokens ({params.max_tokens}) exceeds the KV cache ({num_blocks * block_size} tokens)",
        )
    bad = next((t for t in prompt_ids if not (0 <= t < vocab_size)), None)
    if bad is not None:
        raise RequestError("invalid_request", f"token id {bad} outside the vocabulary (0..{vocab_size - 1})")
    bad = next((t for t in params.stop_token_ids if not (0 <= t < vocab_size)), None)
    if bad is not None:
        raise RequestError("invalid_request", f"stop_token_ids: {bad} is outside the vocabulary (0..{vocab_size - 1})")


def normalize_params(params: SamplingParams, vocab_size: int) -> SamplingParams:
    """``top_k`` at or above the vocabulary keeps every token: the same as off (0)."""
    if params.top_k >= vocab_size:
        return dataclasses.replace(params, top_k=0)
    return params
