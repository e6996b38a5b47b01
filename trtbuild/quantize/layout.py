"""The tensors of a quantized checkpoint, and loading one for ``trtbuild build``.

A quantized checkpoint is a float checkpoint (``convert.layout``) whose quantized linears carry the tensors of
``formats.py`` instead of a float weight, plus ``layers.{i}.attn.k_scale`` / ``v_scale`` (float32 ``[]``) when
the KV cache is quantized. SmoothQuant/AWQ pre-quant scales are folded where a preceding op can absorb them
exactly: into ``input_norm`` for ``attn.qkv``, into ``post_attn_norm`` for ``mlp.gate_up`` and into the up rows'
weight scales of ``mlp.gate_up`` for ``mlp.down``; ``attn.out`` keeps an explicit ``pre_quant_scale`` (its input,
the attention output, is only linear per KV head, which GQA shares across query heads). A quantized ``lm_head``
(not excluded) is int8 weight-only in every format (``formats.HEAD_FORMAT``); a tied one gets its own int8
``lm_head.weight`` while ``embed.weight`` stays float.

A checkpoint converted from a GGUF file keeps llama.cpp's block formats (``QuantConfig.tensor_formats`` says which
tensor has which): Q8_0 as ``int8_group_wo`` (int8 ``weight``, ``weight_scale [out, in/32]``), Q4_0 as ``int4_wo``
at group 32, Q4_1 as ``int4_min_wo`` (unsigned codes, ``weight_scale`` and ``weight_offset [out, in/32]``:
``w = q * scale + offset``); scales and offsets are stored float16 (GGUF's own d and m, exactly). A Q8_0 embedding
is ``embed.weight`` int8 + ``embed.weight_scale``, and a tied head then reads those tensors.
"""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np

from ..checkpoint import WEIGHTS_FILE, load_checkpoint
from ..config import ActivationScales, KVCacheDType, ModelConfig, QFormat, QuantConfig
from ..convert.layout import expected_tensors
from ..errors import BuildError, ConfigError
from .formats import FORMATS, FormatSpec, Numeric, linear_format, unpack_int4
from .hf_model import canonical_linears, excluded_linears

UNFOLDED_PRE_QUANT_SCALE = ("attn.out",)  # canonical linears whose smoothing stays an explicit Mul


def quantized_linears(cfg: ModelConfig) -> list[str]:
    q = cfg.quantization
    assert q is not None
    excluded = set(excluded_linears(cfg, q.exclude))
    if cfg.tie_word_embeddings and "embed" in q.tensor_formats:
        excluded.add("lm_head")  # the tied head reads the quantized embedding's tensors
    return [name for name in canonical_linears(cfg) if name not in excluded]


def unsigned_codes(q: QuantConfig, spec: FormatSpec) -> bool:
    """Whether ``spec``'s int4 codes are stored unsigned (0..15: zero points, or a GGUF Q4_1 offset)."""
    return spec.weights is Numeric.INT4 and (q.zero_points or spec.offset)


