"""The torch backend on a CUDA GPU, both runtimes: correctness against transformers and speed, one JSON line each.

Run on the GPU machine (docs/gpu.md), from the repository root, with no network and no venv::

    python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/site .
    PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 python3 benchmarks/gpu_check.py

Every case runs in a child process of its own (``python -X faulthandler``, ``trtbuild.backends.torch.isolate``):
loading compiled code, capturing CUDA graphs and launching custom kernels can kill a process, and then the case is
one JSON line (``"ok": false, "rc": -11, "trace": [...]``) and the run goes on. Cases are skipped (a JSON line says
so) once ``--budget`` seconds (default 450) have passed; each child has ``--case-timeout`` seconds. The last lines
are a summary table and a ``summary`` JSON line. With ``$OUT`` set, the lines also go to ``$OUT/gpu_check.jsonl``.
``--device cpu --smoke-speed`` runs every case's code on the CPU with a tiny model (how the script is checked
without a GPU; its figures mean nothing); ``--device cpu`` alone runs the correctness cases.

Cases (``<runtime>`` is ``torch-compile`` or ``aot-inductor``; an AOTInductor build whose package does not run in
its child-process check falls back to torch-compile, and the line says so in ``runtime`` and ``warnings``):
- ``correctness/<model>/<runtime>``: tiny random Llama / Qwen2 / Qwen3 / GPT-2 (transformers configs built here) as
  float32 engines: max abs logits error vs transformers on the GPU over a ragged prefill (with a chunk) plus
  8 decode steps, with and without CUDA graphs; limit 1e-3.
- ``bf16_greedy/llama``: the tiny Llama as a bfloat16 engine: greedy tokens vs transformers bfloat16 (match rate).
- ``quantized/<format>``: int8 / int4 weight-only checkpoints of the tiny Llama (round-to-nearest, made here: no
  modelopt): logits vs the same graph run eagerly by the importer on the CPU.
- ``speed/...``: a random model of Llama-3.2-1B shape in bfloat16 (saved once by ``speed/model``, read by each
  later case): the weight-read ceiling (weight bytes / measured device-copy bandwidth); batch-1 decode tok/s of
  engine steps with and without CUDA graphs per runtime (with the engine's load / compile time); through ``LLM``
  (device sampling, greedy and top-p); 64 requests x 512 prompt / 128 new tokens output tok/s and the TTFT of a
  2,048-token prompt; transformers on the same weights (eager ``generate`` at batch 1 and a padded batch of 64,
  its 2,048-token prefill, and its static-cache ``torch.compile`` path); the KV pool ``LLM`` sizes by itself;
  int8 / int4 weight-only engines of the same weights at batch 1 (target: not slower than bf16).
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
DEVICE = "cuda"  # --device cpu runs the cases on the CPU (to check this script without a GPU)

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
    "qwen3": dict(  # per-head q/k RMSNorm, head_dim 32 != 96 / 4
        model_type="qwen3", hidden_size=96, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, vocab_size=499, max_position_embeddings=512, rms_norm_eps=1e-6,
        rope_theta=1e6, tie_word_embeddings=False, initializer_range=0.05,
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
SPEED_BUILD = dict(max_batch_size=64, max_seq_len=2560, max_num_tokens=2048)


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
    hf_dir: Path, root: Path, tag: str, dtype_name: str, runtime: str = "torch-compile", ckpt_dtype: str = "float32",
    ckpt: Path | None = None, **build_kw: Any,
) -> dict[str, Any]:  # fmt: skip
    """Convert ``hf_dir`` (once) and build it as a torch engine in ``dtype_name`` for ``runtime`` (reused when an
    earlier case built it): ``{"ckpt", "engine", "build_s", "runtime", "warnings"}`` (``runtime``: the one the
    engine got, torch-compile after an AOTInductor fallback)."""
    from trtbuild.build import build_engine
    from trtbuild.config import Backend, BuildConfig, DType, TorchConfig, TorchDevice, TorchRuntime
    from trtbuild.convert.convert import convert

    ckpt = ckpt or root / f"{tag}-ckpt"
    engine = root / f"{tag}-{runtime}-engine"
    if not ckpt.exists():
        convert(hf_dir, ckpt, DType(ckpt_dtype))
    t = time.perf_counter()
    warnings: tuple[str, ...] = ()
    if not engine.exists():
        build = BuildConfig(backend=Backend.TORCH, kv_block_size=16, **build_kw)
        cfg = TorchConfig(device=TorchDevice(DEVICE), dtype=DType(dtype_name), torch_runtime=TorchRuntime(runtime))
        warnings = build_engine(ckpt, engine, build, torch=cfg).warnings
    (entry,) = json.loads((engine / "manifest.json").read_text())["engines"]
    seconds = round(time.perf_counter() - t, 1)
    return {"ckpt": ckpt, "engine": engine, "build_s": seconds, "runtime": entry["torch_runtime"],
            "warnings": list(warnings), "package_mb": package_mb(engine)}  # fmt: skip


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


def case_correctness(name: str, runtime: str, work: Path) -> dict[str, Any]:
    import torch

    from trtbuild.backends.torch.session import TorchSession

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    model = make_hf(TINY[name], work / f"{name}-hf", torch.float32)
    built = convert_and_build(work / f"{name}-hf", work, name, "float32", runtime, max_seq_len=512)
    session = TorchSession(built["engine"], kv_cache_memory=64 << 20)  # decode steps as CUDA graphs (the default)
    err = paged_run(session, model.config.vocab_size, lambda ids: hf_logits(model, ids))
    graphs = session._decode.replaying
    eager = TorchSession(built["engine"], kv_cache_memory=64 << 20, decode_batch_sizes=[])
    err_eager = paged_run(eager, model.config.vocab_size, lambda ids: hf_logits(model, ids))
    return {"ok": max(err, err_eager) <= 1e-3, "max_abs_err": err, "max_abs_err_no_graphs": err_eager,
            "cuda_graphs": graphs, "limit": 1e-3, "load_s": round(session.load_seconds, 1),
            **{k: v for k, v in built.items() if k not in ("ckpt", "engine")}}  # fmt: skip


def case_bf16_greedy(work: Path) -> dict[str, Any]:
    import numpy as np
    import torch

    from trtbuild.runtime.llm import LLM, SamplingParams

    model = make_hf(TINY["llama"], work / "llama-bf16-hf", torch.bfloat16, seed=3)
    built = convert_and_build(work / "llama-bf16-hf", work, "llama-bf16", "bfloat16", max_seq_len=512)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 500, int(n)).tolist() for n in (5, 17, 33, 64)]
    outs = LLM(built["engine"], kv_cache_memory=64 << 20).generate(
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
    return {"match_rate": same / total, "tokens": total, "build_s": built["build_s"], "runtime": built["runtime"]}


def quantize_checkpoint(src: Path, dst: Path, qformat: str, group: int = 128) -> Path:
    """A round-to-nearest int8 (per channel) or int4 (blocked) weight-only checkpoint of the float ``src``, the LM
    head int8 per channel as ``trtbuild quantize`` makes it by default."""
    from dataclasses import replace

    import torch
    from safetensors.torch import save_file

    from trtbuild.checkpoint.files import load_checkpoint
    from trtbuild.checkpoint.formats import Numeric, linear_format, pack_int4
    from trtbuild.checkpoint.layout import quantized_linears
    from trtbuild.config import QFormat, QuantConfig
    from trtbuild.configio import to_dict

    cfg, weights = load_checkpoint(src)
    qcfg = replace(cfg, quantization=QuantConfig(qformat=QFormat(qformat), group_size=group))
    out = {k: torch.from_numpy(v) for k, v in weights.items()}
    for prefix in quantized_linears(qcfg):
        name = prefix + ".weight"  # a tied LM head has none: it gets its own quantized copy of the embedding
        w = torch.from_numpy(weights.pop(name) if name in weights else weights["embed.weight"])
        out.pop(name, None)
        if linear_format(qcfg.quantization, prefix).weights is Numeric.INT8:  # int8_wo, and the LM head in every format
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


def case_quantized(qformat: str, work: Path) -> dict[str, Any]:
    import torch

    from trtbuild.backends.torch.importer import PortableModule
    from trtbuild.backends.torch.session import TorchSession
    from trtbuild.build import portable_graph
    from trtbuild.config import Backend, BuildConfig

    ckpt = work / "llama-ckpt"
    if not ckpt.exists():  # the correctness case made it; make it here otherwise
        from trtbuild.config import DType
        from trtbuild.convert.convert import convert

        make_hf(TINY["llama"], work / "llama-hf", torch.float32)
        convert(work / "llama-hf", ckpt, DType.FLOAT32)
    qckpt = work / f"llama-{qformat}-ckpt"
    if not qckpt.exists():
        quantize_checkpoint(ckpt, qckpt, qformat)
    built = convert_and_build(work, work, f"llama-{qformat}", "float32", ckpt=qckpt, max_seq_len=512)
    cfg, build, io, graph = portable_graph(qckpt, BuildConfig(backend=Backend.TORCH, kv_block_size=16, max_seq_len=512))
    module = PortableModule(graph, io, torch.float32)  # the reference: the same graph, eager, on the CPU

    def reference(ids: list[int]) -> Any:
        shape = (64, build.kv_block_size, cfg.num_kv_heads, cfg.head_size)
        caches = [torch.zeros(shape) for _ in range(2 * cfg.num_layers)]
        b = step_batch([ids], [0], [list(range(1, 1 + -(-len(ids) // build.kv_block_size)))], True)
        arrays = (b.input_ids, b.positions, b.block_tables, b.query_start_loc, b.logits_indices)
        with torch.no_grad():
            return module(*map(torch.from_numpy, arrays), caches).numpy()

    session = TorchSession(built["engine"], kv_cache_memory=64 << 20)
    err = paged_run(session, cfg.vocab_size, reference)
    return {"ok": err <= 1e-3, "max_abs_err_vs_eager_cpu": err, "build_s": built["build_s"],
            "package_mb": built["package_mb"], "runtime": built["runtime"]}  # fmt: skip


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


def build_1b(work: Path, runtime: str = "torch-compile", qformat: str | None = None) -> dict[str, Any]:
    if qformat is None:
        return convert_and_build(work / "1b-hf", work, "1b", "bfloat16", runtime, "bfloat16", **SPEED_BUILD)
    qckpt = work / f"1b-{qformat}-ckpt"
    if not qckpt.exists():
        build_1b(work)  # the bf16 checkpoint
        quantize_checkpoint(work / "1b-ckpt", qckpt, qformat)
    return convert_and_build(work, work, f"1b-{qformat}", "bfloat16", runtime, ckpt=qckpt, **SPEED_BUILD)


def speed_model(work: Path) -> dict[str, Any]:
    import torch

    t = time.perf_counter()
    model = make_hf(LLAMA_1B, work / "1b-hf", torch.bfloat16)
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


def speed_engine_decode_b1(work: Path, runtime: str, graphs: bool, qformat: str | None = None) -> dict[str, Any]:
    """Batch-1 decode steps at context 128-264, as the runner takes them: logits left on the device, the greedy
    token read back (one sync a step), the next step's token fed from it."""
    import torch

    from trtbuild.backends.torch.session import TorchSession

    built = build_1b(work, runtime, qformat)
    session = TorchSession(built["engine"], kv_cache_memory=2 << 30, decode_batch_sizes=None if graphs else [])
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
    return {"decode_b1_tok_s": round(n / seconds, 1), "step_ms": round(1e3 * seconds / n, 3),
            "cuda_graphs": session._decode.replaying,
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
    llm.generate([rng.integers(1, 128000, 512).tolist() for _ in range(4)], params)  # warm-up
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


def cases(smoke_speed: bool, skip_speed: bool) -> dict[str, Callable[[Path], dict[str, Any]]]:
    """Name -> case, in the order they run: one correctness case, the speed cases by importance (the figures no
    run has produced yet), then the rest of the correctness cases, the AOTInductor 1B build last (minutes)."""
    out: dict[str, Callable[[Path], dict[str, Any]]] = {"environment": case_environment}
    out["correctness/llama/torch-compile"] = lambda w: case_correctness("llama", "torch-compile", w)
    if not skip_speed and (DEVICE == "cuda" or smoke_speed):
        out["speed/model"] = speed_model
        if DEVICE == "cuda":
            out["speed/weight_read_ceiling"] = speed_ceiling
        out["speed/engine_decode_b1/torch-compile"] = lambda w: speed_engine_decode_b1(w, "torch-compile", True)
        out["speed/engine_decode_b1_no_graphs/torch-compile"] = lambda w: speed_engine_decode_b1(
            w, "torch-compile", False
        )
        out["speed/transformers_eager"] = speed_hf_eager
        out["speed/engine_64x512x128_and_ttft"] = speed_engine_llm
        out["speed/transformers_static_compiled"] = speed_hf_static_compiled
        for qformat in ("int8_wo", "int4_wo"):
            out[f"speed/quantized_decode_b1/{qformat}"] = lambda w, q=qformat: speed_engine_decode_b1(
                w, "torch-compile", True, q
            )
        out["speed/llm_decode_b1"] = speed_llm_decode_b1
        if DEVICE == "cuda":
            out["speed/default_kv_pool"] = speed_default_kv_pool
    for name in ("qwen2", "qwen3", "gpt2"):
        out[f"correctness/{name}/torch-compile"] = lambda w, n=name: case_correctness(n, "torch-compile", w)
    out["correctness/llama/aot-inductor"] = lambda w: case_correctness("llama", "aot-inductor", w)
    out["bf16_greedy/llama"] = case_bf16_greedy
    for qformat in ("int8_wo", "int4_wo"):
        out[f"quantized/{qformat}"] = lambda w, q=qformat: case_quantized(q, w)
    if not skip_speed and (DEVICE == "cuda" or smoke_speed):
        out["speed/engine_decode_b1/aot-inductor"] = lambda w: speed_engine_decode_b1(w, "aot-inductor", True)
    return out


def run_child(args: argparse.Namespace) -> None:
    """In the child: run ``args.case`` and print its result (``isolate.report``)."""
    from trtbuild.backends.torch.isolate import report

    fn = cases(args.smoke_speed, False)[args.case]
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
# (figure, trtbuild's (case, field), the reference's (case, field)): the summary table's rows after correctness
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
]  # fmt: skip


