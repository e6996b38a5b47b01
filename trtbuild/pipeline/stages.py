"""What each stage kind does: convert and build call trtbuild's Python functions in the pipeline's process;
quantize runs the same way in a child process (modelopt patches torch modules and redirects stdout process-wide,
and calibration memory is best returned by exiting); eval runs ``trtbuild eval --json`` in a subprocess.

Every stage writes its artifact atomically (a temporary sibling renamed into place), so a failed or killed stage
leaves either the previous complete artifact or nothing. Child processes log to ``.pipeline/logs/<id>.log`` and
inherit the pipeline's lock, so one that outlives a killed pipeline keeps the next run out until it ends.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..config import (
    Backend,
    BuildConfig,
    DType,
    EvalConfig,
    QuantConfig,
    TensorRTConfig,
    TorchConfig,
    TorchDevice,
    TorchRuntime,
)
from ..configio import from_dict
from ..errors import TrtbuildError
from .plan import Stage, StageKind

CLI = [sys.executable, "-m", "trtbuild.cli"]
CHILD = [sys.executable, "-m", "trtbuild.pipeline.stages"]  # runs one stage function, see ``main``


class StageError(TrtbuildError):
    """A stage failed; the message is one line and names the stage."""


@dataclass(frozen=True)
class StageContext:
    """Where a running stage reads and writes."""

    artifacts_dir: Path
    log: Path  # this stage's log file (subprocess output)
    lock_fd: int | None  # the pipeline lock, inherited by subprocesses so a killed pipeline's children still hold it

    def path(self, stage_id: str) -> Path:
        return self.artifacts_dir / stage_id


def missing_toolchain(stage: Stage) -> str | None:
    """Why ``stage`` cannot run on this machine, or None: a TensorRT build without an importable ``tensorrt``, a
    torch AOTInductor CUDA build without a GPU (its package is compiled for the GPU that builds it; a torch-compile
    engine builds anywhere)."""
    if stage.kind is not StageKind.BUILD:
        return None
    backend = stage.labels.get("backend")
    if backend == Backend.TENSORRT.value:
        try:
            import tensorrt  # noqa: F401
        except ImportError:
            return "TensorRT is not installed on this machine"
    torch_cfg = from_dict(TorchConfig, stage.options["torch"], "torch") if "torch" in stage.options else TorchConfig()
    aot = torch_cfg.torch_runtime is TorchRuntime.AOT_INDUCTOR
    if backend == Backend.TORCH.value and stage.labels.get("target") == TorchDevice.CUDA.value and aot:
        import torch

        if not torch.cuda.is_available():
            return "this machine has no CUDA GPU for torch to compile for"
    return None


def run_stage(stage: Stage, ctx: StageContext) -> dict[str, Any]:
    """Run ``stage``, replacing its artifact; returns facts for its record (eval: the metrics)."""
    return _RUNNERS[stage.kind](stage, ctx)


def _convert(stage: Stage, ctx: StageContext) -> dict[str, Any]:
    from ..convert.convert import convert

    assert stage.source is not None
    # dequantize: a recipe quantizes (or builds float) from float weights, a GGUF source included
    res = convert(stage.source, ctx.path(stage.id), DType(stage.options["dtype"]), dequantize=True, overwrite=True)
    return {"num_tensors": res.num_tensors}


def _quantize(stage: Stage, ctx: StageContext) -> dict[str, Any]:
    request = {"stage": _stage_to_dict(stage), "artifacts_dir": str(ctx.artifacts_dir)}
    stdout = _run_logged([*CHILD, json.dumps(request)], "trtbuild quantize (child process)", stage, ctx)
    return _last_json_object(stdout, stage, ctx)


def _quantize_here(stage: Stage, ctx: StageContext) -> dict[str, Any]:
    from ..quantize.quantize import quantize

    quant = from_dict(QuantConfig, stage.options["quantization"], "quantization")
    res = quantize(ctx.path(stage.deps[0]), ctx.path(stage.id), quant, overwrite=True, progress=False)
    return {"calib_samples": res.calib_samples, "calib_tokens": res.calib_tokens}


def _build(stage: Stage, ctx: StageContext) -> dict[str, Any]:
    from ..build import build_engine

    build = from_dict(BuildConfig, stage.options["build"], "build")
    trt = from_dict(TensorRTConfig, stage.options["tensorrt"], "tensorrt") if "tensorrt" in stage.options else None
    torch = from_dict(TorchConfig, stage.options["torch"], "torch") if "torch" in stage.options else None
    res = build_engine(ctx.path(stage.deps[0]), ctx.path(stage.id), build, overwrite=True, tensorrt=trt, torch=torch)
    return {"portable_op_counts": res.portable_op_counts, "engine_op_counts": res.engine_op_counts}


def _eval(stage: Stage, ctx: StageContext) -> dict[str, Any]:
    cfg = from_dict(EvalConfig, stage.options["eval"], "eval")
    args = [
        "eval",
        str(ctx.path(stage.deps[0])),
        "--json",
        "--dataset",
        cfg.dataset,
        "--windows",
        str(cfg.windows),
        "--seq-len",
        str(cfg.seq_len),
    ]
    metrics = _last_json_object(_run_logged([*CLI, *args], "trtbuild eval", stage, ctx), stage, ctx)
    out = ctx.path(stage.id)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(json.dumps(metrics, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, out)  # atomic: the old results or the new ones, never a torn file
    return {"metrics": metrics}


_RUNNERS = {StageKind.CONVERT: _convert, StageKind.QUANTIZE: _quantize, StageKind.BUILD: _build, StageKind.EVAL: _eval}


def _run_logged(cmd: list[str], what: str, stage: Stage, ctx: StageContext) -> str:
    """Run ``cmd``, stderr and stdout into the stage's log; its stdout, or a one-line ``StageError``."""
    ctx.log.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    with ctx.log.open("w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        pass_fds = () if ctx.lock_fd is None else (ctx.lock_fd,)
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=env, pass_fds=pass_fds)
        log.write(proc.stdout)
    if proc.returncode != 0:
        lines = [ln for ln in ctx.log.read_text().splitlines() if ln.strip()]
        errors = [ln for ln in lines if ln.startswith("error:")]
        detail = (errors or lines or ["no output"])[-1].removeprefix("error: ")
        raise StageError(f"{stage.describe()} failed: {what} exited {proc.returncode}: {detail} (log: {ctx.log})")
    return proc.stdout


