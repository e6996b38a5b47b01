"""BlockPool and FreeBlockQueue: exact block ids through allocate, share, free, evict and re-hit."""

from __future__ import annotations

import pytest

from trtbuild.runtime.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def test_free_queue_remove_anywhere_keeps_order() -> None:
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    queue.remove(blocks[2])  # middle
    queue.remove(blocks[0])  # head
    queue.remove(blocks[4])  # tail
    assert ids(queue) == [1, 3] and len(queue) == 2
    queue.append(blocks[0])
    assert ids(queue) == [1, 3, 0]
    assert queue.popleft() is blocks[1]
    assert ids(queue) == [3, 0]
    assert blocks[1].prev_free is None and blocks[1].next_free is None
    queue.remove(blocks[3])
    queue.remove(blocks[0])
    assert len(queue) == 0 and list(queue) == []
    with pytest.raises(ValueError, match="no free blocks"):
        queue.popleft()


def test_null_block_is_never_handed_out() -> None:
    pool = BlockPool(4)
    assert pool.null_block.block_id == 0
    assert pool.num_free_blocks == 3
    assert ids(pool.get_new_blocks(3)) == [1, 2, 3]
    assert pool.num_free_blocks == 0 and pool.num_used_blocks == 3 and pool.usage == 1.0
    with pytest.raises(ValueError, match="only 0 are free"):
        pool.get_new_blocks(1)
    with pytest.raises(ValueError, match="null block"):
        pool.free_blocks([pool.null_block])


def test_allocate_share_free_evict_rehit() -> None:
    pool = BlockPool(6)  # usable blocks 1..5
    a = pool.get_new_blocks(3)
    assert ids(a) == [1, 2, 3] and all(b.ref_cnt == 1 for b in a)
    assert pool.cache_full_block(a[0], b"h1") and pool.cache_full_block(a[1], b"h2")
    assert pool.get_cached_block(b"h1") is a[0]

    # Another request shares the two cached blocks.
    pool.touch([a[0], a[1]])
    assert [b.ref_cnt for b in a] == [2, 2, 1]

    # The first request leaves, freeing its blocks last-first: only block 3 reaches 0.
    pool.free_blocks(reversed(a))
    assert [b.ref_cnt for b in a] == [1, 1, 0]
    assert ids(pool.free_queue) == [4, 5, 3]

    # The sharer leaves too (reverse order): free queue tail gets 2 then 1, hashes kept.
    pool.free_blocks([a[1], a[0]])
    assert ids(pool.free_queue) == [4, 5, 3, 2, 1]
    assert pool.get_cached_block(b"h1") is a[0] and a[0].block_hash == b"h1"

    # A cache hit on a free block takes it out of the queue in place.
    pool.touch([a[0]])
    assert a[0].ref_cnt == 1 and ids(pool.free_queue) == [4, 5, 3, 2]

    # New blocks come from the head; reusing block 2 evicts its hash.
    assert ids(pool.get_new_blocks(4)) == [4, 5, 3, 2]
    assert pool.get_cached_block(b"h2") is None and a[1].block_hash is None
    assert pool.get_cached_block(b"h1") is a[0]
    assert set(pool.cached) == {b"h1"}
    assert pool.num_free_blocks == 0


def test_cache_full_block_keeps_first_holder_of_a_hash() -> None:
    pool = BlockPool(4)
    x, y = pool.get_new_blocks(2)
    assert pool.cache_full_block(x, b"same")
    assert not pool.cache_full_block(y, b"same")
    assert y.block_hash is None and pool.cached == {b"same": x}
    with pytest.raises(ValueError, match="already cached"):
        pool.cache_full_block(x, b"other")


def test_double_free_is_an_error() -> None:
    pool = BlockPool(3)
    (b,) = pool.get_new_blocks(1)
    pool.free_blocks([b])
    with pytest.raises(ValueError, match="freed more often"):
        pool.free_blocks([b])
    assert pool.num_free_blocks == 2
