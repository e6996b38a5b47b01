"""One handler per ``QFormat``: the quantized tensors made offline, and the Q/DQ graph that uses them.

Checkpoint tensors of a quantized linear ``P`` (canonical prefix, e.g. ``layers.0.attn.qkv``; ``[out, in]``):

| tensor | int8_sq | fp8 | int8_wo | int4_wo / int4_awq |
|---|---|---|---|---|
| ``P.weight`` | int8 | float8_e4m3fn | int8 | uint8 ``[out, in/2]``: two int4 per byte, even column in the low nibble |
| ``P.weight_scale`` (float32) | ``[out]`` | ``[out]`` (*) | ``[out]`` | ``[out, ceil(in/group)]`` |
| ``P.input_scale`` (float32) | ``[]``, static | ``[]``, static | — | — |
| ``P.pre_quant_scale`` (float32) | ``[in]`` where not folded | — | — | ``[in]`` where not folded |
| ``P.weight_zero_point`` (uint8) | — | — | — | ``[out, ceil(in/group)]``, values 0..15, with ``zero_points`` |

``weight = q * weight_scale`` (per output channel, or per block of ``group`` input features). (*) fp8 weights are
per output channel with dynamic activations (FP8 rowwise) and per tensor per source module with static ones (the
scale vector is then constant over each fused module's rows: q | k | v). The activation ``x`` is multiplied by
``pre_quant_scale`` (SmoothQuant / AWQ smoothing) and then quantized symmetrically, ``saturate(round(x / s))``:
with ``ActivationScales.STATIC`` by the calibrated per-tensor ``s = input_scale``; with ``DYNAMIC`` by
``s = amax / bound`` of its own values, per block of ``dynamic_block`` in-features of each token (int8: 16) or per
token (fp8; int8 with ``PER_TOKEN``). Zero points are 0 (symmetric) except int4's with ``zero_points``: unsigned
codes (0..15), ``weight = (q - weight_zero_point) * weight_scale``, a ``uint4`` weight with a blocked ``uint4`` zero
point in the graph.

``int8_group_wo`` and ``int4_min_wo`` are llama.cpp's Q8_0 and Q4_1 as ``trtbuild convert`` keeps them from GGUF
files (``quantize/layout.py``; not made by ``trtbuild quantize``): int8 ``weight`` with ``weight_scale [out,
in/32]``, and unsigned int4 codes with ``weight_scale`` and a float ``weight_offset [out, in/32]``,
``weight = q * weight_scale + weight_offset`` (``emit_weight_offset``).

In the portable graph each becomes standard ONNX: ``[Mul] -> QuantizeLinear -> DequantizeLinear`` on the
activation (dynamic scales: ``Reshape -> Abs -> ReduceMax -> Div`` computes them, and the Q/DQ pair is opset-21
blocked along the row), ``DequantizeLinear`` on the ``[in, out]`` weight (``axis=1`` per channel; opset-21
``block_size`` along axis 0 for int4), ``MatMul``. onnxruntime fuses these into ``MatMulIntegerToFloat`` (static
int8) and ``MatMulNBits`` (int8_wo, int4; dynamic int8 after ``backends/onnxruntime/weights.py`` hands the activation
quantization to the kernel, which does exactly that per block of 16); per-token int8 becomes ``MatMulInteger``
(``onnxruntime.weights.integer_gemms_per_token``); fp8 Q/DQ runs emulated in float.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np
import onnx

from ..config import ActivationScales, QFormat, QuantConfig


class Numeric(enum.Enum):
    """A quantized number format and its largest magnitude (the ``amax`` maps to it)."""

    INT8 = "int8"
    FP8 = "fp8"  # FLOAT8E4M3FN
    INT4 = "int4"

    @property
    def bound(self) -> float:
        return {Numeric.INT8: 127.0, Numeric.FP8: 448.0, Numeric.INT4: 7.0}[self]


@dataclass(frozen=True)
class FormatSpec:
    """How a ``QFormat`` quantizes: weight numbers, granularity, activations, and modelopt's config for it."""

    qformat: QFormat
    weights: Numeric
    activations: Numeric | None  # per-tensor activation quantization, None for weight-only
    blocked: bool  # weight scales per block of ``group_size`` input features (else per channel / per tensor)
    modelopt_config: str | None  # attribute of ``modelopt.torch.quantization``; None: kept from GGUF, not made
    smoothing: bool  # calibration sets per-input-channel pre-quant scales (SmoothQuant, AWQ)
    # With ``ActivationScales.DYNAMIC``: in-features per activation scale (None: one per token, the whole row), and
    # modelopt's config when it is not ``modelopt_config`` (int8_sq keeps SmoothQuant's, for the smoothing, and its
    # input quantizers are made dynamic after calibration: ``calibrate.make_inputs_dynamic``).
    dynamic_block: int | None = None
    dynamic_modelopt_config: str | None = None
    offset: bool = False  # unsigned codes and a float ``weight_offset`` per group: w = q * scale + offset (Q4_1)


