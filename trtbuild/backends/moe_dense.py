"""The dense standard-op form of ``trtbuild::MoE`` (plugins/moe/README.md), shared by the onnxruntime build's
``lowered-moe`` pass (``onnxruntime/build/moe.py``) and the TensorRT lowering (``tensorrt/build/moe.py``).

Each backend supplies the experts as float ``[E, in, out]`` tensors (dequantized however its runtime takes
quantized weights); :func:`emit_dense_moe` adds the rest: ``Softmax`` and ``TopK`` over the router logits (``Div``
by the kept sum when renormalising), the kept weights scattered into a ``[T, E]`` matrix of zeros
(``ScatterElements``), every expert on every token as two batched ``MatMul`` s (``[T, H] x [E, H, 2I] ->
[E, T, 2I]``, SwiGLU, ``x [E, I, H] -> [E, T, H]``), then weighted and summed over experts. Exact, but E / k times
the expert work of the routed form (docs/decisions/moe-plugin-op.md).

With ``activation_block`` b both products read their input through a run-time int8 Q/DQ per block of b of the last
axis (:func:`emit_activation_blocks`): the hidden state once (every expert shares it), the SwiGLU output per expert.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from ..errors import BuildError
from ..graph.builder import GraphBuilder
from ..plugins.moe import ACTIVATION_SILU, OP_TYPE, MoeAttrs

INT8_BOUND = 127.0  # the largest int8 code of a block: s = max(amax / 127, FLT_MIN)


def node_attrs(node: onnx.NodeProto) -> MoeAttrs:
    """The validated attributes of a ``trtbuild::MoE`` node; a malformed node is one ``BuildError`` line."""
    found = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    activation = found.get("activation", ACTIVATION_SILU)
    activation = activation.decode() if isinstance(activation, bytes) else activation
    if activation != ACTIVATION_SILU or len(node.input) not in (4, 6) or "top_k" not in found:
        raise BuildError(f"{node.name}: a {OP_TYPE} node takes 4 or 6 inputs, top_k and activation silu (plugins/moe)")
    group, block = found.get("group_size"), found.get("activation_block")
    if group is not None and len(node.input) != 6:
        raise BuildError(f"{node.name}: int4 experts take their scales and an even group_size (plugins/moe)")
    if block is not None and len(node.input) != 6:
        raise BuildError(f"{node.name}: activation_block is for quantized (int8 / int4) experts only (plugins/moe)")
    try:
        return MoeAttrs(
            int(found["top_k"]),
            bool(found.get("renormalize", 0)),
            group_size=None if group is None else int(group),
            activation_block=None if block is None else int(block),
        )
    except ValueError as e:
        raise BuildError(f"{node.name}: {e} (plugins/moe)") from e


def emit_activation_blocks(b: GraphBuilder, x: str, rank: int, width: int, block: int, name: str) -> str:
    """``x`` (``rank`` dims, the last ``width`` wide) through int8 Q/DQ with run-time scales per block of ``block``
    of its last axis, QLinear's rule: ``s = max(amax / 127, FLT_MIN)`` in float32, ``q = round_half_even(x / s)``
    (``QuantizeLinear``), ``q * s``. A last block shorter than ``block`` is zero-padded to a whole one (zeros leave
    its amax and its other codes unchanged) and the padding sliced off again. The Q node is named ``{name}.quantize``,
    not ``*.q``: the onnxruntime passes that rewrite dense linears' dynamic Q/DQ must not take it for theirs."""
    blocks, pad = -(-width // block), -width % block
    keep = [0] * (rank - 1)  # Reshape's 0: the input's dim
    if pad:
        x = b.op("Pad", [x, b.const([0] * (2 * rank - 1) + [pad])], name=name + ".pad")
    x = b.op("Reshape", [x, b.const([*keep, blocks, block])], name=name + ".blocks")
    amax = b.op("ReduceMax", [b.op("Abs", [x], name=name + ".abs"), b.const([-1])], name=name + ".amax")
    scale = b.op("Div", [amax, b.const(INT8_BOUND, np.float32)], name=name + ".scale")
    scale = b.op("Max", [scale, b.const(np.finfo(np.float32).tiny, np.float32)], name=name + ".scale_floor")
    q_attrs = dict(axis=rank, block_size=block)
    q = b.op("QuantizeLinear", [x, scale], name=name + ".quantize", output_dtype=onnx.TensorProto.INT8, **q_attrs)
    x = b.op("DequantizeLinear", [q, scale], name=name + ".dequantize", **q_attrs)
    x = b.op("Reshape", [x, b.const([*keep, blocks * block])], name=name + ".rows")
    if pad:
        x = b.op("Slice", [x, b.const([0]), b.const([width]), b.const([-1])], name=name + ".unpad")
    return x


def emit_dense_moe(
    b: GraphBuilder, node: onnx.NodeProto, attrs: MoeAttrs, gate_up: str, down: str, widths: tuple[int, int]
) -> None:
    """The dense subgraph of ``node`` (the module doc) into ``b``, writing ``node.output[0]``. ``gate_up``: float
    ``[E, H, 2I]``, ``down``: float ``[E, I, H]`` (the experts' weights ``[in, out]``, however dequantized);
    ``widths``: (H, I)."""
    hidden, logits = node.input[:2]
    probs = b.op("Softmax", [logits], name="probs", axis=-1)
    kept, experts = b.op_multi("TopK", [probs, b.const([attrs.top_k])], outputs=2, name="top_k", axis=-1)
    if attrs.renormalize:
        total = b.op("ReduceSum", [kept, b.const([-1])], name="kept_sum", keepdims=1)
        kept = b.op("Div", [kept, total], name="renormalize")
    zeros = b.op("ConstantOfShape", [b.op("Shape", [probs], name="shape")], name="zeros")
    dense = b.op("ScatterElements", [zeros, experts, kept], name="weights", axis=1)  # [T, E], 0 where not kept
    per_expert = b.op("Unsqueeze", [b.op("Transpose", [dense], name="weights_t", perm=[1, 0]), b.const([2])])
    block, (width, inter) = attrs.activation_block, widths
    x = hidden if block is None else emit_activation_blocks(b, hidden, 2, width, block, "hidden_int8")
    gu = b.op("MatMul", [x, gate_up], name="gate_up")  # [E, T, 2I]
    g, u = b.op_multi("Split", [gu, b.const([inter, inter])], outputs=2, name="split", axis=-1)
    act = b.op("Mul", [b.op("Mul", [g, b.op("Sigmoid", [g], name="sigmoid")], name="silu"), u], name="gated")
    if block is not None:
        act = emit_activation_blocks(b, act, 3, inter, block, "gated_int8")
    y = b.op("Mul", [b.op("MatMul", [act, down], name="down"), per_expert], name="weighted")  # [E, T, H]
    b.rename_output(b.op("ReduceSum", [y, b.const([0])], name="sum", keepdims=0), node.output[0])
