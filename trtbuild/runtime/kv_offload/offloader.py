"""``KVOffloader``: stores full KV blocks into the offload tiers and loads a request's missing prefix back.

Storing: when the KV-cache manager registers a full block in the prefix cache (``KVCacheManager.on_block_cached``),
the block's bytes are copied out of the cache (one memcpy on the engine thread: the block may be overwritten once it
is evicted, so it cannot wait) and queued; a writer thread puts them into every tier. Every block the pool could
later evict is thereby already stored (write-through), and the disk tier outlives the process.

Loading (``load_prefix``, called by the scheduler before a waiting request's prefix-cache lookup): the request's
full blocks past its pool hits are looked up tier by tier (memory, then disk; a disk hit is copied into memory) and
written into free blocks, which are registered in the prefix cache and left free; the lookup that follows takes them
as ordinary hits, so the prefill computes only the rest (``loading.py``).

A model of sliding and full layers has two KV-cache groups (``runtime/kv_groups.py``), each with its own cache and
pool: a block of the full group is stored under its prefix hash, one of the sliding group under ``sliding_key`` of
it. A prefix hit needs the full group's blocks of the whole prefix and the sliding group's blocks of the window at
its end; those are what is loaded.
"""

from __future__ import annotations

import hashlib
import queue
import threading
import weakref
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ...errors import ConfigError
from ..block_pool import BlockHash
from ..engine_session import EngineSession
from ..kv_cache import PagedKVCache
from ..kv_cache_manager import KVCacheManager
from ..sequence import Sequence
from .config import KVOffloadConfig
from .loading import load_run, load_window, sliding_key
from .tiers import DiskTier, MemoryTier, TierStats

if TYPE_CHECKING:
    from .redis_tier import RedisTier

FLUSH_AT_EXIT_S = 30.0  # how long the interpreter's exit waits for queued blocks to reach the tiers


def engine_fingerprint(engine_dir: Path) -> str:
    """What names an engine's blocks on disk: sha256 of its ``runtime_config.json`` and ``manifest.json`` (the
    sha256 of every engine file), so blocks of two engines, or of two builds of one, never mix."""
    h = hashlib.sha256()
    for name in ("runtime_config.json", "manifest.json"):
        path = Path(engine_dir) / name
        h.update(name.encode() + b"\0" + (path.read_bytes() if path.is_file() else b"") + b"\0")
    return h.hexdigest()[:32]


def open_offloader(
    session: EngineSession, engine_dir: Path, config: KVOffloadConfig | None, enable_prefix_caching: bool
) -> KVOffloader | None:
    """The offloader ``LLM(kv_offload=config)`` runs with; None when ``config`` enables no tier."""
    if config is None:
        return None
    if not isinstance(config, KVOffloadConfig):
        raise ConfigError(f"kv_offload must be a KVOffloadConfig, not {type(config).__name__}")
    if not config.enabled:
        return None
    if not enable_prefix_caching:
        raise ConfigError("kv_offload needs prefix caching (its blocks are found by their prefix hashes)")
    cache, sliding_cache = getattr(session, "cache", None), getattr(session, "sliding_cache", None)
    two_groups = session.num_sliding_blocks is not None
    if not isinstance(cache, PagedKVCache) or (two_groups and not isinstance(sliding_cache, PagedKVCache)):
        raise ConfigError("kv_offload needs an engine whose KV cache is in host memory (the onnxruntime backend)")
    try:
        return KVOffloader(config, cache, engine_fingerprint(engine_dir), sliding_cache if two_groups else None)
    except OSError as e:
        raise ConfigError(f"--kv-offload-dir {config.disk_dir}: {e.strerror or e}") from None


