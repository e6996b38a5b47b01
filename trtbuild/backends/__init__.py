"""The backend registry: one entry per ``Backend``, the single place that knows how to build and open its engines.

Each backend is a package here: ``onnxruntime/``, ``tensorrt/``, ``torch/``, with its build function in
``build.py`` (``BuildRequest -> BuildResult``, see ``common.py``) and its session in ``session.py`` (an
``open_<backend>`` function returning an ``EngineSession``). The entries below import those modules only when
called, so TensorRT, torch and onnxruntime stay out of processes that do not use them.

Adding a backend: one ``Backend`` member (``trtbuild/config.py``), one package under ``trtbuild/backends/`` with
its ``build.py`` and ``session.py`` (listed in pyproject.toml's ``packages``), and one ``BackendEntry`` here.
Shared by the backends: ``common.py`` (the build request and the steps every build takes) and
``engine_select.py`` (picking the engine of a multi-arch directory that runs on this machine).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from ..config import Backend

if TYPE_CHECKING:
    from ..runtime.engine_session import EngineSession
    from .common import BuildRequest, BuildResult


class OpenSession(Protocol):
    """A backend's ``open_<backend>``: its session over a built engine directory."""

    def __call__(
        self, engine_dir: Path, *, kv_cache_memory: int | None, num_threads: int | None, profile_kernels: bool = False
    ) -> EngineSession: ...


@dataclass(frozen=True)
class BackendEntry:
    """How to build an engine directory for a backend, and how to open one for running."""

    build: Callable[[BuildRequest], BuildResult]
    open: OpenSession


def _build_onnxruntime(request: BuildRequest) -> BuildResult:
    from .onnxruntime.build import build_onnxruntime

    return build_onnxruntime(request)


def _open_onnxruntime(
    engine_dir: Path, *, kv_cache_memory: int | None, num_threads: int | None, profile_kernels: bool = False
) -> EngineSession:
    from .onnxruntime.session import open_onnxruntime

    return open_onnxruntime(
        engine_dir, kv_cache_memory=kv_cache_memory, num_threads=num_threads, profile_kernels=profile_kernels
    )


def _build_tensorrt(request: BuildRequest) -> BuildResult:
    from .tensorrt.build import build_tensorrt

    return build_tensorrt(request)


def _open_tensorrt(
    engine_dir: Path, *, kv_cache_memory: int | None, num_threads: int | None, profile_kernels: bool = False
) -> EngineSession:
    from .tensorrt.session import open_tensorrt

    return open_tensorrt(
        engine_dir, kv_cache_memory=kv_cache_memory, num_threads=num_threads, profile_kernels=profile_kernels
    )


def _build_torch(request: BuildRequest) -> BuildResult:
    from .torch.build import build_torch

    return build_torch(request)


def _open_torch(
    engine_dir: Path, *, kv_cache_memory: int | None, num_threads: int | None, profile_kernels: bool = False
) -> EngineSession:
    # torch's OpenMP threads spin briefly and then sleep, as onnxruntime's do, instead of spinning for long: on a
    # loaded 2-core machine that took a SmolLM2 CPU engine from 0.15-0.22x to ~0.3x onnxruntime's speed, and cost
    # nothing quiet (docs/gpu.md). Read when OpenMP starts: a process that imported torch already keeps its own.
    os.environ.setdefault("GOMP_SPINCOUNT", "10000")
    from .torch.session import open_torch

    return open_torch(
        engine_dir, kv_cache_memory=kv_cache_memory, num_threads=num_threads, profile_kernels=profile_kernels
    )


BACKENDS: dict[Backend, BackendEntry] = {
    Backend.ONNXRUNTIME: BackendEntry(_build_onnxruntime, _open_onnxruntime),
    Backend.TENSORRT: BackendEntry(_build_tensorrt, _open_tensorrt),
    Backend.TORCH: BackendEntry(_build_torch, _open_torch),
}


def backend_entry(backend: Backend) -> BackendEntry:
    """The registry entry of ``backend``."""
    return BACKENDS[backend]
