"""trtbuild's int4 calibration (round-to-nearest and AWQ, symmetric or with zero points) next to modelopt's AWQ,
on SmolLM2-135M: calibration time (wall and CPU) and the engine's perplexity on every shipped evaluation text.

    python benchmarks/awq_vs_modelopt.py [--work artifacts/awq] [--group-size 128] [--variants ...] [--windows 8]

Variants: ``rtn`` / ``rtn_zp`` (``int4_wo``), ``awq`` / ``awq_zp`` (``int4_awq``, ``awq.py``), ``modelopt_awq``
(``quantize(..., modelopt_int4=True)``: modelopt's AWQ-lite then its clip search, the path trtbuild used before;
symmetric only). Calibration at the format's defaults (``QuantConfig``) unless ``--calib-size`` /
``--calib-seq-len`` say otherwise. Not a test: the figures for docs/quantization.md (modelopt's AWQ takes 6-9
minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from trtbuild.build import build_engine
from trtbuild.calibration_data import DATASETS
from trtbuild.cli.eval import evaluate
from trtbuild.config import BuildConfig, DType, EvalConfig, QFormat, QuantConfig
from trtbuild.convert.convert import convert
from trtbuild.demo import smollm2_gguf_path
from trtbuild.quantize.quantize import quantize

VARIANTS = {  # name -> (format, zero points, modelopt's calibration)
    "rtn": (QFormat.INT4_WO, False, False),
    "rtn_zp": (QFormat.INT4_WO, True, False),
    "awq": (QFormat.INT4_AWQ, False, False),
    "awq_zp": (QFormat.INT4_AWQ, True, False),
    "modelopt_awq": (QFormat.INT4_AWQ, False, True),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=Path("artifacts/awq"))
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    ap.add_argument("--calib-size", type=int)
    ap.add_argument("--calib-seq-len", type=int)
    ap.add_argument("--windows", type=int, default=8)
    args = ap.parse_args()
    build = BuildConfig(max_seq_len=512, max_batch_size=4)
    work = args.work
    if not (work / "ckpt").is_dir():
        convert(smollm2_gguf_path(), work / "ckpt", DType.FLOAT32, dequantize=True)
    if not (work / "fp32").is_dir():
        build_engine(work / "ckpt", work / "fp32", build)
    texts = sorted(DATASETS)

    def perplexities(engine: Path) -> list[float]:
        return [evaluate(engine, EvalConfig(dataset=t, windows=args.windows, seq_len=512)).perplexity for t in texts]

    ref = perplexities(work / "fp32")
    print(
        "| variant | group | calibration | calib s | CPU s | " + " | ".join(f"{t} ppl (vs fp32)" for t in texts) + " |"
    )
    print("|---|---|---|---|---|" + "---|" * len(texts))
    print("| fp32 | | | | | " + " | ".join(f"{p:.3f}" for p in ref) + " |", flush=True)
    for name in args.variants:
        qformat, zero_points, modelopt = VARIANTS[name]
        fields = {k: v for k, v in (("calib_size", args.calib_size), ("calib_seq_len", args.calib_seq_len)) if v}
        qcfg = QuantConfig(qformat=qformat, group_size=args.group_size, zero_points=zero_points, **fields)
        out = work / f"{name}_g{args.group_size}"
        cpu = time.process_time()
        result = quantize(work / "ckpt", out / "ckpt", qcfg, overwrite=True, progress=False, modelopt_int4=modelopt)
        cpu = time.process_time() - cpu
        build_engine(out / "ckpt", out / "engine", build, overwrite=True)
        cells = [f"{p:.3f} ({100 * (p / r - 1):+.1f}%)" for p, r in zip(perplexities(out / "engine"), ref, strict=True)]
        calib = f"{qcfg.calib_size} x {qcfg.calib_seq_len}" if qformat is QFormat.INT4_AWQ else "none"
        row = [name, str(args.group_size), calib, f"{result.calib_seconds:.0f}", f"{cpu:.0f}", *cells]
        print("| " + " | ".join(row) + " |", flush=True)


if __name__ == "__main__":
    main()
