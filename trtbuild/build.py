"""Stage 2, ``trtbuild build``: checkpoint -> portable graph -> backend engine directory (written atomically).

ENGINE_DIR layout::

    manifest.json           sha256 + size of every file, versions, build options, backend, target, engines
    runtime_config.json     RuntimeConfig: model config, build options, engine file, I/O names
    engines/onnxruntime-cpu/model.onnx (+ model.onnx.data)   onnxruntime: the lowered graph, external weights
    engines/tensorrt-sm{XY}/engine.plan (+ cache_aliases.json) tensorrt: one serialized engine per GPU arch
    engines/torch-<target>/model.pt2         torch: AOTInductor package for cuda-sm{XY} or cpu-<isa> (docs/gpu.md)
    tokenizer.json, tokenizer_config.json, chat_template.jinja   copied from the checkpoint when present
"""

from __future__ import annotations

import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path

import onnx

from .artifacts.atomic import atomic_output_dir
from .artifacts.manifest import cpu_target, sha256_file, write_manifest
from .checkpoint import WEIGHTS_FILE
from .config import (
    Backend,
    BuildConfig,
    CpuAttention,
    EngineIO,
    ModelConfig,
    PerplexityGate,
    RuntimeConfig,
    TensorRTConfig,
    TorchConfig,
)
from .configio import to_dict
from .convert.convert import copy_tokenizer_files
from .errors import BuildError, EngineError
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


def portable_graph(ckpt_dir: Path, build: BuildConfig) -> tuple[ModelConfig, BuildConfig, EngineIO, onnx.ModelProto]:
    """Load a (float or quantized) checkpoint and emit its portable graph; ``max_seq_len`` is capped by the model."""
    from .quantize.layout import load_any_checkpoint

    model_cfg, weights = load_any_checkpoint(ckpt_dir)
    if build.max_seq_len > model_cfg.max_position_embeddings:
        build = replace(build, max_seq_len=model_cfg.max_position_embeddings)
    io = EngineIO()
    return model_cfg, build, io, emit_portable_graph(model_cfg, weights, build, io)


@dataclass(frozen=True)
class BuildRequest:
    """One ``trtbuild build``: what every backend's build function (``trtbuild.backends.BACKENDS``) receives."""

    ckpt_dir: Path
    engine_dir: Path
    build: BuildConfig
    overwrite: bool = False
    gate: PerplexityGate | None = None
    tensorrt: TensorRTConfig = field(default_factory=TensorRTConfig)
    torch: TorchConfig = field(default_factory=TorchConfig)
    start: float = 0.0


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
    from .backends import backend_entry

    start = time.perf_counter()
    if build.backend is not Backend.TENSORRT and tensorrt is not None and tensorrt != TensorRTConfig():
        raise BuildError("TensorRT options (--arch, --hardware-compatibility, ...) need --backend tensorrt")
    if build.backend is not Backend.TORCH and torch is not None and torch != TorchConfig():
        raise BuildError("torch options (--device, --dtype, --max-autotune) need --backend torch")
    if gate is not None and build.backend is not Backend.ONNXRUNTIME:
        raise BuildError("--accuracy-gate evaluates on the CPU engine; gate the onnxruntime build instead")
    request = BuildRequest(
        Path(ckpt_dir), Path(engine_dir), build, overwrite, gate, tensorrt or TensorRTConfig(), torch or TorchConfig(),
        start,
    )  # fmt: skip
    return backend_entry(build.backend).build(request)


def build_onnxruntime(req: BuildRequest) -> BuildResult:
    """The onnxruntime backend: portable graph -> onnxruntime lowering -> ``engines/onnxruntime-cpu/model.onnx``."""
    ckpt_dir, engine_dir, gate = req.ckpt_dir, req.engine_dir, req.gate
    if gate is not None and not (gate.ref_engine / "runtime_config.json").is_file():
        raise BuildError(f"--accuracy-gate {gate.ref_engine}: not an engine directory (no runtime_config.json)")
    model_cfg, build, io, portable = portable_graph(ckpt_dir, req.build)
    from .backends.ort_lowering import lower_for_onnxruntime
    from .backends.ort_native import library_path, lower_to_native, native_supports
    from .backends.ort_weights import hand_activations_to_kernel, integer_gemms_per_token, reblock_int8_weights

    if build.cpu_attention is CpuAttention.NATIVE and native_supports(portable, build.kv_block_size) is not None:
        build = replace(build, cpu_attention=CpuAttention.LOWERED)  # recorded: the engine says what it holds
    if build.cpu_attention is CpuAttention.NATIVE:
        try:
            library_path()  # compiled now, so that a machine without a compiler fails here rather than at run time
        except EngineError as e:
            raise BuildError(str(e)) from None
        lowered = lower_to_native(portable)
    else:
        lowered = lower_for_onnxruntime(portable, io)
    native = build.cpu_attention is CpuAttention.NATIVE  # the engine loads the native library: its row ops too
    engine = reblock_int8_weights(hand_activations_to_kernel(integer_gemms_per_token(lowered, native)))
    portable_counts, engine_counts = op_counts(portable), op_counts(engine)
    del portable
    with atomic_output_dir(engine_dir, overwrite=req.overwrite) as tmp:
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
        copy_tokenizer_files(ckpt_dir, tmp)
        gate_result = None
        if gate is not None:
            from .eval import check_gate

            gate_result = check_gate(tmp, gate).as_dict()
        write_manifest(
            tmp,
            backend=build.backend.value,
            target=cpu_target(),
            build_options=to_dict(build),
            checkpoint=_checkpoint_digests(ckpt_dir),
            graph={"portable_op_counts": portable_counts, "engine_op_counts": engine_counts},
            **({"accuracy_gate": gate_result} if gate_result is not None else {}),
        )
    return BuildResult(engine_dir, portable_counts, engine_counts, time.perf_counter() - req.start, gate_result)


