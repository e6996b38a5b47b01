"""``trtbuild quantize`` of a mixture-of-experts checkpoint (Mixtral, Qwen3-MoE): int8 weight-only, round to
nearest, by trtbuild itself.

int8 weight-only needs no model and no calibration data, so the weights are always made here, with or without a
quantized KV cache (whose scales modelopt then calibrates on the transformers model rebuilt from these weights:
``moe_kv.py``). Every quantized linear (``layout.quantized_linears``: attention, the dense MLPs of Qwen3-MoE's dense
layers, the LM head unless excluded) and every expert's rows get a float32 scale per output row,
``scale = amax / 127``, and ``q = round(w / scale)`` (half to even), the rule of modelopt's INT8_WEIGHT_ONLY_CFG
(whose per-expert quantizers give the same codes and scales: tests/test_moe_kv_quantize.py); a row of zeros takes
scale 1. The routers, norms and the embedding stay float
(``checkpoint.layout``: the experts' tensors).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..checkpoint.dtypes import torch_dtype
from ..checkpoint.layout import quantized_linears
from ..config import ModelConfig, QFormat, QuantConfig
from ..errors import TrtbuildError

INT8_BOUND = 127.0


def check_moe_request(cfg: ModelConfig, qcfg: QuantConfig) -> None:
    """One-line errors for what ``trtbuild quantize`` does not make of an MoE checkpoint."""
    if qcfg.qformat is not QFormat.INT8_WO:
        raise TrtbuildError(
            f"quantize: {cfg.architecture} is a mixture-of-experts model, which trtbuild quantizes to int8_wo only "
            f"(not {qcfg.qformat.value})"
        )


def int8_rows(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``w [..., rows, in]`` -> int8 codes of its shape and float32 scales ``[..., rows]``: ``w ~ q * scale``."""
    w = np.asarray(w, np.float32)
    amax = np.abs(w).max(axis=-1)
    scale = np.where(amax > 0, amax / np.float32(INT8_BOUND), np.float32(1.0)).astype(np.float32)
    q = np.clip(np.rint(w / scale[..., None]), -INT8_BOUND, INT8_BOUND).astype(np.int8)
    return q, scale


def moe_weight_only_tensors(cfg: ModelConfig, weights: dict[str, np.ndarray]) -> dict[str, Any]:
    """The int8 weight-only checkpoint tensors of the float MoE checkpoint ``weights`` (``cfg.quantization`` set):
    float tensors in ``cfg.dtype``, quantized ones int8 with float32 scales."""
    import torch

    assert cfg.moe is not None and cfg.quantization is not None
    tensors: dict[str, Any] = {}
    for prefix in quantized_linears(cfg):
        source = "embed.weight" if prefix == "lm_head" and cfg.tie_word_embeddings else prefix + ".weight"
        q, scale = int8_rows(weights[source])
        tensors[prefix + ".weight"], tensors[prefix + ".weight_scale"] = torch.from_numpy(q), torch.from_numpy(scale)
    for n in cfg.moe.sparse_layers:
        for w in ("gate_up", "down"):
            q, scale = int8_rows(weights[f"layers.{n}.moe.{w}.weight"])
            tensors[f"layers.{n}.moe.{w}.weight"] = torch.from_numpy(q)
            tensors[f"layers.{n}.moe.{w}.weight_scale"] = torch.from_numpy(scale)
    dtype = torch_dtype(cfg.dtype)
    for name, value in weights.items():
        if name not in tensors:
            tensors[name] = torch.from_numpy(np.array(value, np.float32)).to(dtype)
    return {name: t.contiguous() for name, t in tensors.items()}
