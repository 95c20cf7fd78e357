"""Block pool / block table invariants under random allocate/append/truncate/free sequences."""

from hypothesis import given, settings
from hypothesis import strategies as st

from specd.engine.kv_cache import BlockPool, SeqBlocks

ops = st.lists(
    st.tuples(
        st.sampled_from(["reserve", "truncate", "free", "share", "cache"]), st.integers(0, 7), st.integers(0, 80)
    ),
    max_size=80,
)


@settings(max_examples=300, deadline=None)
@given(num_blocks=st.integers(1, 24), block_size=st.sampled_from([1, 2, 4, 16]), ops=ops)
def test_random_block_operations_keep_invariants(num_blocks, block_size, ops):
    pool = BlockPool(num_blocks)
    seqs = [SeqBlocks(pool, block_size) for _ in range(8)]
    for op, i, n in ops:
        s = seqs[i]
        before = list(s.blocks)
        if op == "reserve":
            ok = s.reserve(n)
            if ok:
                assert s.capacity >= n
            else:  # exhaustion is reported, never a crash, and allocates nothing
                assert s.blocks == before
        elif op == "truncate":
            s.truncate(n)
            assert len(s.blocks) == min(len(before), -(-n // block_size))
        elif op == "free":
            s.free()
            assert s.blocks == []
        elif op == "share" and seqs[(i + 1) % 8].blocks:  # prefix sharing: take a ref on another's block
            b = seqs[(i + 1) % 8].blocks[0]
            if not s.blocks:
                pool.incref(b)
                s.blocks.append(b)
        elif op == "cache" and s.blocks:
            pool.cache_block(s.blocks[0], hash((i, n)))
        pool.check()
        assert pool.num_allocated + pool.num_free == num_blocks
        owned = [b for q in seqs for b in q.blocks]
        for b in set(owned):
            assert pool.ref[b] == owned.count(b), "ref count != number of owners"
    for s in seqs:
        s.free()
    pool.check()
    assert pool.num_free == num_blocks


def test_slots_follow_block_table():
    pool = BlockPool(8)
    a, b = SeqBlocks(pool, 4), SeqBlocks(pool, 4)
    a.reserve(4)
    b.reserve(4)
    a.reserve(9)  # a: blocks [0, 2, 3]
    assert a.blocks == [0, 2, 3]
    assert a.slots(3, 6) == [3, 8, 9]
    assert a.slot(8) == 12
    a.truncate(5)
    assert a.blocks == [0, 2]
    assert pool.num_free == 5


def test_evictable_cached_blocks_count_as_free_and_are_reused_lru():
    pool = BlockPool(3)
    s = SeqBlocks(pool, 2)
    assert s.reserve(6)
    for k, blk in enumerate(s.blocks):
        pool.cache_block(blk, 100 + k)
    s.free()
    assert pool.num_free == 3 and pool.lookup(100) is not None
    pool.lookup(100)  # touch: most recently used
    t = SeqBlocks(pool, 2)
    # a freed sequence releases its tail first, so its last block is the least recently used
    assert t.reserve(2)
    assert pool.lookup(102) is None and pool.lookup(101) is not None and pool.lookup(100) is not None
    pool.check()
