"""The KV-cache manager: block tables of requests, on a BlockPool, with automatic prefix caching.

Prefix caching (vLLM v1 style): each FULL block of a request's tokens has a chained hash
``hash(parent_hash, block tokens, extra_key)``, so equal hashes mean equal prefixes. After a step computes a block's
last token, the block is registered under its hash; a later request with the same prefix takes the cached blocks
instead of recomputing them. A block is registered only once its K/V is written, so a request never reads a block
that another sequence in the same step is still writing (the paged-attention op's contract).

KV window (``ModelConfig.kv_window``: every layer slides over the last W positions, its own included): a token at
position p reads only positions k with p - W < k <= p, so once a request's next position to compute is c, its blocks
lying wholly before c - W + 1 are never read again. ``free_outside_window`` releases them (one reference each, like
``free``) and points their block-table entries at the null block, which the paged-attention op never reads there.
Footprint: with a step of n new tokens from position c, a request holds exactly the blocks meeting positions
[max(0, c - W + 1), c + n), at most ``ceil((W + n - 2) / block_size) + 1`` (``max_blocks_held``), so at most
``ceil(W / block_size) + 2`` for steps of up to block_size + 2 tokens (33 for a decode with W = 512 and blocks of 16,
34 for chunks of up to 18 tokens); a prefill chunk of n tokens holds its own blocks plus the window before it.

Prefix caching with a window: a released block that was registered stays registered (free, in the LRU queue like
any freed block), so later requests can still hit it until it is evicted. A hit of j blocks needs only the blocks
its first step reads, those from the window of position j * block_size on: the lookup takes the longest such prefix
whose needed blocks are all cached, even when earlier blocks (the oldest, evicted first) are gone; the earlier
entries are the null block and are neither referenced nor counted against the free blocks.
"""

from __future__ import annotations

import enum
import hashlib
import operator
import pickle
from collections.abc import Callable
from dataclasses import dataclass

from .block_pool import BlockHash, BlockPool, KVCacheBlock
from .sequence import Sequence


def hash_block_tokens(parent: BlockHash | None, token_ids: tuple[int, ...], extra_key: str | None) -> BlockHash:
    """The chained hash of one full block: sha256 over (parent hash, the block's tokens, the namespace key)."""
    return hashlib.sha256(pickle.dumps((parent, token_ids, extra_key), protocol=5)).digest()


