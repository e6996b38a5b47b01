"""The torch backend on a CUDA GPU: correctness against transformers and speed, one JSON line per result.

Run on the GPU machine (docs/gpu.md), from the repository root, with no network and no venv::

    python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/site .
    PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 python3 benchmarks/gpu_check.py

``--device cpu --smoke-speed`` runs the speed cases' code on a tiny model (how the script is checked without a
GPU; its figures mean nothing). Every case runs in its own try/except and prints one JSON line (``"ok": false``
with the error when it fails); nothing stops the rest. Cases are skipped (a JSON line says so) once ``--budget``
seconds (default 420) have passed: the speed cases run right after the float32 correctness ones, then bf16 and
quantized. With ``$OUT`` set, the lines are also written to ``$OUT/gpu_check.jsonl``.

Cases:
- ``correctness``: tiny random Llama / Qwen2 / GPT-2 models (transformers configs built here), converted and built
  for CUDA in float32: max abs logits error vs transformers on the GPU over a ragged prefill (with a chunk) plus
  8 decode steps; limit 1e-3.
- ``bf16_greedy``: the tiny Llama as a bfloat16 engine: greedy tokens vs transformers bfloat16 (match rate).
- ``quantized``: int8 / int4 weight-only checkpoints of the tiny Llama (round-to-nearest, made here: no modelopt),
  built for CUDA: logits vs the same graph run eagerly by the importer on the CPU.
- ``speed``: a random model of Llama-3.2-1B shape in bfloat16: batch-1 decode tok/s (engine steps with and without
  CUDA graphs, and through ``LLM`` with device sampling), 64 requests x 512 prompt / 128 new tokens output tok/s,
  TTFT of a 2,048-token prompt; transformers on the same weights (eager ``generate`` with a padded static batch,
  and its static-cache ``torch.compile`` path); the weight-read ceiling (weight bytes / measured device-copy
  bandwidth); build time and package size; the KV pool ``LLM`` sizes by itself; int8 / int4 weight-only engines
  of the same weights at batch 1 (target: not slower than bf16).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

START = time.perf_counter()
RESULTS: list[dict[str, Any]] = []
DEVICE = "cuda"  # --device cpu dry-runs the correctness cases on the CPU (to check this script without a GPU)

TINY = {
    "llama": dict(
        model_type="llama", hidden_size=128, intermediate_size=320, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=512, max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0,
        tie_word_embeddings=False, initializer_range=0.05,
    ),
    "qwen2": dict(
        model_type="qwen2", hidden_size=96, intermediate_size=160, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=2, vocab_size=503, max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=1e6,
        tie_word_embeddings=True, initializer_range=0.05, use_sliding_window=False,
    ),
    "gpt2": dict(
        model_type="gpt2", n_embd=96, n_head=4, n_layer=2, n_positions=512, vocab_size=509, initializer_range=0.05,
        activation_function="gelu_new", bos_token_id=0, eos_token_id=0,
    ),
}  # fmt: skip
LLAMA_1B = dict(
    model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
    num_key_value_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=4096, rms_norm_eps=1e-5,
    rope_theta=500000.0, tie_word_embeddings=True, initializer_range=0.02,
)  # fmt: skip


def emit(case: str, **fields: Any) -> dict[str, Any]:
    line = {"case": case, "t": round(time.perf_counter() - START, 1), **fields}
    RESULTS.append(line)
    print(json.dumps(line, default=str), flush=True)
    out = os.environ.get("OUT")
    if out:
        with open(Path(out) / "gpu_check.jsonl", "a") as f:
            f.write(json.dumps(line, default=str) + "\n")
    return line


def run_case(case: str, budget: float, fn: Callable[[], dict[str, Any] | None]) -> None:
    """Run ``fn`` (it returns extra fields or emits its own lines); any exception becomes one JSON line."""
    if time.perf_counter() - START > budget:
        emit(case, ok=False, skipped=f"time budget of {budget:.0f}s used")
        return
    try:
        fields = fn()
        if fields is not None:
            emit(case, ok=fields.pop("ok", True), **fields)
    except BaseException as e:  # report and go on, whatever it is
        if isinstance(e, KeyboardInterrupt):
            raise
        emit(case, ok=False, error=f"{type(e).__name__}: {e}"[:2000], where=traceback.format_exc()[-1500:])
    finally:
        gc.collect()
        try:
            import torch

            torch.cuda.empty_cache()
        except Exception:
            pass


# --------------------------------------------------------------------------------------------- helpers


def make_hf(spec: dict[str, Any], folder: Path, dtype: Any, seed: int = 0) -> Any:
    """A random-init transformers model (norms/biases perturbed so they are checked), saved to ``folder``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    spec = dict(spec)
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    with torch.device(DEVICE):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "ln_" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(str(folder), safe_serialization=True)
    return model


