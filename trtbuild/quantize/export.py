"""Calibrated torch model -> the tensors of the quantized checkpoint (``checkpoint.formats`` says which).

``export_linear`` recovers each quantized linear's integers and scales from the calibrated modules; ``export_tensors``
adds the float tensors, folds the pre-quant scales where ``checkpoint.layout`` says they fold, and adds the KV-cache
scales (``kv_scale_tensors``, which a mixture-of-experts checkpoint's ``moe_kv.py`` reads too).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..checkpoint.dtypes import torch_dtype
from ..checkpoint.formats import FORMATS, FormatSpec, Numeric, linear_format, pack_int4, static_activations
from ..checkpoint.layout import UNFOLDED_PRE_QUANT_SCALE, quantized_linears
from ..config import KVCacheDType, ModelConfig
from ..errors import TrtbuildError
from .calibrate import KV_NUM_BITS
from .hf_model import hf_modules
from .moe import export_experts

KV_BOUND = {KVCacheDType.INT8: Numeric.INT8.bound, KVCacheDType.FP8: Numeric.FP8.bound}


def export_tensors(model: Any, cfg: ModelConfig, weights: dict[str, np.ndarray]) -> dict[str, Any]:
    """The quantized checkpoint's tensors: float tensors in ``cfg.dtype``, quantized linears per
    ``checkpoint.formats``."""
    import torch

    q = cfg.quantization
    assert q is not None
    spec = FORMATS[q.qformat]
    dtype = torch_dtype(cfg.dtype)
    floats = {name: torch.from_numpy(np.array(w, dtype=np.float32)) for name, w in weights.items()}
    tensors: dict[str, Any] = {}
    for prefix in quantized_linears(cfg):
        modules = [model.get_submodule(m) for m in hf_modules(cfg, prefix)]
        tensors.update(export_linear(linear_format(q, prefix), modules, prefix, static_activations(q)))
        floats.pop(prefix + ".weight", None)  # a tied lm_head has no tensor of its own: the quantized one is new
    i = cfg.intermediate_size
    for n in range(cfg.num_layers):
        p = f"layers.{n}."
        for linear, norm in (("attn.qkv", "input_norm"), ("mlp.gate_up", "post_attn_norm")):
            pqs = tensors.pop(f"{p}{linear}.pre_quant_scale", None)
            if pqs is not None:
                floats[f"{p}{norm}.weight"] *= pqs
        pqs = tensors.pop(p + "mlp.down.pre_quant_scale", None)
        if pqs is not None:  # down's input is silu(gate) * up: scale the up rows of gate_up
            if p + "mlp.gate_up.weight" in floats:
                floats[p + "mlp.gate_up.weight"][i:] *= pqs[:, None]
            else:
                scale = tensors[p + "mlp.gate_up.weight_scale"]
                assert scale.ndim >= 1, "per-tensor weight scales cannot absorb a pre-quant scale"
                scale[i:] *= pqs if scale.ndim == 1 else pqs[:, None]
    if spec.smoothing:  # a module whose smoothing search gave up has no pre-quant scale: use ones
        for prefix in quantized_linears(cfg):
            if prefix.endswith(UNFOLDED_PRE_QUANT_SCALE):
                width = model.get_submodule(hf_modules(cfg, prefix)[0]).in_features
                tensors.setdefault(prefix + ".pre_quant_scale", torch.ones(width))
    if cfg.moe is not None:  # int8_sq's experts: int8 per row (moe.export_experts); the routers stay float
        experts = export_experts(model, cfg)
        tensors.update(experts)
        for name in experts:
            floats.pop(name, None)
    if q.kv_cache_dtype in KV_NUM_BITS:
        tensors.update(kv_scale_tensors(model, cfg))
    tensors.update({name: t.to(dtype).contiguous() for name, t in floats.items()})
    return {name: t.contiguous() for name, t in tensors.items()}


def kv_scale_tensors(model: Any, cfg: ModelConfig) -> dict[str, Any]:
    """``layers.{n}.attn.k_scale`` / ``v_scale`` (float32 ``[]``: ``amax / bound`` of the KV dtype) of the calibrated
    model's per-tensor K/V quantizers."""
    assert cfg.quantization is not None
    bound = KV_BOUND[cfg.quantization.kv_cache_dtype]
    tensors: dict[str, Any] = {}
    for n in range(cfg.num_layers):
        attn = model.get_submodule(f"model.layers.{n}.self_attn")
        for kv in ("k", "v"):
            amax = getattr(attn, f"{kv}_bmm_quantizer").amax
            if amax is None:
                raise TrtbuildError(f"calibration produced no {kv} range for layer {n} (no calibration data?)")
            tensors[f"layers.{n}.attn.{kv}_scale"] = (amax.detach().float().reshape(()) / bound).clone()
    return tensors


def export_linear(spec: FormatSpec, modules: list[Any], prefix: str, static_inputs: bool) -> dict[str, Any]:
    """The checkpoint tensors of the canonical linear ``prefix`` made of the (unified) quantized ``modules``
    (``static_inputs``: with its calibrated per-tensor activation scale).

    The integers are recovered from modelopt's own fake-quantized weight (``q = fq(w) / scale``), so the checkpoint
    holds exactly the values the fake-quantized model computes with. Modules quantized by trtbuild's int4
    (``int4.install``) carry their codes: ``int4.export_int4_linear``.
    """
    import torch

    from .int4 import export_int4_linear

    if hasattr(modules[0], "int4_weight"):
        return export_int4_linear(modules, prefix)

    ints, scales = [], []
    for m in modules:
        with torch.no_grad():
            w = m.weight.detach().float()
            fq = m.weight_quantizer(w).float()
            amax = m.weight_quantizer.amax.detach().float()
        out_f, in_f = w.shape
        if spec.blocked:  # [out, ceil(in/group)]: a partial last group is zero-padded by modelopt, as ONNX's is
            scale = amax.reshape(out_f, -1) / spec.weights.bound
            group = m.weight_quantizer.block_sizes[-1]
            assert scale.shape[1] == -(-in_f // group), (prefix, tuple(scale.shape), group)
            q = fq / scale.repeat_interleave(group, dim=1)[:, :in_f]
        elif amax.numel() == 1:
            scale = (amax.reshape(()) / spec.weights.bound).expand(out_f)
            q = fq / scale[:, None]
        else:
            scale = amax.reshape(out_f) / spec.weights.bound
            q = fq / scale[:, None]
        ints.append(q)
        scales.append(scale)
    q, scale = torch.cat(ints), torch.cat(scales)
    out: dict[str, Any] = {}
    if spec.weights is Numeric.FP8:
        out[prefix + ".weight"] = q.to(torch.float8_e4m3fn)
        out[prefix + ".weight_scale"] = scale.contiguous()  # per channel, or each fused module's per-tensor scale
    else:
        qi = torch.round(q).clamp(-spec.weights.bound - 1, spec.weights.bound).to(torch.int8)
        out[prefix + ".weight"] = pack_int4(qi) if spec.weights is Numeric.INT4 else qi
        out[prefix + ".weight_scale"] = scale.contiguous()
    first = modules[0].input_quantizer
    if spec.activations is not None and static_inputs:
        out[prefix + ".input_scale"] = (first.amax.detach().float().reshape(()) / spec.activations.bound).clone()
    if first.pre_quant_scale is not None:
        out[prefix + ".pre_quant_scale"] = first.pre_quant_scale.detach().float().clone()
    return out
