"""onnxruntime lowering of a GGUF embedding's tied LM head: ``shared_int8_embedding`` (int8 codes with a scale per
group: Q8_0, Q6_K) and ``offset_embedding_head`` (``int8_min_wo``: uint8 codes with a scale and an offset per
group: Q4_0, Q4_1, Q4_K, Q5_K, Q2_K).

The portable graph gathers the embedding's int8 rows and their scales and dequantizes them (``DequantizeLinear``,
``axis=1``, ``block_size`` the group), and states the tied head as ``Gemm(transB=1)`` of the same tensors
dequantized whole (``graph.emit``). onnxruntime would dequantize the whole table at every step for the head, so
this pass stores the codes once, as ``MatMulNBits``' 8-bit weight (uint8 ``[vocab, groups, group]``, the int8 code
+ 128, its default zero point), and makes

- the head ``MatMulNBits`` (8 bits, the group as its block, activations quantized per block: accuracy level 4),
- the embedding ``Gather`` of the same uint8 rows -> ``Cast`` -> ``- 128`` -> ``* scale`` -> ``Reshape``: the same
  floats as the portable graph's (``(u - 128) * s`` is exact in float32),

so the engine holds the vocabulary's codes once (SmolLM2-135M: 28 MB, against 113 MB in float32).

An ``int8_min_wo`` embedding's gathers stay the portable graph's standard ops (``Gather`` of the uint8 rows, their
scales and offsets, ``DequantizeLinear``, ``Add``); its tied head, ``DequantizeLinear -> Reshape -> Add offset ->
Reshape -> Gemm(transB=1)``, becomes ``QLinear`` (``native_linear``) of the same codes packed, with their scales and
offsets, where the native linears run (``cpu_linear native``): the head reads a byte a weight (SmolLM2-135M's
vocabulary: 28 MB) where it read float32 (113 MB). Otherwise it is a ``Gemm`` of the float32 weight (the same
values: ``q * scale + offset`` in float32, in that order), whose rows the embedding then gathers (the table held
once, in float32, as before ``int8_min_wo`` embeddings existed).

Pass contracts (``passes.PASSES``): ``shared-int8-embedding``: the tied head's ``DequantizeLinear -> Gemm`` ->
``com.microsoft::MatMulNBits``, the embedding's ``Gather -> DequantizeLinear`` -> ``Gather -> Cast -> Sub -> Mul ->
Reshape`` of the same uint8 codes; ``offset-embedding-head``: the tied head's chain above -> ``trtbuild.cpu::QLinear``,
or a float ``Gemm`` and the gathers' nodes -> one ``Gather`` of its weight. Every other node is kept.
"""

from __future__ import annotations

import collections

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ....kernels.library import NATIVE_DOMAIN
from .graph_edit import import_domain, node_attrs, replace_nodes
from .native_linear import qlinear_node, qlinear_weights

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


