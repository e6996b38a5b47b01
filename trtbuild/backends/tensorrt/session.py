"""The TensorRT engine session: same interface as ``OrtSession`` (``step(StepBatch) -> logits``), GPU KV pool.

The engine directory's manifest lists one engine per GPU arch; ``select_engine`` picks the one that runs here (or
raises ``EngineError`` saying which to build) before anything is deserialized. The KV pool is one pair of torch
CUDA tensors ``[NB, BS, Hkv, D]`` per layer; each cache input and its aliased plugin output
(``cache_aliases.json``) are bound to the same address, so the plugin's in-place writes land in the pool.

UNVERIFIED: nothing here has run (no GPU or TensorRT where it was written); tensorrt and torch are imported only
when a session is created.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from ...artifacts.engine_select import detect_local_facts, select_engine
from ...artifacts.manifest import read_manifest
from ...config import RuntimeConfig
from ...errors import EngineError
from ...runtime.batch import StepBatch
from ...runtime.engine_session import EngineSession
from ...runtime.kv_cache import DEFAULT_KV_CACHE_MEMORY
from ...runtime.kv_groups import check_sliding_input, sliding_group_layers, split_kv_blocks, step_tables


def open_session(
    engine_dir: Path, *, kv_cache_memory: int | None, num_threads: int | None, profile_kernels: bool = False
) -> TensorRTSession:
    """The backend's ``open_session`` (``runtime.session.SESSION_MODULES``): a ``TensorRTSession`` with as many KV
    blocks as ``kv_cache_memory`` holds (None: ``DEFAULT_KV_CACHE_MEMORY``; split between the KV-cache groups of a
    model of both attention kinds by ``kv_groups.split_kv_blocks``; ``num_threads`` and ``profile_kernels`` do not
    apply)."""
    config = RuntimeConfig.load(engine_dir)
    memory = DEFAULT_KV_CACHE_MEMORY if kv_cache_memory is None else kv_cache_memory
    blocks, sliding = split_kv_blocks(config.model, config.build, memory, itemsize=4)  # a float32 cache
    return TensorRTSession(engine_dir, num_blocks=blocks, num_sliding_blocks=sliding)


class TensorRTSession(EngineSession):
    """An ``EngineSession`` for the TensorRT backend (one CUDA device, one optimization profile)."""

    def __init__(
        self,
        engine_dir: Path,
        *,
        num_blocks: int | None = None,
        num_sliding_blocks: int | None = None,
        device: int = 0,
    ) -> None:
        """``num_blocks`` (the full layers' in a model of both attention kinds) and ``num_sliding_blocks`` (its
        sliding layers'; ignored otherwise): None takes the engine's optimization-profile maximum."""
        engine_dir = Path(engine_dir)
        try:
            self.config = RuntimeConfig.load(engine_dir)
            manifest = read_manifest(engine_dir)
        except Exception as e:
            raise EngineError(f"{engine_dir}: not a loadable engine directory ({e}); run `trtbuild build`") from None
        self.entry = select_engine(manifest, detect_local_facts(), engine_dir=str(engine_dir))
        import tensorrt as trt
        import torch

        from ...plugins.paged_attention import tensorrt_plugin

        tensorrt_plugin.register()  # JIT engines call back into it; AOT engines carry their PTX
        torch.cuda.set_device(device)
        self._torch = torch
        runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        if self.entry.version_compatible:
            runtime.engine_host_code_allowed = True
        plan = engine_dir / self.entry.path
        self._engine = runtime.deserialize_cuda_engine(plan.read_bytes())
        if self._engine is None:
            raise EngineError(f"{plan}: TensorRT could not deserialize the engine (see the TensorRT log)")
        self._context = self._engine.create_execution_context()
        self._aliases: dict[str, str] = json.loads(plan.with_name("cache_aliases.json").read_text())
        model, build, io = self.config.model, self.config.build, self.config.io
        names = {self._engine.get_tensor_name(i) for i in range(self._engine.num_io_tensors)}
        check_sliding_input(model, io.sliding_block_tables in names, engine_dir)
        sliding = sliding_group_layers(model)
        blocks: dict[bool, int] = {}  # in the sliding group -> the group's blocks
        for in_sliding, wanted in ((False, num_blocks), (True, num_sliding_blocks)):
            layer = next((n for n in range(model.num_layers) if (n in sliding) == in_sliding), None)
            if layer is None:
                continue
            profile_max = self._engine.get_tensor_profile_shape(io.key_cache.format(layer=layer), 0)[2][0]
            blocks[in_sliding] = int(wanted or profile_max)
            if not 2 <= blocks[in_sliding] <= profile_max:
                raise EngineError(f"num_blocks must be between 2 and {profile_max} (the engine's optimization profile)")
        self.num_blocks = blocks[False]
        self.num_sliding_blocks = blocks.get(True)
        self.cache: dict[str, Any] = {}
        for n in range(model.num_layers):
            shape = (blocks[n in sliding], build.kv_block_size, model.num_kv_heads, model.head_size)
            for name in (io.key_cache.format(layer=n), io.value_cache.format(layer=n)):
                self.cache[name] = torch.zeros(shape, dtype=torch.float32, device="cuda")
                self._context.set_input_shape(name, shape)
                self._context.set_tensor_address(name, self.cache[name].data_ptr())
        for out_name, in_name in self._aliases.items():
            self._context.set_tensor_address(out_name, self.cache[in_name].data_ptr())
        self._stream = torch.cuda.Stream()

    def step(self, batch: StepBatch) -> np.ndarray:
        """Run the model on ``batch`` (its K/V go into the pool in place); returns logits ``[N, vocab]``."""
        torch, io, ctx = self._torch, self.config.io, self._context
        feeds = {
            io.input_ids: batch.input_ids,
            io.positions: batch.positions,
            io.block_tables: batch.block_tables,
            io.query_start_loc: batch.query_start_loc,
            io.logits_indices: batch.logits_indices,
        }
        if self.num_sliding_blocks is not None:
            feeds[io.sliding_block_tables] = step_tables(batch, self.num_sliding_blocks)[1]
        keep = []  # device copies must outlive the launch
        for name, arr in feeds.items():
            t = torch.from_numpy(np.ascontiguousarray(arr, dtype=np.int64)).to("cuda", non_blocking=False)
            keep.append(t)
            ctx.set_input_shape(name, tuple(t.shape))
            ctx.set_tensor_address(name, t.data_ptr())
        logits = torch.empty((len(batch.logits_indices), self.config.model.vocab_size), device="cuda")
        ctx.set_tensor_address(io.logits, logits.data_ptr())
        self._stream.wait_stream(torch.cuda.current_stream())  # the copies above ran on the current stream
        if not ctx.execute_async_v3(self._stream.cuda_stream):
            raise EngineError("TensorRT failed to run the step (see the TensorRT log)")
        self._stream.synchronize()
        return logits.cpu().numpy()
