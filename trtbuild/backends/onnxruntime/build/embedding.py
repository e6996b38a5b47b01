"""onnxruntime lowering of an int8 embedding with a scale per group (GGUF Q8_0) and the tied LM head reading it.

The portable graph gathers the embedding's int8 rows and their scales and dequantizes them (``DequantizeLinear``,
``axis=1``, ``block_size`` the group), and states the tied head as ``Gemm(transB=1)`` of the same tensors
dequantized whole (``graph.emit``). onnxruntime would dequantize the whole table at every step for the head, so
this pass stores the codes once, as ``MatMulNBits``' 8-bit weight (uint8 ``[vocab, groups, group]``, the int8 code
+ 128, its default zero point), and makes

- the head ``MatMulNBits`` (8 bits, the group as its block, activations quantized per block: accuracy level 4),
- the embedding ``Gather`` of the same uint8 rows -> ``Cast`` -> ``- 128`` -> ``* scale`` -> ``Reshape``: the same
  floats as the portable graph's (``(u - 128) * s`` is exact in float32),

so the engine holds the vocabulary's codes once (SmolLM2-135M: 28 MB, against 113 MB in float32).

Pass contract (``passes.PASSES``: ``shared-int8-embedding``): the tied head's ``DequantizeLinear -> Gemm`` ->
``com.microsoft::MatMulNBits``, the embedding's ``Gather -> DequantizeLinear`` -> ``Gather -> Cast -> Sub -> Mul ->
Reshape`` of the same uint8 codes; every other node is kept.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from .graph_edit import node_attrs, replace_nodes

ZERO_POINT = 128  # MatMulNBits' default 8-bit zero point: the uint8 code is the int8 one + this


def shared_int8_embedding(model: onnx.ModelProto) -> onnx.ModelProto:
    """Rewrite, in place, a tied head ``Gemm(x, DequantizeLinear(E int8 [V, H], S [V, G], axis=1), transB=1)`` as
    ``MatMulNBits`` and the embedding gathers of ``E`` as gathers of the same uint8 codes (module docstring);
    returns ``model``. Models without that pattern are left as they are."""
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    producer = {out: n for n in graph.node for out in n.output}
    for head in [n for n in graph.node if n.op_type == "Gemm" and node_attrs(n).get("transB") == 1]:
        dq = producer.get(head.input[1])
        if dq is None or dq.op_type != "DequantizeLinear" or len(dq.input) != 2 or len(head.input) != 2:
            continue
        codes, scale = inits.get(dq.input[0]), inits.get(dq.input[1])
        block = node_attrs(dq).get("block_size", 0)
        if codes is None or scale is None or codes.data_type != TensorProto.INT8 or node_attrs(dq).get("axis") != 1:
            continue
        vocab, hidden = codes.dims
        if block <= 0 or hidden % block or list(scale.dims) != [vocab, hidden // block]:
            continue
        _lower(model, head, dq, codes, scale.name, block)
        return model
    return model


def _lower(
    model: onnx.ModelProto,
    head: onnx.NodeProto,
    dq: onnx.NodeProto,
    codes: onnx.TensorProto,
    scale: str,
    block: int,
) -> None:
    graph = model.graph
    vocab, hidden = codes.dims
    u8_name = codes.name + ".u8"
    u8 = (numpy_helper.to_array(codes).astype(np.int16) + ZERO_POINT).astype(np.uint8)
    new_inits = [
        numpy_helper.from_array(u8.reshape(vocab, hidden // block, block), u8_name),
        numpy_helper.from_array(np.array(ZERO_POINT, np.float32), u8_name + ".zero_point"),
        numpy_helper.from_array(np.array([-1], np.int64), u8_name + ".last_axis"),
        numpy_helper.from_array(np.array([-1, hidden], np.int64), u8_name + ".rows"),
    ]
    replacements = {
        head.name: [
            helper.make_node(
                "MatMulNBits",
                [head.input[0], u8_name, scale],
                [head.output[0]],
                name=head.name,
                domain="com.microsoft",
                K=hidden,
                N=vocab,
                bits=8,
                block_size=block,
                accuracy_level=4,
            )
        ]
    }
    dead = {dq.name}
    for gather in [n for n in graph.node if n.op_type == "Gather" and n.input[0] == codes.name]:
        # its DequantizeLinear: (gathered codes, gathered scales) -> float rows
        rows_dq = next(
            (n for n in graph.node if n.op_type == "DequantizeLinear" and n.input[0] == gather.output[0]), None
        )
        if rows_dq is None:
            raise AssertionError(f"{gather.name}: an int8 embedding gather without its DequantizeLinear")
        p = gather.name
        replacements[gather.name] = [
            helper.make_node("Gather", [u8_name, gather.input[1]], [p + ".u8"], name=p, axis=0),
            helper.make_node("Cast", [p + ".u8"], [p + ".float"], name=p + ".cast", to=TensorProto.FLOAT),
            helper.make_node("Sub", [p + ".float", u8_name + ".zero_point"], [p + ".codes"], name=p + ".center"),
            helper.make_node("Unsqueeze", [rows_dq.input[1], u8_name + ".last_axis"], [p + ".s"], name=p + ".s"),
            helper.make_node("Mul", [p + ".codes", p + ".s"], [p + ".scaled"], name=p + ".scale_rows"),
            helper.make_node("Reshape", [p + ".scaled", u8_name + ".rows"], [rows_dq.output[0]], name=p + ".rows"),
        ]
        dead.add(rows_dq.name)
    graph.initializer.extend(new_inits)
    replace_nodes(graph, dead, replacements)
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
