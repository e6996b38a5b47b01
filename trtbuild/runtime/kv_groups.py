"""KV-cache groups: models that mix sliding-window and full-attention layers (Gemma 2 / 3) keep two block pools.

Layers of one attention kind share a block table; each group has its own pool and allocation (vLLM's hybrid
allocator, simplified). A model of one kind has one group (``Sequence.block_ids``, every layer), as before. A model
of both kinds (``ModelConfig.has_sliding_kv_group``) has:

- the FULL group: the full layers' caches and ``Sequence.block_ids``; a request holds every block of its positions;
- the SLIDING group: the sliding layers' caches (their own number of blocks, ``num_sliding_blocks``) and
  ``Sequence.sliding_block_ids``, managed with ``window=sliding_window``: blocks wholly before the window of a
  request's next token are released each step (``KVCacheManager.free_outside_window``), so a request holds at most
  ``max_blocks_held(...)`` of them however long it grows (34 at window 512, blocks of 16, steps of up to 18 tokens).

Invariants (the scheduler keeps them, through ``allocate_slots`` / ``free`` here): a request holds blocks in both
groups or in neither; an allocation takes blocks in every group or changes nothing (all-or-nothing); preemption,
abort and finish free both.

Prefix caching: both groups register each full computed block under the same chained hash; a hit
(``get_computed_blocks``) is a prefix found in both pools: the full group's longest cached prefix, cut to the
longest prefix whose sliding blocks from the window of its end on are still cached (the sliding group's windowed
lookup; its earlier entries are the null block). The KV offload tier stores each group's blocks apart and loads
a prefix's full-group run and the sliding group's window at its end (``kv_offload/loading.py``).

Memory split (``split_kv_blocks``): a block of the sliding group costs ``bytes_per_block`` of the sliding layers
only, one of the full group of the full layers only. A running request never holds more sliding blocks than full
ones (its sliding blocks are those of its full blocks still in the window) nor more than ``max_blocks_held``, so
``min(full blocks - 1, max_batch_size * max_blocks_held) + 1`` sliding blocks are never the scarcer pool (blocks
shared through the prefix cache count once in each pool; should the sliding pool still run short, the scheduler
preempts as for the full one). The budget gives both groups the same number of blocks while that is at most
``max_batch_size * max_blocks_held + 1`` (``sliding_blocks_cap``), and beyond it gives the sliding group exactly
that cap and the rest to the full group. Gemma 3 (5 of 6 layers sliding, window 512, blocks of 16): a budget that
one pool of every layer would spend on 8 requests of 32k tokens holds 5.9x as many full-layer blocks this way
(steps of up to 18 tokens; 5.6x with steps of 2,048).
"""

from __future__ import annotations

from collections.abc import Sequence as Seqs

import numpy as np

from ..config import BuildConfig, ModelConfig
from ..errors import EngineError
from .batch import StepBatch
from .block_pool import BlockHash
from .kv_cache_manager import KVCacheBlocks, KVCacheGroup, KVCacheManager, max_blocks_held
from .sequence import Sequence


def sliding_group_layers(model: ModelConfig) -> frozenset[int]:
    """The layers whose caches belong to the sliding group: the sliding layers of a model of both attention kinds,
    none otherwise (every layer is then in the one group)."""
    if not model.has_sliding_kv_group:
        return frozenset()
    return frozenset(n for n in range(model.num_layers) if model.layer_window(n) is not None)


def group_bytes_per_block(model: ModelConfig, block_size: int, itemsize: int) -> tuple[int, int]:
    """Bytes of one block of the (full, sliding) group across its layers, keys and values (sliding: 0 without that
    group); ``itemsize``: bytes of one cache element."""
    per_layer = 2 * block_size * model.num_kv_heads * model.head_size * itemsize
    num_sliding = len(sliding_group_layers(model))
    return (model.num_layers - num_sliding) * per_layer, num_sliding * per_layer


def sliding_blocks_cap(model: ModelConfig, build: BuildConfig) -> int:
    """The most sliding-group blocks an engine's requests hold at once, null block included: ``max_batch_size``
    requests of ``max_blocks_held`` each, plus 1."""
    assert model.sliding_window is not None
    per_seq = max_blocks_held(build.max_seq_len, build.kv_block_size, model.sliding_window, build.max_num_tokens)
    return build.max_batch_size * per_seq + 1


def split_kv_blocks(model: ModelConfig, build: BuildConfig, memory: int, itemsize: int) -> tuple[int, int | None]:
    """(full-group blocks, sliding-group blocks or None without that group) that ``memory`` bytes hold, split by
    the module docstring's rule; a model of one kind gets ``memory // bytes_per_block`` blocks."""
    full, sliding = group_bytes_per_block(model, build.kv_block_size, itemsize)
    if not sliding:
        return memory // full, None
    even = memory // (full + sliding)
    cap = sliding_blocks_cap(model, build)
    if even <= cap:
        return even, even
    return (memory - cap * sliding) // full, cap


def group_memory_need(model: ModelConfig, build: BuildConfig, itemsize: int) -> int:
    """Bytes for ``max_batch_size`` requests of ``max_seq_len`` tokens in every group (each group's null block
    included; with a window, of the blocks such a request holds at once): what a CPU engine's default cache holds at
    most (``kv_cache.default_cpu_kv_cache_memory``)."""
    full, sliding = group_bytes_per_block(model, build.kv_block_size, itemsize)
    per_seq = max_blocks_held(build.max_seq_len, build.kv_block_size, model.kv_window, build.max_num_tokens)
    need = (build.max_batch_size * per_seq + 1) * full
    return need + (sliding_blocks_cap(model, build) * sliding if sliding else 0)


