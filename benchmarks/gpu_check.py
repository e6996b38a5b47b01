"""The torch backend on a CUDA GPU: its speed against transformers on the same weights, one JSON line each.

Run on the GPU machine (docs/gpu.md), from the repository root, with no network and no venv::

    python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/site .
    PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 python3 benchmarks/gpu_check.py

Its correctness counterpart is a test: ``tests/test_gpu_torch_backend.py`` (``pytest -m gpu``); the engines of both
are built by ``tests/gpu_engines.py``.

Every case runs in a child process of its own (``python -X faulthandler``,
``trtbuild.backends.torch.build.isolate``): loading compiled code, capturing CUDA graphs and launching custom
kernels can kill a process, and then the case is one JSON line (``"ok": false, "rc": -11, "trace": [...]``) and the
run goes on. A case starts only if its estimate fits what is left of ``--budget`` seconds (default 450): ~130 s
for one that builds a 1B engine no earlier case built, ~60 s for the others (``Case.estimate_s``, from the H200's
run of 2026-12-04); one that does not fit is skipped (a JSON line says so) and the next is tried. Each child has
``--case-timeout`` seconds. The last lines
are a summary table and a ``summary`` JSON line. With ``$OUT`` set, the lines also go to ``$OUT/gpu_check.jsonl``.
``--device cpu`` runs every case's code on the CPU with a tiny model (how the script is checked without a GPU; its
figures mean nothing).

Cases (``<runtime>`` is ``torch-compile`` or ``aot-inductor``; an AOTInductor build whose package does not run in
its child-process check falls back to torch-compile, and the line says so in ``runtime`` and ``warnings``):
- ``environment``: versions, the GPU, ``nvcc`` and the Inductor cache.
- ``speed/...``: a random model of Llama-3.2-1B shape in bfloat16 (saved once by ``speed/model``, read by each
  later case): the weight-read ceiling (weight bytes / measured device-copy bandwidth); batch-1 decode tok/s of
  engine steps with and without CUDA graphs per runtime (with the engine's load / compile time); through ``LLM``
  (device sampling, greedy and top-p); 64 requests x 512 prompt / 128 new tokens output tok/s and the TTFT of a
  2,048-token prompt; transformers on the same weights (eager ``generate`` at batch 1 and a padded batch of 64,
  its 2,048-token prefill, and its static-cache ``torch.compile`` path); the KV pool ``LLM`` sizes by itself;
  int8 / int4 weight-only engines of the same weights at batch 1 (target: not slower than bf16; their one-row
  products fused with the dequantization, the GPU's default ``RowProducts.QUANTIZED``); last, batch-1 decode with
  every one-row product fused (``*_row_products``: ``RowProducts.ALL``, the CPU's default) for bf16, and the
  quantized engines with matmuls (``*_matmuls``: ``RowProducts.NONE``), to settle the GPU's default.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # gpu_engines: shared with the GPU tests
from gpu_engines import TINY, convert_and_build, engine_name, make_hf, quantize_checkpoint, step_batch

START = time.perf_counter()
DEVICE = "cuda"  # --device cpu runs the cases on the CPU with a tiny model (to check this script without a GPU)

LLAMA_1B = dict(
    model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
    num_key_value_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=4096, rms_norm_eps=1e-5,
    rope_theta=500000.0, tie_word_embeddings=True, initializer_range=0.02,
)  # fmt: skip
SPEED_BUILD = dict(max_batch_size=64, max_seq_len=2560, max_num_tokens=2048)


# --------------------------------------------------------------------------------------------- cases


def case_environment(work: Path) -> dict[str, Any]:
    import shutil

    import torch
    import transformers

    info: dict[str, Any] = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError as e:
        info["triton"] = f"missing ({e})"
    info["transformers"] = transformers.__version__
    info["cuda_available"] = torch.cuda.is_available()
    from torch.utils import cpp_extension

    from trtbuild.backends.torch.runners import inductor_cache_dir

    info["nvcc"] = shutil.which("nvcc")
    info["cuda_home_found_by_torch"] = cpp_extension.CUDA_HOME
    info["inductor_cache"] = str(inductor_cache_dir())
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["capability"] = list(torch.cuda.get_device_capability(0))
    return info


def sync() -> None:
    import torch

    if DEVICE == "cuda":
        torch.cuda.synchronize()


def wall(fn: Callable[[], Any], iters: int = 1) -> float:
    """Seconds per call of ``fn`` (synchronized wall clock)."""
    sync()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    return (time.perf_counter() - t) / iters


def hf_1b(work: Path) -> Any:
    """The saved Llama-3.2-1B-shaped model, on the device, bfloat16."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(work / "1b-hf"), dtype=torch.bfloat16, attn_implementation="sdpa")
    return model.to(DEVICE).eval()


