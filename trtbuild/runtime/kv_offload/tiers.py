"""Storage tiers of the KV offload: host memory and a disk directory, each an LRU under a byte cap.

A tier maps a block hash (the prefix cache's chained digest, ``kv_cache_manager.hash_block_tokens``) to the raw bytes
of that block in every layer's cache, exactly as the cache stores them (float32, int8 or fp8 bit patterns; a
quantized cache's scales are per engine, not per block, so the bytes are the whole block). Tiers are thread-safe: the
writer thread stores while the engine thread looks up.

Disk files: ``<dir>/<engine fingerprint>/<block hash hex>.kv``, written to a dot-named temporary file and renamed, so
a reader (another process too) sees a whole file or none. A file holds a header (magic, block hash, payload length,
crc32) then the payload; one that is short, long, of another block or whose checksum differs is a miss (and
removed), never data.
"""

from __future__ import annotations

import contextlib
import os
import struct
import threading
import time
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..block_pool import BlockHash

MAGIC = b"TRTKV\x00\x01\x00"  # format 1
HEADER = struct.Struct("<8s32sQI12x")  # magic, block hash, payload bytes, crc32 of the payload; 64 bytes (aligned)
STALE_TEMP_S = 600.0  # temporary files older than this are a killed writer's leftovers, removed at open


@dataclass
class TierStats:
    """Counters of one tier since the LLM was made or its stats reset."""

    name: str  # "memory", "disk"
    hits: int = 0  # blocks found here (after the tiers above missed)
    misses: int = 0  # lookups that reached this tier and missed
    bytes_loaded: int = 0  # bytes of the hits
    blocks_stored: int = 0
    bytes_stored: int = 0
    evictions: int = 0  # blocks dropped to stay under the cap
    store_errors: int = 0  # stores that failed (e.g. the disk directory removed or full): the block was not stored