def max_blocks_held(num_tokens: int, block_size: int, window: int | None, max_step_tokens: int) -> int:
    """The most blocks a request of up to ``num_tokens`` positions holds at once when each step computes at most
    ``max_step_tokens`` of its tokens: all its blocks without a window, else at most the blocks meeting
    ``window + max_step_tokens - 1`` consecutive positions, ``ceil((window + max_step_tokens - 2) / block_size) + 1``
    (see the module docstring). The scheduler admits a request only if this fits the pool."""
    need = -(-num_tokens // block_size)
    if window is None:
        return need
    return min(need, -(-(window + max_step_tokens - 2) // block_size) + 1)


class KVCacheGroup(enum.Enum):
    """Which of a request's block tables a manager owns (its value: the ``Sequence`` attribute).

    FULL: ``Sequence.block_ids``, every layer's table in a model of one attention kind (sliding or not), the full
    layers' in a model of both. SLIDING: ``Sequence.sliding_block_ids``, the sliding layers' table in a model of both
    kinds (``ModelConfig.has_sliding_kv_group``; docs/runner.md, "KV-cache groups"), its manager has the window.
    """

    FULL = "block_ids"
    SLIDING = "sliding_block_ids"


@dataclass(slots=True)
class _HeldBlocks:
    """The manager's bookkeeping of one request holding blocks; its block table is the request's table of the
    manager's group (``block_ids``, or ``sliding_block_ids``: ``KVCacheGroup``)."""

    # Leading blocks registered in (or skipped for) the prefix cache: cache_blocks registers from here on.
    num_cached: int
    # Leading entries released for the KV window: block_ids[:num_freed] are all 0 (the null block), the rest are
    # blocks the request holds one reference to. Always 0 without a window.
    num_freed: int


@dataclass(frozen=True)
class KVCacheBlocks:
    """Blocks found in the prefix cache for a request, handed from ``get_computed_blocks`` to ``allocate_slots``."""

    # The hit's block-table entries, one per block of tokens; with a window, the ones wholly before the window of
    # the first position after the hit are the null block.
    blocks: tuple[KVCacheBlock, ...] = ()


class KVCacheManager:
    """Hands out, shares and frees KV-cache blocks for requests; owns every request's block table of its
    ``group`` (``block_ids``, or ``sliding_block_ids`` for the sliding layers of a model of both attention kinds).

    Queries and commands are paired: ``get_computed_blocks`` (no side effects but hashing and counters) then
    ``allocate_slots`` (all-or-nothing), ``cache_blocks`` after each step, ``free`` when a request leaves; with a
    KV window, ``free_outside_window`` before each step that advances a request (see the module docstring).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        window: int | None = None,
        group: KVCacheGroup = KVCacheGroup.FULL,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if window is not None and window <= 0:
            raise ValueError(f"window must be positive, got {window}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # Positions every token attends to, its own included (ModelConfig.kv_window); None: all earlier positions,
        # and no block is released before the request leaves.
        self.window = window
        self.group = group
        # The block table this manager owns on each request (``seq.block_ids`` or ``seq.sliding_block_ids``).
        self._table: Callable[[Sequence], list[int]] = operator.attrgetter(group.value)
        self.pool = BlockPool(num_blocks)
        self._held: dict[Sequence, _HeldBlocks] = {}  # every request holding blocks
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

    def num_blocks_outside_window(self, next_position: int) -> int:
        """Leading blocks of a request lying wholly before the window of its token at ``next_position`` (0 without
        a window): blocks i with (i + 1) * block_size <= next_position - window + 1."""
        if self.window is None:
            return 0
        return max(0, next_position - self.window + 1) // self.block_size

    def max_blocks_held(self, num_tokens: int, max_step_tokens: int) -> int:
        """The most blocks a request of up to ``num_tokens`` positions holds at once when each step computes at most
        ``max_step_tokens`` of its tokens (module-level ``max_blocks_held`` with this manager's window)."""
        return max_blocks_held(num_tokens, self.block_size, self.window, max_step_tokens)

    def block_hashes(self, seq: Sequence, num_blocks: int) -> list[BlockHash]:
        """The hashes of ``seq``'s first ``num_blocks`` full blocks, extending ``seq.block_hashes`` as needed."""
        hashes, bs = seq.block_hashes, self.block_size
        while len(hashes) < num_blocks:
            i = len(hashes)
            tokens = tuple(seq.token_ids(i * bs, (i + 1) * bs))
            hashes.append(hash_block_tokens(hashes[-1] if hashes else None, tokens, seq.cache_salt))
        return hashes[:num_blocks]

    def get_computed_blocks(self, seq: Sequence, max_blocks: int | None = None) -> tuple[KVCacheBlocks, int]:
        """The longest run of cached full blocks matching ``seq``'s leading tokens, and how many tokens they hold.

        With a window, the longest prefix whose blocks from the window of its end on are cached (the module
        docstring), its earlier entries the null block. ``max_blocks``: the longest such prefix of at most that many
        blocks (the sliding KV-cache group's hit within the full group's, ``kv_groups.get_computed_blocks``). For a
        request holding no blocks (waiting or preempted).
        Invariant: the hit never covers every token — at least the last token is recomputed, so the step that
        follows returns logits for it. No side effects but the hashes memoised on ``seq``: the hit counters count at
        ``allocate_slots``, once per admission.
        """
        if self._table(seq):
            raise ValueError(f"request {seq.request_id} already holds blocks")
        if not self.enable_prefix_caching:
            return KVCacheBlocks(), 0
        found: list[KVCacheBlock | None] = []
        num_hit, run_start = 0, 0  # run_start: the first block of the run of cached blocks ending at the current one
        num_blocks = min(seq.num_tokens - 1, seq.prefix_hit_limit) // self.block_size
        if max_blocks is not None:
            num_blocks = min(num_blocks, max_blocks)
        for i, block_hash in enumerate(self.block_hashes(seq, num_blocks)):
            block = self.pool.get_cached_block(block_hash)
            found.append(block)
            if block is None:
                if self.window is None:
                    break
                run_start = i + 1
            elif run_start <= self.num_blocks_outside_window((i + 1) * self.block_size):
                num_hit = i + 1  # every block the first step after block i reads is cached
        num_null = self.num_blocks_outside_window(num_hit * self.block_size)
        # found[num_null:num_hit] are all cached: the run ending at the hit's last block covers them
        hits = (self.pool.null_block,) * num_null + tuple(b for b in found[num_null:num_hit] if b is not None)
        return KVCacheBlocks(hits), num_hit * self.block_size

    def _plan(
        self, seq: Sequence, num_new_tokens: int, hit_blocks: tuple[KVCacheBlock, ...]
    ) -> tuple[int, int, tuple[KVCacheBlock, ...]]:
        """(new blocks, hits entered as the null block, hits referenced) of ``allocate_slots``; no side effects."""
        ids = self._table(seq)
        if hit_blocks and ids:
            raise ValueError(f"request {seq.request_id} already holds blocks; cache hits are for new requests")
        num_computed = seq.num_computed_tokens + len(hit_blocks) * self.block_size
        num_new_blocks = max(0, self.num_blocks_for(num_computed + num_new_tokens) - len(ids) - len(hit_blocks))
        num_skipped = self.num_blocks_outside_window(num_computed) if hit_blocks else 0
        used_hits = hit_blocks[num_skipped:]
        if any(block is self.pool.null_block for block in used_hits):
            raise ValueError(f"request {seq.request_id}: a prefix-cache hit inside the window is the null block")
        return num_new_blocks, num_skipped, used_hits

    def can_allocate(self, seq: Sequence, num_new_tokens: int, computed: KVCacheBlocks | None = None) -> bool:
        """Whether ``allocate_slots`` with these arguments would succeed now; no side effects (the KV-cache groups
        check every group before allocating in any: ``kv_groups.allocate_slots``)."""
        num_new_blocks, _, used_hits = self._plan(seq, num_new_tokens, computed.blocks if computed else ())
        # Free cached hits leave the free queue when touched, so they spend free blocks too.
        num_free_hits = sum(1 for block in used_hits if block.ref_cnt == 0)
        return num_new_blocks + num_free_hits <= self.pool.num_free_blocks

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, computed: KVCacheBlocks | None = None) -> bool:
        """Give ``seq`` blocks for positions up to ``num_computed_tokens + hit tokens + num_new_tokens``.

        ``computed`` (from ``get_computed_blocks``, only for a request holding no blocks) is prepended to its block
        table; with a window, the hits wholly before the window of the first new token are entered as the null block
        and not referenced. Returns False, changing nothing, when the free blocks do not suffice. Block tables only
        grow at the end, but for ``free_outside_window`` turning leading entries into the null block.
        """
        if not self.can_allocate(seq, num_new_tokens, computed):
            return False
        hit_blocks = computed.blocks if computed is not None else ()
        num_new_blocks, num_skipped, used_hits = self._plan(seq, num_new_tokens, hit_blocks)
        self._held.setdefault(seq, _HeldBlocks(num_cached=len(hit_blocks), num_freed=num_skipped))
        self.pool.touch(used_hits)  # before get_new_blocks, which could otherwise evict a hit
        new_blocks = self.pool.get_new_blocks(num_new_blocks)
        ids, null = self._table(seq), self.pool.null_block.block_id
        ids.extend([null] * num_skipped)
        ids.extend(block.block_id for block in (*used_hits, *new_blocks))
        if computed is not None and self.enable_prefix_caching:
            self.prefix_cache_queries += seq.num_tokens
            self.prefix_cache_hits += len(hit_blocks) * self.block_size
        return True

    def cache_blocks(self, seq: Sequence) -> None:
        """Register ``seq``'s full blocks whose K/V is now computed (call after each step that advanced it)."""
        if not self.enable_prefix_caching:
            return
        num_full = min(seq.num_computed_tokens, seq.prefix_cache_limit) // self.block_size
        held = self._held[seq]
        if num_full <= held.num_cached:
            return
        hashes = self.block_hashes(seq, num_full)
        # Entries released for the window before they were registered (a caller that advanced the request and
        # released before caching) are skipped: the null block is never cached.
        for i in range(max(held.num_cached, held.num_freed), num_full):
            block = self.pool.blocks[self._table(seq)[i]]
            if self.pool.cache_full_block(block, hashes[i]) and self.on_block_cached is not None:
                self.on_block_cached(block.block_id, hashes[i])
        held.num_cached = num_full

    def free_outside_window(self, seq: Sequence) -> int:
        """Release ``seq``'s blocks lying wholly before the window of its next position to compute
        (``num_computed_tokens``) and point their entries at the null block; returns how many were released.

        Each loses one reference (a block shared through the prefix cache stays with its other holders); a
        registered one stays in the prefix cache until evicted. No-op without a window or for a request holding no
        blocks. Call it for every running request before planning a step, so their released blocks serve the step.
        """
        held = self._held.get(seq)
        if held is None:
            return 0
        ids = self._table(seq)
        stop = min(self.num_blocks_outside_window(seq.num_computed_tokens), len(ids))
        if stop <= held.num_freed:
            return 0
        start, null = held.num_freed, self.pool.null_block.block_id
        # Oldest first: the request's earliest blocks (the start of a cached chain) are then evicted first.
        self.pool.free_blocks(self.pool.blocks[b] for b in ids[start:stop])
        ids[start:stop] = [null] * (stop - start)
        held.num_freed = stop
        return stop - start

    def num_held_blocks(self, seq: Sequence) -> int:
        """Blocks ``seq`` holds a reference to: its block table's entries but the null ones."""
        held = self._held.get(seq)
        return 0 if held is None else len(self._table(seq)) - held.num_freed

    def free(self, seq: Sequence) -> None:
        """Release all of ``seq``'s blocks (last block first, so its tail is evicted first) and empty its table."""
        held = self._held.pop(seq, None)
        if held is not None:
            self.pool.free_blocks(self.pool.blocks[b] for b in reversed(self._table(seq)[held.num_freed :]))
        self._table(seq).clear()

    def kv_waste_slots(self) -> int:
        """Allocated token slots (blocks in use x block size) minus slots holding a computed token.

        Counts internal fragmentation of last blocks plus slots allocated for tokens not yet computed; a block
        shared by several requests counts once, filled as far as its fullest owner.
        """
        bs = self.block_size
        full: set[int] = set()  # blocks full in some owner (only those can be shared)
        partial: dict[int, int] = {}  # the one partly filled block of a sequence -> its filled slots
        for seq, held in self._held.items():  # O(sequences) per step: the runner calls this every step
            ids, computed = self._table(seq), seq.num_computed_tokens
            num_full = min(len(ids), computed // bs)
            full.update(ids[held.num_freed : num_full])  # the null entries are no blocks in use
            rest = computed - num_full * bs
            if num_full < len(ids) and rest > 0:
                partial[ids[num_full]] = max(partial.get(ids[num_full], 0), rest)
        filled = len(full) * bs + sum(n for block, n in partial.items() if block not in full)
        return self.num_used_blocks * bs - filled
