"""What a step hands back per request: the tokens it emitted (cut at a stop condition) and the
text they complete, honouring stop strings (a suffix that may start one is held back)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from specd.engine.sequence import Sequence


@dataclass
class RequestOutput:
    request_id: str
    token_ids: list  # tokens emitted this step
    text: str  # text completed this step
    finished: bool
    finish_reason: str | None
    seq: Any  # the engine's Sequence, or the process link's RemoteSeq mirror of it
    error: str | None = None  # finish_reason "error": what failed (stage and exception)
    logprobs: list | None = None  # with params.logprobs: per token of token_ids, see token_logprobs


if TYPE_CHECKING:
    import torch


def token_logprobs(logits: torch.Tensor, rows: list, tokens: list, top: int) -> list:
    """Per emitted token ``tokens[i]`` (predicted by logits row ``rows[i]``): ``(logprob, [(id,
    logprob), ...])``, its log-probability under the target's raw distribution (log-softmax of the
    logits: before temperature, top-k and top-p, as vLLM's default) and the ``top`` likeliest
    tokens with theirs, likeliest first."""
    if not tokens:
        return []
    import torch  # (the engine's: the server process imports this module and never calls this)

    dev = logits.device
    lp = torch.log_softmax(logits[torch.tensor(rows, device=dev)].float(), dim=-1)
    chosen = lp.gather(1, torch.tensor(tokens, device=dev)[:, None]).squeeze(1).tolist()
    if top == 0:
        return [(c, []) for c in chosen]
    vals, ids = lp.topk(top, dim=-1)
    return [(c, list(zip(i, v))) for c, i, v in zip(chosen, ids.tolist(), vals.tolist())]


def emit(seq: Sequence, tokens: list, eos_ids: set, max_model_len: int) -> tuple[list, str | None, str]:
    """Append the step's tokens to ``seq`` up to a stop condition: (new tokens, finish reason or
    None, text delta). An EOS or stop id ends with ``stop`` (the token is emitted); reaching
    ``max_tokens`` or the context ends with ``length``; a stop string ends with ``stop``."""
    p = seq.params
    new: list = []
    reason = None
    for t in tokens:
        new.append(t)
        seq.tokens.append(t)
        if (t in eos_ids and not p.ignore_eos) or t in p.stop_token_ids:
            reason = "stop"
            break
        if seq.num_output >= p.max_tokens or len(seq.tokens) >= max_model_len:
            reason = "length"
            break
    text = ""
    if seq.detok is not None:
        text = text_delta(seq, new, reason is not None)
        if seq.finish_reason == "stop" and reason is None:
            reason = "stop"  # a stop string matched
    return new, reason, text


def text_delta(seq: Sequence, new: list, final: bool) -> str:
    """The text ``new`` completes; a matched stop string cuts the text (and sets ``finish_reason``),
    a suffix that may start one is held back until the next step or the end."""
    d = seq.detok
    assert d is not None
    d.add(new)
    if final:
        d.flush()
    full = d.text
    sent = seq.sent_chars
    stops = seq.params.stop
    if not stops:
        seq.sent_chars = len(full)
        return full[sent:]
    lo = max(0, sent - max(len(s) for s in stops))
    hits = [i for i in (full.find(s, lo) for s in stops) if i >= 0]
    if hits:
        cut = min(hits)
        seq.finish_reason = "stop"
        seq.sent_chars = max(sent, cut)
        seq.stop_text = full[:cut]
        return full[sent:cut] if cut > sent else ""
    upto = len(full) if final else len(full) - _held_back(full, stops)
    seq.sent_chars = max(sent, upto)
    return full[sent:upto] if upto > sent else ""


def _held_back(full: str, stops: tuple) -> int:
    """Length of the longest suffix of ``full`` that is a proper prefix of a stop string."""
    hold = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(full)), 0, -1):
            if full.endswith(s[:k]):
                hold = max(hold, k)
                break
    return hold