def offset_embedding_head(model: onnx.ModelProto, *, native: bool) -> onnx.ModelProto:
    """Rewrite, in place, a tied head ``Gemm(x, Reshape(Add(Reshape(DequantizeLinear(E uint8 [V, H], S [V, G],
    axis=1)), O [V, G, 1])), transB=1)`` (``checkpoint.graph.emit_row_offset``) as ``QLinear`` of ``E``'s codes
    (``native``) or as a ``Gemm`` of the float32 weight (module docstring); returns ``model``. The embedding's
    gathers keep reading ``E``, ``S`` and ``O``."""
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    producer = {out: n for n in graph.node for out in n.output}
    consumers = collections.Counter(i for n in graph.node for i in n.input)
    for head in [n for n in graph.node if n.op_type == "Gemm" and node_attrs(n).get("transB") == 1]:
        chain = _offset_rows(head.input[1], producer, consumers) if len(head.input) == 2 else None
        if chain is None:
            continue
        dq, add = chain[0], chain[2]
        codes, scale, offset = (inits.get(name) for name in (dq.input[0], dq.input[1], add.input[1]))
        block = node_attrs(dq).get("block_size", 0)
        if codes is None or scale is None or offset is None or codes.data_type != TensorProto.UINT8:
            continue
        vocab, hidden = codes.dims
        groups = hidden // block if block > 0 and hidden % block == 0 else 0
        if not groups or node_attrs(dq).get("axis") != 1 or list(scale.dims) != [vocab, groups]:
            continue
        if list(offset.dims) != [vocab, groups, 1]:
            continue
        u = numpy_helper.to_array(codes)
        s = numpy_helper.to_array(scale).astype(np.float32)
        o = numpy_helper.to_array(offset).astype(np.float32)[..., 0]
        if native:
            name = head.name + ".q"
            node = qlinear_node(
                name, head.input[0], head.output[0], k=hidden, n=vocab, bits=8, group=block, block=block,
                offsets=True,
            )  # fmt: skip
            graph.initializer.extend(qlinear_weights(name, u.T, s.T, bits=8, offset=o.T))  # [H, V]: in, out
            import_domain(model, NATIVE_DOMAIN)
            replace_nodes(graph, {n.name for n in chain}, {head.name: [node]})
            return model
        # onnxruntime's linears: the float32 table, which the head multiplies and the embedding gathers (the codes
        # are then read by nothing: held once, as before)
        w = u.astype(np.float32).reshape(vocab, groups, block) * s[..., None] + o[..., None]
        weight = numpy_helper.from_array(w.reshape(vocab, hidden), head.name + ".weight")
        graph.initializer.append(weight)
        gemm = helper.make_node("Gemm", [head.input[0], weight.name], [head.output[0]], name=head.name, transB=1)
        replacements = {head.name: [gemm]}
        dead = {n.name for n in chain}
        for gather in [n for n in graph.node if n.op_type == "Gather" and n.input[0] == codes.name]:
            rows = _gathered_rows(gather, producer, graph)
            dead |= {n.name for n in rows}
            replacements[gather.name] = [
                helper.make_node("Gather", [weight.name, gather.input[1]], [rows[-1].output[0]], name=gather.name)
            ]
        dead -= set(replacements)
        replace_nodes(graph, dead, replacements)
        return model
    return model


def _gathered_rows(
    gather: onnx.NodeProto, producer: dict[str, onnx.NodeProto], graph: onnx.GraphProto
) -> list[onnx.NodeProto]:
    """An ``int8_min_wo`` embedding gather's nodes (``graph.emit``): the codes' ``Gather``, ``DequantizeLinear``,
    ``Reshape``, ``Add``, ``Reshape`` (the float rows: last) and the ``Gather`` of the scales and of the offsets."""
    readers = {i: n for n in graph.node for i in n.input}
    dq = readers[gather.output[0]]
    groups = readers[dq.output[0]]
    add = readers[groups.output[0]]
    rows = readers[add.output[0]]
    if [n.op_type for n in (dq, groups, add, rows)] != ["DequantizeLinear", "Reshape", "Add", "Reshape"]:
        raise AssertionError(f"{gather.name}: an int8_min_wo embedding gather without its rows' nodes")
    return [gather, producer[dq.input[1]], producer[add.input[1]], dq, groups, add, rows]


def _offset_rows(
    name: str, producer: dict[str, onnx.NodeProto], consumers: collections.Counter
) -> list[onnx.NodeProto] | None:
    """The nodes ``DequantizeLinear, Reshape, Add, Reshape`` making ``name`` (each output read once), or None."""
    chain: list[onnx.NodeProto] = []
    for op in ("Reshape", "Add", "Reshape", "DequantizeLinear"):
        node = producer.get(name)
        if node is None or node.op_type != op or consumers[name] != 1:
            return None
        chain.append(node)
        name = node.input[0]
    return chain[::-1]
