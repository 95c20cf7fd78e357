"""Sampling parameters: the one validation of every sampling field a request carries.

``SamplingParams`` is built by every front end (OpenAI HTTP, our websocket, gRPC) and by the engine's
own callers; its ``__post_init__`` is the only place a field is checked, so a bad value gets the same
error message whichever door it came through.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["SamplingParams"]


INT64_MAX = (1 << 63) - 1
MAX_TEMPERATURE = 100.0
MIN_TEMPERATURE = 1e-5  # a positive temperature below this samples as greedy (argmax)
MIN_TOP_P = 1e-6  # top_p below this keeps the top token alone, exactly like 1e-6 (1/V > 1e-6)
MAX_STOP = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
MAX_LOGPROBS = 20  # alternatives per token with ``logprobs`` (OpenAI's top_logprobs bound)
MAX_LOGIT_BIAS = 300  # entries of ``logit_bias`` (OpenAI's bound)
MAX_PENALTY = 2.0  # |presence_penalty|, |frequency_penalty| (OpenAI's bound)
MAX_REPETITION_PENALTY = 10.0


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings (validated; immutable), bounded by what the engine represents.

    temperature     0 <= t <= 100; 0 means greedy (argmax, ties to the lowest token id); a positive
                    t below 1e-5 also samples greedily (dividing logits by it would overflow float32)
    top_p           nucleus mass, 0 < top_p <= 1 (1 = off); values below 1e-6 act as 1e-6 (the top
                    token alone, as they would mathematically)
    top_k           keep the k most likely tokens; 0 or -1 = off; at most 2**63-1 (int64); the engine
                    treats a value at or above its vocabulary as off
    seed            any integer, reduced to 64 bits (``seed mod 2**64``); None = nondeterministic
    max_tokens      1 .. 2**63-1 generated tokens at most (the context bounds it further: too_long)
    stop            at most 16 stop strings of 1..256 characters; lists are stored as tuples
    stop_token_ids  at most 256 token ids (0 .. 2**63-1; the engine checks them against its
                    vocabulary) that end generation (besides EOS unless ignore_eos)
    ignore_eos      keep generating after EOS
    logprobs        None = off; 0..20 = return each emitted token's log-probability under the target
                    (log-softmax of its logits, before temperature / top-k / top-p) and that many of
                    the likeliest tokens with theirs
    logit_bias      at most 300 (token id, bias) pairs, bias in [-100, 100], added to the token's
                    logit in every row the target computes for the request (a mapping, e.g. OpenAI's
                    ``{"50256": -100}``, is accepted and stored as sorted pairs; the engine checks
                    the ids against its vocabulary); speculation verifies against the biased
                    distribution, so output stays that of the target with the bias
    presence_penalty, frequency_penalty
                    in [-2, 2] (OpenAI's): subtracted from the logit of every token the reply holds
                    so far, once (presence) and per occurrence (frequency); 0 = off
    repetition_penalty
                    in (0, 10] (vLLM's and Hugging Face's): the logit of every token of the prompt or
                    the reply so far is divided by it when positive, else multiplied; 1 = off
    min_p           in [0, 1] (vLLM's): after temperature, tokens less likely than min_p times the
                    likeliest are dropped (before top-k and top-p); 0 = off
                    The penalties apply to every row the target verifies, each with the reply as far
                    as that row's draft path (``specd.sampling.penalties``): speculation verifies
                    against the penalized distribution, so output stays that of the target with them
    Every refusal is a ValueError naming the field.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0

    def __post_init__(self):
        t = _real("temperature", self.temperature)
        if not 0 <= t <= MAX_TEMPERATURE:
            raise ValueError(f"temperature must be in [0, {MAX_TEMPERATURE:g}] (0 = greedy), got {self.temperature}")
        p = _real("top_p", self.top_p)
        if not 0 < p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _int("top_k", self.top_k, -1, INT64_MAX, "0 / -1 = off")
        seed = self.seed
        if seed is not None:
            seed = _int("seed", seed) & 0xFFFF_FFFF_FFFF_FFFF
        _int("max_tokens", self.max_tokens, 1, INT64_MAX)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if self.logprobs is not None:
            _int("logprobs", self.logprobs, 0, MAX_LOGPROBS, "None = off")
        object.__setattr__(self, "temperature", t if t >= MIN_TEMPERATURE else 0.0)
        object.__setattr__(self, "top_p", max(p, MIN_TOP_P))
        object.__setattr__(self, "seed", seed)
        object.__setattr__(self, "stop", _stop_strings(self.stop))
        object.__setattr__(self, "stop_token_ids", _stop_ids(self.stop_token_ids))
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        for name in ("presence_penalty", "frequency_penalty"):
            v = _real(name, getattr(self, name))
            if not -MAX_PENALTY <= v <= MAX_PENALTY:
                raise ValueError(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}] (0 = off), got {v}")
            object.__setattr__(self, name, v)
        r = _real("repetition_penalty", self.repetition_penalty)
        if not 0 < r <= MAX_REPETITION_PENALTY:
            raise ValueError(f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}] (1 = off), got {r}")
        m = _real("min_p", self.min_p)
        if not 0 <= m <= 1:
            raise ValueError(f"min_p must be in [0, 1] (0 = off), got {m}")
        object.__setattr__(self, "repetition_penalty", r)
        object.__setattr__(self, "min_p", m)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Whether a penalty changes the target's logits (``specd.sampling.penalties``)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


def _real(name: str, v) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"{name} must be a number, got {v!r}")
    v = float(v)
    if not math.isfinite(v):
        raise ValueError(f"{name} must be finite, got {v}")
    return v


def _int(name: str, v, lo: int | None = None, hi: int | None = None, off: str = "") -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"{name} must be an int, got {v!r}")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise ValueError(f"{name} must be in [{lo}, {hi}]{f' ({off})' if off else ''}, got {v}")
    return v


def _bounded_tuple(name: str, items, limit: int, what: str) -> tuple:
    """``items`` as a tuple of at most ``limit`` entries (ValueError naming ``name`` otherwise)."""
    try:
        items = tuple(items)
    except TypeError:
        raise ValueError(f"{name} must be a sequence of {what}, got {items!r:.80}") from None
    if len(items) > limit:
        raise ValueError(f"{name}: at most {limit} {what}, got {len(items)}")
    return items


def _stop_strings(stop) -> tuple:
    stop = _bounded_tuple("stop", (stop,) if isinstance(stop, str) else stop, MAX_STOP, "strings")
    for s in stop:
        if not isinstance(s, str) or not s or len(s) > MAX_STOP_CHARS:
            raise ValueError(
                f"stop strings must be non-empty strings of at most {MAX_STOP_CHARS} characters, got {s!r:.80}"
            )
    return stop


def _stop_ids(ids) -> tuple:
    ids = _bounded_tuple("stop_token_ids", ids, MAX_STOP_TOKEN_IDS, "ints")
    return tuple(_int("stop_token_ids entry", i, 0, INT64_MAX) for i in ids)


def _logit_bias(bias) -> tuple:
    """Sorted ``(token id, bias)`` pairs from a mapping (ids may be decimal strings, as OpenAI's JSON
    keys are) or from pairs."""
    items = bias.items() if isinstance(bias, dict) else bias
    try:
        items = list(items)
    except TypeError:
        raise ValueError(f"logit_bias must map token ids to biases, got {bias!r}") from None
    if len(items) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias has {len(items)} entries; at most {MAX_LOGIT_BIAS}")
    out = {}
    for item in items:
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise ValueError(f"logit_bias entries must be (token id, bias) pairs, got {item!r}")
        k, v = item
        if isinstance(k, str) and k.strip().isdigit():
            k = int(k)
        tok = _int("logit_bias token id", k, 0, INT64_MAX)
        b = _real("logit_bias value", v)
        if not -100 <= b <= 100:
            raise ValueError(f"logit_bias value must be in [-100, 100], got {v} for token {tok}")
        out[tok] = b
    return tuple(sorted(out.items()))