def convert_and_build(
    hf_dir: Path, root: Path, tag: str, dtype_name: str, ckpt_dtype: str = "float32", **build_kw: Any
) -> tuple[Path, Path, float]:
    """(checkpoint, engine dir, build seconds) for ``hf_dir`` built as a torch engine in ``dtype_name``."""
    from trtbuild.build import build_engine
    from trtbuild.config import Backend, BuildConfig, DType, TorchConfig, TorchDevice
    from trtbuild.convert.convert import convert

    ckpt, engine = root / f"{tag}-ckpt", root / f"{tag}-engine"
    if not ckpt.exists():
        convert(hf_dir, ckpt, DType(ckpt_dtype))
    t = time.perf_counter()
    build = BuildConfig(backend=Backend.TORCH, kv_block_size=16, **build_kw)
    build_engine(ckpt, engine, build, torch=TorchConfig(device=TorchDevice(DEVICE), dtype=DType(dtype_name)))
    return ckpt, engine, time.perf_counter() - t


def package_mb(engine: Path) -> float:
    return round(sum(p.stat().st_size for p in (engine / "engines").rglob("*") if p.is_file()) / 2**20, 2)


def step_batch(token_ids: list[list[int]], starts: list[int], tables: list[list[int]], all_logits: bool = False):
    from trtbuild.runtime.batch import StepBatch

    return StepBatch.build(token_ids, starts, tables, all_logits=all_logits)


def hf_logits(model: Any, ids: list[int]) -> Any:
    import torch

    with torch.no_grad():
        return model(torch.tensor([ids], device=DEVICE)).logits[0].float().cpu().numpy()


def paged_run(session: Any, vocab: int, reference: Callable[[list[int]], Any], seed: int = 1) -> float:
    """Max abs logits error vs ``reference(ids) -> [len, vocab]`` over a ragged prefill (sequence 2 chunked), then
    the rest of its prompt beside decodes, then 8 decode steps for all."""
    import numpy as np

    rng = np.random.default_rng(seed)
    block = session.config.build.kv_block_size
    seqs = [list(map(int, rng.integers(0, vocab, n))) for n in (7, 1, 29, 4)]
    free = list(rng.permutation(np.arange(1, session.num_blocks)))
    tables: dict[int, list[int]] = {}

    def table(s: int, length: int) -> list[int]:
        t = tables.setdefault(s, [])
        while len(t) * block < length:
            t.append(int(free.pop()))
        return t

    worst = 0.0
    chunk = {0: seqs[0], 1: seqs[1], 2: seqs[2][:11], 3: seqs[3]}
    logits = session.step(step_batch(list(chunk.values()), [0] * 4, [table(s, len(t)) for s, t in chunk.items()], True))
    offset = 0
    for toks in chunk.values():
        worst = max(worst, float(np.abs(logits[offset : offset + len(toks)] - reference(toks)).max()))
        offset += len(toks)
    done = {0: len(seqs[0]), 1: 1, 2: 11, 3: len(seqs[3])}
    for step in range(9):
        new = {}
        for s in range(4):
            if step == 0 and s == 2:
                new[s] = seqs[2][11:]
            else:
                seqs[s].append(int(rng.integers(0, vocab)))
                new[s] = [seqs[s][-1]]
        batch = step_batch(
            list(new.values()), [done[s] for s in new], [table(s, done[s] + len(t)) for s, t in new.items()]
        )
        logits = session.step(batch)
        for i, s in enumerate(new):
            done[s] += len(new[s])
            worst = max(worst, float(np.abs(logits[i] - reference(seqs[s])[-1]).max()))
    return worst