def check_sliding_input(model: ModelConfig, has_input: bool, engine: object) -> None:
    """``EngineError`` (one line) for an engine of a model of both attention kinds whose graph lacks the
    ``sliding_block_tables`` input: built before KV-cache groups, its sliding layers would read the full layers'
    block ids in their own, smaller pool."""
    if model.has_sliding_kv_group and not has_input:
        raise EngineError(
            f"{engine}: built before KV-cache groups (no sliding_block_tables input for the sliding layers); "
            "rebuild it with `trtbuild build`"
        )


def step_tables(batch: StepBatch, num_sliding_blocks: int) -> tuple[np.ndarray, np.ndarray]:
    """(full, sliding) block tables of a step on an engine of two KV-cache groups. A batch without sliding tables
    (a caller driving a session directly with one table, e.g. ``trtbuild eval``) has its sliding layers read
    ``block_tables``, whose ids must then lie in the sliding pool too (ValueError otherwise)."""
    if batch.sliding_block_tables is not None:
        return batch.block_tables, batch.sliding_block_tables
    if batch.block_tables.size and int(batch.block_tables.max()) >= num_sliding_blocks:
        raise ValueError(f"block ids up to {int(batch.block_tables.max())} but the sliding layers have "
                         f"{num_sliding_blocks} blocks: pass sliding_block_tables")  # fmt: skip
    return batch.block_tables, batch.block_tables


def make_groups(
    num_blocks: int,
    block_size: int,
    enable_prefix_caching: bool,
    kv_window: int | None,
    sliding_window: int | None,
    num_sliding_blocks: int | None,
) -> list[KVCacheManager]:
    """The KV-cache managers of a scheduler: one (every layer's, with ``kv_window``), or the full layers' and the
    sliding layers' (``KVCacheGroup.SLIDING``, with ``sliding_window``) when ``num_sliding_blocks`` is given."""
    full = KVCacheManager(num_blocks, block_size, enable_prefix_caching, window=kv_window)
    if sliding_window is None or num_sliding_blocks is None:
        return [full]
    group = KVCacheGroup.SLIDING
    return [full, KVCacheManager(num_sliding_blocks, block_size, enable_prefix_caching, sliding_window, group)]


def get_computed_blocks(groups: Seqs[KVCacheManager], seq: Sequence) -> tuple[list[KVCacheBlocks], int]:
    """A prefix-cache hit found in every group: (each group's ``KVCacheBlocks``, the tokens they hold), within
    ``seq.prefix_hit_limit``.

    The full group's hit is the longest cached prefix; the sliding group's, the longest prefix of at most as many
    blocks whose blocks from its window on are cached (``KVCacheManager.get_computed_blocks(max_blocks=...)``); the
    hit is the sliding group's, the full group's blocks cut to it (any shorter prefix of a full-group hit is one).
    No side effects but the hashes memoised on ``seq``."""
    computed, num_tokens = groups[0].get_computed_blocks(seq)
    if len(groups) == 1:
        return [computed], num_tokens
    block_size = groups[0].block_size
    sliding, num_tokens = groups[1].get_computed_blocks(seq, max_blocks=num_tokens // block_size)
    return [KVCacheBlocks(computed.blocks[: num_tokens // block_size]), sliding], num_tokens


def allocate_slots(
    groups: Seqs[KVCacheManager],
    seq: Sequence,
    num_new_tokens: int,
    computed: Seqs[KVCacheBlocks] | None = None,
) -> bool:
    """``KVCacheManager.allocate_slots`` in every group, all or nothing: False, changing nothing, when some group's
    free blocks do not suffice. ``computed``: each group's hit, from ``get_computed_blocks`` (for a request holding
    no blocks)."""
    hits: list[KVCacheBlocks | None] = [None] * len(groups) if computed is None else list(computed)
    if len(hits) != len(groups):
        raise ValueError(f"{len(hits)} prefix-cache hits for {len(groups)} KV-cache groups")
    if len(groups) == 1:
        return groups[0].allocate_slots(seq, num_new_tokens, hits[0])
    if not all(kv.can_allocate(seq, num_new_tokens, hit) for kv, hit in zip(groups, hits, strict=True)):
        return False
    for kv, hit in zip(groups, hits, strict=True):
        if not kv.allocate_slots(seq, num_new_tokens, hit):
            raise AssertionError("a KV-cache group refused blocks it said it had")  # can_allocate is exact
    return True


def in_flight(kv: KVCacheManager, seqs: Seqs[Sequence]) -> set[BlockHash]:
    """Hashes of the full blocks of ``seqs``' tokens that they have not computed yet (they are being scheduled):
    a waiting request whose next block is one of them finds it cached once they have (``waits_for``)."""
    if not kv.enable_prefix_caching:
        return set()
    bs, out = kv.block_size, set()
    for seq in seqs:
        first, end = seq.num_computed_tokens // bs, min(seq.num_tokens, seq.prefix_cache_limit) // bs  # it registers
        if first < end:
            out.update(kv.block_hashes(seq, end)[first:])
    return out


def waits_for(kv: KVCacheManager, seq: Sequence, num_hit_tokens: int, pending: set[BlockHash]) -> bool:
    """Whether waiting request ``seq``, whose prefix-cache hit is ``num_hit_tokens``, should wait a step for a
    request computing its next full block (``pending``, from ``in_flight``) instead of computing it too: so the
    requests of one batch sharing a prefix compute it once (SGLang's in-batch prefix caching). Never when the hit
    is at its limit (``seq.prefix_hit_limit``), or the block is the one holding its last token (always recomputed)."""
    j = num_hit_tokens // kv.block_size
    if not pending or j >= min(seq.num_tokens - 1, seq.prefix_hit_limit) // kv.block_size:
        return False
    return kv.block_hashes(seq, j + 1)[j] in pending