DYNAMIC_INT8_BLOCK = 16  # what MatMulNBits quantizes its int8 activations by (backends/onnxruntime/weights.py)

FORMATS: dict[QFormat, FormatSpec] = {
    QFormat.INT8_SQ: FormatSpec(
        QFormat.INT8_SQ, Numeric.INT8, Numeric.INT8, False, "INT8_SMOOTHQUANT_CFG", True, DYNAMIC_INT8_BLOCK
    ),
    QFormat.FP8: FormatSpec(
        QFormat.FP8, Numeric.FP8, Numeric.FP8, False, "FP8_DEFAULT_CFG", False, None, "FP8_PER_CHANNEL_PER_TOKEN_CFG"
    ),
    QFormat.INT8_WO: FormatSpec(QFormat.INT8_WO, Numeric.INT8, None, False, "INT8_WEIGHT_ONLY_CFG", False),
    QFormat.INT4_WO: FormatSpec(QFormat.INT4_WO, Numeric.INT4, None, True, "INT4_BLOCKWISE_WEIGHT_ONLY_CFG", False),
    QFormat.INT4_AWQ: FormatSpec(QFormat.INT4_AWQ, Numeric.INT4, None, True, "INT4_AWQ_CFG", True),
    QFormat.INT8_GROUP_WO: FormatSpec(QFormat.INT8_GROUP_WO, Numeric.INT8, None, True, None, False),
    QFormat.INT4_MIN_WO: FormatSpec(QFormat.INT4_MIN_WO, Numeric.INT4, None, True, None, False, offset=True),
}

# The LM head, when quantized (``--exclude`` without ``lm_head``), is int8 weight-only in every format
# (``calibrate.quantize_lm_head``): the vocabulary projection does not take int4 or per-tensor activations well.
HEAD_FORMAT = FORMATS[QFormat.INT8_WO]


def linear_format(qcfg: QuantConfig, prefix: str) -> FormatSpec:
    """How the canonical linear ``prefix`` of a ``qcfg`` checkpoint is quantized (``tensor_formats`` first)."""
    if prefix in qcfg.tensor_formats:
        return FORMATS[qcfg.tensor_formats[prefix]]
    return HEAD_FORMAT if prefix == "lm_head" else FORMATS[qcfg.qformat]


def dynamic_activations(qcfg: QuantConfig) -> bool:
    """Whether ``qcfg``'s activations are quantized with run-time scales (never for weight-only formats)."""
    dynamic = qcfg.activation_scales in (ActivationScales.DYNAMIC, ActivationScales.PER_TOKEN)
    return FORMATS[qcfg.qformat].activations is not None and dynamic


def activation_block(qcfg: QuantConfig) -> int | None:
    """In-features per run-time activation scale of ``qcfg``'s linears (None: one per token, the whole row)."""
    if qcfg.activation_scales is ActivationScales.PER_TOKEN:
        return None
    return FORMATS[qcfg.qformat].dynamic_block


