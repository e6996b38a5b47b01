"""The torch engine on the CPU against the onnxruntime engine of the same SmolLM2 checkpoint, in one process.

    .venv/bin/python benchmarks/torch_cpu.py [--work DIR] [--rounds 3] [--tokens 32] [--prompt-tokens 64]
        [--threads 2]

Builds (once, under ``--work``) SmolLM2-135M-Instruct fp32 as an onnxruntime engine and as torch engines of both
runtimes (torch-compile; AOTInductor), or of a weight-only quantized copy (``--qformat``), opens each (and any
``--engine NAME=DIR`` given, e.g. one built by another commit), and times batch-1 greedy decode through ``LLM`` (a
``--prompt-tokens`` prompt: the context each step reads; ``--tokens`` new tokens, EOS ignored) in interleaved rounds
so background load hits every engine alike; prints each engine's median ms a token and its ratio to the onnxruntime
engine (issue 34's CPU target: torch decode at >= 0.5x onnxruntime's speed), plus the torch engines' open times.
``--max-autotune`` builds the torch engines with it (C++ GEMM micro-kernels on prepacked weights: minutes more at
build / every open). ``--profile`` adds torch's profiler table of one torch-compile decode step (where its time
goes). Results: benchmarks/results/2026-12-04-cpu2-torch-backend.md, 2026-12-05-cpu2-torch-cpu.md,
2026-12-05-cpu2-aoti-decode-program.md, 2026-12-05-cpu2-int4-row-products.md, 2026-12-05-cpu2-dynamo-guards.md,
2026-12-05-cpu2-attention-threads.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def build_engines(work: Path, max_autotune: bool, qformat: str | None) -> dict[str, Path]:
    from trtbuild.build import build_engine
    from trtbuild.config import (
        Backend,
        BuildConfig,
        DType,
        QFormat,
        QuantConfig,
        TorchConfig,
        TorchDevice,
        TorchRuntime,
    )
    from trtbuild.convert.convert import convert
    from trtbuild.demo import smollm2_gguf_path
    from trtbuild.quantize.quantize import quantize

    ckpt = work / "smollm2-ckpt"
    if not (ckpt / "config.json").is_file():
        convert(smollm2_gguf_path(), ckpt, DType.FLOAT32, dequantize=True, overwrite=True)
    suffix = f"-{qformat}" if qformat else ""
    if qformat == "gguf":  # the GGUF file's own blocks, as ``trtbuild convert`` keeps them (Q4_1, Q8_0 embedding)
        ckpt = work / "smollm2-gguf"
        if not (ckpt / "config.json").is_file():
            convert(smollm2_gguf_path(), ckpt, overwrite=True)
    elif qformat:  # weight-only: round to nearest, no calibration text
        float_ckpt, ckpt = ckpt, work / f"smollm2{suffix}"
        if not (ckpt / "config.json").is_file():
            quantize(float_ckpt, ckpt, QuantConfig(QFormat(qformat)), overwrite=True, progress=False)
    engines = {"onnxruntime": work / f"ort{suffix}"}
    build = BuildConfig(max_seq_len=512)
    if not (engines["onnxruntime"] / "manifest.json").is_file():
        build_engine(ckpt, engines["onnxruntime"], build, overwrite=True)
    for runtime in TorchRuntime:
        tag = f"{runtime.value}{'-max-autotune' if max_autotune else ''}{suffix}"
        engine = engines[f"torch/{tag}"] = work / f"torch-{tag}"
        if not (engine / "manifest.json").is_file():
            cfg = TorchConfig(device=TorchDevice.CPU, torch_runtime=runtime, max_autotune=max_autotune)
            build_engine(ckpt, engine, BuildConfig(backend=Backend.TORCH, max_seq_len=512), overwrite=True, torch=cfg)
    return engines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=Path("artifacts/torch_cpu"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=64, help="prompt length (the context decode reads)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--profile", action="store_true", help="torch's profiler table of one decode step")
    parser.add_argument(
        "--max-autotune", action="store_true", help="torch engines built with --max-autotune (minutes to build/open)"
    )
    parser.add_argument(
        "--qformat",
        choices=["int8_wo", "int4_wo", "gguf"],
        default=None,
        help="a weight-only SmolLM2, or the GGUF file's own Q4_1 / Q8_0 blocks (gguf) (default: float32)",
    )
    parser.add_argument(
        "--engine", action="append", default=[], metavar="NAME=DIR", help="also time this engine (repeatable)"
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    # First, before the build step imports torch: the torch session module sets torch's OpenMP spin as a process
    # that opens a torch engine gets it (read when OpenMP starts; without it a loaded machine measured 4x slower).
    import trtbuild.backends.torch.session  # noqa: F401
    from trtbuild.runtime.llm import LLM, SamplingParams

    engines = build_engines(args.work, args.max_autotune, args.qformat)
    engines.update((name, Path(directory)) for name, directory in (e.split("=", 1) for e in args.engine))
    llms, opened = {}, {}
    for name, engine in engines.items():
        t = time.perf_counter()
        llms[name] = LLM(engine, num_threads=args.threads)
        opened[name] = round(time.perf_counter() - t, 1)
    prompt = list(range(100, 100 + args.prompt_tokens))
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    for llm in llms.values():  # warm-up
        llm.generate([prompt], params)
    ms: dict[str, list[float]] = {name: [] for name in llms}
    tokens: dict[str, list[int]] = {}
    for _ in range(args.rounds):
        for name, llm in llms.items():
            out = llm.generate([prompt], params)[0]
            ms[name].append(1e3 / out.metrics.decode_tokens_per_s)
            tokens[name] = out.token_ids
    medians = {name: statistics.median(v) for name, v in ms.items()}
    ort = medians["onnxruntime"]
    print(f"{'engine':28} {'ms/token':>9} {'speed vs onnxruntime':>21} {'open s':>7}  same tokens")
    for name, value in medians.items():
        same = tokens[name] == tokens["onnxruntime"]
        print(f"{name:28} {value:9.2f} {ort / value:20.2f}x {opened[name]:7.1f}  {same}")
    if args.profile:
        profile_step(next(llm for name, llm in llms.items() if "torch-compile" in name), prompt)
    if args.json:
        figures = {"ms_per_token": medians, "rounds": ms, "open_s": opened, "threads": args.threads,
                   "max_autotune": args.max_autotune, "qformat": args.qformat,
                   "prompt_tokens": args.prompt_tokens}  # fmt: skip
        args.json.write_text(json.dumps(figures, indent=2) + "\n")


def profile_step(llm: object, prompt: list[int]) -> None:
    """torch's profiler over a few decode steps of the torch-compile engine (self CPU time per op)."""
    import torch

    from trtbuild.runtime.llm import SamplingParams

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))  # type: ignore[attr-defined]
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()
