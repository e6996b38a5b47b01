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
activation's Q/DQ per block of 16 in-features with run-time scales (``checkpoint.graph.emit_dynamic_quantization``),
which is what MatMulNBits does inside itself, so ``hand_activations_to_kernel`` removes those nodes and the MatMul
then takes the float activation and becomes MatMulNBits like a weight-only one.

W8A8 per token (``--activation-scales per_token``) is what MatMulNBits cannot do exactly (its blocks are at most
the row's length only by accident); ``integer_gemms_per_token`` states it as onnxruntime's uint8 x int8 integer GEMM
instead, which is also 2-3x faster than MatMulNBits' 8-bit kernel on a few dozen rows or more (prefill chunks,
batched decodes) and as fast on one.

Pass contracts (``passes.PASSES``), each in place, every other node kept:
``activations-to-kernel``: a dynamic int8 activation Q/DQ per block of 16 -> removed (the MatMul reads the floats);
``offset-linears``: uint4 ``DequantizeLinear -> Reshape -> Add -> Reshape -> MatMul`` -> two ``MatMulNBits`` + ``Add``;
``integer-gemms-per-token``: a per-token activation Q/DQ + int8 weight ``MatMul`` -> ``MatMulInteger`` between row
ops (``trtbuild.cpu::QuantizeRows`` / ``RescaleRows`` with the native library, standard ops without);
``unsigned-static-int8-weights``: int8 weights of static W8A8 linears -> uint8 with zero point 128;
``reblock-int8-weights``: per-channel int8 weight ``DequantizeLinear`` -> blocked along in-features.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ....kernels.library import NATIVE_DOMAIN  # the native library's domain: QuantizeRows, RescaleRows
from .graph_edit import dynamic_linears, emitted_quantization, import_domain, node_attrs, replace_nodes

ACTIVATION_BLOCK = 16  # MatMulNBits' smallest block


def hand_activations_to_kernel(model: onnx.ModelProto, block: int = ACTIVATION_BLOCK) -> onnx.ModelProto:
    """Remove, in place, each dynamic int8 activation Q/DQ (per ``block`` in-features) feeding a MatMul of an int8
    weight: MatMulNBits quantizes its activations exactly so (accuracy level 4). Returns ``model``."""
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    dead: set[str] = set()
    for node, q, weight_dq, x in dynamic_linears(graph):
        attrs = node_attrs(q)
        weight = inits.get(weight_dq.input[0])
        if attrs.get("output_dtype") != TensorProto.INT8 or attrs.get("block_size") != block:
            continue
        if weight is None or weight.data_type != TensorProto.INT8:
            continue
        node.input[0] = x
        dead |= emitted_quantization(graph, q)
    replace_nodes(graph, dead, {})
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
        attrs = node_attrs(node)
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


# Why onnxruntime's integer GEMMs get uint8 weights (zero point 128) rather than int8 ones: MLAS's uint8 x int8
# kernel on AVX2 CPUs without VNNI sums pairs of products in saturating int16 (vpmaddubsw): 255 x 127 x 2 does not
# fit, and measured on an AVX2 EPYC every output of a 1536 x 576 MatMulInteger was off (int8_sq static engines missed
# the fake-quant model by 1.1). Its uint8 x uint8 kernel widens to int16 first and is exact on every CPU; the codes
# are the same integers (u - 128 = c), so an engine built on one CPU stays exact on any other.
WEIGHT_ZERO_POINT = 128  # the uint8 weight code is the int8 one + this


def _unsigned(weight: onnx.TensorProto) -> onnx.TensorProto:
    codes = numpy_helper.to_array(weight).astype(np.int16) + WEIGHT_ZERO_POINT
    return numpy_helper.from_array(codes.astype(np.uint8), weight.name + ".u8")


