"""The backend registry: one entry per ``Backend``, the single place that knows how to build and open its engines.

Each entry's functions import their backend lazily (TensorRT, torch and onnxruntime stay out of processes that do
not use them). Adding a backend means one ``Backend`` member, one package under ``trtbuild/backends/`` and one
``BackendEntry`` here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..config import Backend

if TYPE_CHECKING:
    from ..build import BuildRequest, BuildResult
    from ..runtime.session import EngineSession


@dataclass(frozen=True)
class BackendEntry:
    """How to build an engine directory for a backend, and how to open one for running."""

    build: Callable[[BuildRequest], BuildResult]
    open: Callable[..., EngineSession]  # (engine_dir, *, kv_cache_memory, num_threads, profile_kernels) -> session


def _build_onnxruntime(request: BuildRequest) -> BuildResult:
    from ..build import build_onnxruntime

    return build_onnxruntime(request)


def _build_tensorrt(request: BuildRequest) -> BuildResult:
    from ..build import build_tensorrt

    return build_tensorrt(request)


def _build_torch(request: BuildRequest) -> BuildResult:
    from ..build import build_torch

    return build_torch(request)


def _open_onnxruntime(
    engine_dir: Path, *, kv_cache_memory: int | None, num_threads: int | None, profile_kernels: bool = False
) -> Any:
    from ..runtime.ort_session import DEFAULT_KV_CACHE_MEMORY, OrtSession

    memory = DEFAULT_KV_CACHE_MEMORY if kv_cache_memory is None else kv_cache_memory
    return OrtSession(engine_dir, kv_cache_memory=memory, num_threads=num_threads, profile_kernels=profile_kernels)


def _open_tensorrt(
    engine_dir: Path, *, kv_cache_memory: int | None, num_threads: int | None, profile_kernels: bool = False
) -> Any:
    from ..config import RuntimeConfig
    from ..runtime.kv_cache import num_blocks_for_memory
    from ..runtime.ort_session import DEFAULT_KV_CACHE_MEMORY
    from ..runtime.trt_session import TensorRTSession

    config = RuntimeConfig.load(engine_dir)
    memory = DEFAULT_KV_CACHE_MEMORY if kv_cache_memory is None else kv_cache_memory
    blocks = num_blocks_for_memory(config.model, config.build.kv_block_size, memory)
    return TensorRTSession(engine_dir, num_blocks=blocks)


def _open_torch(
    engine_dir: Path, *, kv_cache_memory: int | None, num_threads: int | None, profile_kernels: bool = False
) -> Any:
    from .torch.session import TorchSession

    return TorchSession(engine_dir, kv_cache_memory=kv_cache_memory, num_threads=num_threads)


BACKENDS: dict[Backend, BackendEntry] = {
    Backend.ONNXRUNTIME: BackendEntry(_build_onnxruntime, _open_onnxruntime),
    Backend.TENSORRT: BackendEntry(_build_tensorrt, _open_tensorrt),
    Backend.TORCH: BackendEntry(_build_torch, _open_torch),
}


def backend_entry(backend: Backend) -> BackendEntry:
    return BACKENDS[backend]
