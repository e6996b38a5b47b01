"""The TensorRT backend's build: portable graph -> TensorRT lowering (``lowering.py``) -> one engine per GPU arch
(``engines.py``; docs/tensorrt.md). The session (``..session``) imports nothing from this package."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import onnx

from ....artifacts.atomic import atomic_output_dir
from ....checkpoint.files import copy_tokenizer_files
from ....config import RuntimeConfig
from ....configio import to_dict
from ...build_request import BuildRequest, BuildResult, op_counts, portable_graph, write_engine_manifest


def build_engine_dir(req: BuildRequest) -> BuildResult:
    """The tensorrt backend's entry in ``trtbuild.backends.BUILD_MODULES``: portable graph -> TensorRT lowering -> one
    engine per GPU arch (see docs/tensorrt.md)."""
    from .engines import build_tensorrt_engines, require_tensorrt

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
            write_engine_manifest(
                tmp,
                req,
                build,
                target=",".join(e.target for e in entries),
                graph={"portable_op_counts": portable_counts},
                backend_options={"tensorrt": to_dict(trt)},
                engines=[e.to_dict() for e in entries],
            )
    return BuildResult(engine_dir, portable_counts, {}, time.perf_counter() - start)
