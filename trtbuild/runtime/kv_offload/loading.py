"""Loading a waiting request's prefix from the offload tiers into free pool blocks (``KVOffloader.load_prefix``).

Loaded blocks are registered in the prefix cache and left free: the scheduler's lookup that follows takes them as
ordinary hits. Loading never evicts the request's own pool hits (they are held while free blocks are taken) and
keeps room in the pool for the blocks the rest of the request needs.

- ``load_run``: the full blocks past the pool's leading hits, up to the first tier miss (every layer's blocks, or the
  full group's of a model of two KV-cache groups).
- ``load_window``: a model of two groups (``runtime/kv_groups.py``) also needs, for a hit of n blocks, the sliding
  group's blocks of the window at its end (``num_blocks_outside_window(n * block_size)`` to n); those missing from
  the sliding pool are loaded when the tiers have them all, for the longest prefix the full pool now holds.
"""

from __future__ import annotations

import hashlib
from typing import Protocol

import numpy as np

from ..block_pool import BlockHash, KVCacheBlock
from ..kv_cache import PagedKVCache
from ..kv_cache_manager import KVCacheManager
from ..sequence import Sequence


class StoredBlocks(Protocol):
    """What loading reads (``KVOffloader``): the pools' caches and the tiers' lookup."""

    cache: PagedKVCache  # every layer's, or the full layers' of a model of two KV-cache groups
    sliding_cache: PagedKVCache | None  # the sliding layers' of a model of two groups

    def lookup(self, key: BlockHash, nbytes: int) -> np.ndarray | None: ...


SLIDING_KEY_TAG = b"sliding"


def sliding_key(block_hash: BlockHash) -> BlockHash:
    """The tiers' key of the sliding group's block of ``block_hash`` (apart from the full group's, which is the
    hash itself; a chained digest, so no other block's key equals it)."""
    return hashlib.sha256(SLIDING_KEY_TAG + block_hash).digest()


def load_run(offloader: StoredBlocks, kv: KVCacheManager, seq: Sequence) -> int:
    """Load ``seq``'s full blocks missing from ``kv``'s pool (after its hits, up to the first tier miss); returns
    how many were loaded.

    Loads only while the pool keeps room for the blocks the rest of the request needs, and never evicts the
    request's own pool hits (they are held while loading): with a KV window those are also the blocks of the
    pool's own hit past a gap (``KVCacheManager.get_computed_blocks``). A block found in the pool past a gap is
    held, not loaded again. The last token is never covered (as the lookup's).
    """
    if not kv.enable_prefix_caching or seq.block_ids:
        return 0
    pool, num_full = kv.pool, min(seq.num_tokens - 1, seq.prefix_hit_limit) // kv.block_size
    computed, num_hit_tokens = kv.get_computed_blocks(seq)
    if num_hit_tokens == num_full * kv.block_size:
        return 0
    hashes = kv.block_hashes(seq, num_full)
    hits = []
    for h in hashes:
        block = pool.get_cached_block(h)
        if block is None:
            break
        hits.append(block)
    # With a window the pool's hit may lie past the leading run: held too, after it (so evicted later).
    later = [b for b in computed.blocks[len(hits) :] if b is not pool.null_block]
    rest = kv.num_blocks_for(seq.num_tokens) - num_full  # blocks past the full ones, whatever is loaded
    room = pool.num_free_blocks - sum(1 for b in (*hits, *later) if b.ref_cnt == 0) - rest
    if room <= 0:
        return 0
    pool.touch(hits + later)  # so that taking free blocks below cannot evict them
    taken: list[KVCacheBlock] = []  # the prefix's blocks past the leading hits: loaded, or held from the pool
    num_loaded = 0
    nbytes = offloader.cache.block_nbytes
    try:
        for h in hashes[len(hits) : len(hits) + room]:
            block = pool.get_cached_block(h)
            if block is not None:  # in the pool past a gap: held, not loaded again
                pool.touch([block])
            else:
                data = offloader.lookup(h, nbytes)
                if data is None:
                    break
                [block] = pool.get_new_blocks(1)
                offloader.cache.write_block(block.block_id, data)
                pool.cache_full_block(block, h)
                num_loaded += 1
            taken.append(block)
    finally:
        # last block first: the prefix's tail is evicted first; the window's blocks after it
        pool.free_blocks([*reversed(hits + taken), *later])
    return num_loaded


def load_window(offloader: StoredBlocks, full: KVCacheManager, sliding: KVCacheManager, seq: Sequence) -> int:
    """Load the sliding group's blocks of the window at the end of the full pool's hit that the sliding pool lacks
    (all of them from the tiers, or none); returns how many were loaded."""
    if not sliding.enable_prefix_caching or seq.block_ids or offloader.sliding_cache is None:
        return 0
    _, num_hit_tokens = full.get_computed_blocks(seq)
    num_blocks = num_hit_tokens // full.block_size
    hashes = full.block_hashes(seq, num_blocks)
    first = sliding.num_blocks_outside_window(num_hit_tokens)
    pool = sliding.pool
    present = [b for h in hashes[first:] if (b := pool.get_cached_block(h)) is not None]
    missing = [h for h in hashes[first:] if pool.get_cached_block(h) is None]
    if not missing:
        return 0
    rest = min(sliding.num_blocks_for(seq.num_tokens) - num_blocks, sliding.num_blocks_for(sliding.window or 0) + 1)
    if pool.num_free_blocks - sum(1 for b in present if b.ref_cnt == 0) - rest < len(missing):
        return 0
    nbytes = offloader.sliding_cache.block_nbytes
    found: list[np.ndarray] = []
    for h in missing:
        data = offloader.lookup(sliding_key(h), nbytes)
        if data is None:
            return 0  # the window cannot be completed: the full group's blocks alone make no hit
        found.append(data)
    pool.touch(present)  # so that taking free blocks below cannot evict them
    loaded = pool.get_new_blocks(len(missing))
    for block, h, data in zip(loaded, missing, found, strict=True):
        offloader.sliding_cache.write_block(block.block_id, data)
        pool.cache_full_block(block, h)
    window = [pool.get_cached_block(h) for h in hashes[first:]]
    pool.free_blocks([b for b in reversed(window) if b is not None])  # the window's tail is evicted first
    return len(missing)