def static_activations(qcfg: QuantConfig) -> bool:
    """Whether ``qcfg``'s activations are quantized with calibrated per-tensor scales (``P.input_scale``)."""
    return FORMATS[qcfg.qformat].activations is not None and qcfg.activation_scales is ActivationScales.STATIC


# ---------------------------------------------------------------------------------------------------------------
# Offline: modelopt-calibrated torch modules -> checkpoint tensors.


def export_linear(spec: FormatSpec, modules: list[Any], prefix: str, static_inputs: bool) -> dict[str, Any]:
    """The checkpoint tensors of the canonical linear ``prefix`` made of the (unified) quantized ``modules``
    (``static_inputs``: with its calibrated per-tensor activation scale).

    The integers are recovered from modelopt's own fake-quantized weight (``q = fq(w) / scale``), so the checkpoint
    holds exactly the values the fake-quantized model computes with. Modules quantized by trtbuild's int4
    (``int4.install``) carry their codes: ``int4.export_int4_linear``.
    """
    import torch

    from .int4 import export_int4_linear, pack_int4

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


def unpack_int4(packed: np.ndarray, *, signed: bool = True) -> np.ndarray:
    """uint8 ``[out, in/2]`` -> ``ml_dtypes.int4`` ``[out, in]`` (``ml_dtypes.uint4`` unless ``signed``); the
    inverse of ``int4.pack_int4``."""
    lo = (packed & 0x0F).astype(np.int8)
    hi = (packed >> 4).astype(np.int8)
    both = np.stack([lo, hi], axis=-1).reshape(packed.shape[0], -1)
    if not signed:
        return both.astype(ml_dtypes.uint4)
    return np.where(both > 7, both - 16, both).astype(ml_dtypes.int4)


# ---------------------------------------------------------------------------------------------------------------
# Build time: checkpoint tensors -> standard Q/DQ in the portable graph.

FP8 = np.dtype(ml_dtypes.float8_e4m3fn)


def is_quantized_linear(weights: dict[str, np.ndarray], prefix: str) -> bool:
    return prefix + ".weight_scale" in weights