class MemoryTier:
    """Blocks in host memory, least recently used dropped first past ``capacity`` bytes."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.stats = TierStats("memory")
        self._blocks: OrderedDict[BlockHash, np.ndarray] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def __contains__(self, key: BlockHash) -> bool:
        with self._lock:
            return key in self._blocks

    @property
    def nbytes(self) -> int:
        return self._bytes

    def get(self, key: BlockHash) -> np.ndarray | None:
        with self._lock:
            data = self._blocks.get(key)
            if data is None:
                self.stats.misses += 1
                return None
            self._blocks.move_to_end(key)
            self.stats.hits += 1
            self.stats.bytes_loaded += data.nbytes
            return data

    def put(self, key: BlockHash, data: np.ndarray) -> None:
        if data.nbytes > self.capacity:
            return
        with self._lock:
            if key in self._blocks:
                self._blocks.move_to_end(key)
                return
            self._blocks[key] = data
            self._bytes += data.nbytes
            self.stats.blocks_stored += 1
            self.stats.bytes_stored += data.nbytes
            while self._bytes > self.capacity:
                _, old = self._blocks.popitem(last=False)
                self._bytes -= old.nbytes
                self.stats.evictions += 1


class DiskTier:
    """Blocks as files under ``root/<fingerprint>/``, at most about ``capacity`` bytes (LRU by file mtime).

    The cap is kept by this process over the files it knows (those there at open, those it wrote or read); when its
    tally passes the cap it rescans the directory, so several processes sharing it stay near the cap together.
    """

    def __init__(self, root: Path, fingerprint: str, capacity: int) -> None:
        self.dir = Path(root) / fingerprint
        self.dir.mkdir(parents=True, exist_ok=True)
        self.capacity = capacity
        self.stats = TierStats("disk")
        self._lock = threading.Lock()
        self._files: OrderedDict[str, int] = OrderedDict()  # file name -> size, least recently used first
        self._bytes = 0
        self._rescan(remove_stale=True)

    def path(self, key: BlockHash) -> Path:
        return self.dir / f"{key.hex()}.kv"

    def __contains__(self, key: BlockHash) -> bool:
        return self.path(key).is_file()

    def get(self, key: BlockHash, nbytes: int) -> np.ndarray | None:
        """The block's ``nbytes`` payload, or None (a miss) when the file is absent, truncated or corrupt."""
        path = self.path(key)
        data = _read_block_file(path, key, nbytes)
        with self._lock:
            if data is None:
                self.stats.misses += 1
                if path.exists():  # there but not a valid block: remove it so that it is written afresh
                    path.unlink(missing_ok=True)
                self._forget(path.name)
                return None
            self.stats.hits += 1
            self.stats.bytes_loaded += nbytes
            self._remember(path.name, HEADER.size + nbytes)
        with contextlib.suppress(OSError):
            os.utime(path)  # most recently used, for every process's LRU
        return data

    def put(self, key: BlockHash, data: np.ndarray) -> None:
        """Write the block atomically (temporary file + rename); a block already there is only marked used."""
        path = self.path(key)
        if path.is_file():
            with self._lock:
                self._remember(path.name, HEADER.size + data.nbytes)
            return
        payload = memoryview(np.ascontiguousarray(data).view(np.uint8).reshape(-1))
        tmp = self.dir / f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(encode_block(key, payload))
                f.write(payload)
            os.replace(tmp, path)
        except OSError:
            tmp.unlink(missing_ok=True)
            with self._lock:
                self.stats.store_errors += 1
            return
        with self._lock:
            self.stats.blocks_stored += 1
            self.stats.bytes_stored += payload.nbytes
            self._remember(path.name, HEADER.size + payload.nbytes)
            if self._bytes > self.capacity:
                self._rescan()
                self._evict()

    def _remember(self, name: str, size: int) -> None:
        if name in self._files:
            self._files.move_to_end(name)
            return
        self._files[name] = size
        self._bytes += size

    def _forget(self, name: str) -> None:
        size = self._files.pop(name, None)
        if size is not None:
            self._bytes -= size

    def _rescan(self, remove_stale: bool = False) -> None:
        """Rebuild the index from the directory (oldest mtime first); optionally drop killed writers' temp files."""
        entries = []
        now = time.time()
        for entry in os.scandir(self.dir):
            try:
                st = entry.stat()
            except OSError:
                continue
            if entry.name.endswith(".tmp"):
                if remove_stale and now - st.st_mtime > STALE_TEMP_S:
                    Path(entry.path).unlink(missing_ok=True)
            elif entry.name.endswith(".kv"):
                entries.append((st.st_mtime, entry.name, st.st_size))
        entries.sort()
        self._files = OrderedDict((name, size) for _, name, size in entries)
        self._bytes = sum(self._files.values())

    def _evict(self) -> None:
        while self._bytes > self.capacity and self._files:
            name, size = self._files.popitem(last=False)
            self._bytes -= size
            (self.dir / name).unlink(missing_ok=True)
            self.stats.evictions += 1


def encode_block(key: BlockHash, payload: memoryview) -> bytes:
    """The header a stored block starts with (a disk file, a Redis value); the payload follows it."""
    return HEADER.pack(MAGIC, key, payload.nbytes, zlib.crc32(payload))


def decode_block(raw: bytes, key: BlockHash, nbytes: int) -> np.ndarray | None:
    """The ``nbytes`` payload of a stored block ``key`` (header + payload), or None when it is not exactly that."""
    if len(raw) != HEADER.size + nbytes:
        return None
    magic, stored_key, length, crc = HEADER.unpack_from(raw)
    if magic != MAGIC or stored_key != key or length != nbytes:
        return None
    if zlib.crc32(memoryview(raw)[HEADER.size :]) != crc:
        return None
    return np.frombuffer(raw, dtype=np.uint8, offset=HEADER.size)


def _read_block_file(path: Path, key: BlockHash, nbytes: int) -> np.ndarray | None:
    try:
        with open(path, "rb") as f:
            raw = f.read(HEADER.size + nbytes + 1)
    except OSError:
        return None
    return decode_block(raw, key, nbytes)
