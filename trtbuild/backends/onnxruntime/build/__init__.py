"""The onnxruntime backend's build: portable graph -> onnxruntime lowering -> ``engines/onnxruntime-cpu/model.onnx``."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, replace

import onnx

from ...artifacts.atomic import atomic_output_dir
from ...artifacts.manifest import cpu_target, write_manifest
from ...config import CpuAttention, CpuLinear, RuntimeConfig
from ...configio import to_dict
from ...convert.convert import copy_tokenizer_files
from ...errors import BuildError, EngineError
from ..common import BuildRequest, BuildResult, checkpoint_digests, op_counts, portable_graph

ORT_ENGINE = "engines/onnxruntime-cpu/model.onnx"


def build_onnxruntime(req: BuildRequest) -> BuildResult:
    """The onnxruntime backend: portable graph -> onnxruntime lowering -> ``engines/onnxruntime-cpu/model.onnx``.

    With ``req.gate`` the finished engine is checked (``req.check_gate``) before the directory is moved into place.
    """
    ckpt_dir, engine_dir, gate = req.ckpt_dir, req.engine_dir, req.gate
    if gate is not None and not (gate.ref_engine / "runtime_config.json").is_file():
        raise BuildError(f"--accuracy-gate {gate.ref_engine}: not an engine directory (no runtime_config.json)")
    if gate is not None and req.check_gate is None:
        raise BuildError("a build request with an accuracy gate needs its check_gate (build_engine passes it)")
    model_cfg, build, io, portable = portable_graph(ckpt_dir, req.build)
    from .embedding import shared_int8_embedding
    from .huge_pages import ARENA_LAYOUT
    from .kernel_library import WEIGHT_OPS, library_path
    from .lowering import lower_for_onnxruntime
    from .native import fuse_swiglu, lower_to_native, native_supports
    from .native_linear import LinearSimd, cpu_linear_simd, native_linears, weight_arena_layout
    from .weights import (
        hand_activations_to_kernel,
        integer_gemms_per_token,
        offset_linears,
        reblock_int8_weights,
        unsigned_static_int8_weights,
    )

    # What the engine holds is recorded: a fallback here is written into its runtime config.
    if build.cpu_attention is CpuAttention.NATIVE and native_supports(portable, build.kv_block_size) is not None:
        build = replace(build, cpu_attention=CpuAttention.LOWERED)
    if build.cpu_linear is CpuLinear.NATIVE and cpu_linear_simd() is LinearSimd.NONE:
        build = replace(build, cpu_linear=CpuLinear.ONNXRUNTIME)
    if build.cpu_attention is CpuAttention.NATIVE:
        lowered = lower_to_native(portable)
    else:
        lowered = lower_for_onnxruntime(portable, io)
    engine = shared_int8_embedding(hand_activations_to_kernel(lowered))
    if build.cpu_linear is CpuLinear.NATIVE:
        engine = native_linears(engine)
        if not any((n.domain, n.op_type) in WEIGHT_OPS for n in engine.graph.node):  # a float model: nothing to run
            build = replace(build, cpu_linear=CpuLinear.ONNXRUNTIME)
    if model_cfg.quantization is not None:  # GGUF Q4_1 linears QLinear did not take
        engine = offset_linears(engine, model_cfg.quantization.group_size)
    if build.uses_native_cpu_library:
        try:
            library_path()  # compiled now, so that a machine without a compiler fails here rather than at run time
        except EngineError as e:
            raise BuildError(str(e)) from None
    native = build.uses_native_cpu_library  # the engine loads the native library: its row ops too
    if native:
        engine = fuse_swiglu(engine)
    engine = reblock_int8_weights(unsigned_static_int8_weights(integer_gemms_per_token(engine, native)))
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
        if build.uses_native_cpu_library:  # the runtime's huge-page arena, readable without onnx
            layout = weight_arena_layout(onnx.load(str(path), load_external_data=False))
            text = json.dumps({"tensors": [asdict(t) for t in layout]}, indent=1)
            path.with_name(ARENA_LAYOUT).write_text(text + "\n")
        RuntimeConfig(model=model_cfg, build=build, engine_file=ORT_ENGINE, io=io).save(tmp)
        copy_tokenizer_files(ckpt_dir, tmp)
        gate_result = None
        if gate is not None:
            gate_result = req.check_gate(tmp, gate)
        write_manifest(
            tmp,
            backend=build.backend.value,
            target=cpu_target(),
            build_options=to_dict(build),
            checkpoint=checkpoint_digests(ckpt_dir),
            graph={"portable_op_counts": portable_counts, "engine_op_counts": engine_counts},
            **({"accuracy_gate": gate_result} if gate_result is not None else {}),
        )
    return BuildResult(engine_dir, portable_counts, engine_counts, time.perf_counter() - req.start, gate_result)