def tag_1b(qformat: str | None) -> str:
    """The 1B checkpoint's and engine's name prefix under the work folder: ``1b``, ``1b-int8_wo`` ..."""
    return "1b" if qformat is None else f"1b-{qformat}"


def build_1b(work: Path, runtime: str = "torch-compile", qformat: str | None = None) -> dict[str, Any]:
    tag = tag_1b(qformat)
    if qformat is None:
        return convert_and_build(work / "1b-hf", work, tag, "bfloat16", DEVICE, runtime, "bfloat16", **SPEED_BUILD)
    qckpt = work / f"{tag}-ckpt"
    if not qckpt.exists():
        build_1b(work)  # the bf16 checkpoint
        quantize_checkpoint(work / "1b-ckpt", qckpt, qformat)
    return convert_and_build(work, work, tag, "bfloat16", DEVICE, runtime, ckpt=qckpt, **SPEED_BUILD)


def speed_model(work: Path) -> dict[str, Any]:
    import torch

    t = time.perf_counter()
    model = make_hf(LLAMA_1B, work / "1b-hf", torch.bfloat16, DEVICE)
    return {"params": sum(p.numel() for p in model.parameters()), "make_s": round(time.perf_counter() - t, 1),
            "weight_bytes": weight_bytes(work)}  # fmt: skip


def weight_bytes(work: Path) -> int:
    return sum(p.stat().st_size for p in (work / "1b-hf").glob("*.safetensors"))


