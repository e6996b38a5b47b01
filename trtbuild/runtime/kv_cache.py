"""The KV cache memory of an onnxruntime engine: one key and one value array per layer, ``[NB, BS, Hkv, D]``.

Block ids index dimension 0; block 0 is the null block that pads block tables (the block manager never hands
it out, so writes of padded rows cannot happen). Only the block manager decides which block holds which tokens;
this class only stores what a step computed.

A quantized cache (``ModelConfig.kv_cache_dtype`` int8 / fp8) stores what the engine's ``new_keys`` /
``new_values`` outputs already hold: int8 values, or FLOAT8E4M3FN bit patterns as uint8 (the onnxruntime lowering
reads an fp8 cache as uint8; see ``backends/onnxruntime/build/lowering.py``). Scales live in the engine, not here.
"""

from __future__ import annotations

import math
import mmap
import os

import numpy as np

from ..config import BuildConfig, KVCacheDType, ModelConfig
from .kv_groups import group_bytes_per_block, group_memory_need

# Storage dtype of the cache arrays per KV cache dtype (fp8 as its bit patterns).
CACHE_NUMPY_DTYPES = {KVCacheDType.FLOAT32: np.float32, KVCacheDType.INT8: np.int8, KVCacheDType.FP8: np.uint8}

DEFAULT_KV_CACHE_MEMORY = 256 * 2**20  # a fixed size where the default cannot be sized (TensorRT, the torch CPU)
KV_MEMORY_FRACTION = 0.25  # of the memory available when a CPU engine opens: the most its default cache takes


def bytes_per_block(model: ModelConfig, block_size: int) -> int:
    """Memory one block takes across all layers, keys and values (a block of each KV-cache group)."""
    return sum(group_bytes_per_block(model, block_size, np.dtype(CACHE_NUMPY_DTYPES[model.kv_cache_dtype]).itemsize))