# --------------------------------------------------------------------------------------------- cases


def case_environment() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {"python": sys.version.split()[0], "torch": torch.__version__}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError as e:
        info["triton"] = f"missing ({e})"
    import transformers

    info["transformers"] = transformers.__version__
    info["cuda_available"] = torch.cuda.is_available()
    import shutil

    from torch.utils import cpp_extension

    info["nvcc"] = shutil.which("nvcc")
    info["cuda_home_found_by_torch"] = cpp_extension.CUDA_HOME
    if torch.cuda.is_available():
        from trtbuild.backends.torch.writer import ensure_cuda_home

        info["cuda_home_used"] = ensure_cuda_home()
        info["gpu"] = torch.cuda.get_device_name(0)
        info["capability"] = list(torch.cuda.get_device_capability(0))
    return info


def case_correctness(name: str, root: Path) -> dict[str, Any]:
    import torch

    from trtbuild.backends.torch.session import TorchSession

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    model = make_hf(TINY[name], root / f"{name}-hf", torch.float32)
    _, engine, seconds = convert_and_build(root / f"{name}-hf", root, name, "float32", max_seq_len=512)
    session = TorchSession(engine, kv_cache_memory=64 << 20)  # decode steps as CUDA graphs (the default)
    err = paged_run(session, model.config.vocab_size, lambda ids: hf_logits(model, ids))
    eager = TorchSession(engine, kv_cache_memory=64 << 20, decode_batch_sizes=[])
    err_eager = paged_run(eager, model.config.vocab_size, lambda ids: hf_logits(model, ids))
    return {"ok": max(err, err_eager) <= 1e-3, "model": name, "max_abs_err": err, "max_abs_err_no_graphs": err_eager,
            "cuda_graphs_failed": session._decode.failed, "limit": 1e-3, "build_s": round(seconds, 1),
            "package_mb": package_mb(engine), "target": session.entry.target}  # fmt: skip


def case_bf16_greedy(root: Path) -> dict[str, Any]:
    import numpy as np
    import torch

    from trtbuild.runtime.llm import LLM, SamplingParams

    model = make_hf(TINY["llama"], root / "llama-bf16-hf", torch.bfloat16, seed=3)
    _, engine, seconds = convert_and_build(root / "llama-bf16-hf", root, "llama-bf16", "bfloat16", max_seq_len=512)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 500, int(n)).tolist() for n in (5, 17, 33, 64)]
    outs = LLM(engine, kv_cache_memory=64 << 20).generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    )
    same = total = 0
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            ref = model.generate(
                torch.tensor([prompt], device=DEVICE), max_new_tokens=16, min_new_tokens=16, do_sample=False
            )[0, len(prompt) :].tolist()
        same += sum(a == b for a, b in zip(out.token_ids, ref, strict=False))
        total += len(ref)
    return {"model": "llama", "match_rate": same / total, "tokens": total, "build_s": round(seconds, 1),
            "package_mb": package_mb(engine)}  # fmt: skip


