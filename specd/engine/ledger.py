"""The KV ledger: the one owner of every sequence's KV state in both caches.

A sequence's KV state is its block tables in the target and draft caches (``seq.blocks``,
``seq.draft_blocks``), how many committed tokens each cache holds (``seq.num_computed``,
``seq.draft_computed``), its prefix-cache cursors (``seq.pc_state``, ``seq.pc_draft_state``) and,
with a feature head, the target features of its committed tokens the head has not consumed yet
(``seq.hidden`` from position ``seq.hidden_start``: kept, rolled back and freed with the KV).
Only this module changes them (tests/test_layout.py checks it): the scheduler reserves and frees
through it, the drafter advances the draft side through it, and after verification the engine calls
``accept(seq, n)``, the one rollback of rejected tokens.

Vocabulary: the *committed* tokens of a sequence are ``seq.tokens``; its last one is *pending*
(its KV is written by the step that consumes it). A step writes KV only past the committed prefix,
so a rollback needs no copy: resetting the counters and releasing whole blocks past them suffices.

Worked example (block size 4): 9 committed tokens, the pending one at position 8; a tree of 5 nodes
is verified at positions 8..12 with 2 draft tokens accepted (nodes 3 and 4, say). ``compact`` moves
the KV of nodes 3 and 4 to positions 9 and 10; ``accept(seq, 2)`` sets ``num_computed = 11`` and
keeps 3 blocks (positions 0..11), releasing the 4th block the tree had reserved.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specd.engine.kv_cache import KVCache, PrefixCache
from specd.engine.sequence import Sequence


@dataclass(frozen=True)
class Checkpoint:
    """A request's state at the start of a step's compute; ``KVLedger.restore`` puts it back, as if
    the step never ran for it."""

    num_tokens: int
    num_computed: int
    draft_computed: int
    capacity: int  # target cache slots reserved
    draft_capacity: int
    pc_state: tuple
    pc_draft_state: tuple
    generator_state: torch.Tensor | None
    grammar_tokens: int = 0  # tokens its grammar matcher had consumed


class KVLedger:
    """Reservations, prefix reuse, acceptance and release of each sequence's KV in the target cache
    and (when there is a draft) the draft cache. ``backend`` does the batched KV copy of ``compact``."""

    def __init__(
        self,
        cache: KVCache,
        draft_cache: KVCache | None = None,
        prefix_cache: PrefixCache | None = None,
        draft_prefix_cache: PrefixCache | None = None,
        backend=None,
    ):
        self.cache = cache
        self.draft_cache = draft_cache
        self.prefix_cache = prefix_cache
        self.draft_prefix_cache = draft_prefix_cache if draft_cache is not None else None
        self.backend = backend
        self.block_size = cache.block_size

    # admission ----------------------------------------------------------------------------------
    def attach(self, seq: Sequence, admitting: bool) -> None:
        """Give ``seq`` its block tables (once); a request being admitted with nothing computed
        reuses cached prefix blocks."""
        if seq.blocks is None:
            seq.blocks = self.cache.new_seq()
            if self.draft_cache is not None:
                seq.draft_blocks = self.draft_cache.new_seq()
        if admitting and seq.num_computed == 0 and not seq.blocks.blocks:
            self._match_prefix(seq)

    def _match_prefix(self, seq: Sequence) -> None:
        """Reuse cached full blocks of the committed tokens (the pending token is always recomputed)."""
        limit = len(seq.tokens) - 1
        blocks = seq.blocks
        assert blocks is not None
        if self.prefix_cache is not None:
            hit = self.prefix_cache.match(seq.tokens, limit)
            blocks.blocks.extend(hit)
            seq.num_computed = len(hit) * self.block_size
            seq.pc_state = [len(hit), self.prefix_cache.chain_key(seq.tokens, len(hit)) if hit else 0]
            seq.cached_prefix_tokens = max(seq.cached_prefix_tokens, seq.num_computed)
        if self.draft_prefix_cache is not None and seq.draft_blocks is not None:
            hit = self.draft_prefix_cache.match(seq.tokens, limit)
            seq.draft_blocks.blocks.extend(hit)
            seq.draft_computed = len(hit) * self.block_size
            seq.pc_draft_state = [len(hit), self.draft_prefix_cache.chain_key(seq.tokens, len(hit)) if hit else 0]

    # target cache -------------------------------------------------------------------------------
    def reserve(self, seq: Sequence, num_tokens: int) -> bool:
        """Room for positions [0, num_tokens) in the target cache; False (no change) when short."""
        return seq.blocks is not None and seq.blocks.reserve(num_tokens)

    @staticmethod
    def capacity(seq: Sequence) -> int:
        return seq.blocks.capacity if seq.blocks is not None else 0

    @staticmethod
    def holds_blocks(seq: Sequence) -> bool:
        return seq.blocks is not None and bool(seq.blocks.blocks)

    def advance(self, seq: Sequence, num_tokens: int, hidden: torch.Tensor | None = None) -> None:
        """A prefill chunk of ``num_tokens`` committed tokens was computed (``hidden``: their
        target features [num_tokens, F], kept for a feature head)."""
        start = seq.num_computed
        seq.num_computed += num_tokens
        self._keep_hidden(seq, start, hidden)
        self.register(seq)

    @staticmethod
    def _keep_hidden(seq: Sequence, start: int, rows: torch.Tensor | None) -> None:
        """Append the features of positions [start, start + len(rows)) and drop those the head has
        consumed (below ``seq.draft_computed``). A gap (positions the target never computed for
        this request, e.g. a prefix-cache hit) starts the kept rows afresh."""
        if rows is None:
            return
        h = seq.hidden
        if h is None or seq.hidden_start + h.shape[0] != start:
            h, seq.hidden_start, seq.hidden_buf = rows, start, None
        else:
            h = _append_rows(seq, h, rows)
        drop = min(seq.draft_computed - seq.hidden_start, h.shape[0])
        if drop > 0:
            h, seq.hidden_start = h[drop:], seq.hidden_start + drop
        seq.hidden = h

    def compact(self, accepted: list) -> None:
        """Move the KV of accepted tree nodes to consecutive positions after their root, in one
        batched copy. ``accepted``: ``[(seq, [node index of the 1st, 2nd, ... accepted token])]``
        with the root at position ``len(seq.tokens) - 1`` (before the step's tokens are added)."""
        src, dst = [], []
        for seq, nodes in accepted:
            base = len(seq.tokens) - 1
            for k, node in enumerate(nodes, 1):
                if node != k:
                    src.append(seq.blocks.slot(base + node))
                    dst.append(seq.blocks.slot(base + k))
        if src:  # positions past the committed prefix only: a rollback needs no undo
            dev = self.cache.kv.device
            self.backend.copy_slots(self.cache.kv, torch.tensor(src, device=dev), torch.tensor(dst, device=dev))

    def accept(
        self, seq: Sequence, num_accepted: int, hidden: torch.Tensor | None = None, tokens: list | None = None
    ) -> None:
        """The one rollback: keep the root and ``num_accepted`` draft tokens in the target cache
        (``compact`` first), release the rest of the tree's reservation; the draft cache keeps only
        what it computed for committed tokens; ``hidden`` (feature head): the target features of
        the step's committed rows and accepted path only (``stages.kept_hidden``); ``tokens``: the
        step's emitted tokens (accepted + the next), which a constrained request's grammar matcher
        consumes (its drafts' states were only visited while masking: nothing to roll back). Call
        before the step's tokens join ``seq.tokens``."""
        if tokens is not None and seq.matcher is not None:
            for t in tokens:
                if seq.matcher.is_terminated():
                    break  # a stop token ended the reply (emit trims what follows it)
                if not seq.matcher.advance(t):
                    raise RuntimeError(f"token {t} is outside the request's grammar (its masks were not applied)")
        keep = len(seq.tokens) + num_accepted
        assert seq.blocks is not None
        start = seq.num_computed
        seq.num_computed = keep
        self._keep_hidden(seq, start, hidden)
        seq.blocks.truncate(keep)
        if seq.draft_blocks is not None:
            seq.draft_blocks.truncate(seq.draft_computed)

    def register(self, seq: Sequence) -> None:
        """Offer newly completed full blocks to the prefix caches (cheap when there are none)."""
        pc, dpc = self.prefix_cache, self.draft_prefix_cache
        if pc is not None and seq.blocks is not None and seq.num_computed // pc.block_size > seq.pc_state[0]:
            pc.register(seq.blocks, seq.tokens, seq.num_computed, seq.pc_state)
        if (
            dpc is not None
            and seq.draft_blocks is not None
            and seq.draft_computed // dpc.block_size > seq.pc_draft_state[0]
        ):
            dpc.register(seq.draft_blocks, seq.tokens, seq.draft_computed, seq.pc_draft_state)

    # draft cache --------------------------------------------------------------------------------
    @staticmethod
    def draft_reserve(seq: Sequence, num_tokens: int) -> bool:
        return seq.draft_blocks is not None and seq.draft_blocks.reserve(num_tokens)

    @staticmethod
    def draft_release(seq: Sequence) -> None:
        """Drop draft reservations past what the draft cache has computed."""
        if seq.draft_blocks is not None:
            seq.draft_blocks.truncate(max(seq.draft_computed, 0))

    @staticmethod
    def draft_advance(seq: Sequence, upto: int) -> None:
        """The draft cache now holds committed tokens [0, upto)."""
        seq.draft_computed = upto

    # release ------------------------------------------------------------------------------------
    def free(self, seq: Sequence) -> None:
        """Release both caches' blocks (full ones stay reusable through the prefix cache)."""
        self.register(seq)
        for blocks in (seq.blocks, seq.draft_blocks):
            if blocks is not None:
                blocks.free()
        seq.num_computed = 0
        seq.draft_computed = 0
        seq.hidden, seq.hidden_start, seq.hidden_buf = None, 0, None
        seq.pc_state = [0, 0]
        seq.pc_draft_state = [0, 0]

    @staticmethod
    def drop(seq: Sequence) -> None:
        """Last resort for a sequence whose state cannot be restored: release every block without
        offering any to the prefix cache (a double free is already counted as freed)."""
        for blocks in (seq.blocks, seq.draft_blocks):
            while blocks is not None and blocks.blocks:
                try:
                    blocks.pool.decref(blocks.blocks.pop())
                except Exception:  # noqa: BLE001
                    pass

    # atomic steps -------------------------------------------------------------------------------
    @staticmethod
    def checkpoint(seq: Sequence) -> Checkpoint:
        """What a step's batched stages (draft, target forward, verify, KV compaction) may change,
        taken after scheduling (a sampling request's generator state included)."""
        gen = seq.generator if not seq.params.greedy and seq.generator is not None else None
        return Checkpoint(
            len(seq.tokens),
            seq.num_computed,
            seq.draft_computed,
            seq.blocks.capacity if seq.blocks is not None else 0,
            seq.draft_blocks.capacity if seq.draft_blocks is not None else 0,
            tuple(seq.pc_state),
            tuple(seq.pc_draft_state),
            gen.get_state() if gen is not None else None,
            seq.matcher.num_tokens if seq.matcher is not None else 0,
        )

    @staticmethod
    def restore(seq: Sequence, cp: Checkpoint) -> None:
        """Undo a failed step: KV below ``num_computed`` is never written by a step, so resetting
        the counters and dropping the blocks the step reserved restores the caches; a sampling
        request's generator rewinds, so a retried step draws exactly what the failed one drew."""
        del seq.tokens[cp.num_tokens :]
        seq.num_computed = cp.num_computed
        if seq.hidden is not None:  # features are kept by position: drop those the step added
            seq.hidden = seq.hidden[: max(cp.num_computed - seq.hidden_start, 0)]
        seq.draft_computed = cp.draft_computed
        if seq.blocks is not None:
            seq.blocks.truncate(cp.capacity)
        if seq.draft_blocks is not None:
            seq.draft_blocks.truncate(cp.draft_capacity)
        seq.pc_state = list(cp.pc_state)
        seq.pc_draft_state = list(cp.pc_draft_state)
        if cp.generator_state is not None and seq.generator is not None:
            seq.generator.set_state(cp.generator_state)
        if seq.matcher is not None:
            seq.matcher.rollback(seq.matcher.num_tokens - cp.grammar_tokens)


def _append_rows(seq: Sequence, h: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``h`` then ``rows``, written in place after ``h`` in ``seq.hidden_buf`` where ``h`` views it
    and there is room, else in a new buffer twice the size (amortized O(rows) per step, where a
    ``cat`` per step copies everything kept so far: quadratic while a lazy head is not drafting)."""
    buf, n, r = seq.hidden_buf, h.shape[0], rows.shape[0]
    if buf is not None and h.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr():
        off = (h.data_ptr() - buf.data_ptr()) // (buf.stride(0) * buf.element_size())
        if off + n + r <= buf.shape[0]:
            buf[off + n : off + n + r] = rows
            return buf[off : off + n + r]
    buf = rows.new_empty((max(2 * (n + r), 64), rows.shape[1]))
    buf[:n] = h
    buf[n : n + r] = rows
    seq.hidden_buf = buf
    return buf[: n + r]
