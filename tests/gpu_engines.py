"""Torch engines of random transformers models, for the GPU checks: the correctness tests
(``test_gpu_torch_backend.py``) and the speed cases of ``benchmarks/gpu_check.py`` build their engines here.

Every function takes the torch device (``"cuda"``, or ``"cpu"`` where the same code is checked without a GPU);
torch, transformers and trtbuild are imported inside them, so importing this module costs nothing.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

# Tiny random models (transformers configs), a few hundred thousand weights each: float32 logits on the GPU are
# compared with transformers' within 1e-3.
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


def make_hf(spec: dict[str, Any], folder: Path, dtype: Any, device: str, seed: int = 0) -> Any:
    """A random-init transformers model on ``device`` (norms/biases perturbed so they are checked), saved to
    ``folder``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    spec = dict(spec)
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "ln_" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(str(folder), safe_serialization=True)
    return model


def engine_name(tag: str, runtime: str) -> str:
    """The engine directory ``convert_and_build`` writes for ``tag`` and ``runtime``, under its root."""
    return f"{tag}-{runtime}-engine"


def convert_and_build(
    hf_dir: Path, root: Path, tag: str, dtype_name: str, device: str, runtime: str = "torch-compile",
    ckpt_dtype: str = "float32", ckpt: Path | None = None, **build_kw: Any,
) -> dict[str, Any]:  # fmt: skip
    """Convert ``hf_dir`` (once) and build it as a torch engine for ``device`` in ``dtype_name`` for ``runtime``
    (reused when an earlier case built it): ``{"ckpt", "engine", "build_s", "runtime", "warnings",
    "package_mb"}`` (``runtime``: the one the engine got, torch-compile after an AOTInductor fallback)."""
    from trtbuild.build import build_engine
    from trtbuild.config import Backend, BuildConfig, DType, TorchConfig, TorchDevice, TorchRuntime
    from trtbuild.convert.convert import convert

    ckpt = ckpt or root / f"{tag}-ckpt"
    engine = root / engine_name(tag, runtime)
    if not ckpt.exists():
        convert(hf_dir, ckpt, DType(ckpt_dtype))
    t = time.perf_counter()
    warnings: tuple[str, ...] = ()
    if not engine.exists():
        build = BuildConfig(backend=Backend.TORCH, kv_block_size=16, **build_kw)
        cfg = TorchConfig(device=TorchDevice(device), dtype=DType(dtype_name), torch_runtime=TorchRuntime(runtime))
        warnings = build_engine(ckpt, engine, build, torch=cfg).warnings
    (entry,) = json.loads((engine / "manifest.json").read_text())["engines"]
    seconds = round(time.perf_counter() - t, 1)
    return {"ckpt": ckpt, "engine": engine, "build_s": seconds, "runtime": entry["torch_runtime"],
            "warnings": list(warnings), "package_mb": package_mb(engine)}  # fmt: skip


def package_mb(engine: Path) -> float:
    """MiB of the engine's files under ``engines/``."""
    return round(sum(p.stat().st_size for p in (engine / "engines").rglob("*") if p.is_file()) / 2**20, 2)


def step_batch(token_ids: list[list[int]], starts: list[int], tables: list[list[int]], all_logits: bool = False):
    """One engine step's inputs (``StepBatch.build``)."""
    from trtbuild.runtime.batch import StepBatch

    return StepBatch.build(token_ids, starts, tables, all_logits=all_logits)


def quantize_checkpoint(src: Path, dst: Path, qformat: str, group: int = 128) -> Path:
    """A round-to-nearest int8 (per channel) or int4 (blocked) weight-only checkpoint of the float ``src`` (no
    modelopt), the LM head int8 per channel as ``trtbuild quantize`` makes it by default."""
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