def unsigned_static_int8_weights(model: onnx.ModelProto) -> onnx.ModelProto:
    """Rewrite, in place, each int8 weight ``DequantizeLinear`` (no zero point) feeding a ``MatMul`` whose activation
    is itself dequantized (static W8A8, which onnxruntime fuses into an integer GEMM) as the same weight in uint8
    with zero point 128 (``WEIGHT_ZERO_POINT``); the dequantized floats are identical. Returns ``model``."""
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    dequantized = {n.output[0] for n in graph.node if n.op_type == "DequantizeLinear"}
    static_weights = {n.input[1] for n in graph.node if n.op_type == "MatMul" and n.input[0] in dequantized}
    added: dict[str, tuple[onnx.TensorProto, onnx.TensorProto]] = {}  # int8 weight -> (uint8 codes, zero point)
    for node in graph.node:
        if node.op_type != "DequantizeLinear" or node.output[0] not in static_weights or len(node.input) > 2:
            continue
        weight, scale = inits.get(node.input[0]), inits.get(node.input[1])
        if weight is None or scale is None or weight.data_type != TensorProto.INT8:
            continue
        if weight.name not in added:
            zero = np.full(tuple(scale.dims), WEIGHT_ZERO_POINT, np.uint8)
            added[weight.name] = (_unsigned(weight), numpy_helper.from_array(zero, weight.name + ".u8_zero_point"))
        codes, zero_point = added[weight.name]
        node.input[0] = codes.name
        node.input.append(zero_point.name)
    if added:
        graph.initializer.extend(t for pair in added.values() for t in pair)
        replace_nodes(graph, set(), {})  # drops the int8 codes no node reads any more
    return model


def integer_gemms_per_token(model: onnx.ModelProto, native: bool) -> onnx.ModelProto:
    """Rewrite, in place, each linear whose activation has a run-time int8 Q/DQ per token (one block of the whole
    row, ``--activation-scales per_token``) and whose weight is a per-channel int8 ``DequantizeLinear`` as
    onnxruntime's integer GEMM; returns ``model``.

    The row's scale is the graph's own, ``s = max(amax / 127, tiny)``; ``QuantizeLinear(x / s)`` to uint8 with zero
    point 128 gives the same codes as the graph's int8 ones plus 128 (|x / s| <= 127, so nothing saturates);
    ``MatMulInteger`` (the zero points subtracted inside, int32 sums) against the weight stored as uint8 with zero
    point 128 (``WEIGHT_ZERO_POINT``), then the sums times ``s`` and the weight's per-channel scale. Only the float
    rounding of that rescale differs from the graph's ``DequantizeLinear`` -> ``MatMul``. (int8 activation codes
    would take a slow reference kernel: onnxruntime's fast integer GEMMs take uint8 activations.) With ``native``
    (the engine loads trtbuild's native library anyway) the scale-and-codes ops before the GEMM are one
    ``trtbuild.cpu::QuantizeRows`` and the rescale after it one ``trtbuild.cpu::RescaleRows``
    (trtbuild/kernels/cpu/row_ops.cc), the same arithmetic in one pass each; else ten standard ops.
    """
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    consts = {
        "per_token.bound": np.array(127.0, np.float32),
        "per_token.tiny": np.array(np.finfo(np.float32).tiny, np.float32),
        "per_token.one": np.array(1.0, np.float32),
        "per_token.zero_point": np.array(128, np.uint8),
        "per_token.last_axis": np.array([-1], np.int64),
    }
    replacements: dict[str, list[onnx.NodeProto]] = {}  # MatMul name -> the nodes that take its place
    dead: set[str] = set()
    unsigned_weights: dict[str, onnx.TensorProto] = {}  # int8 weight name -> its uint8 form (WEIGHT_ZERO_POINT)
    for node, q, weight_dq, x in dynamic_linears(graph):
        if weight_dq.op_type != "DequantizeLinear" or len(weight_dq.input) > 2:
            continue
        weight, wscale = inits.get(weight_dq.input[0]), inits.get(weight_dq.input[1])
        if weight is None or wscale is None or weight.data_type != TensorProto.INT8 or len(weight.dims) != 2:
            continue
        attrs, wattrs = node_attrs(q), node_attrs(weight_dq)
        if attrs.get("output_dtype") != TensorProto.INT8 or attrs.get("block_size") != weight.dims[0]:
            continue  # int8 per block of 16: MatMulNBits (hand_activations_to_kernel)
        if wattrs.get("axis") != 1 or "block_size" in wattrs or list(wscale.dims) != [weight.dims[1]]:
            continue
        emit = _native_int8_rows if native else _standard_int8_rows
        unsigned = unsigned_weights.setdefault(weight.name, _unsigned(weight))
        replacements[node.name] = emit(node.name + ".int8", x, unsigned.name, wscale.name, node.output[0])
        dead |= emitted_quantization(graph, q) | {weight_dq.name}
    if not replacements:
        return model
    graph.initializer.extend(numpy_helper.from_array(v, k) for k, v in consts.items())
    graph.initializer.extend(unsigned_weights.values())
    replace_nodes(graph, dead, replacements)
    if native:
        import_domain(model, NATIVE_DOMAIN)
    return model


