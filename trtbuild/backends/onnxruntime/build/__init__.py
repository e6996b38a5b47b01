"""The onnxruntime backend's build: portable graph -> ``passes.PASSES`` -> ``engines/onnxruntime-cpu/model.onnx``.

The passes (``passes.py``, each in its own module with its contract): attention as the native kernel
(``native.py``) or as standard ops (``lowering.py``), quantized linears restated for onnxruntime's kernels
(``weights.py``) or the native ``QLinear`` (``native_linear.py``), the tied int8 embedding (``embedding.py``);
what they share to edit a graph is ``graph_edit.py``. Nothing in the session (``..session``) imports this package.
"""

from __future__ import annotations

import time

import onnx

from ....artifacts.atomic import atomic_output_dir
from ....artifacts.manifest import cpu_target
from ....checkpoint.files import copy_tokenizer_files
from ....config import RuntimeConfig
from ....errors import BuildError, EngineError
from ....kernels.library import library_path
from ...build_request import BuildRequest, BuildResult, op_counts, portable_graph, write_engine_manifest
from ..huge_pages import write_arena_layout
from .passes import Target, run_passes, settle_options

ORT_ENGINE = "engines/onnxruntime-cpu/model.onnx"


def build_engine_dir(req: BuildRequest) -> BuildResult:
    """The onnxruntime backend's entry in ``trtbuild.backends.BUILD_MODULES``: portable graph -> ``PASSES`` ->
    ``engines/onnxruntime-cpu/model.onnx``.

    With ``req.gate`` the finished engine is checked (``req.check_gate``) before the directory is moved into place.
    """
    ckpt_dir, engine_dir, gate = req.ckpt_dir, req.engine_dir, req.gate
    if gate is not None and not (gate.ref_engine / "runtime_config.json").is_file():
        raise BuildError(f"--accuracy-gate {gate.ref_engine}: not an engine directory (no runtime_config.json)")
    if gate is not None and req.check_gate is None:
        raise BuildError("a build request with an accuracy gate needs its check_gate (build_engine passes it)")
    model_cfg, build, io, portable = portable_graph(ckpt_dir, req.build)
    # What the engine holds is recorded: a fallback here is written into its runtime config.
    build = settle_options(portable, build)
    engine, build = run_passes(portable, Target(build, model_cfg, io))
    if build.uses_native_cpu_library:
        try:
            library_path()  # compiled now, so that a machine without a compiler fails here rather than at run time
        except EngineError as e:
            raise BuildError(str(e)) from None
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
            write_arena_layout(path)
        RuntimeConfig(model=model_cfg, build=build, engine_file=ORT_ENGINE, io=io).save(tmp)
        copy_tokenizer_files(ckpt_dir, tmp)
        gate_result = None
        if gate is not None:
            gate_result = req.check_gate(tmp, gate)
        write_engine_manifest(
            tmp,
            req,
            build,
            target=cpu_target(),
            graph={"portable_op_counts": portable_counts, "engine_op_counts": engine_counts},
            **({"accuracy_gate": gate_result} if gate_result is not None else {}),
        )
    return BuildResult(engine_dir, portable_counts, engine_counts, time.perf_counter() - req.start, gate_result)