def emit_quantized_linear(g: Any, weights: dict[str, np.ndarray], x: str, prefix: str, qcfg: QuantConfig) -> str:
    """``y = x @ W.T (+ b)`` with ``W`` and (for int8_sq / fp8) ``x`` as Q/DQ; returns the output name.

    The weight format follows from the tensors: the weight's dtype (int8, float8_e4m3fn, int4), the scale's rank
    (blocked along in-features by ``group_size`` when 2-D; the last block may be partial, as ONNX's blocked
    DequantizeLinear and onnxruntime's MatMulNBits allow) and the presence of ``input_scale`` / ``pre_quant_scale``;
    activations without an ``input_scale`` are quantized with dynamic scales when the format quantizes them.
    """
    group_size = qcfg.group_size
    spec = linear_format(qcfg, prefix)
    w = weights[prefix + ".weight"]
    scale = np.asarray(weights[prefix + ".weight_scale"], dtype=np.float32)
    if prefix + ".pre_quant_scale" in weights:
        pqs = g.initializer(prefix + ".pre_quant_scale", np.asarray(weights[prefix + ".pre_quant_scale"], np.float32))
        x = g.op("Mul", [x, pqs], name=prefix + ".smooth")
    if prefix + ".input_scale" in weights:
        s = g.initializer(prefix + ".input_scale", np.asarray(weights[prefix + ".input_scale"], np.float32))
        zero = np.array(0, dtype=FP8 if w.dtype == FP8 else np.int8)  # activations use the weights' number format
        zp = g.initializer(prefix + ".input_zero_point", zero)
        xq = g.op("QuantizeLinear", [x, s, zp], name=prefix + ".input_q")
        x = g.op("DequantizeLinear", [xq, s, zp], name=prefix + ".input_dq")
    elif spec.activations is not None:
        block = activation_block(qcfg) or w.shape[1]
        x = emit_dynamic_quantization(g, x, spec.activations, block, w.shape[1], prefix + ".input_dynamic")
    wt = g.initializer(prefix + ".weight", np.ascontiguousarray(w.T))  # [in, out]
    if scale.ndim == 2:  # [out, ceil(in/group)] -> blocked along the in axis of [in, out]
        assert scale.shape[1] == -(-w.shape[1] // group_size), (prefix, scale.shape, group_size)
        inputs = [wt, g.initializer(prefix + ".weight_scale", np.ascontiguousarray(scale.T))]
        if prefix + ".weight_zero_point" in weights:  # uint4 codes, uint4 zero point per block
            zp = np.asarray(weights[prefix + ".weight_zero_point"]).T.astype(ml_dtypes.uint4)
            inputs.append(g.initializer(prefix + ".weight_zero_point", zp))
        wd = g.op("DequantizeLinear", inputs, name=prefix + ".weight_dq", axis=0, block_size=group_size)
        if prefix + ".weight_offset" in weights:  # GGUF Q4_1: w = q * scale + offset, whole groups
            wd = emit_weight_offset(g, wd, np.asarray(weights[prefix + ".weight_offset"]), group_size, prefix)
    else:
        st = g.initializer(prefix + ".weight_scale", scale)
        wd = g.op("DequantizeLinear", [wt, st], name=prefix + ".weight_dq", axis=1)
    y = g.op("MatMul", [x, wd], name=prefix)
    if prefix + ".bias" in weights:
        y = g.op("Add", [y, g.initializer(prefix + ".bias", weights[prefix + ".bias"])], name=prefix + ".bias_add")
    return y


def emit_weight_offset(g: Any, wd: str, offset: np.ndarray, group: int, prefix: str) -> str:
    """The dequantized weight ``wd`` ``[in, out]`` plus ``offset`` ``[out, in / group]`` over each group of ``group``
    in-features (``Reshape -> Add -> Reshape``; ``backends/onnxruntime`` lowers the pattern onto one kernel)."""
    out_f, groups = offset.shape
    shaped = g.op("Reshape", [wd, g.const([groups, group, out_f])], name=prefix + ".weight_groups")
    off = g.initializer(prefix + ".weight_offset", np.ascontiguousarray(offset.T.astype(np.float32)[:, None, :]))
    shifted = g.op("Add", [shaped, off], name=prefix + ".weight_offset_add")
    return g.op("Reshape", [shifted, g.const([groups * group, out_f])], name=prefix + ".weight_rows")


def emit_dynamic_quantization(g: Any, x: str, numeric: Numeric, block: int, width: int, name: str) -> str:
    """``x`` ``[tokens, width]`` through symmetric Q/DQ with scales computed from its own values: per block of
    ``block`` in-features of each token, ``s = max(amax / bound, tiny)`` (an all-zero block stays zero); the nodes
    are named ``{name}.*``, the Q node ``{name}.q`` (``backends/onnxruntime/weights.py`` finds them by these names)."""
    assert width % block == 0, (name, width, block)  # quantize.check_request refuses other widths
    blocks = g.op("Reshape", [x, g.const([-1, width // block, block])], name=name + ".blocks")
    amax = g.op("ReduceMax", [g.op("Abs", [blocks], name=name + ".abs"), g.const([-1])], name=name + ".amax")
    scale = g.op("Div", [amax, g.const(numeric.bound, np.float32)], name=name + ".scale")
    scale = g.op("Max", [scale, g.const(np.finfo(np.float32).tiny, np.float32)], name=name + ".scale_floor")
    to = onnx.TensorProto.FLOAT8E4M3FN if numeric is Numeric.FP8 else onnx.TensorProto.INT8
    q = g.op("QuantizeLinear", [blocks, scale], name=name + ".q", axis=2, block_size=block, output_dtype=to)
    dq = g.op("DequantizeLinear", [q, scale], name=name + ".dq", axis=2, block_size=block)
    return g.op("Reshape", [dq, g.const([-1, width])], name=name + ".rows")
