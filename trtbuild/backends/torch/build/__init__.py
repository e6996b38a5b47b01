"""The torch backend's build: the portable graph written as a torch-compile engine (graph + weights) or exported
and compiled into an AOTInductor ``model.pt2`` (``writer.py``, its load check in a child: ``isolate.py``). The
graph import, the custom op and the module files beside this package are shared with the session, which imports
nothing from here."""

from __future__ import annotations

import time

from ....artifacts.atomic import atomic_output_dir
from ....checkpoint.files import copy_tokenizer_files
from ....config import RuntimeConfig, TorchRuntime
from ....configio import to_dict
from ...build_request import BuildRequest, BuildResult, op_counts, portable_graph, write_engine_manifest


def build_engine_dir(req: BuildRequest) -> BuildResult:
    """The torch backend's entry in ``trtbuild.backends.BUILD_MODULES`` (docs/gpu.md): a torch-compile engine, or
    an AOTInductor package checked in a child."""
    from ..target import local_target

    if req.torch.torch_runtime is TorchRuntime.AOT_INDUCTOR:
        local_target(req.torch.device)  # no GPU for --device cuda: one line before any heavy work
    model_cfg, build, io, portable = portable_graph(req.ckpt_dir, req.build)
    from .writer import write_torch_engine

    portable_counts = op_counts(portable)
    with atomic_output_dir(req.engine_dir, overwrite=req.overwrite) as tmp:
        written = write_torch_engine(portable, model_cfg, build, io, req.torch, tmp)
        entry = written.entry
        del portable
        RuntimeConfig(model=model_cfg, build=build, engine_file=entry.path, io=io).save(tmp)
        copy_tokenizer_files(req.ckpt_dir, tmp)
        write_engine_manifest(
            tmp,
            req,
            build,
            target=entry.target,
            graph={"portable_op_counts": portable_counts},
            backend_options={"torch": to_dict(req.torch)},
            engines=[entry.to_dict()],
        )
    seconds = time.perf_counter() - req.start
    return BuildResult(req.engine_dir, portable_counts, {}, seconds, warnings=written.warnings)
