"""The quantized formats on disk: one ``FormatSpec`` per ``QFormat``, and the tensors of a quantized linear.

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
files (``layout.py``; not made by ``trtbuild quantize``): int8 ``weight`` with ``weight_scale [out,
in/32]``, and unsigned int4 codes with ``weight_scale`` and a float ``weight_offset [out, in/32]``,
``weight = q * weight_scale + weight_offset`` (``graph.emit_weight_offset``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

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
    offset: bool = False  # unsigned codes and a float ``weight_offset`` per group: w = q * scale + offset (Q4_1, Q5_K)


DYNAMIC_INT8_BLOCK = 16  # what MatMulNBits quantizes its int8 activations by (backends/onnxruntime/build/weights.py)

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
    QFormat.INT8_MIN_WO: FormatSpec(QFormat.INT8_MIN_WO, Numeric.INT8, None, True, None, False, offset=True),
}

# The LM head, when quantized (``--exclude`` without ``lm_head``), is int8 weight-only in every format
# (``calibrate.quantize_lm_head``): the vocabulary projection does not take int4 or per-tensor activations well.
HEAD_FORMAT = FORMATS[QFormat.INT8_WO]


def linear_format(qcfg: QuantConfig, prefix: str) -> FormatSpec:
    """How the canonical linear ``prefix`` of a ``qcfg`` checkpoint is quantized (``tensor_formats`` first)."""
    if prefix in qcfg.tensor_formats:
        return FORMATS[qcfg.tensor_formats[prefix]]
    return HEAD_FORMAT if prefix == "lm_head" else FORMATS[qcfg.qformat]


def linear_group_size(qcfg: QuantConfig, prefix: str) -> int:
    """In-features per weight block of the blocked tensor ``prefix`` (a linear or ``embed``) of a ``qcfg``
    checkpoint (``tensor_group_sizes`` first)."""
    return qcfg.tensor_group_sizes.get(prefix, qcfg.group_size)


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


def pack_int4(q: Any) -> Any:
    """int4 codes, a torch tensor ``[out, in]`` (int8 in [-8, 7], or uint8 in [0, 15]) -> uint8 ``[out, in/2]``
    (even column in the low nibble)."""
    import torch

    u = (q & 0x0F).view(q.shape[0], q.shape[1] // 2, 2).to(torch.uint8)
    return (u[..., 0] | (u[..., 1] << 4)).contiguous()


def unpack_int4(packed: np.ndarray, *, signed: bool = True) -> np.ndarray:
    """uint8 ``[out, in/2]`` -> ``ml_dtypes.int4`` ``[out, in]`` (``ml_dtypes.uint4`` unless ``signed``); the
    inverse of ``pack_int4``."""
    lo = (packed & 0x0F).astype(np.int8)
    hi = (packed >> 4).astype(np.int8)
    both = np.stack([lo, hi], axis=-1).reshape(packed.shape[0], -1)
    if not signed:
        return both.astype(ml_dtypes.uint4)
    return np.where(both > 7, both - 16, both).astype(ml_dtypes.int4)
