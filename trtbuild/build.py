"""Stage 2, ``trtbuild build``: checkpoint -> portable graph -> backend engine directory (written atomically).

ENGINE_DIR layout::

    manifest.json           sha256 + size of every file, versions, build options, backend, target, engines
    runtime_config.json     RuntimeConfig: model config, build options, engine file, I/O names
    engines/onnxruntime-cpu/model.onnx (+ model.onnx.data)   onnxruntime: the lowered graph, external weights
    engines/tensorrt-sm{XY}/engine.plan (+ cache_aliases.json) tensorrt: one serialized engine per GPU arch
    engines/torch-<target>/model.pt2         torch: AOTInductor package for cuda-sm{XY} or cpu-<isa> (docs/gpu.md)
    tokenizer.json, tokenizer_config.json, chat_template.jinja   copied from the checkpoint when present

Each backend writes its own engines (``build_engine_dir`` of ``trtbuild/backends/<backend>/build/``, found through
``trtbuild.backends.BUILD_MODULES``); what they share is ``trtbuild.backends.build_request``.
"""

from __future__ import annotations

import time
from pathlib import Path

from .backends import build_engine_dir
from .backends.build_request import BuildRequest, BuildResult
from .config import Backend, BuildConfig, PerplexityGate, TensorRTConfig, TorchConfig
from .errors import BuildError

__all__ = ["BuildRequest", "BuildResult", "build_engine"]


def build_engine(
    ckpt_dir: Path,
    engine_dir: Path,
    build: BuildConfig,
    *,
    overwrite: bool = False,
    gate: PerplexityGate | None = None,
    tensorrt: TensorRTConfig | None = None,
    torch: TorchConfig | None = None,
) -> BuildResult:
    """Build ``engine_dir`` from the checkpoint at ``ckpt_dir`` with the backend of ``build``.

    With a ``gate``, the finished engine is evaluated against the reference engine before it is moved into place;
    when its perplexity rose too far the build raises ``BuildError`` and leaves no engine directory.
    ``tensorrt`` / ``torch`` hold the options of those backends (given with another backend, they are an error).
    """
    start = time.perf_counter()
    if build.backend is not Backend.TENSORRT and tensorrt is not None and tensorrt != TensorRTConfig():
        raise BuildError("TensorRT options (--arch, --hardware-compatibility, ...) need --backend tensorrt")
    if build.backend is not Backend.TORCH and torch is not None and torch != TorchConfig():
        raise BuildError("torch options (--device, --dtype, --torch-runtime, --max-autotune) need --backend torch")
    if gate is not None and build.backend is not Backend.ONNXRUNTIME:
        raise BuildError("--accuracy-gate evaluates on the CPU engine; gate the onnxruntime build instead")
    request = BuildRequest(
        Path(ckpt_dir), Path(engine_dir), build, overwrite, gate, tensorrt or TensorRTConfig(), torch or TorchConfig(),
        start, _check_gate,
    )  # fmt: skip
    return build_engine_dir(request)


def _check_gate(engine_dir: Path, gate: PerplexityGate) -> dict[str, float]:
    """``trtbuild.eval.check_gate`` on a finished engine, as its manifest records the result."""
    from .eval import check_gate

    return check_gate(engine_dir, gate).as_dict()