def available_memory() -> int | None:
    """Bytes of memory available to new allocations (Linux ``MemAvailable``), or None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def default_cpu_kv_cache_memory(model: ModelConfig, build: BuildConfig, available: int | None) -> int:
    """The KV cache a CPU engine opens with when none is named: room for ``max_batch_size`` sequences of
    ``max_seq_len`` tokens (the engine's own limits, so a full batch never preempts; with a KV window, of the blocks
    such a sequence holds at once, ``kv_cache_manager.max_blocks_held``; with two KV-cache groups, in each group:
    ``kv_groups.group_memory_need``), at most ``KV_MEMORY_FRACTION`` of
    ``available`` memory (``DEFAULT_KV_CACHE_MEMORY`` when that is unknown), never less than
    ``DEFAULT_KV_CACHE_MEMORY`` (or the need, when smaller). numpy's zeroed arrays take pages only as blocks are
    first written, so a large default costs nothing until it is used."""
    need = group_memory_need(model, build, np.dtype(CACHE_NUMPY_DTYPES[model.kv_cache_dtype]).itemsize)
    cap = DEFAULT_KV_CACHE_MEMORY if available is None else int(KV_MEMORY_FRACTION * available)
    return min(need, max(cap, DEFAULT_KV_CACHE_MEMORY))


def num_blocks_for_memory(model: ModelConfig, block_size: int, memory_bytes: int) -> int:
    return memory_bytes // bytes_per_block(model, block_size)


def slot_mapping(
    positions: np.ndarray, query_start_loc: np.ndarray, block_tables: np.ndarray, block_size: int
) -> np.ndarray:
    """Cache slot (``block * BS + offset``) of every token of a step (the plugin contract's addressing)."""
    seq = np.repeat(np.arange(len(query_start_loc) - 1), np.diff(query_start_loc))
    return block_tables[seq, positions // block_size] * block_size + positions % block_size


def lazy_zeros(shape: tuple[int, ...], dtype: type) -> np.ndarray:
    """A zeroed array whose memory is taken page by page as it is written, on 4 KB pages where Linux lets us choose.

    numpy advises transparent huge pages for large arrays: a cache block's first write then faults in and zeroes a
    whole 2 MB page, and (the kernel's default ``defrag=madvise``) may compact memory first, which slows fresh
    prefills (docs/decisions/huge-pages-weights-not-kv-cache.md)."""
    count = math.prod(shape)
    advice = getattr(mmap, "MADV_NOHUGEPAGE", None)
    if advice is None or count == 0:
        return np.zeros(shape, dtype=dtype)
    memory = mmap.mmap(-1, count * np.dtype(dtype).itemsize, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    memory.madvise(advice)
    return np.frombuffer(memory, dtype=dtype, count=count).reshape(shape)


class PagedKVCache:
    """Per-layer key/value arrays; ``write`` stores a step's new K/V at their slots.

    ``num_layers``: the layers it holds (default: all of the model's); a model of two KV-cache groups has one cache
    per group (``kv_groups.py``), each indexed by the group's own layer order and block ids."""

    def __init__(self, model: ModelConfig, num_blocks: int, block_size: int, num_layers: int | None = None) -> None:
        if num_blocks < 2:
            raise ValueError("the KV cache needs at least 2 blocks (block 0 is the null block)")
        layers = model.num_layers if num_layers is None else num_layers
        shape = (layers, num_blocks, block_size, model.num_kv_heads, model.head_size)
        dtype = CACHE_NUMPY_DTYPES[model.kv_cache_dtype]
        self.keys = lazy_zeros(shape, dtype)
        self.values = lazy_zeros(shape, dtype)
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Flat [NB * BS, Hkv, D] views per layer: assignment through them writes the arrays above.
        self._flat_k = [self.keys[n].reshape(-1, *shape[3:]) for n in range(shape[0])]
        self._flat_v = [self.values[n].reshape(-1, *shape[3:]) for n in range(shape[0])]

    def write(self, layer: int, slots: np.ndarray, new_keys: np.ndarray, new_values: np.ndarray) -> None:
        self._flat_k[layer][slots] = new_keys
        self._flat_v[layer][slots] = new_values

    def write_layers(self, slots: np.ndarray, keys: np.ndarray, values: np.ndarray) -> None:
        """Store ``keys`` / ``values`` ``[layers, T, Hkv, D]`` of every layer at ``slots`` in one pass."""
        layers, _, heads, dim = keys.shape
        self.keys.reshape(layers, -1, heads, dim)[:, slots] = keys
        self.values.reshape(layers, -1, heads, dim)[:, slots] = values

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block in every layer, keys and values (``bytes_per_block``)."""
        return 2 * self.keys[:, 0].nbytes

    def read_block(self, block_id: int) -> np.ndarray:
        """A copy of block ``block_id`` as raw bytes: every layer's keys, then every layer's values (the KV offload
        tier's payload; a quantized cache's codes as they are)."""
        out = np.empty(self.block_nbytes, np.uint8)
        half = self.block_nbytes // 2
        for i, arr in enumerate((self.keys, self.values)):
            np.copyto(out[i * half : (i + 1) * half].view(arr.dtype).reshape(arr[:, block_id].shape), arr[:, block_id])
        return out

    def write_block(self, block_id: int, data: np.ndarray) -> None:
        """Store ``read_block``'s bytes into block ``block_id``."""
        self.keys[:, block_id], self.values[:, block_id] = self.split_block(data)

    def split_block(self, data: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``read_block``'s bytes as views of (keys, values) ``[layers, BS, Hkv, D]``."""
        if data.nbytes != self.block_nbytes:
            raise ValueError(f"a block is {self.block_nbytes} bytes, got {data.nbytes}")
        half, shape = self.block_nbytes // 2, self.keys[:, 0].shape
        raw = data.view(np.uint8).reshape(-1)
        return raw[:half].view(self.keys.dtype).reshape(shape), raw[half:].view(self.values.dtype).reshape(shape)
