"""The KV-cache block pool: block bookkeeping, the LRU free queue and the prefix-cache map (vLLM v1 style).

The engine session owns the cache memory; this module only decides which block ids are in use. A block id ``b``
names the token slots ``b * block_size .. (b + 1) * block_size - 1`` of every layer's cache.

Invariants (checked by ``tests/test_block_pool.py`` and the property tests of the cache manager):
- block 0 is the null block: never handed out, never freed, never cached, never in the free queue. Block tables
  are padded with it (``StepBatch.build`` pads with 0).
- every other block is either in use (``ref_cnt > 0``, not in the free queue) or free (``ref_cnt == 0``, in the
  free queue exactly once); so ``num_free_blocks + blocks in use == num_blocks - 1``.
- ``cached[h]`` is a block whose ``block_hash == h``, and every block with a hash is in ``cached``: a free block
  keeps its hash (and stays a prefix-cache hit) until ``get_new_blocks`` reuses it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

BlockHash = bytes  # a chained digest of a full block's tokens and all tokens before it (see kv_cache_manager)


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    """One block of token slots in every layer's KV cache; identity (``is``) is the block."""

    block_id: int  # index along dimension 0 of the engine's cache tensors; fixed for the pool's life
    ref_cnt: int = 0  # number of block tables holding this block; 0 means it is in the free queue (unless null)
    block_hash: BlockHash | None = None  # set while the block is full and registered in BlockPool.cached
    prev_free: KVCacheBlock | None = None  # previous block in the FreeBlockQueue; None at its head or when not queued
    next_free: KVCacheBlock | None = None  # next block in the FreeBlockQueue; None at its tail or when not queued


class FreeBlockQueue:
    """Free blocks in eviction order: an intrusive doubly linked list through ``prev_free``/``next_free``.

    The head is evicted first. Blocks freed later are appended later, so they are evicted later (LRU). ``remove``
    is O(1), so a prefix-cache hit on a free block takes it out of the queue without a scan.
    """

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head: KVCacheBlock | None = None  # next block to evict
        self._tail: KVCacheBlock | None = None  # most recently freed block
        self._len = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[KVCacheBlock]:
        block = self._head
        while block is not None:
            yield block
            block = block.next_free

    def popleft(self) -> KVCacheBlock:
        """Remove and return the head (least recently freed) block."""
        block = self._head
        if block is None:
            raise ValueError("no free blocks")
        self.remove(block)
        return block

    def append(self, block: KVCacheBlock) -> None:
        """Add ``block`` (not in the queue) at the tail."""
        block.prev_free, block.next_free = self._tail, None
        if self._tail is None:
            self._head = block
        else:
            self._tail.next_free = block
        self._tail = block
        self._len += 1

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink ``block``, which must be in the queue, in O(1)."""
        if block.prev_free is None:
            self._head = block.next_free
        else:
            block.prev_free.next_free = block.next_free
        if block.next_free is None:
            self._tail = block.prev_free
        else:
            block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self._len -= 1


class BlockPool:
    """All ``num_blocks`` blocks of the cache: hands out free blocks, counts references, remembers cached blocks."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"a block pool needs at least 2 blocks (block 0 is reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]  # blocks[i].block_id == i
        self.null_block = self.blocks[0]  # pads block tables; never handed out or freed
        self.free_queue = FreeBlockQueue(self.blocks[1:])  # ids ascending at first: allocation starts at block 1
        self.cached: dict[BlockHash, KVCacheBlock] = {}  # full, computed blocks by hash; in use or free

    @property
    def num_free_blocks(self) -> int:
        """Blocks ``get_new_blocks`` can hand out (free cached blocks included: they are evicted on reuse)."""
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by at least one block table (the null block is not counted)."""
        return self.num_blocks - 1 - self.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of the usable blocks (all but the null block) in use."""
        return self.num_used_blocks / (self.num_blocks - 1)

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """The cached block holding ``block_hash``'s tokens, in use or free; no side effects."""
        return self.cached.get(block_hash)

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Take ``n`` blocks from the head of the free queue, each with ``ref_cnt == 1``.

        A reused block that was cached loses its hash (it is evicted from the prefix cache).
        """
        if n > self.num_free_blocks:
            raise ValueError(f"cannot get {n} blocks: only {self.num_free_blocks} are free")
        blocks = [self.free_queue.popleft() for _ in range(n)]
        for block in blocks:
            if block.block_hash is not None:
                del self.cached[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference on each block (a prefix-cache hit); free ones leave the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block; blocks reaching 0 join the free queue's tail in the given order.

        Pass a request's blocks last-first: its tail blocks, the least likely to be shared, are then evicted first.
        """
        for block in ordered_blocks:
            if block is self.null_block:
                raise ValueError("the null block is never freed")
            if block.ref_cnt <= 0:
                raise ValueError(f"block {block.block_id} freed more often than taken")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def cache_full_block(self, block: KVCacheBlock, block_hash: BlockHash) -> bool:
        """Register a full, computed, in-use block under ``block_hash``.

        Returns False and changes nothing when another block already holds that hash (two requests computed the
        same prefix in the same step): ``block`` then stays an uncached block and is plainly freed later.
        """
        if block.block_hash is not None:
            raise ValueError(f"block {block.block_id} is already cached")
        if block_hash in self.cached:
            return False
        block.block_hash = block_hash
        self.cached[block_hash] = block
        return True