def _node(op_type: str, inputs: list[str], out: str, **attrs: int) -> onnx.NodeProto:
    return helper.make_node(op_type, inputs, [out], name=out, **attrs)


def _native_int8_rows(p: str, x: str, weight: str, wscale: str, y: str) -> list[onnx.NodeProto]:
    """``y`` = the per-token int8 linear of rows ``x`` as the native library's row ops around ``MatMulInteger``."""
    return [
        helper.make_node("QuantizeRows", [x], [p + ".codes", p + ".scale"], name=p + ".quantize", domain=NATIVE_DOMAIN),
        _node("MatMulInteger", [p + ".codes", weight, "per_token.zero_point", "per_token.zero_point"], p + ".sums"),
        helper.make_node(
            "RescaleRows", [p + ".sums", p + ".scale", wscale], [y], name=p + ".rescale", domain=NATIVE_DOMAIN
        ),
    ]


def _standard_int8_rows(p: str, x: str, weight: str, wscale: str, y: str) -> list[onnx.NodeProto]:
    """The same in standard ops (the ``per_token.*`` constants of ``integer_gemms_per_token``)."""
    return [
        _node("Abs", [x], p + ".abs"),
        _node("ReduceMax", [p + ".abs", "per_token.last_axis"], p + ".amax"),
        _node("Div", [p + ".amax", "per_token.bound"], p + ".scale_raw"),
        _node("Max", [p + ".scale_raw", "per_token.tiny"], p + ".scale"),
        _node("Div", [x, p + ".scale"], p + ".scaled"),
        _node("QuantizeLinear", [p + ".scaled", "per_token.one", "per_token.zero_point"], p + ".codes"),
        _node("MatMulInteger", [p + ".codes", weight, "per_token.zero_point", "per_token.zero_point"], p + ".sums"),
        _node("Cast", [p + ".sums"], p + ".sums_float", to=TensorProto.FLOAT),
        _node("Mul", [p + ".sums_float", p + ".scale"], p + ".row_scaled"),
        helper.make_node("Mul", [p + ".row_scaled", wscale], [y], name=p + ".col_scaled"),
    ]


def offset_weight(
    reshape: onnx.NodeProto, producer: dict[str, onnx.NodeProto], inits: dict[str, onnx.TensorProto]
) -> tuple[onnx.NodeProto, np.ndarray, list[str]] | None:
    """(the DequantizeLinear, offsets ``[groups, N]``, the pattern's other node names) of a weight stated as
    ``checkpoint.graph.emit_weight_offset`` states it (``DequantizeLinear -> Reshape -> Add offset -> Reshape``),
    else None."""
    add = producer.get(reshape.input[0]) if reshape.op_type == "Reshape" else None
    if add is None or add.op_type != "Add" or add.input[1] not in inits:
        return None
    groups = producer.get(add.input[0])
    dq = producer.get(groups.input[0]) if groups is not None and groups.op_type == "Reshape" else None
    if dq is None or dq.op_type != "DequantizeLinear":
        return None
    offset = numpy_helper.to_array(inits[add.input[1]])
    return dq, offset.reshape(offset.shape[0], offset.shape[-1]), [groups.name, add.name, reshape.name]