def _last_json_object(stdout: str, stage: Stage, ctx: StageContext) -> dict[str, Any]:
    text = stdout.strip()
    start = text.rfind("\n{") + 1 if not text.startswith("{") else 0
    try:
        data = json.loads(text[start:])
    except json.JSONDecodeError:
        raise StageError(f"{stage.describe()}: the stage printed no JSON result (log: {ctx.log})") from None
    if not isinstance(data, dict):
        raise StageError(f"{stage.describe()}: the stage printed {type(data).__name__}, not a JSON object")
    return data


def _stage_to_dict(stage: Stage) -> dict[str, Any]:
    data = asdict(stage)
    data["kind"] = stage.kind.value
    data["source"] = None if stage.source is None else str(stage.source)
    data["data_files"] = [str(p) for p in stage.data_files]
    return data


def _stage_from_dict(data: dict[str, Any]) -> Stage:
    return Stage(
        kind=StageKind(data["kind"]),
        id=data["id"],
        deps=tuple(data["deps"]),
        options=data["options"],
        source=None if data["source"] is None else Path(data["source"]),
        data_files=tuple(Path(p) for p in data["data_files"]),
        labels=data["labels"],
    )


_IN_CHILD = {StageKind.QUANTIZE: _quantize_here}


def main(argv: list[str]) -> int:
    """Child process: ``python -m trtbuild.pipeline.stages REQUEST_JSON`` runs one stage, prints its facts."""
    request = json.loads(argv[0])
    stage = _stage_from_dict(request["stage"])
    ctx = StageContext(Path(request["artifacts_dir"]), Path(os.devnull), None)
    try:
        facts = _IN_CHILD[stage.kind](stage, ctx)
    except TrtbuildError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(facts, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
