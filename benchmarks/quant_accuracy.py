"""Perplexity, engine size and calibration time of each quantization variant of SmolLM2-135M, against float32.

    python benchmarks/quant_accuracy.py [--work DIR] [--variants NAME ...] [--windows 8] [--seq-len 512]
        [--calib-size 16] [--calib-seq-len 256]

Converts the SmolLM2 GGUF once (float32: the reference), then for each variant runs ``trtbuild quantize`` (the
library call), ``build`` and ``eval`` (lee_news evaluation split, the calibration split is disjoint), and prints one
table row: perplexity, increase over float32 in percent, the issue's target, calibration seconds (modelopt alone)
and engine MiB. Checkpoints and engines stay under ``--work`` (default ``artifacts/quant``); a variant whose engine
exists there is evaluated again, not rebuilt, so delete it after changing the code. The engines are what
``benchmarks/quant_formats.py`` times. Calibrate on a quiet machine: torch slows down many times when its threads
share the cores with other jobs. Not a test: numbers for the notes (the slow tests gate on them).
"""

from __future__ import annotations

import argparse
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trtbuild.build import build_engine
from trtbuild.cli.eval import evaluate
from trtbuild.config import BuildConfig, DType, EvalConfig, KVCacheDType, QFormat, QuantConfig

DOWN_FLOAT = ["lm_head", "layers.*.mlp.down"]


@dataclass(frozen=True)
class Variant:
    fields: dict[str, Any]
    target: float | None = None  # the bound on the perplexity increase, in percent
    calib: dict[str, int] = field(default_factory=dict)  # overrides --calib-size / --calib-seq-len


AWQ_CALIB = {"calib_size": 4, "calib_seq_len": 256}  # AWQ-full's searches: minutes per 1k tokens on 2 cores
VARIANTS: dict[str, Variant] = {
    "int8_wo": Variant({"qformat": QFormat.INT8_WO}, 0.5),
    "int8_wo+head": Variant({"qformat": QFormat.INT8_WO, "exclude": []}, 0.5),
    "int8_wo+kv_int8": Variant({"qformat": QFormat.INT8_WO, "kv_cache_dtype": KVCacheDType.INT8}),
    "int8_sq": Variant({"qformat": QFormat.INT8_SQ}, 1.0),
    "int8_sq_down_float": Variant({"qformat": QFormat.INT8_SQ, "exclude": DOWN_FLOAT}, 1.0),
    "int8_sq_down_float+head": Variant({"qformat": QFormat.INT8_SQ, "exclude": DOWN_FLOAT[1:]}, 1.0),
    "fp8": Variant({"qformat": QFormat.FP8}, 1.0),
    "int4_wo_g128": Variant({"qformat": QFormat.INT4_WO, "group_size": 128}),
    "int4_awq_g128": Variant({"qformat": QFormat.INT4_AWQ, "group_size": 128}, 4.0, AWQ_CALIB),
    "int4_awq_g128+head": Variant({"qformat": QFormat.INT4_AWQ, "group_size": 128, "exclude": []}, 4.0, AWQ_CALIB),
}
BUILD = BuildConfig(max_seq_len=2048, max_batch_size=16)


def dir_mib(path: Path) -> float:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=Path("artifacts/quant"))
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS), metavar="NAME")
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--calib-size", type=int, default=16)
    parser.add_argument("--calib-seq-len", type=int, default=256)
    args = parser.parse_args()

    from trtbuild.convert.convert import convert
    from trtbuild.demo import smollm2_gguf_path
    from trtbuild.quantize.quantize import quantize

    ckpt, ref = args.work / "fp32-ckpt", args.work / "fp32"
    if not ref.is_dir():
        convert(smollm2_gguf_path(), ckpt, DType.FLOAT32, dequantize=True, overwrite=True)
        build_engine(ckpt, ref, BUILD, overwrite=True)
    ecfg = EvalConfig(dataset="lee_news", windows=args.windows, seq_len=args.seq_len)
    base = evaluate(ref, ecfg).perplexity
    print(f"{'variant':22s} {'ppl':>8s} {'vs fp32':>8s} {'target':>7s} {'calib s':>8s} {'calib':>7s} {'MiB':>6s}")
    print(f"{'fp32':22s} {base:8.3f} {'':>8s} {'':>7s} {'':>8s} {'':>7s} {dir_mib(ref):6.0f}", flush=True)
    for name in args.variants:
        variant = VARIANTS[name]
        calib = {"calib_size": args.calib_size, "calib_seq_len": args.calib_seq_len, **variant.calib}
        qckpt, engine = args.work / f"{name}-ckpt", args.work / name
        seconds, shape = float("nan"), "cached"
        if not engine.is_dir():
            shutil.rmtree(qckpt, ignore_errors=True)
            start = time.perf_counter()
            result = quantize(ckpt, qckpt, QuantConfig(**variant.fields, **calib), progress=False)
            if result.calib_samples:  # modelopt's calibration alone
                seconds, shape = result.calib_seconds, f"{calib['calib_size']}x{calib['calib_seq_len']}"
            else:  # weight-only round to nearest reads no data: the whole quantize stage
                seconds, shape = time.perf_counter() - start, "weights"
            build_engine(qckpt, engine, BUILD)
        ppl = evaluate(engine, ecfg).perplexity
        target = f"{variant.target:.1f}%" if variant.target is not None else ""
        print(
            f"{name:22s} {ppl:8.3f} {100 * (ppl / base - 1):+7.2f}% {target:>7s} {seconds:8.1f} {shape:>7s} "
            f"{dir_mib(engine):6.0f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
