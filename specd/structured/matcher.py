"""``Matcher``: one request's grammar state, with exactly what speculative decoding asks of it.

Vocabulary (as in :mod:`specd.sampling.tree`): the matcher has *consumed* every committed token of
the reply, the pending (root) token included; ``allowed()`` is the mask of the token after them.

- ``advance(token)``: consume one more token if the grammar allows it (True), else change nothing
  (False); a stop token is allowed where the reply may end, and consuming it *terminates* the
  matcher.
- ``rollback(n)``: un-consume the last ``n`` tokens (rejected drafts); any ``n`` up to
  ``num_tokens``. After ``advance`` along a path and ``rollback`` of it, the state (its mask) is
  what it was: the invariant the tests check against a fresh replay.
- ``forced_tokens(max_n)``: where the grammar leaves exactly one continuation *text* (keys,
  quotes, braces, an enum's tail), that text as the target tokenizer's token ids: jump-forward
  drafts that cost no drafter. The target still verifies them; a tokenization the target would not
  choose is rejected like any draft.
- a terminated matcher's mask allows the stop tokens only (so a row after the end never has all
  logits at -inf).

Masks cover the target's vocabulary (``vocab.size`` = the logits' width); padded ids and special
tokens other than the stop tokens are never allowed.
"""

from __future__ import annotations

import torch
import xgrammar as xgr

from specd.structured.masks import unpack, words
from specd.structured.vocab import Vocabulary

__all__ = ["Matcher"]


class Matcher:
    """One request's grammar state (see the module docstring); made by ``Grammar.matcher()``."""

    __slots__ = ("_m", "vocab", "num_tokens", "_stop_row")

    def __init__(self, compiled: xgr.CompiledGrammar, vocab: Vocabulary):
        self._m = xgr.GrammarMatcher(compiled)
        self.vocab = vocab
        self.num_tokens = 0  # tokens consumed (what rollback may undo)
        self._stop_row: torch.Tensor | None = None

    # ------------------------------------------------------------------ masks
    def fill(self, bitmask: torch.Tensor, row: int = 0) -> None:
        """Write the current mask into ``bitmask[row]`` (``bitmask``: [rows, ceil(V/32)] int32, CPU)."""
        if self._m.is_terminated():
            bitmask[row] = self._stop_only()
        else:
            self._m.fill_next_token_bitmask(bitmask, row)

    def bitmask(self) -> torch.Tensor:
        """[ceil(V/32)] int32: the current mask, packed."""
        out = torch.empty((1, words(self.vocab.size)), dtype=torch.int32)
        self.fill(out)
        return out[0]

    def allowed(self) -> torch.Tensor:
        """[V] bool: which tokens may come next."""
        return unpack(self.bitmask(), self.vocab.size)

    def _stop_only(self) -> torch.Tensor:
        if self._stop_row is None:
            row = torch.zeros(words(self.vocab.size), dtype=torch.int32)
            for t in self.vocab.stop_ids:
                row[t // 32] |= torch.tensor(1 << (t % 32)).to(torch.int32)
            self._stop_row = row
        return self._stop_row

    # ------------------------------------------------------------------ state
    def advance(self, token: int) -> bool:
        """Consume ``token`` if allowed; False (state unchanged) otherwise."""
        if not 0 <= token < self.vocab.size or not self._m.accept_token(int(token)):
            return False
        self.num_tokens += 1
        return True

    def rollback(self, n: int) -> None:
        """Un-consume the last ``n`` tokens (0 <= n <= num_tokens)."""
        if not 0 <= n <= self.num_tokens:
            raise ValueError(f"cannot roll back {n} of {self.num_tokens} consumed tokens")
        if n:
            self._m.rollback(n)
            self.num_tokens -= n

    def reset(self) -> None:
        self._m.reset()
        self.num_tokens = 0

    def is_terminated(self) -> bool:
        """A stop token was consumed: the reply is over."""
        return self._m.is_terminated()

    def can_end(self) -> bool:
        """The reply so far is complete under the grammar (a stop token is allowed now)."""
        return self._m.is_completed()

    # ------------------------------------------------------------------ jump-forward
    def forced_text(self) -> str:
        """The longest text every continuation starts with ('' when the next text is free)."""
        return "" if self._m.is_terminated() else self._m.find_jump_forward_string()

    def forced_tokens(self, max_n: int) -> list:
        """At most ``max_n`` token ids (the target tokenizer's encoding of :meth:`forced_text`) that the
        grammar allows in a row from here. The encoding's last token is left out when a longer vocabulary
        token extends it (the text after it may merge with it); the state is unchanged."""
        text = self.forced_text() if max_n > 0 else ""
        if not text:
            return []
        ids = self.vocab.encode(text)
        if ids and self.vocab.extendable(ids[-1]):
            ids.pop()
        out = []
        for t in ids[:max_n]:
            if not self.advance(t):
                break
            out.append(t)
        self.rollback(len(out))
        return out
