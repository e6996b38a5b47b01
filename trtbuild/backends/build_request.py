"""What every backend's build receives and returns, and the steps the backends' builds share.

``trtbuild.build.build_engine`` checks the options, makes a ``BuildRequest`` and hands it to the backend's
``build_engine_dir`` (``trtbuild.backends.BUILD_MODULES``), which loads the checkpoint into the portable graph
(``portable_graph``), lowers that for its engines and writes the engine directory atomically, its manifest through
``write_engine_manifest`` (with ``checkpoint_digests`` and ``op_counts``); it returns a ``BuildResult``. Nothing
here imports a backend or ``trtbuild.build``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import onnx

from ..artifacts.manifest import sha256_file, write_manifest
from ..checkpoint.files import WEIGHTS_FILE, load_any_checkpoint
from ..config import BuildConfig, EngineIO, ModelConfig, PerplexityGate, TensorRTConfig, TorchConfig
from ..configio import to_dict
from ..graph.emit import emit_portable_graph

# (finished engine directory, gate) -> the gate's result as the manifest records it; raises BuildError on failure
GateCheck = Callable[[Path, PerplexityGate], dict[str, float]]


@dataclass(frozen=True)
class BuildResult:
    engine_dir: Path
    portable_op_counts: dict[str, int]
    engine_op_counts: dict[str, int]
    seconds: float
    accuracy_gate: dict[str, float] | None = None  # perplexities and increase when built with a gate
    warnings: tuple[str, ...] = ()  # one line each, for the user (e.g. a runtime fallback)


@dataclass(frozen=True)
class BuildRequest:
    """One ``trtbuild build``: what every backend's ``build_engine_dir`` receives.

    ``check_gate`` evaluates a finished engine against ``gate`` (``build_engine`` passes ``trtbuild.eval``'s): ``eval``
    sits a layer above the backends' builds (``tests/test_layering.py``), so a build is handed it rather than
    importing it.
    """

    ckpt_dir: Path
    engine_dir: Path
    build: BuildConfig
    overwrite: bool = False
    gate: PerplexityGate | None = None
    tensorrt: TensorRTConfig = field(default_factory=TensorRTConfig)
    torch: TorchConfig = field(default_factory=TorchConfig)
    start: float = 0.0
    check_gate: GateCheck | None = None


def op_counts(model: onnx.ModelProto) -> dict[str, int]:
    """Node count per op type (``domain::Op`` for custom domains), sorted by type."""
    c = Counter(f"{n.domain}::{n.op_type}" if n.domain else n.op_type for n in model.graph.node)
    return dict(sorted(c.items()))


def portable_graph(ckpt_dir: Path, build: BuildConfig) -> tuple[ModelConfig, BuildConfig, EngineIO, onnx.ModelProto]:
    """Load a (float or quantized) checkpoint and emit its portable graph; ``max_seq_len`` is capped by the model."""
    model_cfg, weights = load_any_checkpoint(ckpt_dir)
    if build.max_seq_len > model_cfg.max_position_embeddings:
        build = replace(build, max_seq_len=model_cfg.max_position_embeddings)
    io = EngineIO()
    return model_cfg, build, io, emit_portable_graph(model_cfg, weights, build, io)


def checkpoint_digests(ckpt_dir: Path) -> dict[str, str]:
    """sha256 of the checkpoint files an engine was built from (recorded in its manifest)."""
    return {name: sha256_file(ckpt_dir / name) for name in ("config.json", WEIGHTS_FILE)}


def write_engine_manifest(
    tmp: Path,
    req: BuildRequest,
    build: BuildConfig,
    *,
    target: str,
    graph: dict[str, dict[str, int]],
    backend_options: dict[str, Any] | None = None,
    **sections: Any,
) -> None:
    """``manifest.json`` of the finished engine directory ``tmp``: the sections every backend records (backend,
    target, build options as the engine holds them plus the backend's own, the checkpoint's digests, op counts) and
    the backend's further ``sections`` (``engines``, ``accuracy_gate``)."""
    write_manifest(
        tmp,
        backend=build.backend.value,
        target=target,
        build_options={**to_dict(build), **(backend_options or {})},
        checkpoint=checkpoint_digests(req.ckpt_dir),
        graph=graph,
        **sections,
    )
