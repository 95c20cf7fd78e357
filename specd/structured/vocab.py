"""``Vocabulary``: the target's tokenizer as the grammar library sees it, built once per model.

Masks are over the *target's* vocabulary: ``size`` is the width of the model's logits, which may be
larger than the tokenizer's vocabulary (embedding tables padded to a multiple of 64 or 128); the
padded ids are never allowed. ``stop_ids`` are the tokens that end a reply (EOS, ``<|im_end|>``):
a grammar allows them exactly where the reply may end. Other special tokens are never allowed.

``fingerprint`` identifies the tokenizer's token strings, the size and the stop ids: compiled
grammars are cached under it (a grammar compiled for one vocabulary is meaningless for another).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import xgrammar as xgr

__all__ = ["Vocabulary", "builtin_tokenizer", "builtin_vocabulary"]


@dataclass(frozen=True, eq=False)
class Vocabulary:
    """``tokenizer`` (Hugging Face), ``size`` (the logits' width), ``stop_ids``, the library's view."""

    tokenizer: object
    size: int
    stop_ids: tuple
    info: xgr.TokenizerInfo = field(repr=False)
    fingerprint: str

    @classmethod
    def from_tokenizer(cls, tokenizer, size: int | None = None, stop_ids: Sequence[int] | None = None) -> Vocabulary:
        """``size``: the model's logits width (default: the tokenizer's length); ``stop_ids``: default
        the tokenizer's EOS."""
        n = len(tokenizer)
        size = n if size is None else int(size)
        if size < n:
            raise ValueError(f"vocabulary size {size} is smaller than the tokenizer's {n} tokens")
        if stop_ids is None:
            eos = getattr(tokenizer, "eos_token_id", None)
            stop_ids = [] if eos is None else [eos]
        stops = tuple(sorted({int(t) for t in stop_ids}))
        if not stops or not all(0 <= t < n for t in stops):
            raise ValueError(f"stop ids {list(stops)} must be non-empty token ids below {n}")
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=size, stop_token_ids=list(stops))
        return cls(tokenizer, size, stops, info, _fingerprint(tokenizer, size, stops))

    @property
    def words(self) -> int:
        """int32 words of one bitmask row: ceil(size / 32)."""
        return (self.size + 31) // 32

    @cached_property
    def _extendable(self) -> frozenset:
        """Ids whose bytes are a strict prefix of another token's (in sorted order, the next different
        string starts with it exactly when some longer token does)."""
        raw = list(self.info.decoded_vocab)
        order = sorted(range(len(raw)), key=raw.__getitem__)
        out = set()
        for k, i in enumerate(order):
            j = k + 1
            while j < len(order) and raw[order[j]] == raw[i]:
                j += 1
            if j < len(order) and raw[order[j]].startswith(raw[i]):
                out.add(i)
        return frozenset(out)

    def extendable(self, token: int) -> bool:
        """Some longer token starts with this one's bytes (so text after it may merge into one token)."""
        return token in self._extendable

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids))  # type: ignore[attr-defined]

    def encode(self, text: str) -> list:
        """``text``'s token ids as a continuation (mid-reply). A SentencePiece tokenizer writes a
        word-start marker (Llama 2's ``▁``: a space) before any text it encodes, which would add a
        space the text does not have: there the text is encoded behind an anchor letter, whose
        tokens are then dropped."""
        enc = self.tokenizer.encode  # type: ignore[attr-defined]
        if not self._dummy_prefix:
            return list(enc(text, add_special_tokens=False))
        head = list(enc("a", add_special_tokens=False))
        ids = list(enc("a" + text, add_special_tokens=False))
        if ids[: len(head)] == head:
            return ids[len(head) :]
        return list(enc(text, add_special_tokens=False))

    @cached_property
    def _dummy_prefix(self) -> bool:
        """The tokenizer writes a lone letter as a space and the letter (SentencePiece's marker)."""
        ids = list(self.tokenizer.encode("a", add_special_tokens=False))  # type: ignore[attr-defined]
        return bool(ids) and self.info.decoded_vocab[ids[0]].startswith(b" ")


def _fingerprint(tokenizer, size: int, stops: tuple) -> str:
    h = hashlib.sha256(f"{size}:{stops}:".encode())
    vocab = tokenizer.get_vocab()
    for tok, i in sorted(vocab.items(), key=lambda kv: kv[1]):
        h.update(f"{i}\t{tok}\n".encode())
    return h.hexdigest()[:16]


def builtin_tokenizer():
    """The built-in model's tokenizer (SmolLM2-135M-Instruct, 49,152 tokens), from the model cache."""
    from specd.model import builtin
    from specd.model.gguf import cached_folder
    from specd.model.loader import load_tokenizer

    return load_tokenizer(cached_folder(builtin.ensure(download=False), weights=False))


def builtin_vocabulary(size: int | None = None) -> Vocabulary:
    """:class:`Vocabulary` of the built-in model (stop id: its EOS ``<|im_end|>``)."""
    return Vocabulary.from_tokenizer(builtin_tokenizer(), size)
