"""The backends: one package per ``Backend``, each a build and a session, and the table of their builds.

Each backend package (``onnxruntime/``, ``tensorrt/``, ``torch/``) has
- ``build/``: its build, ``build_engine_dir(BuildRequest) -> BuildResult`` in ``build/__init__.py``, listed in
  ``BUILD_MODULES`` below; what every build shares is ``build_request.py`` (the request, the portable graph, op
  counts, checkpoint digests), and ``moe_dense.py`` is the dense standard-op form of ``trtbuild::MoE`` that the
  onnxruntime and TensorRT builds both lower to;
- ``session.py``: its ``EngineSession`` (``trtbuild.runtime.engine_session``), opened by
  ``open_session(engine_dir, *, kv_cache_memory, num_threads, profile_kernels)``, listed in
  ``trtbuild.runtime.session.SESSION_MODULES``; it and the modules it imports import nothing from ``build/``.

Both tables name modules, imported when used, so TensorRT, torch and onnxruntime stay out of processes that do not
use them, and the runtime imports nothing from here (the backends import the runtime's protocol, not the reverse).
Adding a backend: one ``Backend`` member (``trtbuild/config.py``), one package here with its ``build/`` and
``session.py`` (listed in pyproject.toml's ``packages``), and one line in each table. Picking the engine of a
multi-arch engine directory that runs on this machine is ``trtbuild/artifacts/engine_select.py``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from ..config import Backend

if TYPE_CHECKING:
    from .build_request import BuildRequest, BuildResult

# Backend -> the module whose ``build_engine_dir(request)`` builds its engine directory.
BUILD_MODULES: dict[Backend, str] = {
    Backend.ONNXRUNTIME: "trtbuild.backends.onnxruntime.build",
    Backend.TENSORRT: "trtbuild.backends.tensorrt.build",
    Backend.TORCH: "trtbuild.backends.torch.build",
}


def build_engine_dir(request: BuildRequest) -> BuildResult:
    """Build ``request.engine_dir`` with the build module of ``request.build.backend`` (imported now)."""
    return importlib.import_module(BUILD_MODULES[request.build.backend]).build_engine_dir(request)
