"""``trtbuild quantize`` of a mixture-of-experts checkpoint (Mixtral, Qwen3-MoE): int8 or int4 weight-only, round
to nearest, by trtbuild itself; or int8 SmoothQuant, calibrated by modelopt (``export_experts``).

Weight-only round to nearest needs no model and no calibration data, so the weights are always made here, with or
without a quantized KV cache (whose scales modelopt then calibrates on the transformers model rebuilt from these
weights: ``moe_kv.py``). Every quantized linear (``layout.quantized_linears``: attention, the
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

``int8_sq`` (dynamic activation scales only) goes modelopt's way, as a dense model does (``calibrate.py``), on the
transformers model rebuilt by ``hf_moe.py``: SmoothQuant smooths and quantizes the attention and dense linears;
modelopt's fused-experts wrapper (``_QuantFusedExperts``) gives each expert int8 weights per row and the experts one
shared input quantizer per projection, which modelopt does not smooth, and which ``calibrate.make_inputs_dynamic``
switches to run-time int8 per block of 16 in-features as every input quantizer. The checkpoint's experts are int8
per row as int8_wo's (``export_experts``: modelopt's own codes), and the graph's ``trtbuild::MoE`` node quantizes the
experts' activations per block of 16 (its ``activation_block``: plugins/moe/README.md), what the calibrated model
computes.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..checkpoint.dtypes import torch_dtype
from ..checkpoint.formats import Numeric, linear_format, pack_int4
from ..checkpoint.layout import quantized_linears
from ..config import ActivationScales, ModelConfig, QFormat, QuantConfig
from ..errors import TrtbuildError
from .int4 import quantize_weight

INT8_BOUND = 127.0
MOE_WEIGHT_ONLY = (QFormat.INT8_WO, QFormat.INT4_WO)  # what round to nearest makes of an MoE checkpoint
MOE_QFORMATS = (*MOE_WEIGHT_ONLY, QFormat.INT8_SQ)
# The experts' tensors of modelopt's fused-experts wrapper: canonical name -> its 3-D parameter and its per-expert
# weight quantizers (``_QuantFusedExperts``).
EXPERT_QUANTIZERS = {
    "gate_up": ("gate_up_proj", "gate_up_proj_weight_quantizers"),
    "down": ("down_proj", "down_proj_weight_quantizers"),
}


def check_moe_request(cfg: ModelConfig, qcfg: QuantConfig) -> None:
    """One-line errors for what ``trtbuild quantize`` does not make of an MoE checkpoint."""
    if qcfg.qformat not in MOE_QFORMATS:
        raise TrtbuildError(
            f"quantize: {cfg.architecture} is a mixture-of-experts model, which trtbuild quantizes to int8_wo, "
            f"int4_wo or int8_sq ({qcfg.qformat.value} is not supported for its experts)"
        )
    if qcfg.qformat is QFormat.INT4_WO:
        check_int4_experts(cfg, qcfg)
    if qcfg.qformat is QFormat.INT8_SQ and qcfg.activation_scales is not ActivationScales.DYNAMIC:
        raise TrtbuildError(
            f"quantize: int8_sq of {cfg.architecture} (mixture of experts) takes --activation-scales dynamic only "
            "(the experts' activations are quantized per block of 16 at run time)"
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


def export_experts(model: Any, cfg: ModelConfig) -> dict[str, Any]:
    """``layers.{n}.moe.{gate_up,down}.weight`` (int8 ``[E, rows, in]``) and ``.weight_scale`` (float32 ``[E, rows]``)
    of the calibrated transformers model's fused experts (``_QuantFusedExperts``): each expert's codes recovered
    from its own weight quantizer's fake-quantized weight (``q = fq(w) / scale``, ``scale = amax / 127``), as
    ``export.export_linear`` recovers a linear's."""
    import torch

    assert cfg.moe is not None
    tensors: dict[str, Any] = {}
    for n in cfg.moe.sparse_layers:
        experts = model.get_submodule(f"model.layers.{n}.mlp.experts")
        for w, (param, quantizers) in EXPERT_QUANTIZERS.items():
            codes, scales = [], []
            for e, quantizer in enumerate(getattr(experts, quantizers)):
                weight = getattr(experts, param)[e].detach().float()
                with torch.no_grad():
                    fake = quantizer(weight).float()
                scale = quantizer.amax.detach().float().reshape(-1) / INT8_BOUND
                scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # a row of zeros: int8_rows' scale 1
                codes.append(torch.round(fake / scale[:, None]).clamp(-INT8_BOUND, INT8_BOUND).to(torch.int8))
                scales.append(scale)
            tensors[f"layers.{n}.moe.{w}.weight"] = torch.stack(codes).contiguous()
            tensors[f"layers.{n}.moe.{w}.weight_scale"] = torch.stack(scales).contiguous()
    return tensors
