"""The KV-cache manager: block tables of requests, on a BlockPool, with automatic prefix caching.

Prefix caching (vLLM v1 style): each FULL block of a request's tokens has a chained hash
``hash(parent_hash, block tokens, extra_key)``, so equal hashes mean equal prefixes. After a step computes a block's
last token, the block is registered under its hash; a later request with the same prefix takes the cached blocks
instead of recomputing them. A block is registered only once its K/V is written, so a request never reads a block
that another sequence in the same step is still writing (the paged-attention op's contract).
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable
from dataclasses import dataclass

from .block_pool import BlockHash, BlockPool, KVCacheBlock
from .sequence import Sequence


def hash_block_tokens(parent: BlockHash | None, token_ids: tuple[int, ...], extra_key: str | None) -> BlockHash:
    """The chained hash of one full block: sha256 over (parent hash, the block's tokens, the namespace key)."""
    return hashlib.sha256(pickle.dumps((parent, token_ids, extra_key), protocol=5)).digest()


@dataclass(frozen=True)
class KVCacheBlocks:
    """Blocks found in the prefix cache for a request, handed from ``get_computed_blocks`` to ``allocate_slots``."""

    blocks: tuple[KVCacheBlock, ...] = ()


class KVCacheManager:
    """Hands out, shares and frees KV-cache blocks for requests; owns every request's ``block_ids``.

    Queries and commands are paired: ``get_computed_blocks`` (no side effects but hashing and counters) then
    ``allocate_slots`` (all-or-nothing), ``cache_blocks`` after each step, ``free`` when a request leaves.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        # Requests holding blocks -> how many of their leading blocks are registered in (or skipped for) the cache.
        self._num_cached_blocks: dict[Sequence, int] = {}
        self.prefix_cache_queries = 0  # tokens of admitted requests looked up in the prefix cache
        self.prefix_cache_hits = 0  # of those, tokens found there
        # Called with (block id, hash) for each block newly registered by ``cache_blocks`` (the KV offload's store).
        self.on_block_cached: Callable[[int, BlockHash], None] | None = None

    @property
    def num_usable_blocks(self) -> int:
        """Blocks a request can ever hold: all but the null block."""
        return self.pool.num_blocks - 1

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_used_blocks

    @property
    def usage(self) -> float:
        """Fraction of the usable blocks in use (0..1)."""
        return self.pool.usage

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` positions."""
        return -(-num_tokens // self.block_size)

    def block_hashes(self, seq: Sequence, num_blocks: int) -> list[BlockHash]:
        """The hashes of ``seq``'s first ``num_blocks`` full blocks, extending ``seq.block_hashes`` as needed."""
        hashes, bs = seq.block_hashes, self.block_size
        while len(hashes) < num_blocks:
            i = len(hashes)
            tokens = tuple(seq.token_ids(i * bs, (i + 1) * bs))
            hashes.append(hash_block_tokens(hashes[-1] if hashes else None, tokens, seq.cache_salt))
        return hashes[:num_blocks]

    def get_computed_blocks(self, seq: Sequence) -> tuple[KVCacheBlocks, int]:
        """The longest run of cached full blocks matching ``seq``'s leading tokens, and how many tokens they hold.

        For a request holding no blocks (waiting or preempted). Invariant: the hit never covers every token — at
        least the last token is recomputed, so the step that follows returns logits for it. No side effects but the
        hashes memoised on ``seq``: the hit counters count at ``allocate_slots``, once per admission.
        """
        if seq.block_ids:
            raise ValueError(f"request {seq.request_id} already holds blocks")
        if not self.enable_prefix_caching:
            return KVCacheBlocks(), 0
        hits: list[KVCacheBlock] = []
        for block_hash in self.block_hashes(seq, (seq.num_tokens - 1) // self.block_size):
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return KVCacheBlocks(tuple(hits)), len(hits) * self.block_size

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, computed: KVCacheBlocks | None = None) -> bool:
        """Give ``seq`` blocks for positions up to ``num_computed_tokens + hit tokens + num_new_tokens``.

        ``computed`` (from ``get_computed_blocks``, only for a request holding no blocks) is prepended to its block
        table. Returns False, changing nothing, when the free blocks do not suffice. Block tables are append-only:
        existing entries never change while the request holds them.
        """
        hit_blocks = computed.blocks if computed is not None else ()
        if hit_blocks and seq.block_ids:
            raise ValueError(f"request {seq.request_id} already holds blocks; cache hits are for new requests")
        num_tokens = seq.num_computed_tokens + len(hit_blocks) * self.block_size + num_new_tokens
        num_new_blocks = max(0, self.num_blocks_for(num_tokens) - len(seq.block_ids) - len(hit_blocks))
        # Free cached hits leave the free queue when touched, so they spend free blocks too.
        num_free_hits = sum(1 for block in hit_blocks if block.ref_cnt == 0)
        if num_new_blocks + num_free_hits > self.pool.num_free_blocks:
            return False
        self._num_cached_blocks.setdefault(seq, len(hit_blocks))
        self.pool.touch(hit_blocks)  # before get_new_blocks, which could otherwise evict a hit
        new_blocks = self.pool.get_new_blocks(num_new_blocks)
        seq.block_ids.extend(block.block_id for block in (*hit_blocks, *new_blocks))
        if computed is not None and self.enable_prefix_caching:
            self.prefix_cache_queries += seq.num_tokens
            self.prefix_cache_hits += len(hit_blocks) * self.block_size
        return True

    def cache_blocks(self, seq: Sequence) -> None:
        """Register ``seq``'s full blocks whose K/V is now computed (call after each step that advanced it)."""
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        start = self._num_cached_blocks[seq]
        if num_full <= start:
            return
        hashes = self.block_hashes(seq, num_full)
        for i in range(start, num_full):
            block = self.pool.blocks[seq.block_ids[i]]
            if self.pool.cache_full_block(block, hashes[i]) and self.on_block_cached is not None:
                self.on_block_cached(block.block_id, hashes[i])
        self._num_cached_blocks[seq] = num_full

    def free(self, seq: Sequence) -> None:
        """Release all of ``seq``'s blocks (last block first, so its tail is evicted first) and empty its table."""
        self.pool.free_blocks(self.pool.blocks[b] for b in reversed(seq.block_ids))
        seq.block_ids.clear()
        self._num_cached_blocks.pop(seq, None)

    def kv_waste_slots(self) -> int:
        """Allocated token slots (blocks in use x block size) minus slots holding a computed token.

        Counts internal fragmentation of last blocks plus slots allocated for tokens not yet computed; a block
        shared by several requests counts once, filled as far as its fullest owner.
        """
        bs = self.block_size
        full: set[int] = set()  # blocks full in some owner (only those can be shared)
        partial: dict[int, int] = {}  # the one partly filled block of a sequence -> its filled slots
        for seq in self._num_cached_blocks:  # O(sequences) per step: the runner calls this every step
            ids, computed = seq.block_ids, seq.num_computed_tokens
            num_full = min(len(ids), computed // bs)
            full.update(ids[:num_full])
            rest = computed - num_full * bs
            if num_full < len(ids) and rest > 0:
                partial[ids[num_full]] = max(partial.get(ids[num_full], 0), rest)
        filled = len(full) * bs + sum(n for block, n in partial.items() if block not in full)
        return self.num_used_blocks * bs - filled
