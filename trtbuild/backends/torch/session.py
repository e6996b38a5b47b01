"""``TorchSession``: runs a torch engine one step at a time over a paged KV cache.

The engine runs in the form it was built for (``runners.py``): a torch-compile engine's module is rebuilt on the
device and compiled by its warm-up steps at open (``load_seconds``, logged); an AOTInductor package is loaded.

The KV pool is one key and one value tensor ``[NB, BS, Hkv, D]`` per layer on the engine's device (compute dtype,
or int8 / float8 for a quantized cache), sized from ``kv_cache_memory`` or, on a GPU, from the memory left free
after loading (``memory.py``); a model of both sliding and full layers gives its sliding layers
``num_sliding_blocks`` blocks (``runtime.kv_groups.split_kv_blocks`` splits the memory); the engine's
paged-attention op writes each step's keys/values into it in place. Only the requested logits rows leave the engine
(``logits_indices``), and in the runner they stay on the device: ``new_sampler`` samples there, so a step hands the
host its token ids, not its logits.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from collections.abc import Sequence
from pathlib import Path

# torch's OpenMP threads spin briefly and then sleep, as onnxruntime's do, instead of spinning for long: on a loaded
# 2-core machine that took a SmolLM2 CPU engine from 0.15-0.22x to ~0.3x onnxruntime's speed, and cost nothing quiet
# (docs/gpu.md). Read when OpenMP starts, so set before torch is imported: a process that imported torch already
# keeps its own.
os.environ.setdefault("GOMP_SPINCOUNT", "10000")

import numpy as np
import torch

from ...artifacts.manifest import read_manifest
from ...artifacts.torch_select import TorchFacts, entry_device, entry_runtime, select_torch_engine
from ...checkpoint.dtypes import torch_dtype
from ...config import RuntimeConfig, TorchConfig, TorchRuntime
from ...configio import from_dict
from ...errors import EngineError
from ...runtime.batch import StepBatch
from ...runtime.engine_session import EngineSession
from ...runtime.kv_cache import DEFAULT_KV_CACHE_MEMORY
from ...runtime.kv_groups import check_sliding_input, sliding_group_layers, split_kv_blocks, step_tables
from . import moe, ops  # noqa: F401  (register torch.ops.trtbuild.paged_attention / .moe, which the package calls)
from .decode_graphs import DecodeGraphs
from .memory import default_kv_cache_memory
from .row_products import RowProducts, default_row_products
from .runners import load_aoti, load_compiled
from .sampling import DeviceSampler

CUDA_GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
log = logging.getLogger(__name__)


def open_session(
    engine_dir: Path, *, kv_cache_memory: int | None, num_threads: int | None, profile_kernels: bool = False
) -> TorchSession:
    """The backend's ``open_session`` (``runtime.session.SESSION_MODULES``): a ``TorchSession`` over
    ``engine_dir`` (``profile_kernels`` does not apply)."""
    return TorchSession(engine_dir, kv_cache_memory=kv_cache_memory, num_threads=num_threads)


class TorchSession(EngineSession):
    """An ``EngineSession`` for the torch backend.

    ``decode_batch_sizes``: pure decode steps of up to the largest of these sizes run padded to the next one, as
    CUDA graphs on a GPU (``decode_graphs.py``); default: ``CUDA_GRAPH_BATCH_SIZES`` up to the engine's
    ``max_batch_size`` on CUDA (for a mixture-of-experts model none: its op's routing reads the device), none on
    the CPU. ``kv_cache_memory``: the pool's bytes; None sizes it from the
    memory free after loading on a GPU (``memory.default_kv_cache_memory``), or ``DEFAULT_KV_CACHE_MEMORY``.
    ``compile``: a torch-compile engine is compiled (False: its module runs eagerly). ``num_threads``: torch's
    intra-op threads on the CPU (None: as the onnxruntime session, the CPUs this process may use, at most 8).
    ``row_products`` (``row_products.RowProducts``): which one-row products (batch-1 steps) a compiled torch-compile
    engine computes as fused reductions instead of matmuls; None: ``default_row_products``.
    ``load_seconds``: opening time, weights, compilation and warm-up included.
    """

    def __init__(
        self,
        engine_dir: Path,
        *,
        kv_cache_memory: int | None = None,
        num_threads: int | None = None,
        decode_batch_sizes: Sequence[int] | None = None,
        compile: bool = True,
        row_products: RowProducts | None = None,
    ) -> None:
        start = time.perf_counter()
        engine_dir = Path(engine_dir)
        try:
            self.config = RuntimeConfig.load(engine_dir)
            manifest = read_manifest(engine_dir)
            torch_cfg = from_dict(TorchConfig, manifest["build_options"]["torch"], "manifest torch options")
        except Exception as e:
            raise EngineError(f"{engine_dir}: not a loadable torch engine directory ({e})") from None
        self.entry = select_torch_engine(manifest, str(engine_dir), TorchFacts.detect())
        self.runtime = entry_runtime(self.entry)
        self.device = torch.device(entry_device(self.entry).value)
        if self.device.type == "cpu":
            torch.set_num_threads(num_threads or cpu_threads())
        model, build = self.config.model, self.config.build
        compute = torch_dtype(torch_cfg.dtype)
        dtype = ops.cache_dtype(model, compute)
        shape = (build.kv_block_size, model.num_kv_heads, model.head_size)
        path = engine_dir / self.entry.path
        if self.runtime is TorchRuntime.AOT_INDUCTOR:
            self._runner = load_aoti(path, self.device)
        else:
            self._runner = load_compiled(
                path, self.config.io, compute, self.device, compile=compile, max_autotune=torch_cfg.max_autotune,
                row_products=default_row_products(self.device) if row_products is None else row_products,
            )  # fmt: skip
            check_sliding_input(model, getattr(self._runner, "sliding", False), engine_dir)  # the PortableModule's
        if kv_cache_memory is None:  # after loading: the weights are resident, what is free is the pool's to take
            kv_cache_memory = self._default_kv_cache_memory(compute)
        self.kv_cache_memory = kv_cache_memory
        itemsize = torch.empty((), dtype=dtype).element_size()
        self.num_blocks, self.num_sliding_blocks = split_kv_blocks(model, build, kv_cache_memory, itemsize)
        if min(self.num_blocks, self.num_sliding_blocks or self.num_blocks) < 2:
            raise ValueError("the KV cache needs at least 2 blocks (block 0 is the null block)")
        sliding = sliding_group_layers(model)
        blocks = [self.num_sliding_blocks if n in sliding else self.num_blocks for n in range(model.num_layers)]
        self.caches = [  # key_cache.0, value_cache.0, key_cache.1, ...: each layer's with its group's blocks
            torch.zeros((blocks[n // 2], *shape), dtype=dtype, device=self.device) for n in range(2 * model.num_layers)
        ]
        if self.runtime is TorchRuntime.TORCH_COMPILE:  # block size, KV heads, head size: constants, not symbols to
            for cache in self.caches:  # trace and guard every step (the block count stays symbolic: it is the pool's)
                for dim in (1, 2, 3):
                    torch._dynamo.mark_static(cache, dim)
        if decode_batch_sizes is None:  # (the MoE op routes on the host, which a CUDA graph cannot capture)
            graphs = self.device.type == "cuda" and model.moe is None
            decode_batch_sizes = [s for s in CUDA_GRAPH_BATCH_SIZES if s <= build.max_batch_size] if graphs else []
        max_blocks = math.ceil(build.max_seq_len / build.kv_block_size)
        self._decode = DecodeGraphs(
            self._runner, self.caches, decode_batch_sizes, max_blocks, sliding=self.num_sliding_blocks is not None
        )
        if self.runtime is TorchRuntime.TORCH_COMPILE and compile:
            self._warm_up()
        self.load_seconds = time.perf_counter() - start
        log.info("opened %s (%s, %s) in %.1fs", engine_dir, self.runtime.value, self.device, self.load_seconds)

    def _warm_up(self) -> None:
        """Compile the shapes steps take (a decode step of 1 and of several sequences, a prefill, a mixed step) now
        rather than in the first requests; every write goes to the null block 0, which no sequence reads."""
        block = self.config.build.kv_block_size
        zeros = [0] * -(-3 // block)  # a table covering positions 0..2, all in the null block
        two = self.num_sliding_blocks is not None  # the sliding layers' tables too, alike

        def step(tokens: list[list[int]]) -> StepBatch:
            tables = [zeros] * len(tokens)
            return StepBatch.build(tokens, [0] * len(tokens), tables, sliding_block_tables=tables if two else None)

        # one sequence of 3 tokens; 2 sequences (4 tokens); one decode; decodes of 2 (CUDA graphs)
        steps = [step([[0, 0, 0]]), step([[0, 0, 0], [0]]), step([[0]]), step([[0], [0]])]
        for batch in steps:
            if batch.num_seqs <= self.config.build.max_batch_size:
                self.step_logits(batch)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _default_kv_cache_memory(self, compute_dtype: torch.dtype) -> int:
        if self.device.type != "cuda":
            return DEFAULT_KV_CACHE_MEMORY
        free, _ = torch.cuda.mem_get_info(self.device)
        elem = torch.empty((), dtype=compute_dtype).element_size()
        return default_kv_cache_memory(free, self.config.model, self.config.build, elem)

    def step(self, batch: StepBatch) -> np.ndarray:
        """Run the model on ``batch`` (its K/V go into the pool in place); returns float32 logits ``[N, vocab]``."""
        return self.step_logits(batch).float().cpu().numpy()

    def step_logits(self, batch: StepBatch) -> torch.Tensor:
        """``step`` with the logits left on the engine's device, in its compute dtype (for ``DeviceSampler``).

        On a GPU they may be a CUDA graph's output, which the next step overwrites: read or copy them first."""
        if self.num_sliding_blocks is not None and batch.sliding_block_tables is None:  # a caller of one table
            batch = dataclasses.replace(batch, sliding_block_tables=step_tables(batch, self.num_sliding_blocks)[1])
        if self._decode.fits(batch):
            return self._decode.run(batch)
        arrays = [batch.input_ids, batch.positions, _wide(batch.block_tables), batch.query_start_loc]
        arrays.append(batch.logits_indices)
        if self.num_sliding_blocks is not None and batch.sliding_block_tables is not None:  # (never None here)
            arrays.append(_wide(batch.sliding_block_tables))
        tensors = [
            torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(self.device, non_blocking=True) for a in arrays
        ]
        with torch.inference_mode():
            return self._runner(*tensors[:5], self.caches, *tensors[5:])

    def new_sampler(self, seed: int | None) -> DeviceSampler:
        """Samples on the engine's device: only the chosen token ids (and host-only rows) cross to the host."""
        return DeviceSampler(seed)


def _wide(tables: np.ndarray) -> np.ndarray:
    """Block tables of at least 2 columns (null-block padding): width 1 would be one more size-1 specialisation for
    Dynamo to compile."""
    return tables if tables.shape[1] >= 2 else np.pad(tables, ((0, 0), (0, 2 - tables.shape[1])))


def cpu_threads() -> int:
    """torch's intra-op threads on the CPU: as the onnxruntime session's (the CPUs this process may use, at most
    8), rather than torch's own choice."""
    return min(len(os.sched_getaffinity(0)), 8)