def quantize_checkpoint(src: Path, dst: Path, qformat: str, group: int = 128) -> Path:
    """A round-to-nearest int8 (per channel) or int4 (blocked) weight-only checkpoint of the float ``src``."""
    from dataclasses import replace

    import torch
    from safetensors.torch import save_file

    from trtbuild.checkpoint import load_checkpoint
    from trtbuild.config import QFormat, QuantConfig
    from trtbuild.configio import to_dict
    from trtbuild.quantize.int4 import pack_int4
    from trtbuild.quantize.layout import quantized_linears

    cfg, weights = load_checkpoint(src)
    qcfg = replace(cfg, quantization=QuantConfig(qformat=QFormat(qformat), group_size=group))
    out = {k: torch.from_numpy(v) for k, v in weights.items()}
    for prefix in quantized_linears(qcfg):
        w = torch.from_numpy(weights.pop(prefix + ".weight"))
        del out[prefix + ".weight"]
        if qformat == "int8_wo":
            scale = w.abs().amax(dim=1).clamp(min=1e-8) / 127.0
            out[prefix + ".weight"] = torch.round(w / scale[:, None]).clamp(-128, 127).to(torch.int8)
        else:
            rows, cols = w.shape
            groups = -(-cols // group)
            padded = torch.nn.functional.pad(w, (0, groups * group - cols)).view(rows, groups, group)
            scale = padded.abs().amax(dim=2).clamp(min=1e-8) / 7.0
            q = torch.round(padded / scale[..., None]).clamp(-8, 7).view(rows, -1)[:, :cols].to(torch.int8)
            out[prefix + ".weight"] = pack_int4(q)
        out[prefix + ".weight_scale"] = scale.float().contiguous()
    dst.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in out.items()}, str(dst / "rank0.safetensors"))
    (dst / "config.json").write_text(json.dumps(to_dict(qcfg), indent=2, sort_keys=True) + "\n")
    return dst


