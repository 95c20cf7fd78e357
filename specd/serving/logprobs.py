"""Log-probability entries in OpenAI's shapes, from the engine's ``RequestOutput.logprobs``.

A token's ``bytes`` are its exact UTF-8 bytes, so a client can rebuild text split inside a
character: byte-level BPE pieces (GPT-2 / Llama 3 / SmolLM: ``Ġ`` for a space) map back through
the byte alphabet, SentencePiece pieces turn ``▁`` into a space and ``<0xNN>`` into that byte.
``token`` is those bytes as text (a partial character shows as U+FFFD, as OpenAI's do).
"""

from __future__ import annotations

import re
from functools import lru_cache

__all__ = ["LogprobRenderer", "TokenText", "chat_logprobs", "completion_logprobs"]

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@lru_cache(maxsize=1)
def _byte_decoder() -> dict:
    """The inverse of byte-level BPE's printable alphabet (GPT-2's ``bytes_to_unicode``)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class TokenText:
    """Token id -> (text, bytes), cached per id."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self.byte_level = "ByteLevel" in repr(decoder)
        self._cache: dict = {}

    def _bytes(self, tid: int) -> bytes:
        piece = self.tok.convert_ids_to_tokens(tid)
        if not isinstance(piece, str):
            return self.tok.decode([tid]).encode()
        m = _BYTE_PIECE.fullmatch(piece)
        if m:
            return bytes([int(m.group(1), 16)])
        if self.byte_level:
            table = _byte_decoder()
            if all(c in table for c in piece):
                return bytes(table[c] for c in piece)
            return piece.encode()
        return piece.replace("\u2581", " ").encode()

    def __call__(self, tid: int) -> tuple:
        hit = self._cache.get(tid)
        if hit is None:
            b = self._bytes(tid)
            hit = self._cache[tid] = (b.decode("utf-8", errors="replace"), list(b))
        return hit


def _entry(text: TokenText, tid: int, lp: float) -> dict:
    s, b = text(tid)
    return {"token": s, "logprob": lp, "bytes": b}


def chat_logprobs(text: TokenText, token_ids: list, logprobs: list) -> dict:
    """``choices[].logprobs`` of a chat completion (or one chunk): ``{"content": [...], "refusal": None}``."""
    content = []
    for tid, (lp, top) in zip(token_ids, logprobs):
        e = _entry(text, tid, lp)
        e["top_logprobs"] = [_entry(text, t, v) for t, v in top]
        content.append(e)
    return {"content": content, "refusal": None}


def completion_logprobs(text: TokenText, token_ids: list, logprobs: list, offset: int = 0) -> dict:
    """``choices[].logprobs`` of a (legacy) completion: parallel lists, ``text_offset`` counting
    characters of the completion from ``offset`` (what earlier chunks of a stream covered)."""
    tokens, offsets, top = [], [], []
    for tid, (_, alts) in zip(token_ids, logprobs):
        s = text(tid)[0]
        tokens.append(s)
        offsets.append(offset)
        offset += len(s)
        top.append({text(t)[0]: v for t, v in alts})
    return {
        "tokens": tokens,
        "token_logprobs": [lp for lp, _ in logprobs],
        "top_logprobs": top,
        "text_offset": offsets,
    }


class LogprobRenderer:
    """One request's ``choices[].logprobs`` maker: chat or completions shape; for completions the
    character offset carries over from chunk to chunk of a stream."""

    def __init__(self, text: TokenText, chat: bool):
        self.text, self.chat, self.offset = text, chat, 0

    def __call__(self, token_ids: list, logprobs: list | None) -> dict | None:
        if logprobs is None:
            return None
        if self.chat:
            return chat_logprobs(self.text, token_ids, logprobs)
        d = completion_logprobs(self.text, token_ids, logprobs, self.offset)
        self.offset += sum(len(t) for t in d["tokens"])
        return d