def expected_quantized_tensors(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], str]]:
    """Canonical name -> (shape, safetensors dtype) of every tensor of the quantized checkpoint ``cfg``."""
    q = cfg.quantization
    assert q is not None
    out = {name: (shape, "F32") for name, shape in expected_tensors(cfg).items()}
    for prefix in quantized_linears(cfg):
        spec = linear_format(q, prefix)
        rows, cols = (cfg.vocab_size, cfg.hidden_size) if prefix == "lm_head" else out[prefix + ".weight"][0]
        groups = -(-cols // q.group_size)  # the last group may be partial
        if spec.weights is Numeric.INT4:
            out[prefix + ".weight"] = ((rows, cols // 2), "U8")
            out[prefix + ".weight_scale"] = ((rows, groups), "F32")
            if q.zero_points and not spec.offset:
                out[prefix + ".weight_zero_point"] = ((rows, groups), "U8")
            if spec.offset:
                out[prefix + ".weight_offset"] = ((rows, groups), "F32")
        elif spec.blocked:  # int8 per group (GGUF Q8_0)
            out[prefix + ".weight"] = ((rows, cols), "I8")
            out[prefix + ".weight_scale"] = ((rows, groups), "F32")
        else:
            out[prefix + ".weight"] = ((rows, cols), "F8_E4M3" if spec.weights is Numeric.FP8 else "I8")
            out[prefix + ".weight_scale"] = ((rows,), "F32")
        if spec.activations is not None and q.activation_scales is ActivationScales.STATIC:
            out[prefix + ".input_scale"] = ((), "F32")
        if spec.smoothing and prefix.endswith(UNFOLDED_PRE_QUANT_SCALE):
            out[prefix + ".pre_quant_scale"] = ((cols,), "F32")
    if "embed" in q.tensor_formats:  # int8 per group (GGUF Q8_0), gathered and dequantized row by row
        assert FORMATS[q.tensor_formats["embed"]].qformat is QFormat.INT8_GROUP_WO
        out["embed.weight"] = ((cfg.vocab_size, cfg.hidden_size), "I8")
        out["embed.weight_scale"] = ((cfg.vocab_size, -(-cfg.hidden_size // q.group_size)), "F32")
    if q.kv_cache_dtype is not KVCacheDType.FLOAT32:
        for n in range(cfg.num_layers):
            out[f"layers.{n}.attn.k_scale"] = ((), "F32")
            out[f"layers.{n}.attn.v_scale"] = ((), "F32")
    return out


def load_any_checkpoint(ckpt_dir: Path) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """A float or quantized checkpoint for the graph: float tensors as float32, quantized weights as int8,
    ``ml_dtypes.float8_e4m3fn`` or ``ml_dtypes.int4`` ``[out, in]`` (unpacked; ``ml_dtypes.uint4`` with zero
    points, which load as ``ml_dtypes.uint4`` ``[out, groups]``)."""
    if not (ckpt_dir / "config.json").is_file():
        return load_checkpoint(ckpt_dir)  # its errors name what is missing
    try:
        cfg = ModelConfig.load(ckpt_dir)
    except ConfigError as e:
        raise BuildError(f"{ckpt_dir}: invalid checkpoint config: {e}") from None
    if cfg.quantization is None:
        return load_checkpoint(ckpt_dir)
    path = ckpt_dir / WEIGHTS_FILE
    if not path.is_file():
        raise BuildError(f"{ckpt_dir}: missing {WEIGHTS_FILE}")
    import torch
    from safetensors import safe_open

    expected = expected_quantized_tensors(cfg)
    weights: dict[str, np.ndarray] = {}
    try:
        with safe_open(str(path), framework="pt") as f:
            names = set(f.keys())
            for name, (shape, dtype) in expected.items():
                if name not in names:
                    raise BuildError(f"{path}: missing tensor {name}")
                t = f.get_tensor(name)
                if tuple(t.shape) != shape:
                    raise BuildError(f"{path}: tensor {name} has shape {tuple(t.shape)}, expected {shape}")
                want = {"F8_E4M3": torch.float8_e4m3fn, "U8": torch.uint8, "I8": torch.int8}.get(dtype)
                if (want is not None and t.dtype is not want) or (want is None and not t.dtype.is_floating_point):
                    raise BuildError(f"{path}: tensor {name} has dtype {t.dtype}, expected {dtype}")
                if t.dtype is torch.float8_e4m3fn:
                    weights[name] = t.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)
                elif name.endswith(".weight_zero_point"):
                    weights[name] = t.numpy().astype(ml_dtypes.uint4)
                elif dtype == "U8":
                    spec = linear_format(cfg.quantization, name.removesuffix(".weight"))
                    weights[name] = unpack_int4(t.numpy(), signed=not unsigned_codes(cfg.quantization, spec))
                elif dtype == "I8":
                    weights[name] = t.numpy()
                else:
                    weights[name] = t.float().numpy()
    except BuildError:
        raise
    except Exception as e:  # corrupt header or truncated file
        raise BuildError(f"{path}: unreadable ({e})") from None
    extra = sorted(names - set(expected))
    if extra:
        raise BuildError(f"{path}: unexpected tensor {extra[0]}")
    return cfg, weights