def offset_linears(model: onnx.ModelProto, block: int) -> onnx.ModelProto:
    """Rewrite, in place, each ``MatMul`` whose weight is uint4 codes blocked by ``block`` plus an offset per group
    (GGUF Q4_1, ``offset_weight``) as two ``MatMulNBits`` of the same rows summed: the codes with the scales (zero
    point 0), and codes that are all 1 with the offsets as their scales: ``q * scale + 1 * offset``, the exact
    weight in two parts. Both quantize the activations alike (int8 per block, accuracy level 4), so the sum is
    the quantized rows times the whole weight, as llama.cpp computes Q4_1 (an offset term from the float rows
    instead cost SmolLM2 +1.6% perplexity against +0.2%; float zero points ``-offset / scale`` made
    ``MatMulNBits`` ~25x slower). The all-ones codes are one tensor per weight shape. Returns ``model``.
    ``QLinear`` (``native_linear``) takes these linears first where it runs."""
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    producer = {out: n for n in graph.node for out in n.output}
    replacements: dict[str, list[onnx.NodeProto]] = {}
    dead: set[str] = set()
    added: dict[str, onnx.TensorProto] = {}
    for node in graph.node:
        weight = producer.get(node.input[1]) if node.op_type == "MatMul" else None
        found = offset_weight(weight, producer, inits) if weight is not None else None
        if found is None:
            continue
        dq, offset, pattern = found
        codes, scale = inits.get(dq.input[0]), inits.get(dq.input[1])
        attrs = node_attrs(dq)
        if codes is None or scale is None or codes.data_type != TensorProto.UINT4 or attrs.get("block_size") != block:
            continue
        k, n = codes.dims
        groups = k // block
        if k % block or list(scale.dims) != [groups, n]:
            continue
        q = numpy_helper.to_array(codes).astype(np.uint8).T.reshape(n, groups, block)  # [N, groups, block]
        packed = q[..., 0::2] | (q[..., 1::2] << 4)  # MatMulNBits: the even element in the low nibble
        p, ones, zero = node.name + ".nbits", f"offset_linears.ones_{n}x{k}", f"offset_linears.zero_{n}x{k}"
        added[p + ".codes"] = numpy_helper.from_array(np.ascontiguousarray(packed), p + ".codes")
        scales = np.ascontiguousarray(numpy_helper.to_array(scale).astype(np.float32).T)
        added[p + ".scales"] = numpy_helper.from_array(scales, p + ".scales")
        offsets = np.ascontiguousarray(offset.astype(np.float32).T)  # [N, groups]
        added[p + ".offsets"] = numpy_helper.from_array(offsets, p + ".offsets")
        added[ones] = numpy_helper.from_array(np.full((n, groups, block // 2), 0x11, np.uint8), ones)
        added[zero] = numpy_helper.from_array(np.zeros((n, -(-groups // 2)), np.uint8), zero)
        nbits = dict(domain="com.microsoft", K=k, N=n, bits=4, block_size=block, accuracy_level=4)
        x = node.input[0]
        replacements[node.name] = [
            helper.make_node("MatMulNBits", [x, p + ".codes", p + ".scales", zero], [p + ".q"], name=p, **nbits),
            helper.make_node("MatMulNBits", [x, ones, p + ".offsets", zero], [p + ".o"], name=p + ".offset", **nbits),
            helper.make_node("Add", [p + ".q", p + ".o"], [node.output[0]], name=p + ".add"),
        ]
        dead |= {dq.name, *pattern}
    if not replacements:
        return model
    graph.initializer.extend(added.values())
    replace_nodes(graph, dead, replacements)
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return model