def build_torch(req: BuildRequest) -> BuildResult:
    """The torch backend: portable graph -> torch module -> torch.export -> AOTInductor ``model.pt2`` (docs/gpu.md)."""
    from .backends.torch.target import local_target

    local_target(req.torch.device)  # no GPU for --device cuda: one line before any heavy work
    model_cfg, build, io, portable = portable_graph(req.ckpt_dir, req.build)
    from .backends.torch.writer import write_torch_engine

    portable_counts = op_counts(portable)
    with atomic_output_dir(req.engine_dir, overwrite=req.overwrite) as tmp:
        entry = write_torch_engine(portable, model_cfg, build, io, req.torch, tmp)
        del portable
        RuntimeConfig(model=model_cfg, build=build, engine_file=entry.path, io=io).save(tmp)
        copy_tokenizer_files(req.ckpt_dir, tmp)
        write_manifest(
            tmp,
            backend=build.backend.value,
            target=entry.target,
            build_options={**to_dict(build), "torch": to_dict(req.torch)},
            engines=[entry.to_dict()],
            checkpoint=_checkpoint_digests(req.ckpt_dir),
            graph={"portable_op_counts": portable_counts},
        )
    return BuildResult(req.engine_dir, portable_counts, {}, time.perf_counter() - req.start)


def _checkpoint_digests(ckpt_dir: Path) -> dict[str, str]:
    """sha256 of the checkpoint files an engine was built from (recorded in its manifest)."""
    return {name: sha256_file(ckpt_dir / name) for name in ("config.json", WEIGHTS_FILE)}


def build_tensorrt(req: BuildRequest) -> BuildResult:
    """The tensorrt backend: portable graph -> TensorRT lowering -> one engine per GPU arch (see docs/tensorrt.md)."""
    from .backends.tensorrt import build_tensorrt_engines, require_tensorrt

    ckpt_dir, engine_dir, build, trt, overwrite, start = (
        req.ckpt_dir, req.engine_dir, req.build, req.tensorrt, req.overwrite, req.start
    )  # fmt: skip
    require_tensorrt()  # fail with the install hint before any heavy work
    model_cfg, build, io, portable = portable_graph(ckpt_dir, build)
    portable_counts = op_counts(portable)
    with tempfile.TemporaryDirectory(prefix="trtbuild-portable-") as work:
        portable_path = Path(work) / "portable.onnx"
        onnx.save_model(portable, str(portable_path), save_as_external_data=True, all_tensors_to_one_file=True,
                        location="portable.onnx.data", size_threshold=1024)  # fmt: skip
        del portable
        with atomic_output_dir(engine_dir, overwrite=overwrite) as tmp:
            entries = build_tensorrt_engines(
                portable_path, tmp, build, archs=trt.arch, hardware_compatibility=trt.hardware_compatibility.value,
                version_compatible=trt.version_compatible, timing_cache=trt.timing_cache,
                builder_optimization_level=trt.builder_optimization_level, plugin_impl=trt.plugin_impl.value,
                ptx_version=trt.ptx_version,
            )  # fmt: skip
            RuntimeConfig(model=model_cfg, build=build, engine_file=entries[0].path, io=io).save(tmp)
            copy_tokenizer_files(ckpt_dir, tmp)
            write_manifest(
                tmp,
                backend=build.backend.value,
                target=",".join(e.target for e in entries),
                build_options={**to_dict(build), "tensorrt": to_dict(trt)},
                engines=[e.to_dict() for e in entries],
                checkpoint=_checkpoint_digests(ckpt_dir),
                graph={"portable_op_counts": portable_counts},
            )
    return BuildResult(engine_dir, portable_counts, {}, time.perf_counter() - start)