def speed_ceiling(work: Path) -> dict[str, Any]:
    import torch

    src = torch.empty(1 << 30, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    dst.copy_(src)
    seconds = wall(lambda: dst.copy_(src), iters=20)
    bandwidth = 2 * src.numel() / seconds  # bytes read + written per second
    return {"weight_bytes": weight_bytes(work), "copy_bandwidth_GBps": round(bandwidth / 1e9, 1),
            "ceiling_tok_s": round(bandwidth / weight_bytes(work), 1)}  # fmt: skip


def speed_engine_decode_b1(
    work: Path, runtime: str, graphs: bool, qformat: str | None = None, row_products: str | None = None
) -> dict[str, Any]:
    """Batch-1 decode steps at context 128-264, as the runner takes them: logits left on the device, the greedy
    token read back (one sync a step), the next step's token fed from it. ``row_products``: a ``RowProducts``
    value (which one-row products are fused reductions, dequantization included) or None: the session's default."""
    import torch

    from trtbuild.backends.torch.row_products import RowProducts
    from trtbuild.backends.torch.session import TorchSession

    built = build_1b(work, runtime, qformat)
    rows = None if row_products is None else RowProducts(row_products)
    session = TorchSession(
        built["engine"], kv_cache_memory=2 << 30, decode_batch_sizes=None if graphs else [], row_products=rows
    )
    prompt = list(range(1, 129))
    table = list(range(1, 1 + (128 + 200) // 16 + 1))
    token = int(session.step_logits(step_batch([prompt], [0], [table])).argmax(-1)[0])
    pos = 128
    for _ in range(8):  # warm-up (captures the graph)
        token = int(session.step_logits(step_batch([[token]], [pos], [table])).argmax(-1)[0])
        pos += 1
    n = 128
    t = time.perf_counter()
    for _ in range(n):
        logits = session.step_logits(step_batch([[token]], [pos], [table]))
        token = int(logits.argmax(-1)[0])
        pos += 1
    seconds = time.perf_counter() - t
    module = getattr(session._runner, "_orig_mod", None)  # a compiled PortableModule (an AOTInductor runner: none)
    return {"decode_b1_tok_s": round(n / seconds, 1), "step_ms": round(1e3 * seconds / n, 3),
            "cuda_graphs": session._decode.replaying,
            "row_products": getattr(module, "row_products", RowProducts.NONE).value,
            "finite": bool(torch.isfinite(logits).all()), "load_s": round(session.load_seconds, 1),
            **{k: v for k, v in built.items() if k not in ("ckpt", "engine")}}  # fmt: skip


def speed_llm_decode_b1(work: Path) -> dict[str, Any]:
    """Batch-1 decode through ``LLM`` (scheduler, device sampling, no detokenizer): what a user gets."""
    import numpy as np

    from trtbuild.runtime.llm import LLM, SamplingParams

    llm = LLM(build_1b(work)["engine"], kv_cache_memory=2 << 30)
    rng = np.random.default_rng(1)
    params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    llm.generate([rng.integers(1, 128000, 128).tolist()], params)  # warm-up
    out = llm.generate([rng.integers(1, 128000, 128).tolist()], params)[0]
    sampled = llm.generate([rng.integers(1, 128000, 128).tolist()], SamplingParams(
        temperature=0.8, top_p=0.9, top_k=50, max_tokens=128, ignore_eos=True, seed=0))[0]  # fmt: skip
    return {"greedy_decode_b1_tok_s": round(out.metrics.decode_tokens_per_s, 1),
            "top_p_decode_b1_tok_s": round(sampled.metrics.decode_tokens_per_s, 1),
            "sampler": type(llm.sampler).__name__}  # fmt: skip


def speed_engine_llm(work: Path) -> dict[str, Any]:
    """64 requests x 512 prompt / 128 new tokens through ``LLM``; then the TTFT of one 2,048-token prompt."""
    import numpy as np

    from trtbuild.runtime.llm import LLM, SamplingParams

    llm = LLM(build_1b(work)["engine"], kv_cache_memory=8 << 30)
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    # warm-up as the timed run: every padded decode size (up to 64) is captured as a CUDA graph on its first use,
    # and a 4-request warm-up left sizes 8-64 to be captured inside the timed run
    llm.generate([rng.integers(1, 128000, 512).tolist() for _ in range(64)], params)
    prompts = [rng.integers(1, 128000, 512).tolist() for _ in range(64)]
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - t
    tokens = sum(len(o.token_ids) for o in outs)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    llm.generate([rng.integers(1, 128000, 2048).tolist()], one)  # warm-up at that size
    ttfts = []
    for _ in range(3):  # other random tokens each time: no prefix-cache hit
        long_prompt = rng.integers(1, 128000, 2048).tolist()
        t = time.perf_counter()
        llm.generate([long_prompt], one)
        ttfts.append(time.perf_counter() - t)
    return {"requests": 64, "output_tok_s": round(tokens / seconds, 1), "wall_s": round(seconds, 2),
            "ttft_2048_ms": round(1e3 * sorted(ttfts)[1], 1)}  # fmt: skip


def _hf_decode(model: Any, batch: int, prompt_len: int, compiled: bool) -> tuple[float, float, float]:
    """(decode tok/s per sequence-step, total output tok/s, prefill seconds) of transformers' greedy generate.

    Every timed ``generate`` has the same prompt and 65 new tokens, so the static cache keeps one length and the
    compiled path does not recompile; the prefill (a plain forward of the prompt) is subtracted for decode."""
    import torch

    ids = torch.randint(1, 128000, (batch, prompt_len), device=DEVICE)
    kwargs: dict[str, Any] = {"do_sample": False, "attention_mask": torch.ones_like(ids)}
    if compiled:
        kwargs["cache_implementation"] = "static"
    else:
        kwargs["disable_compile"] = True

    def gen() -> Any:
        with torch.no_grad():
            return model.generate(ids, max_new_tokens=65, min_new_tokens=65, **kwargs)

    def prefill() -> Any:
        with torch.no_grad():
            return model(ids, use_cache=False, logits_to_keep=1)

    gen()  # warm-up (compiles on the static-cache path)
    full = min(wall(gen) for _ in range(2))
    first = min(wall(prefill) for _ in range(3))
    return 64 / max(full - first, 1e-9), batch * 65 / full, first


def speed_hf_eager(work: Path) -> dict[str, Any]:
    model = hf_1b(work)
    b1, _, _ = _hf_decode(model, 1, 128, compiled=False)
    _, out64, _ = _hf_decode(model, 64, 512, compiled=False)
    import torch

    ids = torch.randint(1, 128000, (1, 2048), device=DEVICE)
    with torch.no_grad():
        model(ids, use_cache=False, logits_to_keep=1)
        prefill = min(wall(lambda: model(ids, use_cache=False, logits_to_keep=1)) for _ in range(3))
    return {"decode_b1_tok_s": round(b1, 1), "batch64_output_tok_s": round(out64, 1),
            "prefill_2048_ms": round(1e3 * prefill, 1)}  # fmt: skip


def speed_hf_static_compiled(work: Path) -> dict[str, Any]:
    b1, _, _ = _hf_decode(hf_1b(work), 1, 128, compiled=True)
    return {"decode_b1_tok_s": round(b1, 1)}


def speed_default_kv_pool(work: Path) -> dict[str, Any]:
    """The KV pool ``LLM(engine)`` sizes by itself on this GPU (90% of the free memory less one step)."""
    import torch

    from trtbuild.runtime.llm import LLM

    llm = LLM(build_1b(work)["engine"])
    free, total = torch.cuda.mem_get_info()
    return {"kv_cache_GiB": round(llm.session.kv_cache_memory / 2**30, 2), "blocks": llm.num_kv_blocks,
            "free_after_GiB": round(free / 2**30, 2), "total_GiB": round(total / 2**30, 2)}  # fmt: skip


# --------------------------------------------------------------------------------------------- the run


# What a case takes on the H200 (2026-12-04 run 1, cold Inductor cache): one that first builds and compiles its 1B
# engine 108-122 s; one that opens an engine an earlier case built, or runs transformers, 30-63 s.
BUILD_S, CASE_S = 130.0, 60.0


@dataclass(frozen=True)
class Case:
    """A case: what it runs, and the 1B engine directory (under the work folder) it builds when no earlier case
    has (None: it builds none). The parent starts it only when its estimate fits the budget left."""

    run: Callable[[Path], dict[str, Any]]
    engine: str | None = None

    def estimate_s(self, work: Path) -> float:
        return BUILD_S if self.engine is not None and not (work / self.engine).exists() else CASE_S


def engine_dir(runtime: str, qformat: str | None = None) -> str:
    """The 1B engine directory ``build_1b`` writes (its tags, ``gpu_engines.engine_name``)."""
    return engine_name(tag_1b(qformat), runtime)


def cases() -> dict[str, Case]:
    """Name -> case, in the order they run: the speed cases by importance (the figures no run has produced yet),
    the AOTInductor 1B build last (minutes)."""
    bf16 = engine_dir("torch-compile")
    out: dict[str, Case] = {"environment": Case(case_environment)}
    out["speed/model"] = Case(speed_model)
    if DEVICE == "cuda":
        out["speed/weight_read_ceiling"] = Case(speed_ceiling)
    out["speed/engine_decode_b1/torch-compile"] = Case(lambda w: speed_engine_decode_b1(w, "torch-compile", True), bf16)
    out["speed/engine_decode_b1_no_graphs/torch-compile"] = Case(
        lambda w: speed_engine_decode_b1(w, "torch-compile", False), bf16
    )
    out["speed/transformers_eager"] = Case(speed_hf_eager)
    out["speed/engine_64x512x128_and_ttft"] = Case(speed_engine_llm, bf16)
    out["speed/transformers_static_compiled"] = Case(speed_hf_static_compiled)
    for qformat in ("int8_wo", "int4_wo"):
        out[f"speed/quantized_decode_b1/{qformat}"] = Case(
            lambda w, q=qformat: speed_engine_decode_b1(w, "torch-compile", True, q),
            engine_dir("torch-compile", qformat),
        )
    out["speed/llm_decode_b1"] = Case(speed_llm_decode_b1, bf16)
    if DEVICE == "cuda":
        out["speed/default_kv_pool"] = Case(speed_default_kv_pool, bf16)
    out["speed/engine_decode_b1/aot-inductor"] = Case(
        lambda w: speed_engine_decode_b1(w, "aot-inductor", True), engine_dir("aot-inductor")
    )
    # one-row products as fused reductions: every weight's (the CPU's default) vs the GPU default's quantized ones
    out["speed/engine_decode_b1_row_products/torch-compile"] = Case(
        lambda w: speed_engine_decode_b1(w, "torch-compile", True, row_products="all"), bf16
    )
    for qformat in ("int8_wo", "int4_wo"):  # the quantized weights as matmuls of a dequantized copy (the old default)
        out[f"speed/quantized_decode_b1_matmuls/{qformat}"] = Case(
            lambda w, q=qformat: speed_engine_decode_b1(w, "torch-compile", True, q, row_products="none"),
            engine_dir("torch-compile", qformat),
        )
    return out


def selected(names: list[str], only: str | None) -> list[str]:
    """The cases ``--only`` names, in its order (a prefix's own cases in their usual order), each once; all of them
    without it. A short run lists the figures it needs most first: the budget skips the cases at the end."""
    if only is None:
        return names
    chosen: dict[str, None] = {}
    for prefix in only.split(","):
        chosen.update((name, None) for name in names if name.startswith(prefix))
    return list(chosen)


def run_child(args: argparse.Namespace) -> None:
    """In the child: run ``args.case`` and print its result (``isolate.report``)."""
    from trtbuild.backends.torch.build.isolate import report

    fn = cases()[args.case].run
    try:
        fields = fn(Path(args.work))
    except Exception as e:
        fields = {"ok": False, "error": f"{type(e).__name__}: {e}"[:2000], "where": traceback.format_exc()[-1500:]}
    report(fields)
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown (CUDA graphs, compile workers): the result is out


def emit(line: dict[str, Any], results: list[dict[str, Any]]) -> None:
    line = {"case": line.pop("case"), "t": round(time.perf_counter() - START, 1), **line}
    results.append(line)
    text = json.dumps(line, default=str)
    print(text, flush=True)
    out = os.environ.get("OUT")
    if out:
        with open(Path(out) / "gpu_check.jsonl", "a") as f:
            f.write(text + "\n")


B1 = ("speed/engine_decode_b1/torch-compile", "decode_b1_tok_s")
ENGINE_LLM = "speed/engine_64x512x128_and_ttft"
HF_EAGER = "speed/transformers_eager"
# (figure, trtbuild's (case, field), the reference's (case, field)): the summary table's rows
SUMMARY_ROWS = [
    ("decode b1 tok/s (torch-compile, CUDA graphs) vs weight-read ceiling", B1,
     ("speed/weight_read_ceiling", "ceiling_tok_s")),
    ("decode b1 tok/s vs transformers static cache + compile", B1,
     ("speed/transformers_static_compiled", "decode_b1_tok_s")),
    ("decode b1 tok/s vs transformers eager", B1, (HF_EAGER, "decode_b1_tok_s")),
    ("decode b1 tok/s without CUDA graphs vs with", ("speed/engine_decode_b1_no_graphs/torch-compile",
                                                     "decode_b1_tok_s"), B1),
    ("decode b1 tok/s, aot-inductor build vs torch-compile", ("speed/engine_decode_b1/aot-inductor",
                                                               "decode_b1_tok_s"), B1),
    ("64 x 512/128 output tok/s vs transformers eager b64", (ENGINE_LLM, "output_tok_s"),
     (HF_EAGER, "batch64_output_tok_s")),
    ("TTFT 2,048 tokens (ms) vs transformers prefill", (ENGINE_LLM, "ttft_2048_ms"), (HF_EAGER, "prefill_2048_ms")),
    ("int8_wo decode b1 tok/s vs bf16", ("speed/quantized_decode_b1/int8_wo", "decode_b1_tok_s"), B1),
    ("int4_wo decode b1 tok/s vs bf16", ("speed/quantized_decode_b1/int4_wo", "decode_b1_tok_s"), B1),
    ("LLM greedy decode b1 tok/s vs engine steps", ("speed/llm_decode_b1", "greedy_decode_b1_tok_s"), B1),
    ("LLM top-p decode b1 tok/s vs engine steps", ("speed/llm_decode_b1", "top_p_decode_b1_tok_s"), B1),
    ("torch-compile open s, first vs cache warm", ("speed/engine_decode_b1/torch-compile", "load_s"),
     ("speed/engine_decode_b1_no_graphs/torch-compile", "load_s")),
    ("decode b1 tok/s, every one-row product fused vs matmuls", ("speed/engine_decode_b1_row_products/torch-compile",
                                                      "decode_b1_tok_s"), B1),
    ("int8_wo decode b1 tok/s, fused (default) vs matmuls", ("speed/quantized_decode_b1/int8_wo", "decode_b1_tok_s"),
     ("speed/quantized_decode_b1_matmuls/int8_wo", "decode_b1_tok_s")),
    ("int4_wo decode b1 tok/s, fused (default) vs matmuls", ("speed/quantized_decode_b1/int4_wo", "decode_b1_tok_s"),
     ("speed/quantized_decode_b1_matmuls/int4_wo", "decode_b1_tok_s")),
]  # fmt: skip


def summary_table(results: list[dict[str, Any]]) -> list[str]:
    """The figures that answer the targets, with their ratios (the table of
    benchmarks/results/2026-12-04-h200-torch-backend.md)."""
    by = {r["case"]: r for r in results}

    def get(case: str, key: str) -> Any:
        return by.get(case, {}).get(key)

    def ratio(a: Any, b: Any) -> str:
        return f"{a / b:.2f}x" if isinstance(a, int | float) and isinstance(b, int | float) and b else "—"

    rows = ["| figure | trtbuild | reference | ratio |", "|---|---|---|---|"]
    for label, ours, reference in SUMMARY_ROWS:
        a, b = get(*ours), get(*reference)
        rows.append(f"| {label} | {a} | {b} | {ratio(a, b)} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--budget", type=float, default=450.0, help="seconds the run may take: a case starts if its estimate fits"
    )
    parser.add_argument("--case-timeout", type=float, default=240.0, help="seconds one case's child may take")
    parser.add_argument(
        "--device",
        default="cuda",
        choices=["cuda", "cpu"],
        help="cpu: run the cases' code on a tiny model (checks this script, measures nothing)",
    )
    parser.add_argument(
        "--only", default=None, help="run the cases whose name starts with one of these (commas), in that order"
    )
    parser.add_argument("--case", help=argparse.SUPPRESS)  # in a child: the case to run
    parser.add_argument("--work", help=argparse.SUPPRESS)  # in a child: the shared work folder
    args = parser.parse_args()
    global DEVICE, LLAMA_1B
    DEVICE = args.device
    if DEVICE == "cpu":  # the speed cases draw token ids up to 128k and build for 2,560 positions
        LLAMA_1B = dict(TINY["llama"], vocab_size=128256, max_position_embeddings=4096)
    if args.case:
        run_child(args)
        return
    work = Path(tempfile.mkdtemp(prefix="trtbuild-gpu-check-"))
    try:
        run_cases(args, work)
    finally:  # the 1B checkpoints and engines the cases built (0.5 GB on the CPU, GBs on the GPU)
        shutil.rmtree(work, ignore_errors=True)


def run_cases(args: argparse.Namespace, work: Path) -> None:
    """Each selected case in a child process of its own that fits the budget left, then the summary lines."""
    from trtbuild.backends.torch.build.isolate import run_isolated

    results: list[dict[str, Any]] = []
    flags = ["--device", DEVICE]
    launcher = "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
    table = cases()
    for name in selected(list(table), args.only):
        left, need = args.budget - (time.perf_counter() - START), table[name].estimate_s(work)
        if need > left:  # a later, shorter case (one reusing a built engine) may still fit
            emit({"case": name, "ok": False, "skipped": f"needs ~{need:.0f}s, {max(left, 0):.0f}s of the budget left"},
                 results)  # fmt: skip
            continue
        child_args = [str(Path(__file__).resolve()), "--case", name, "--work", str(work), *flags]
        run = run_isolated(launcher, args=child_args, timeout=args.case_timeout)
        line: dict[str, Any] = {"case": name}
        if run.results:
            line.update(run.results[-1])
            line.setdefault("ok", True)
        else:
            line.update(ok=False, summary=run.summary())
        if not run.ok or line.get("ok") is False:
            line.update(rc=run.rc, trace=run.trace[-20:])
        line["case_s"] = round(run.seconds, 1)
        emit(line, results)
        gc.collect()
    for row in summary_table(results):
        print(row, flush=True)
    emit({"case": "summary", "total_s": round(time.perf_counter() - START, 1),
          "failed": [r["case"] for r in results if r.get("ok") is False and "skipped" not in r],
          "skipped": [r["case"] for r in results if "skipped" in r], "table": summary_table(results)},
         results)  # fmt: skip


if __name__ == "__main__":
    main()
