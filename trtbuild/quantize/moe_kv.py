"""KV-cache scales of a mixture-of-experts checkpoint (``trtbuild quantize --kv-cache-dtype int8|fp8`` of Mixtral or
Qwen3-MoE): modelopt calibrates the K/V quantizers of the transformers model rebuilt from the quantized weights.

One path per weight-only request: the weights are always ``moe.py``'s (int8 per row by round to nearest, whose codes
and scales are those of modelopt's ``INT8_WEIGHT_ONLY_CFG`` per-expert quantizers, ``_QuantFusedExperts``, which
tests/test_moe_kv_quantize.py checks; or int4 per block), with or without a quantized cache. With one, ``hf_moe.py``
rebuilds the model holding those weights dequantized (``q * scale`` per row, or per block of ``group_size``
in-features for int4: what the engines compute), and modelopt's max calibration over
the calibration samples sets each layer's per-tensor K and V ranges (``calibrate.calibrate_kv_cache``; every other
quantizer stays off), which become ``layers.{n}.attn.{k,v}_scale`` as for the dense families (``export.py``). The
calibrated model, fake-quantizing its cache, is what the quantized checkpoint computes: the tests' oracle.

A tied LM head that is quantized is rebuilt untied (its int8 copy as ``lm_head``, the embedding float), as the
checkpoint holds them.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from ..config import ModelConfig
from ..plugins.moe import dequantize_int4
from .calibrate import calibrate_kv_cache
from .export import kv_scale_tensors
from .hf_moe import build_moe_hf_model


def dequantized_weights(tensors: dict[str, Any], group_size: int) -> dict[str, np.ndarray]:
    """float32 weights of the weight-only checkpoint ``tensors`` (``moe.moe_weight_only_tensors``): each int8
    ``X.weight`` times its ``X.weight_scale`` (one per row, broadcast over the last axis), each packed int4 one
    (uint8, two codes a byte) unpacked and scaled per block of ``group_size`` in-features (the op's oracle,
    ``plugins.moe.dequantize_int4``), the others as they are."""
    import torch

    out: dict[str, np.ndarray] = {}
    for name, t in tensors.items():
        if name.endswith(".weight_scale"):
            continue
        scale = tensors.get(name + "_scale")
        if scale is None:
            out[name] = t.float().numpy()
        elif t.dtype == torch.uint8:  # packed int4: [..., rows, in/2], a scale per block [..., rows, blocks]
            assert scale.shape == (*t.shape[:-1], -(-2 * t.shape[-1] // group_size)), (name, tuple(scale.shape))
            out[name] = dequantize_int4(t.numpy(), scale.float().numpy(), group_size).astype(np.float32)
        else:
            assert t.dtype == torch.int8 and scale.shape == t.shape[:-1], (name, t.dtype, tuple(scale.shape))
            out[name] = (t.float() * scale.float()[..., None]).numpy()
    return out


def moe_kv_scales(
    cfg: ModelConfig, tensors: dict[str, Any], samples: np.ndarray, *, progress: bool = True
) -> tuple[dict[str, Any], Any]:
    """(``layers.{n}.attn.{k,v}_scale`` tensors, the calibrated model) of the quantized MoE checkpoint ``cfg``
    (``quantization.kv_cache_dtype`` int8 or fp8) holding ``tensors``, calibrated on ``samples`` ``[n, L]``."""
    assert cfg.quantization is not None
    weights = dequantized_weights(tensors, cfg.quantization.group_size)
    rebuilt = replace(cfg, tie_word_embeddings=False) if "lm_head.weight" in weights else cfg
    model = build_moe_hf_model(rebuilt, weights)
    calibrate_kv_cache(model, cfg.quantization, samples, progress=progress)
    return kv_scale_tensors(model, cfg), model