def case_quantized(qformat: str, root: Path) -> dict[str, Any]:
    import torch

    from trtbuild.backends.torch.importer import PortableModule
    from trtbuild.backends.torch.session import TorchSession
    from trtbuild.build import build_engine, portable_graph
    from trtbuild.config import Backend, BuildConfig, TorchConfig, TorchDevice

    ckpt = root / "llama-ckpt"
    if not ckpt.exists():  # the correctness case made it; make it here otherwise
        make_hf(TINY["llama"], root / "llama-hf", torch.float32)
        from trtbuild.config import DType
        from trtbuild.convert.convert import convert

        convert(root / "llama-hf", ckpt, DType.FLOAT32)
    qckpt = quantize_checkpoint(ckpt, root / f"llama-{qformat}-ckpt", qformat)
    engine = root / f"llama-{qformat}-engine"
    t = time.perf_counter()
    build = BuildConfig(backend=Backend.TORCH, kv_block_size=16, max_seq_len=512)
    build_engine(qckpt, engine, build, torch=TorchConfig(device=TorchDevice(DEVICE)))
    seconds = time.perf_counter() - t
    cfg, build, io, graph = portable_graph(qckpt, build)
    module = PortableModule(graph, io, torch.float32)  # the reference: the same graph, eager, on the CPU

    def reference(ids: list[int]) -> Any:
        shape = (64, build.kv_block_size, cfg.num_kv_heads, cfg.head_size)
        caches = [torch.zeros(shape) for _ in range(2 * cfg.num_layers)]
        b = step_batch([ids], [0], [list(range(1, 1 + -(-len(ids) // build.kv_block_size)))], True)
        arrays = (b.input_ids, b.positions, b.block_tables, b.query_start_loc, b.logits_indices)
        with torch.no_grad():
            return module(*map(torch.from_numpy, arrays), caches).numpy()

    session = TorchSession(engine, kv_cache_memory=64 << 20)
    err = paged_run(session, cfg.vocab_size, reference)
    return {"ok": err <= 1e-3, "qformat": qformat, "max_abs_err_vs_eager_cpu": err, "build_s": round(seconds, 1),
            "package_mb": package_mb(engine)}  # fmt: skip


def cuda_time(fn: Callable[[], Any], iters: int = 1) -> float:
    """Seconds per call of ``fn`` (synchronized wall clock)."""
    import torch

    sync = torch.cuda.synchronize if DEVICE == "cuda" else (lambda: None)
    sync()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    return (time.perf_counter() - t) / iters


class Speed:
    """The Llama-3.2-1B-shaped model: made once, then measured by several cases."""

    def __init__(self, root: Path) -> None:
        import torch

        t = time.perf_counter()
        self.model = make_hf(LLAMA_1B, root / "1b-hf", torch.bfloat16)
        self.make_s = time.perf_counter() - t
        self.root = root
        self.engine: Path | None = None
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())

    def build(self) -> dict[str, Any]:
        _, self.engine, seconds = convert_and_build(
            self.root / "1b-hf", self.root, "1b", "bfloat16", "bfloat16", max_batch_size=64, max_seq_len=2560,
            max_num_tokens=2048,
        )  # fmt: skip
        return {
            "build_s": round(seconds, 1),
            "package_mb": package_mb(self.engine),
            "model_make_s": round(self.make_s, 1),
        }

    def ceiling(self) -> dict[str, Any]:
        import torch

        src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        dst.copy_(src)
        seconds = cuda_time(lambda: dst.copy_(src), iters=20)
        bandwidth = 2 * src.numel() / seconds  # bytes read + written per second
        return {"weight_bytes": self.weight_bytes, "copy_bandwidth_GBps": round(bandwidth / 1e9, 1),
                "ceiling_tok_s": round(bandwidth / self.weight_bytes, 1)}  # fmt: skip

    def engine_decode_b1(self, graphs: bool = True, engine: Path | None = None) -> dict[str, Any]:
        """Batch-1 decode steps at context 128-264, as the runner takes them: logits left on the device, the greedy
        token read back (one sync a step), the next step's token fed from it."""
        import torch

        from trtbuild.backends.torch.session import TorchSession

        engine = engine or self.engine
        assert engine is not None, "the engine build failed"
        sizes = None if graphs else []
        session = TorchSession(engine, kv_cache_memory=2 << 30, decode_batch_sizes=sizes)
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
        failed = session._decode.failed
        finite = bool(torch.isfinite(logits).all())
        del session
        return {"decode_b1_tok_s": round(n / seconds, 1), "step_ms": round(1e3 * seconds / n, 3),
                "cuda_graphs": graphs and DEVICE == "cuda", "cuda_graphs_failed": failed, "finite": finite,
                "engine": engine.name}  # fmt: skip

    def llm_decode_b1(self) -> dict[str, Any]:
        """Batch-1 decode through ``LLM`` (scheduler, device sampling, detokenizer-free ids): what a user gets."""
        import numpy as np

        from trtbuild.runtime.llm import LLM, SamplingParams

        assert self.engine is not None, "the engine build failed"
        llm = LLM(self.engine, kv_cache_memory=2 << 30)
        rng = np.random.default_rng(1)
        params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
        llm.generate([rng.integers(1, 128000, 128).tolist()], params)  # warm-up (graph capture)
        out = llm.generate([rng.integers(1, 128000, 128).tolist()], params)[0]
        sampled = llm.generate([rng.integers(1, 128000, 128).tolist()], SamplingParams(
            temperature=0.8, top_p=0.9, top_k=50, max_tokens=128, ignore_eos=True, seed=0))[0]  # fmt: skip
        return {"greedy_decode_b1_tok_s": round(out.metrics.decode_tokens_per_s, 1),
                "top_p_decode_b1_tok_s": round(sampled.metrics.decode_tokens_per_s, 1),
                "sampler": type(llm.sampler).__name__}  # fmt: skip

    def default_kv_pool(self) -> dict[str, Any]:
        """The KV pool ``LLM(engine)`` sizes by itself on this GPU (90% of the free memory less one step)."""
        import torch

        from trtbuild.runtime.llm import LLM

        assert self.engine is not None, "the engine build failed"
        llm = LLM(self.engine)
        free, total = torch.cuda.mem_get_info()
        fields = {"kv_cache_GiB": round(llm.session.kv_cache_memory / 2**30, 2), "blocks": llm.num_kv_blocks,
                  "free_after_GiB": round(free / 2**30, 2), "total_GiB": round(total / 2**30, 2)}  # fmt: skip
        del llm
        return fields

    def quantized_decode_b1(self, qformat: str, max_autotune: bool = False) -> dict[str, Any]:
        """A round-to-nearest ``qformat`` checkpoint of the same weights, built and timed as the bf16 engine; the
        issue's target: not slower than bf16 at batch 1 (compare with ``speed/engine_decode_b1``). ``max_autotune``:
        Inductor's Triton templates with the dequantization as a fused prologue, timed against cuBLAS."""
        from trtbuild.build import build_engine
        from trtbuild.config import Backend, BuildConfig, DType, TorchConfig, TorchDevice

        qckpt = self.root / f"1b-{qformat}-ckpt"
        if not qckpt.exists():
            quantize_checkpoint(self.root / "1b-ckpt", qckpt, qformat)
        engine = self.root / f"1b-{qformat}{'-autotune' if max_autotune else ''}-engine"
        t = time.perf_counter()
        build = BuildConfig(backend=Backend.TORCH, kv_block_size=16, max_batch_size=64, max_seq_len=2560,
                            max_num_tokens=2048)  # fmt: skip
        torch_cfg = TorchConfig(device=TorchDevice(DEVICE), dtype=DType.BFLOAT16, max_autotune=max_autotune)
        build_engine(qckpt, engine, build, torch=torch_cfg)
        seconds = time.perf_counter() - t
        return {"qformat": qformat, "max_autotune": max_autotune, "build_s": round(seconds, 1),
                "package_mb": package_mb(engine), **self.engine_decode_b1(engine=engine)}  # fmt: skip

    def engine_llm(self) -> dict[str, Any]:
        import numpy as np

        from trtbuild.runtime.llm import LLM, SamplingParams

        assert self.engine is not None, "the engine build failed"
        llm = LLM(self.engine, kv_cache_memory=8 << 30)
        rng = np.random.default_rng(0)
        params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
        llm.generate([rng.integers(1, 128000, 512).tolist() for _ in range(4)], params)  # warm-up
        prompts = [rng.integers(1, 128000, 512).tolist() for _ in range(64)]
        t = time.perf_counter()
        outs = llm.generate(prompts, params)
        seconds = time.perf_counter() - t
        tokens = sum(len(o.token_ids) for o in outs)
        one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        llm.generate([rng.integers(1, 128000, 2048).tolist()], one)  # warm-up at that size
        long_prompt = rng.integers(1, 128000, 2048).tolist()  # other random tokens: no prefix-cache hit
        t = time.perf_counter()
        llm.generate([long_prompt], one)
        ttft = time.perf_counter() - t
        return {"requests": 64, "output_tok_s": round(tokens / seconds, 1), "wall_s": round(seconds, 2),
                "ttft_2048_ms": round(1e3 * ttft, 1)}  # fmt: skip

    def _hf_decode(self, batch: int, prompt_len: int, compiled: bool) -> tuple[float, float]:
        """(decode tok/s per sequence-step, total output tok/s) of transformers' greedy generate on a padded batch."""
        import torch

        ids = torch.randint(1, 128000, (batch, prompt_len), device=DEVICE)
        kwargs: dict[str, Any] = {"do_sample": False, "attention_mask": torch.ones_like(ids)}
        if compiled:
            kwargs["cache_implementation"] = "static"
        else:
            kwargs["disable_compile"] = True

        def gen(n: int) -> Any:
            with torch.no_grad():
                return self.model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kwargs)

        gen(4)  # warm-up (compiles on the static-cache path)
        gen(4)
        full = cuda_time(lambda: gen(65))
        first = cuda_time(lambda: gen(1))
        return 64 / (full - first), batch * 65 / full

    def hf_eager(self) -> dict[str, Any]:
        b1, _ = self._hf_decode(1, 128, compiled=False)
        _, out64 = self._hf_decode(64, 512, compiled=False)
        return {"decode_b1_tok_s": round(b1, 1), "batch64_output_tok_s": round(out64, 1)}

    def hf_static_compiled(self) -> dict[str, Any]:
        b1, _ = self._hf_decode(1, 128, compiled=True)
        return {"decode_b1_tok_s": round(b1, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", type=float, default=420.0, help="start no case after this many seconds")
    parser.add_argument("--skip-speed", action="store_true", help="only the correctness cases")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: dry-run the correctness cases")
    parser.add_argument(
        "--smoke-speed",
        action="store_true",
        help="with --device cpu: run the speed cases' code on a tiny model (checks this script, measures nothing)",
    )
    args = parser.parse_args()
    global DEVICE, LLAMA_1B
    DEVICE = args.device
    if args.smoke_speed:
        if DEVICE != "cpu":
            parser.error("--smoke-speed checks the script on the CPU: use it with --device cpu")
        # the speed cases draw token ids up to 128k and build for 2,560 positions
        LLAMA_1B = dict(TINY["llama"], vocab_size=128256, max_position_embeddings=4096)
    work = Path(tempfile.mkdtemp(prefix="trtbuild-gpu-check-"))
    run_case("environment", args.budget, case_environment)
    for name in TINY:
        run_case(f"correctness/{name}", args.budget, lambda name=name: case_correctness(name, work))
    if not args.skip_speed and (DEVICE == "cuda" or args.smoke_speed):
        speed_cases(work, args.budget)
    run_case("bf16_greedy/llama", args.budget, lambda: case_bf16_greedy(work))
    for qformat in ("int8_wo", "int4_wo"):
        run_case(f"quantized/{qformat}", args.budget, lambda q=qformat: case_quantized(q, work))
    emit("summary", total_s=round(time.perf_counter() - START, 1),
         failed=[r["case"] for r in RESULTS if r.get("ok") is False and "skipped" not in r],
         skipped=[r["case"] for r in RESULTS if "skipped" in r])  # fmt: skip


def speed_cases(work: Path, budget: float) -> None:
    """The Llama-3.2-1B-shaped model: ceiling, build, the engine (with and without CUDA graphs), transformers."""
    holder: dict[str, Speed] = {}

    def setup() -> dict[str, Any]:
        holder["speed"] = Speed(work)
        return {"params": sum(p.numel() for p in holder["speed"].model.parameters())}

    run_case("speed/model", budget, setup)
    if "speed" not in holder:
        return
    speed = holder["speed"]
    cuda = DEVICE == "cuda"
    if cuda:  # device-copy bandwidth
        run_case("speed/weight_read_ceiling", budget, speed.ceiling)
    run_case("speed/build", budget, speed.build)
    run_case("speed/engine_decode_b1", budget, speed.engine_decode_b1)
    run_case("speed/engine_decode_b1_no_graphs", budget, lambda: speed.engine_decode_b1(graphs=False))
    run_case("speed/llm_decode_b1", budget, speed.llm_decode_b1)
    run_case("speed/engine_64x512x128_and_ttft", budget, speed.engine_llm)
    run_case("speed/transformers_eager", budget, speed.hf_eager)
    run_case("speed/transformers_static_compiled", budget, speed.hf_static_compiled)
    if cuda:  # the GPU's free memory; --max-autotune builds
        run_case("speed/default_kv_pool", budget, speed.default_kv_pool)
    for qformat, tune in (("int8_wo", False), ("int8_wo", True), ("int4_wo", False), ("int4_wo", True)):
        if tune and not cuda:
            continue
        name = f"speed/quantized_decode_b1/{qformat}{'/max_autotune' if tune else ''}"
        run_case(name, budget, lambda q=qformat, t=tune: speed.quantized_decode_b1(q, t))
    del holder["speed"]


if __name__ == "__main__":
    main()