def summary_table(results: list[dict[str, Any]]) -> list[str]:
    """The figures that answer the targets, with their ratios (docs/gpu.md's "Measured" table)."""
    by = {r["case"]: r for r in results}

    def get(case: str, key: str) -> Any:
        return by.get(case, {}).get(key)

    def ratio(a: Any, b: Any) -> str:
        return f"{a / b:.2f}x" if isinstance(a, int | float) and isinstance(b, int | float) and b else "—"

    rows = ["| figure | trtbuild | reference | ratio |", "|---|---|---|---|"]
    for case in [f"correctness/{name}/torch-compile" for name in TINY] + ["correctness/llama/aot-inductor"]:
        errors = f"{get(case, 'max_abs_err')} / {get(case, 'max_abs_err_no_graphs')}"
        rows.append(f"| {case} max abs err, CUDA graphs / none (runs as {get(case, 'runtime')}) | {errors} | "
                    f"limit 1e-3 | ok={get(case, 'ok')} |")  # fmt: skip
    for label, ours, reference in SUMMARY_ROWS:
        a, b = get(*ours), get(*reference)
        rows.append(f"| {label} | {a} | {b} | {ratio(a, b)} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", type=float, default=450.0, help="start no case after this many seconds")
    parser.add_argument("--case-timeout", type=float, default=240.0, help="seconds one case's child may take")
    parser.add_argument("--skip-speed", action="store_true", help="only the correctness cases")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: check this script")
    parser.add_argument(
        "--smoke-speed",
        action="store_true",
        help="with --device cpu: run the speed cases' code on a tiny model (checks this script, measures nothing)",
    )
    parser.add_argument("--only", default=None, help="run the cases whose name starts with one of these (commas)")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # in a child: the case to run
    parser.add_argument("--work", help=argparse.SUPPRESS)  # in a child: the shared work folder
    args = parser.parse_args()
    global DEVICE, LLAMA_1B
    DEVICE = args.device
    if args.smoke_speed:
        if DEVICE != "cpu":
            parser.error("--smoke-speed checks the script on the CPU: use it with --device cpu")
        # the speed cases draw token ids up to 128k and build for 2,560 positions
        LLAMA_1B = dict(TINY["llama"], vocab_size=128256, max_position_embeddings=4096)
    if args.case:
        run_child(args)
        return
    from trtbuild.backends.torch.isolate import run_isolated

    work = Path(tempfile.mkdtemp(prefix="trtbuild-gpu-check-"))
    results: list[dict[str, Any]] = []
    flags = ["--device", DEVICE, *(["--smoke-speed"] if args.smoke_speed else [])]
    launcher = "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
    for name in cases(args.smoke_speed, args.skip_speed):
        if args.only and not name.startswith(tuple(args.only.split(","))):
            continue
        if time.perf_counter() - START > args.budget:
            emit({"case": name, "ok": False, "skipped": f"time budget of {args.budget:.0f}s used"}, results)
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
