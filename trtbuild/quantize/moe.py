"""``trtbuild quantize`` of a mixture-of-experts checkpoint (Mixtral, Qwen3-MoE): int8 or int4 weight-only, round
to nearest, by trtbuild itself.

Weight-only round to nearest needs no model and no calibration data, so the weights are always made here, with or
without a quantized KV cache (whose scales modelopt then calibrates on the transformers model rebuilt from these
weights: ``moe_kv.py``; int8 experts only). Every quantized linear (``layout.quantized_linears``: attention, the
dense MLPs of Qwen3-MoE's dense layers, the LM head unless excluded) and every expert's rows are quantized:
- int8_wo: a float32 scale per output row, ``scale = amax / 127``, and ``q = round(w / scale)`` (half to even), the
  rule of modelopt's INT8_WEIGHT_ONLY_CFG (whose per-expert quantizers give the same codes and scales:
  tests/test_moe_kv_quantize.py); a row of zeros takes scale 1;
- int4_wo: symmetric int4 per block of ``group_size`` in-features (a last partial block where it does not divide
  them), ``int4.quantize_weight``'s rule (modelopt's INT4 round to nearest: ``scale = amax / 7``,
  ``q = clamp(round(w / scale), -8, 7)``), packed two codes a byte in the dense int4 format (``formats.py``), each
  expert's rows alike (``[E, rows, in/2]`` codes, ``[E, rows, blocks]`` scales); the LM head is int8 per row as in
  every format (``formats.HEAD_FORMAT``).
The routers, norms and the embedding stay float (``checkpoint.layout``: the experts' tensors).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..checkpoint.dtypes import torch_dtype
from ..checkpoint.formats import Numeric, linear_format, pack_int4
from ..checkpoint.layout import quantized_linears
from ..config import KVCacheDType, ModelConfig, QFormat, QuantConfig
from ..errors import TrtbuildError
from .int4 import quantize_weight

INT8_BOUND = 127.0
MOE_QFORMATS = (QFormat.INT8_WO, QFormat.INT4_WO)  # what round to nearest makes of an MoE checkpoint


def check_moe_request(cfg: ModelConfig, qcfg: QuantConfig) -> None:
    """One-line errors for what ``trtbuild quantize`` does not make of an MoE checkpoint."""
    if qcfg.qformat not in MOE_QFORMATS:
        raise TrtbuildError(
            f"quantize: {cfg.architecture} is a mixture-of-experts model, which trtbuild quantizes to int8_wo or "
            f"int4_wo only, by round to nearest ({qcfg.qformat.value} needs calibration)"
        )
    if qcfg.qformat is QFormat.INT4_WO:
        check_int4_experts(cfg, qcfg)
        if qcfg.kv_cache_dtype is not KVCacheDType.FLOAT32:  # moe_kv.py rebuilds the model from int8 experts only
            raise TrtbuildError(
                f"quantize: --kv-cache-dtype is not supported with int4_wo for {cfg.architecture} (mixture of "
                "experts); int8_wo takes it"
            )


def check_int4_experts(cfg: ModelConfig, qcfg: QuantConfig) -> None:
    """One-line errors for int4 experts ``trtbuild::MoE`` does not take: zero points (its int4 is symmetric) and odd
    in-features (two codes a byte per row)."""
    assert cfg.moe is not None
    if qcfg.zero_points:
        raise TrtbuildError(f"quantize: --zero-points is not supported for {cfg.architecture}'s int4 experts")
    odd = sorted(w for w in {cfg.hidden_size, cfg.moe.intermediate_size} if w % 2)
    if odd:
        raise TrtbuildError(f"quantize: int4 experts pack two in-features a byte; {cfg.architecture} has {odd[0]}")


def int8_rows(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``w [..., rows, in]`` -> int8 codes of its shape and float32 scales ``[..., rows]``: ``w ~ q * scale``."""
    w = np.asarray(w, np.float32)
    amax = np.abs(w).max(axis=-1)
    scale = np.where(amax > 0, amax / np.float32(INT8_BOUND), np.float32(1.0)).astype(np.float32)
    q = np.clip(np.rint(w / scale[..., None]), -INT8_BOUND, INT8_BOUND).astype(np.int8)
    return q, scale


def int4_blocks(w: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray]:
    """``w [..., rows, in]`` (in even) -> packed int4 codes uint8 ``[..., rows, in/2]`` (in-feature 2j in byte j's
    low nibble) and float32 scales ``[..., rows, ceil(in / group)]``: ``int4.quantize_weight``'s symmetric rule per
    block of ``group`` in-features of each row."""
    import torch

    w = np.asarray(w, np.float32)
    q = quantize_weight(torch.from_numpy(np.ascontiguousarray(w.reshape(-1, w.shape[-1]))), group, zero_points=False)
    packed = pack_int4(q.codes).numpy().reshape(*w.shape[:-1], w.shape[-1] // 2)
    return packed, q.scale.numpy().reshape(*w.shape[:-1], -1)


def moe_weight_only_tensors(cfg: ModelConfig, weights: dict[str, np.ndarray]) -> dict[str, Any]:
    """The weight-only checkpoint tensors (int8_wo or int4_wo) of the float MoE checkpoint ``weights``
    (``cfg.quantization`` set): float tensors in ``cfg.dtype``, quantized ones int8 or packed int4 (uint8) with
    float32 scales."""
    import torch

    assert cfg.moe is not None and cfg.quantization is not None
    qcfg = cfg.quantization

    def quantized(w: np.ndarray, int4: bool) -> tuple[Any, Any]:
        q, scale = int4_blocks(w, qcfg.group_size) if int4 else int8_rows(w)
        return torch.from_numpy(q), torch.from_numpy(scale)

    tensors: dict[str, Any] = {}
    for prefix in quantized_linears(cfg):
        source = "embed.weight" if prefix == "lm_head" and cfg.tie_word_embeddings else prefix + ".weight"
        int4 = linear_format(qcfg, prefix).weights is Numeric.INT4
        tensors[prefix + ".weight"], tensors[prefix + ".weight_scale"] = quantized(weights[source], int4)
    for n in cfg.moe.sparse_layers:
        for w in ("gate_up", "down"):
            name = f"layers.{n}.moe.{w}"
            int4 = qcfg.qformat is QFormat.INT4_WO
            tensors[name + ".weight"], tensors[name + ".weight_scale"] = quantized(weights[name + ".weight"], int4)
    dtype = torch_dtype(cfg.dtype)
    for name, value in weights.items():
        if name not in tensors:
            tensors[name] = torch.from_numpy(np.array(value, np.float32)).to(dtype)
    return {name: t.contiguous() for name, t in tensors.items()}
