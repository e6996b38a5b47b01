"""The onnxruntime engine session: runs one step of a built engine over a ragged batch and its paged KV cache.

The cache arrays are bound to the session once (zero-copy OrtValues over numpy memory); each step binds only the
small metadata inputs and runs. An engine with native attention (``CpuAttention.NATIVE``) writes the step's keys
and values into those arrays itself; a lowered one returns them and the session stores them at their slots.
A model of both sliding and full layers has two caches, ``cache`` (full layers, ``num_blocks``) and
``sliding_cache`` (sliding layers, ``num_sliding_blocks``), the memory split by ``kv_groups.split_kv_blocks``.
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import onnxruntime as ort

from ...config import CpuAttention, RuntimeConfig
from ...errors import EngineError
from ...runtime.batch import StepBatch
from ...runtime.engine_session import EngineSession
from ...runtime.kv_cache import (
    CACHE_NUMPY_DTYPES,
    DEFAULT_KV_CACHE_MEMORY,
    PagedKVCache,
    available_memory,
    default_cpu_kv_cache_memory,
    slot_mapping,
)
from ...runtime.kv_groups import check_sliding_input, sliding_group_layers, split_kv_blocks, step_tables
from ...runtime.profile import KernelTimes, SessionTimes, read_ort_profile
from . import huge_pages as hp


def open_session(
    engine_dir: Path, *, kv_cache_memory: int | None, num_threads: int | None, profile_kernels: bool = False
) -> OrtSession:
    """The backend's ``open_session`` (``runtime.session.SESSION_MODULES``): an ``OrtSession`` over ``engine_dir``
    (``kv_cache_memory`` None: sized for the engine's limits within a share of the available memory,
    ``kv_cache.default_cpu_kv_cache_memory``)."""
    if kv_cache_memory is None:
        config = RuntimeConfig.load(engine_dir)
        kv_cache_memory = default_cpu_kv_cache_memory(config.model, config.build, available_memory())
    return OrtSession(
        engine_dir, kv_cache_memory=kv_cache_memory, num_threads=num_threads, profile_kernels=profile_kernels
    )


class OrtSession(EngineSession):
    """An ``EngineSession`` for the onnxruntime backend."""

    def __init__(
        self,
        engine_dir: Path,
        *,
        kv_cache_memory: int = DEFAULT_KV_CACHE_MEMORY,
        num_threads: int | None = None,
        session_config: Mapping[str, str] | None = None,
        profile_kernels: bool = False,
        huge_pages: bool = True,
        kernel_library: Path | None = None,
    ) -> None:
        """``huge_pages``: put the weights on transparent huge pages where Linux allows it (``huge_pages.py``: the
        native kernels' weights copied into one arena, and what onnxruntime allocates while creating the session,
        e.g. its prepacked float matrices); ``huge_page_bytes`` says how much was advised.
        ``session_config``: extra onnxruntime session config entries, e.g.
        ``{"session.qdq_matmulnbits_accuracy_level": "0"}`` for float (not int8) activations in ``MatMulNBits``.
        ``profile_kernels``: run onnxruntime's profiler (it times every node: a decode step of a 30-layer model
        takes up to 2x as long); ``kernel_times()`` reads it.
        ``kernel_library``: the native kernels' compiled library to register (default: this machine's build of the
        source, ``kernels.library.library_path()``); benchmarks pass other builds to compare kernels in one process."""
        engine_dir = Path(engine_dir)
        if not (engine_dir / "runtime_config.json").is_file():
            raise EngineError(f"{engine_dir}: not an engine directory (no runtime_config.json); run `trtbuild build`")
        try:
            self.config = RuntimeConfig.load(engine_dir)
        except Exception as e:
            raise EngineError(f"{engine_dir}: corrupt runtime_config.json ({e})") from None
        model, build, io = self.config.model, self.config.build, self.config.io
        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        opts.intra_op_num_threads = num_threads or min(os.cpu_count() or 1, 8)
        opts.inter_op_num_threads = 1
        # Split each parallel loop into shrinking chunks (onnxruntime's dynamic block size): faster decode steps of
        # many small nodes on 2 cores (benchmarks/results/2026-12-01-cpu2-lowering-rewrite.md).
        opts.add_session_config_entry("session.dynamic_block_base", "4")
        if profile_kernels:
            opts.enable_profiling = True
            opts.profile_file_prefix = str(Path(tempfile.gettempdir()) / "trtbuild-ort-profile")
        for key, value in (session_config or {}).items():
            opts.add_session_config_entry(key, value)
        self._native = build.cpu_attention is CpuAttention.NATIVE  # the graph writes the KV cache itself
        if build.uses_native_cpu_library:
            from ...kernels.library import library_path  # compiles the kernels on this machine's first use

            library = Path(kernel_library) if kernel_library is not None else library_path()
            if not library.is_file():
                raise EngineError(f"{library}: no such kernel library")
            try:
                opts.register_custom_ops_library(str(library))
            except Exception as e:
                raise EngineError(f"{library}: cannot load the kernel library ({str(e).splitlines()[0]})") from None
        path = engine_dir / self.config.engine_file
        huge_pages = huge_pages and hp.supported()
        self._arena: hp.WeightArena | None = None  # holds the native kernels' weights while the session lives
        if huge_pages:
            hp.map_large_allocations_apart()
        if huge_pages and build.uses_native_cpu_library:
            try:
                self._arena = hp.WeightArena(path, _arena_layout(path))
            except Exception as e:
                raise EngineError(f"{path}: cannot load the engine's weights ({str(e).splitlines()[0]})") from None
            for name, value in self._arena.values.items():
                opts.add_initializer(name, value)
        before = hp.anonymous_ranges() if huge_pages else []
        try:
            self._session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        except Exception as e:
            raise EngineError(f"{path}: onnxruntime cannot load the engine ({str(e).splitlines()[0]})") from None
        names = {value.name for value in self._session.get_inputs()}
        check_sliding_input(model, io.sliding_block_tables in names, engine_dir)
        # Before the KV cache exists: only the session's own allocations (its weights) change page size.
        advised = hp.advise_huge_pages(hp.subtract(hp.anonymous_ranges(), before)) if huge_pages else 0
        self.huge_page_bytes = advised + (self._arena.nbytes if self._arena else 0)
        self.kv_cache_memory = kv_cache_memory
        itemsize = np.dtype(CACHE_NUMPY_DTYPES[model.kv_cache_dtype]).itemsize
        num_blocks, num_sliding = split_kv_blocks(model, build, kv_cache_memory, itemsize)
        sliding = sliding_group_layers(model)
        full = [n for n in range(model.num_layers) if n not in sliding]
        self.cache = PagedKVCache(model, num_blocks, build.kv_block_size, len(full))  # all layers with one group
        self.sliding_cache: PagedKVCache | None = None  # the sliding layers' of a model of both kinds
        self.num_blocks, self.num_sliding_blocks = num_blocks, num_sliding
        # Each layer's (cache, index in it): the full layers in self.cache, the sliding ones in self.sliding_cache.
        self._layer_caches = {n: (self.cache, i) for i, n in enumerate(full)}
        if num_sliding is not None:
            self.sliding_cache = PagedKVCache(model, num_sliding, build.kv_block_size, len(sliding))
            self._layer_caches |= {n: (self.sliding_cache, i) for i, n in enumerate(sorted(sliding))}
        self._binding = self._session.io_binding()
        self._cache_values = []  # keep the OrtValues alive as long as the binding
        for n in range(model.num_layers):
            cache, i = self._layer_caches[n]
            for name, arr in ((io.key_cache, cache.keys[i]), (io.value_cache, cache.values[i])):
                value = ort.OrtValue.ortvalue_from_numpy(arr)
                self._cache_values.append(value)
                self._binding.bind_ortvalue_input(name.format(layer=n), value)
        self.times = SessionTimes()
        self._profiling = profile_kernels
        self._outputs = [io.logits]
        if not self._native:  # the lowered graph returns the step's keys/values for the session to store
            layers = range(model.num_layers)
            self._outputs += [name.format(layer=n) for n in layers for name in (io.new_keys, io.new_values)]

    def step(self, batch: StepBatch) -> np.ndarray:
        """Run the model on ``batch``; store its K/V in the cache; return logits ``[len(logits_indices), vocab]``."""
        io, binding = self.config.io, self._binding
        t0 = time.perf_counter()
        feeds = [
            (io.input_ids, batch.input_ids),
            (io.positions, batch.positions),
            (io.block_tables, batch.block_tables),
            (io.query_start_loc, batch.query_start_loc),
            (io.logits_indices, batch.logits_indices),
        ]
        sliding_tables = None
        if self.num_sliding_blocks is not None:
            sliding_tables = step_tables(batch, self.num_sliding_blocks)[1]
            feeds.append((io.sliding_block_tables, sliding_tables))
        for name, arr in feeds:
            binding.bind_cpu_input(name, np.ascontiguousarray(arr, dtype=np.int64))
        for name in self._outputs:
            binding.bind_output(name, "cpu")
        t1 = time.perf_counter()
        self._session.run_with_iobinding(binding)
        t2 = time.perf_counter()
        outs = binding.get_outputs()
        if not self._native:
            groups = [(self.cache, batch.block_tables), (self.sliding_cache, sliding_tables)]
            slots = {
                id(cache): slot_mapping(batch.positions, batch.query_start_loc, tables, cache.block_size)
                for cache, tables in groups
                if cache is not None and tables is not None
            }
            for n in range(self.config.model.num_layers):
                cache, i = self._layer_caches[n]
                cache.write(i, slots[id(cache)], outs[1 + 2 * n].numpy(), outs[2 + 2 * n].numpy())
        logits = outs[0].numpy()
        times = self.times
        times.bind += t1 - t0
        times.run += t2 - t1
        times.cache_write += time.perf_counter() - t2
        times.calls += 1
        return logits

    def kernel_times(self, skip_runs: int = 0) -> KernelTimes:
        """onnxruntime's kernel times by kind since the session opened, less its first ``skip_runs`` runs (needs
        ``profile_kernels``; ends profiling)."""
        if not self._profiling:
            raise EngineError("kernel times need a session opened with profile_kernels=True")
        path = Path(self._session.end_profiling())
        self._profiling = False
        try:
            return read_ort_profile(path, skip_runs)
        finally:
            path.unlink(missing_ok=True)


def _arena_layout(model_path: Path) -> list[hp.ArenaTensor]:
    """The native ops' weights for the huge-page arena: the layout the build wrote, else (an engine built before
    it did) read from the graph with ``onnx`` where that build tool is installed, else none."""
    layout = hp.read_arena_layout(model_path)
    if layout is not None:
        return layout
    if importlib.util.find_spec("onnx") is None:
        return []
    return hp.graph_arena_layout(model_path)
