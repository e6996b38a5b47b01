"""Perplexity of what `trtbuild quantize` makes by default, with the LM head quantized (the default since 2026-12-04)
and kept in float, and of the shipped recipes' TensorRT formats, on SmolLM2-135M.

    .venv/bin/python benchmarks/default_formats.py [--work artifacts/peers] [--variants NAME,...]
        [--datasets flask_docs,lee_news] [--windows 8] [--seq-len 512] [--json out.json]

Each variant is a list of ``trtbuild quantize`` flags run by the CLI itself, then ``trtbuild build`` (default
``BuildConfig``) and ``trtbuild eval``; checkpoints and engines are cached under ``--work`` with the names
``benchmarks/vs_peers.py`` gives them (``trt-ckpt-NAME``, ``trt-engine-NAME``), so the engines it timed are the
ones evaluated here (delete them after changing a variant's flags or the code). ``hf-fp32`` (the SmolLM2 GGUF
dequantized to a float32 Hugging Face folder) is made by ``vs_peers.py --prepare-only``, or converted here from
the GGUF. The % column is each variant's perplexity over the fp32 engine's on the same windows. Not a test.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TRTBUILD = str(Path(sys.executable).parent / "trtbuild")
STATIC_64x512 = ["--activation-scales", "static", "--calib-size", "64", "--calib-seq-len", "512"]
# name -> quantize flags (None: the float32 checkpoint itself)
VARIANTS: dict[str, list[str] | None] = {
    "fp32": None,
    "int8_wo": ["--qformat", "int8_wo"],
    "int8_wo+fhead": ["--qformat", "int8_wo", "--exclude", "lm_head"],
    "int8_sq": ["--qformat", "int8_sq"],
    "int8_sq+fhead": ["--qformat", "int8_sq", "--exclude", "lm_head"],
    "fp8": ["--qformat", "fp8"],
    "fp8+fhead": ["--qformat", "fp8", "--exclude", "lm_head"],
    "int4_awq": ["--qformat", "int4_awq"],
    "int4_awq+fhead": ["--qformat", "int4_awq", "--exclude", "lm_head"],
    # recipes/smollm2-int8_sq.yaml's and smollm2-fp8.yaml's TensorRT formats
    "int8_sq_static": ["--qformat", "int8_sq", *STATIC_64x512, "--exclude", "lm_head", "--exclude", "*.mlp.down"],
    "fp8_static": ["--qformat", "fp8", *STATIC_64x512, "--exclude", "lm_head"],
}


def sh(*cmd: str) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"error: {' '.join(cmd[:3])}: {proc.stderr.strip().splitlines()[-1:]}")
    return proc.stdout


def engine_for(work: Path, name: str) -> Path:
    """The engine of variant ``name``, made (convert / quantize / build through the CLI) when missing."""
    engine = work / f"trt-engine-{name}"
    if engine.is_dir():
        return engine
    ckpt = work / "trt-ckpt-fp32"
    if not ckpt.is_dir():
        hf = work / "hf-fp32"
        if hf.is_dir():
            sh(TRTBUILD, "convert", str(hf), "-o", str(ckpt))
        else:
            from trtbuild.demo import smollm2_gguf_path

            sh(TRTBUILD, "convert", str(smollm2_gguf_path()), "-o", str(ckpt), "--dequantize", "--dtype", "float32")
    src = ckpt
    flags = VARIANTS[name]
    if flags is not None:
        src = work / f"trt-ckpt-{name}"
        if not src.is_dir():
            start = time.perf_counter()
            sh(TRTBUILD, "quantize", str(ckpt), "-o", str(src), "--quiet", *flags)
            print(f"[prepare] quantized {name} in {time.perf_counter() - start:.0f}s", file=sys.stderr, flush=True)
    sh(TRTBUILD, "build", str(src), "-o", str(engine))
    return engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=Path("artifacts/peers"))
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"of {','.join(VARIANTS)}")
    parser.add_argument("--datasets", default="flask_docs,lee_news")
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    names = ["fp32", *(v for v in args.variants.split(",") if v and v != "fp32")]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        parser.error(f"--variants: unknown {unknown[0]} (choose from {', '.join(VARIANTS)})")
    datasets = [d for d in args.datasets.split(",") if d]
    args.work.mkdir(parents=True, exist_ok=True)
    from trtbuild.cli.eval import evaluate
    from trtbuild.config import EvalConfig

    rows: dict[str, dict[str, float]] = {}
    print("| variant | quantize flags | " + " | ".join(f"{d} ppl | vs fp32" for d in datasets) + " | engine MB |")
    print("|---|---|" + "---|---|" * len(datasets) + "---|")
    for name in names:
        engine = engine_for(args.work, name)
        rows[name] = {
            d: evaluate(engine, EvalConfig(dataset=d, windows=args.windows, seq_len=args.seq_len)).perplexity
            for d in datasets
        }
        size = sum(p.stat().st_size for p in engine.rglob("*") if p.is_file()) / 1e6
        ppl = rows[name]
        cells = " | ".join(f"{ppl[d]:.3f} | {100 * (ppl[d] / rows['fp32'][d] - 1):+.2f}%" for d in datasets)
        flags = " ".join(VARIANTS[name] or ["(float32)"])
        print(f"| {name} | `{flags}` | {cells} | {size:.0f} |", flush=True)
        rows[name]["engine_mb"] = size
    if args.json:
        meta = {"windows": args.windows, "seq_len": args.seq_len, "date": time.strftime("%Y-%m-%d %H:%M UTC")}
        args.json.write_text(json.dumps({"meta": meta, "variants": VARIANTS, "perplexity": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