class KVOffloader:
    """The tiers of one ``LLM``; see the module docstring. ``flush()`` waits for queued blocks to be stored."""

    def __init__(
        self, config: KVOffloadConfig, cache: PagedKVCache, fingerprint: str, sliding_cache: PagedKVCache | None = None
    ) -> None:
        self.config = config
        self.cache = cache  # every layer's, or the full layers' of a model of two KV-cache groups
        self.sliding_cache = sliding_cache  # the sliding layers' of a model of two groups, else None
        self.fingerprint = fingerprint
        self.memory = MemoryTier(config.memory) if config.memory is not None else None
        self.disk = DiskTier(config.disk_dir, fingerprint, config.disk) if config.disk_dir is not None else None
        self.remote = None
        if config.url is not None:
            from .redis_tier import RedisTier

            self.remote = RedisTier(config.url, fingerprint)
        self.tiers: list[MemoryTier | DiskTier | RedisTier] = [
            t for t in (self.memory, self.disk, self.remote) if t is not None
        ]
        self.loaded_blocks = 0  # blocks written back into the pool
        self._pending: dict[BlockHash, np.ndarray] = {}  # queued, not yet in every tier (lookups see them)
        self._lock = threading.Lock()
        self._queue: queue.Queue[tuple[BlockHash, np.ndarray] | None] = queue.Queue()
        # The writer holds no reference to the offloader, so that an unused LLM (and its cache) can be collected:
        # the finalizer (also run at the interpreter's exit) drains the queue and stops the thread.
        writer = threading.Thread(
            target=_write_loop, args=(self._queue, self.tiers, self._pending, self._lock), daemon=True
        )
        writer.name = "kv-offload-writer"
        writer.start()
        self._stop = weakref.finalize(self, _stop_writer, self._queue, writer)

    # ------------------------------------------------------------------------------------------------ storing

    def store(self, block_id: int, block_hash: BlockHash) -> None:
        """Queue block ``block_id`` of ``cache`` (full, computed, registered under ``block_hash``) for the tiers."""
        self._store(self.cache, block_id, block_hash)

    def store_sliding(self, block_id: int, block_hash: BlockHash) -> None:
        """``store`` for a block of the sliding group (``sliding_cache``), kept under ``sliding_key(block_hash)``."""
        assert self.sliding_cache is not None
        self._store(self.sliding_cache, block_id, sliding_key(block_hash))

    def _store(self, cache: PagedKVCache, block_id: int, key: BlockHash) -> None:
        if not self._stop.alive:
            return
        with self._lock:
            if key in self._pending:
                return
        if self.memory is not None and key in self.memory and self.tiers == [self.memory]:
            return
        data = cache.read_block(block_id)
        with self._lock:
            self._pending[key] = data
        self._queue.put((key, data))

    def flush(self) -> None:
        """Wait until every queued block is in the tiers."""
        self._queue.join()

    def close(self) -> None:
        """Store what is queued and stop the writer thread (later ``store`` calls do nothing)."""
        self._stop()

    # ------------------------------------------------------------------------------------------------ loading

    def lookup(self, key: BlockHash, nbytes: int) -> np.ndarray | None:
        """The bytes of the block of ``nbytes`` stored under ``key`` from the first tier that has it; a block still
        queued for the writer is found in the queue (counted in no tier's hits). A hit below the memory tier is
        copied into it."""
        with self._lock:
            data = self._pending.get(key)
        if data is not None:
            return data
        if self.memory is not None:
            data = self.memory.get(key)
            if data is not None:
                return data
        for tier in (self.disk, self.remote):
            if tier is not None:
                data = tier.get(key, nbytes)
                if data is not None:
                    if self.memory is not None:
                        self.memory.put(key, data)
                    return data
        return None

    def load_prefix(self, groups: list[KVCacheManager], seq: Sequence) -> int:
        """Load ``seq``'s prefix blocks missing from the pools (``groups``: the scheduler's KV-cache groups) into
        free blocks registered in the prefix cache; returns how many were loaded (``loading.py``)."""
        num_loaded = load_run(self, groups[0], seq)
        if len(groups) > 1:
            num_loaded += load_window(self, groups[0], groups[1], seq)
        self.loaded_blocks += num_loaded
        return num_loaded

    # ------------------------------------------------------------------------------------------------ stats

    def stats(self) -> tuple[TierStats, ...]:
        """A copy of every tier's counters, top tier first."""
        return tuple(TierStats(**vars(t.stats)) for t in self.tiers)

    def reset_stats(self) -> None:
        for t in self.tiers:
            t.stats = TierStats(t.stats.name)
        self.loaded_blocks = 0


def _write_loop(
    jobs: queue.Queue[tuple[BlockHash, np.ndarray] | None],
    tiers: list[MemoryTier | DiskTier | RedisTier],
    pending: dict[BlockHash, np.ndarray],
    lock: threading.Lock,
) -> None:
    """The writer thread: put each queued block into every tier, until a None."""
    while True:
        item = jobs.get()
        try:
            if item is None:
                return
            key, data = item
            for tier in tiers:
                try:
                    tier.put(key, data)
                except Exception:  # a store that fails is a store dropped: the writer must go on (flush waits)
                    tier.stats.store_errors += 1
            with lock:
                pending.pop(key, None)
        finally:
            jobs.task_done()


def _stop_writer(jobs: queue.Queue[tuple[BlockHash, np.ndarray] | None], writer: threading.Thread) -> None:
    jobs.put(None)
    writer.join(FLUSH_AT_EXIT_S)
