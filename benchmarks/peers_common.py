"""What ``vs_peers.py`` and ``quant_vs_llamacpp.py`` share: error lines and the ``Failed`` of a step, inputs made once
under a work folder (``atomic_dir``), the peers' virtualenv that runs ``peers_worker.py`` requests (``Peers``), the
float32 Hugging Face folder of SmolLM2 (``make_hf_folder``), trtbuild engines timed through ``LLM`` (``Trtbuild``)
and the tensors a checkpoint stores (``stored_tensors``)."""

from __future__ import annotations

import gc
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent  # peers_worker.py's folder
# system -> [(pip requirement, module it provides)]: only the --systems measured are installed
PEER_PACKAGES = {
    "ort": [("onnxruntime-genai==0.18.0", "onnxruntime_genai"), ("onnx-ir", "onnx_ir")],
    "llama": [("llama-cpp-python==0.3.36", "llama_cpp")],
}


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


NO_PREPARE = False  # vs_peers.py --no-prepare: use what --work holds, prepare nothing


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


# ---------------------------------------------------------------- the float32 inputs, and trtbuild's engines


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


# ---------------------------------------------------------------- stored tensors


def stored_tensors(path: Path) -> dict[str, tuple[list[int], int, str]]:
    """name -> (shape, bytes, safetensors dtype) of every tensor in the ``*.safetensors`` files of folder ``path``."""
    from safetensors import safe_open

    out = {}
    for file in path.glob("*.safetensors"):
        with safe_open(file, "np") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                t = f.get_slice(key)
                shape = t.get_shape()
                dtype = t.get_dtype()
                out[key] = (shape, math.prod(shape) * np.dtype(safetensors_dtype(dtype)).itemsize, dtype)
    return out


def safetensors_dtype(name: str) -> str:
    """numpy dtype name of a safetensors dtype string (F8_E4M3 has no numpy twin: one byte)."""
    return {"F32": "f4", "F16": "f2", "BF16": "u2", "I8": "i1", "U8": "u1", "I32": "i4", "I64": "i8"}.get(name, "u1")
