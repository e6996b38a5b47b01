"""The quantized formats in the portable graph: checkpoint tensors (``formats.py``) -> standard Q/DQ ONNX nodes.

Each format becomes standard ONNX: ``[Mul] -> QuantizeLinear -> DequantizeLinear`` on the activation (dynamic
scales: ``Reshape -> Abs -> ReduceMax -> Div`` computes them, and the Q/DQ pair is opset-21 blocked along the row),
``DequantizeLinear`` on the ``[in, out]`` weight (``axis=1`` per channel; opset-21 ``block_size`` along axis 0 for
int4), ``MatMul``. onnxruntime fuses these into ``MatMulIntegerToFloat`` (static int8) and ``MatMulNBits`` (int8_wo,
int4; dynamic int8 after ``backends/onnxruntime/build/weights.py`` hands the activation quantization to the kernel,
which does exactly that per block of 16); per-token int8 becomes ``MatMulInteger`` (``integer_gemms_per_token`` in
the same file); fp8 Q/DQ runs emulated in float.

The builder ``g`` is a ``trtbuild.graph.builder.GraphBuilder`` (typed ``Any``: ``trtbuild.graph`` imports this
module, not the other way round). Called by ``trtbuild.graph.emit`` for each linear that has a ``weight_scale``.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import onnx

from ..config import QuantConfig
from .formats import Numeric, activation_block, linear_format, linear_group_size

FP8 = np.dtype(ml_dtypes.float8_e4m3fn)


def emit_quantized_linear(g: Any, weights: dict[str, np.ndarray], x: str, prefix: str, qcfg: QuantConfig) -> str:
    """``y = x @ W.T (+ b)`` with ``W`` and (for int8_sq / fp8) ``x`` as Q/DQ; returns the output name.

    The weight format follows from the tensors: the weight's dtype (int8, float8_e4m3fn, int4), the scale's rank
    (blocked along in-features by ``linear_group_size`` when 2-D; the last block may be partial, as ONNX's blocked
    DequantizeLinear and onnxruntime's MatMulNBits allow) and the presence of ``input_scale`` / ``pre_quant_scale``;
    activations without an ``input_scale`` are quantized with dynamic scales when the format quantizes them.
    """
    group_size = linear_group_size(qcfg, prefix)
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


def emit_row_offset(g: Any, rows: str, offset: str, group: int, width: int, prefix: str) -> str:
    """Dequantized rows ``rows`` ``[N, width]`` (an embedding's, laid out as the checkpoint's ``[out, in]``) plus
    ``offset`` ``[N, width / group, 1]`` over each group of ``group`` (``Reshape -> Add -> Reshape``, the nodes
    ``{prefix}.weight_groups`` / ``_offset_add`` / ``_rows``)."""
    assert width % group == 0, (prefix, width, group)  # GGUF rows are whole blocks
    shaped = g.op("Reshape", [rows, g.const([-1, width // group, group])], name=prefix + ".weight_groups")
    shifted = g.op("Add", [shaped, offset], name=prefix + ".weight_offset_add")
    return g.op("Reshape", [shifted, g.const([-1, width])], name=prefix + ".weight_rows")


def emit_dynamic_quantization(g: Any, x: str, numeric: Numeric, block: int, width: int, name: str) -> str:
    """``x`` ``[tokens, width]`` through symmetric Q/DQ with scales computed from its own values: per block of
    ``block`` in-features of each token, ``s = max(amax / bound, tiny)`` (an all-zero block stays zero); the nodes
    are named ``{name}.*``, the Q node ``{name}.q`` (``backends/onnxruntime/build/weights.py`` finds them by these
    names)."""
    assert width % block == 0, (name, width, block)  # quantize.check_request refuses other widths
    blocks = g.op("Reshape", [x, g.const([-1, width // block, block])], name=name + ".blocks")
    amax = g.op("ReduceMax", [g.op("Abs", [blocks], name=name + ".abs"), g.const([-1])], name=name + ".amax")
    scale = g.op("Div", [amax, g.const(numeric.bound, np.float32)], name=name + ".scale")
    scale = g.op("Max", [scale, g.const(np.finfo(np.float32).tiny, np.float32)], name=name + ".scale_floor")
    to = onnx.TensorProto.FLOAT8E4M3FN if numeric is Numeric.FP8 else onnx.TensorProto.INT8
    q = g.op("QuantizeLinear", [blocks, scale], name=name + ".q", axis=2, block_size=block, output_dtype=to)
    dq = g.op("DequantizeLinear", [q, scale], name=name + ".dq", axis=2, block_size=block)
    return g.op("Reshape", [dq, g.const([-1, width])], name=name + ".rows")
