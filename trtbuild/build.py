"""Stage 2, ``trtbuild build``: checkpoint -> portable graph -> backend engine directory (written atomically).

ENGINE_DIR layout (onnxruntime backend)::

    manifest.json           sha256 + size of every file, versions, build options, backend, target
    runtime_config.json     RuntimeConfig: model config, build options, engine file, I/O names
    engines/onnxruntime-cpu/model.onnx (+ model.onnx.data)   the lowered graph, weights as external data
    tokenizer.json, tokenizer_config.json, chat_template.jinja   copied from the checkpoint when present
"""

from __future__ import annotations

import shutil
import time
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

import onnx

from .artifacts.atomic import atomic_output_dir
from .artifacts.manifest import cpu_target, sha256_file, write_manifest
from .checkpoint import WEIGHTS_FILE
from .config import Backend, BuildConfig, EngineIO, PerplexityGate, RuntimeConfig
from .configio import to_dict
from .convert.convert import TOKENIZER_FILES
from .errors import BuildError
from .graph.emit import emit_portable_graph

ORT_ENGINE = "engines/onnxruntime-cpu/model.onnx"


@dataclass(frozen=True)
class BuildResult:
    engine_dir: Path
    portable_op_counts: dict[str, int]
    engine_op_counts: dict[str, int]
    seconds: float
    accuracy_gate: dict[str, float] | None = None  # perplexities and increase when built with a gate


def op_counts(model: onnx.ModelProto) -> dict[str, int]:
    """Node count per op type (``domain::Op`` for custom domains), sorted by type."""
    c = Counter(f"{n.domain}::{n.op_type}" if n.domain else n.op_type for n in model.graph.node)
    return dict(sorted(c.items()))


def build_engine(
    ckpt_dir: Path,
    engine_dir: Path,
    build: BuildConfig,
    *,
    overwrite: bool = False,
    gate: PerplexityGate | None = None,
) -> BuildResult:
    """Build ``engine_dir`` from the checkpoint at ``ckpt_dir``.

    With a ``gate``, the finished engine is evaluated against the reference engine before it is moved into place;
    when its perplexity rose too far the build raises ``BuildError`` and leaves no engine directory.
    """
    start = time.perf_counter()
    if build.backend is not Backend.ONNXRUNTIME:
        raise BuildError(f"backend {build.backend.value} is not available in this build stage")
    if gate is not None and not (gate.ref_engine / "runtime_config.json").is_file():
        raise BuildError(f"--accuracy-gate {gate.ref_engine}: not an engine directory (no runtime_config.json)")
    from .quantize.layout import load_any_checkpoint

    model_cfg, weights = load_any_checkpoint(ckpt_dir)
    if build.max_seq_len > model_cfg.max_position_embeddings:
        build = replace(build, max_seq_len=model_cfg.max_position_embeddings)
    io = EngineIO()
    portable = emit_portable_graph(model_cfg, weights, build, io)
    del weights
    from .backends.ort_lowering import lower_for_onnxruntime

    engine = lower_for_onnxruntime(portable, io)
    portable_counts, engine_counts = op_counts(portable), op_counts(engine)
    del portable
    with atomic_output_dir(engine_dir, overwrite=overwrite) as tmp:
        path = tmp / ORT_ENGINE
        path.parent.mkdir(parents=True)
        onnx.save_model(
            engine,
            str(path),
            save_as_external_data=True,
            all_tensors_to_one_file=True,
            location=path.name + ".data",
            size_threshold=1024,
        )
        RuntimeConfig(model=model_cfg, build=build, engine_file=ORT_ENGINE, io=io).save(tmp)
        for name in TOKENIZER_FILES:
            if (ckpt_dir / name).is_file():
                shutil.copyfile(ckpt_dir / name, tmp / name)
        gate_result = None
        if gate is not None:
            from .eval import check_gate

            gate_result = check_gate(tmp, gate).as_dict()
        write_manifest(
            tmp,
            backend=build.backend.value,
            target=cpu_target(),
            build_options=to_dict(build),
            checkpoint={name: sha256_file(ckpt_dir / name) for name in ("config.json", WEIGHTS_FILE)},
            graph={"portable_op_counts": portable_counts, "engine_op_counts": engine_counts},
            **({"accuracy_gate": gate_result} if gate_result is not None else {}),
        )
    return BuildResult(engine_dir, portable_counts, engine_counts, time.perf_counter() - start, gate_result)
