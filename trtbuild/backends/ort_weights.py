"""onnxruntime lowering of per-channel int8 weights: blocked ``DequantizeLinear`` so ``MatMulNBits`` takes them.

The portable graph states an int8 weight-only linear as a per-output-channel ``DequantizeLinear`` (``axis=1`` on the
``[in, out]`` weight) feeding ``MatMul``. onnxruntime fuses that into ``MatMulNBits`` (8 bits) with blocks of 32
in-features, and its fast CPU path (accuracy level 4) quantizes the *activations* to int8 per block of the same
length. On SmolLM2-135M blocks of 32 cost +0.74% perplexity over float activations, blocks of 16 +0.38% (the
weights alone: +0.29%; emulated in torch on 8 x 512 tokens of lee_news, the engine measured the same). So this pass
restates each such weight as the same int8 codes with its per-channel scale repeated over blocks of
``ACTIVATION_BLOCK`` in-features: identical weights, finer activation quantization inside the kernel, at the same
speed (float-activation levels 0/1 of the 8-bit kernel are ~50x slower on the CPU).

W8A8 with dynamic activation scales (``int8_sq``'s default) is the same kernel: the portable graph states the
activation's Q/DQ per block of 16 in-features with run-time scales (``quantize.formats.emit_dynamic_quantization``),
which is what MatMulNBits does inside itself, so ``hand_activations_to_kernel`` removes those nodes and the MatMul
then takes the float activation and becomes MatMulNBits like a weight-only one.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

ACTIVATION_BLOCK = 16  # MatMulNBits' smallest block


def hand_activations_to_kernel(model: onnx.ModelProto, block: int = ACTIVATION_BLOCK) -> onnx.ModelProto:
    """Remove, in place, each dynamic int8 activation Q/DQ (per ``block`` in-features) feeding a MatMul of an int8
    weight: MatMulNBits quantizes its activations exactly so (accuracy level 4). Returns ``model``."""
    graph = model.graph
    producer = {out: n for n in graph.node for out in n.output}
    inits = {t.name: t for t in graph.initializer}
    dead: set[str] = set()
    for node in graph.node:
        if node.op_type != "MatMul":
            continue
        rows, weight_dq = producer.get(node.input[0]), producer.get(node.input[1])
        dq = producer.get(rows.input[0]) if rows is not None and rows.op_type == "Reshape" else None
        q = producer.get(dq.input[0]) if dq is not None and dq.op_type == "DequantizeLinear" else None
        if q is None or q.op_type != "QuantizeLinear" or not q.name.endswith(".q"):
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in q.attribute}
        weight = inits.get(weight_dq.input[0]) if weight_dq is not None else None
        if attrs.get("output_dtype") != TensorProto.INT8 or attrs.get("block_size") != block:
            continue
        if weight is None or weight.data_type != TensorProto.INT8:
            continue
        base = q.name[: -len("q")]  # the emitted nodes are named {base}blocks, {base}abs, ..., {base}rows
        blocks = producer[q.input[0]]
        node.input[0] = blocks.input[0]
        dead.update(n.name for n in graph.node if n.name.startswith(base))
    kept = [n for n in graph.node if n.name not in dead]
    del graph.node[:]
    graph.node.extend(kept)
    return model


def reblock_int8_weights(model: onnx.ModelProto, block: int = ACTIVATION_BLOCK) -> onnx.ModelProto:
    """Rewrite, in place, each per-channel int8 weight ``DequantizeLinear`` feeding a ``MatMul`` of float
    activations as blocked by ``block`` along in-features (scales repeated); returns ``model``. Other Q/DQ nodes
    (SmoothQuant's W8A8 linears included) are left alone."""
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    dequantized = {n.output[0] for n in graph.node if n.op_type == "DequantizeLinear"}
    # weight-only linears: a MatMul of float activations (int8 ones fuse into MatMulIntegerToFloat, per channel)
    matmul_weights = {n.input[1] for n in graph.node if n.op_type == "MatMul" and n.input[0] not in dequantized}
    for node in graph.node:
        if node.op_type != "DequantizeLinear" or node.output[0] not in matmul_weights or len(node.input) > 2:
            continue
        weight, scale = inits.get(node.input[0]), inits.get(node.input[1])
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if weight is None or scale is None or weight.data_type != TensorProto.INT8 or len(weight.dims) != 2:
            continue
        if attrs.get("axis") != 1 or "block_size" in attrs or list(scale.dims) != [weight.dims[1]]:
            continue
        per_channel = numpy_helper.to_array(scale)
        rows = -(-int(weight.dims[0]) // block)
        scale.CopyFrom(numpy_helper.from_array(np.ascontiguousarray(np.tile(per_channel, (rows, 1))), scale.name))
        del node.attribute[:]
        node.attribute.extend([helper.make_attribute("axis", 0), helper.make_attribute("block_size", block)])
    return model
