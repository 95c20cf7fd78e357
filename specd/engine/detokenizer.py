"""Incremental detokenizer: stream correct text for byte-level BPE and sentencepiece tokenizers.

Decoding token by token breaks multi-byte UTF-8 characters split across byte-level BPE tokens
(partial bytes decode to U+FFFD) and drops sentencepiece's leading spaces (a piece decoded alone
loses its "▁"). So each step decodes a short window ``ids[prefix_offset:]`` and emits only the text
beyond what the window ``ids[prefix_offset:read_offset]`` already produced, holding back while the
new text ends in an incomplete character.
"""

from __future__ import annotations


class IncrementalDetokenizer:
    CONTEXT = 6  # prompt tokens kept as left context (sentencepiece spaces, byte merges)

    def __init__(self, tokenizer, prompt_ids=(), skip_special_tokens: bool = True):
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = list(prompt_ids[-self.CONTEXT :]) if prompt_ids else []
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""  # everything emitted so far
        self._prefix = (-1, -1, "")  # (prefix_offset, read_offset, decoded prefix window)
        # transformers' fast tokenizers decode through their ``tokenizers.Tokenizer``; with
        # clean-up off the wrapper adds only argument conversion, so call the backend directly
        backend = getattr(tokenizer, "_tokenizer", None)
        decode = getattr(backend, "decode", None)
        self._backend_decode = decode if decode is not None and hasattr(backend, "encode") else None

    def _decode(self, ids) -> str:
        if self._backend_decode is not None:
            return self._backend_decode(ids, skip_special_tokens=self.skip)
        return self.tok.decode(ids, skip_special_tokens=self.skip, clean_up_tokenization_spaces=False)

    def _prefix_text(self) -> str:
        po, ro, text = self._prefix
        if po != self.prefix_offset or ro != self.read_offset:
            text = (
                self._decode(self.ids[self.prefix_offset : self.read_offset])
                if self.read_offset > self.prefix_offset
                else ""
            )
            self._prefix = (self.prefix_offset, self.read_offset, text)
        return text

    def add(self, new_ids) -> str:
        """Append token ids; return the newly completed text (possibly empty)."""
        self.ids.extend(new_ids)
        prefix = self._prefix_text()
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        """At the end of a stream: emit whatever is held back (even an incomplete character)."""
        prefix = self._prefix_text()
        full = self._decode(self.ids[self.prefix_offset :])
        delta = full[len(prefix) :] if len(full) > len(prefix) else ""
        self.prefix_offset = self.read_offset = len(self.ids)
        self.text += delta
        return delta
