"""Paged KV cache: a block pool with ref counts, per-sequence block tables, and the cache tensor.

Running out of blocks is a normal event: ``SeqBlocks.reserve`` returns False (allocating nothing)
and the scheduler queues or preempts. Blocks are ref-counted so full blocks can be shared between
sequences (prefix cache): a block whose ref count drops to zero but that holds a cached prefix is
kept in an LRU of evictable blocks and counts as free.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (torch loads with the tensors: the server process imports SeqBlocks and never a cache)
    import torch


class BlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError("a block pool needs at least one block")
        self.num_blocks = num_blocks
        self.ref = [0] * num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # stack: pop() gives the lowest id first
        self._evictable: OrderedDict[int, None] = OrderedDict()  # ref 0 but holding a cached prefix
        self.block_hash: dict[int, int] = {}  # block id -> prefix hash (prefix cache)
        self.hash_block: dict[int, int] = {}  # prefix hash -> block id
        self.evictions = 0

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def num_allocated(self) -> int:
        return self.num_blocks - self.num_free

    def allocate(self, n: int) -> list[int] | None:
        """n fresh blocks with ref 1, or None (nothing allocated) when the pool cannot give n."""
        if n > self.num_free:
            return None
        out = []
        for _ in range(n):
            if self._free:
                b = self._free.pop()
            else:
                b, _ = self._evictable.popitem(last=False)  # least recently used
                self._uncache(b)
                self.evictions += 1
            self.ref[b] = 1
            out.append(b)
        return out

    def incref(self, b: int) -> None:
        if self.ref[b] == 0:
            self._evictable.pop(b)
        self.ref[b] += 1

    def decref(self, b: int) -> None:
        r = self.ref[b]
        if r <= 0:
            raise RuntimeError(f"block {b} freed twice")
        self.ref[b] = r - 1
        if r == 1:
            if b in self.block_hash:
                self._evictable[b] = None
            else:
                self._free.append(b)

    # prefix cache -------------------------------------------------------------------------------
    def _uncache(self, b: int) -> None:
        h = self.block_hash.pop(b, None)
        if h is not None and self.hash_block.get(h) == b:
            del self.hash_block[h]

    def cache_block(self, b: int, h: int) -> None:
        """Record that full block b holds the prefix with hash h (first writer wins)."""
        if h in self.hash_block or b in self.block_hash:
            return
        self.block_hash[b] = h
        self.hash_block[h] = b

    def lookup(self, h: int) -> int | None:
        b = self.hash_block.get(h)
        if b is not None and b in self._evictable:
            self._evictable.move_to_end(b)
        return b

    def check(self) -> None:
        """Invariant: allocated + free == total, no block both free and referenced."""
        free = set(self._free)
        ev = set(self._evictable)
        assert len(free) == len(self._free), "block on the free list twice"
        assert not (free & ev), "block both free and evictable"
        for b in range(self.num_blocks):
            if self.ref[b] > 0:
                assert b not in free and b not in ev, f"referenced block {b} on a free list"
            else:
                assert (b in free) != (b in ev), f"unreferenced block {b} lost"
        assert self.num_allocated + self.num_free == self.num_blocks


class SeqBlocks:
    """One sequence's block table in one pool. ``capacity`` = slots reserved."""

    __slots__ = ("pool", "block_size", "blocks")

    def __init__(self, pool: BlockPool, block_size: int):
        self.pool = pool
        self.block_size = block_size
        self.blocks: list[int] = []

    @property
    def capacity(self) -> int:
        return len(self.blocks) * self.block_size

    def blocks_needed(self, num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.block_size) - len(self.blocks))

    def reserve(self, num_tokens: int) -> bool:
        """Make room for positions [0, num_tokens). False (and no change) if the pool is short."""
        need = self.blocks_needed(num_tokens)
        if need == 0:
            return True
        got = self.pool.allocate(need)
        if got is None:
            return False
        self.blocks.extend(got)
        return True

    def truncate(self, num_tokens: int) -> None:
        """Keep positions [0, num_tokens); release whole blocks past it (the rollback primitive)."""
        keep = -(-num_tokens // self.block_size)
        while len(self.blocks) > keep:
            self.pool.decref(self.blocks.pop())

    def free(self) -> None:
        self.truncate(0)

    def slot(self, pos: int) -> int:
        bs = self.block_size
        return self.blocks[pos // bs] * bs + pos % bs

    def slots(self, start: int, end: int) -> list[int]:
        bs, blocks = self.block_size, self.blocks
        return [blocks[p // bs] * bs + p % bs for p in range(start, end)]


def zeros(shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.zeros(shape)``; on a CPU in fresh anonymous pages of the OS (``mmap``), which read as
    zeros until first written: nothing is touched now. ``torch.zeros`` writes every byte at once: the
    2 GiB default CPU budget took 1.5 s of CPU (3 s on a busy core) at every start, and all of it
    resident, where a server uses the blocks its requests reach. The memory is page-aligned and
    stays mapped as long as a tensor views it."""
    import torch

    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    import math
    import mmap

    n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if n == 0:
        return torch.zeros(shape, dtype=dtype)
    return torch.frombuffer(mmap.mmap(-1, n), dtype=torch.uint8).view(dtype).view(shape)


class KVCache:
    """The cache tensor of one model plus its block pool."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        import torch

        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        # [L, 2, NB, BS, KVH, D]
        self.kv = zeros((num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim), dtype, torch.device(device))

    @staticmethod
    def bytes_per_block(num_layers, num_kv_heads, head_dim, block_size, dtype) -> int:
        import torch

        return num_layers * 2 * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def new_seq(self) -> SeqBlocks:
        return SeqBlocks(self.pool, self.block_size)


class PrefixCache:
    """Hash-chained full blocks shared across requests (multi-turn chat, common system prompts).

    Block i of a token sequence is keyed by (key of block i-1, its exact tokens), so equal keys mean
    equal prefixes (the dict compares the tokens; the chained int is only the parent's identity).
    A block is registered once its KV is fully computed; it is never written again (writes happen
    past the computed prefix), and when its last owner frees it, it waits in the pool's LRU of
    evictable blocks until reused or evicted.
    """

    def __init__(self, pool: BlockPool, block_size: int):
        self.pool = pool
        self.block_size = block_size
        self.queried_tokens = 0
        self.hit_tokens = 0

    def _keys(self, tokens, n_blocks: int, start_key: int = 0, start: int = 0):
        bs = self.block_size
        key = start_key
        for i in range(start, n_blocks):
            key = hash((key, tuple(tokens[i * bs : (i + 1) * bs])))
            yield i, key

    def chain_key(self, tokens, n_blocks: int) -> int:
        """The chained key of the first ``n_blocks`` full blocks of ``tokens`` (0 for none)."""
        keys = [key for _, key in self._keys(tokens, n_blocks)]
        return keys[-1] if keys else 0

    def match(self, tokens, max_tokens: int) -> list:
        """Cached blocks covering a prefix of ``tokens`` (at most ``max_tokens`` tokens); increfs them."""
        n = max_tokens // self.block_size
        out = []
        for _, key in self._keys(tokens, n):
            b = self.pool.lookup(key)
            if b is None:
                break
            self.pool.incref(b)
            out.append(b)
        self.queried_tokens += max_tokens
        self.hit_tokens += len(out) * self.block_size
        return out

    def register(self, blocks: SeqBlocks, tokens, computed: int, state: list) -> None:
        """Register the blocks of ``blocks`` fully covered by the first ``computed`` tokens.

        ``state`` = [blocks registered so far, chained key of the last one], kept per sequence.
        """
        n = min(min(computed, len(tokens)) // self.block_size, len(blocks.blocks))
        if n <= state[0]:
            return
        key = state[1]
        for i, key in self._keys(tokens, n, state[1], state[0]):
            self.pool.cache_block(blocks.blocks[i], key)
        state[0], state[1] = n, key

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0
