"""What the onnxruntime build's passes share to read and rewrite a graph: node attributes, the dynamic int8
activation pattern the portable graph emits, and replacing nodes in place.

Every pass here takes an ``onnx.ModelProto`` and rewrites it; these helpers are the only code they share, so a pass
module imports this one and never another pass's internals.
"""

from __future__ import annotations

from collections.abc import Iterator

import onnx
from onnx import helper


def node_attrs(node: onnx.NodeProto) -> dict:
    """``node``'s attributes by name, as Python values."""
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def node_attr(node: onnx.NodeProto, name: str, default: int | float | None = None) -> int | float:
    """The attribute ``name`` of ``node``, else ``default``; without a default a missing one raises ``KeyError``."""
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    if default is None:
        raise KeyError(f"{node.name}: missing attribute {name}")
    return default


def dynamic_linears(
    graph: onnx.GraphProto,
) -> Iterator[tuple[onnx.NodeProto, onnx.NodeProto, onnx.NodeProto, str]]:
    """Each ``MatMul`` whose activation comes through a run-time Q/DQ as ``checkpoint.graph.emit_dynamic_quantization``
    emits it (``x -> Reshape -> ... -> QuantizeLinear '{name}.q' -> DequantizeLinear -> Reshape``): (the MatMul,
    that Q node, the producer of its weight input, ``x``: the float rows before the blocks reshape)."""
    producer = {out: n for n in graph.node for out in n.output}
    for node in list(graph.node):
        if node.op_type != "MatMul":
            continue
        rows, weight_dq = producer.get(node.input[0]), producer.get(node.input[1])
        dq = producer.get(rows.input[0]) if rows is not None and rows.op_type == "Reshape" else None
        q = producer.get(dq.input[0]) if dq is not None and dq.op_type == "DequantizeLinear" else None
        if q is not None and q.op_type == "QuantizeLinear" and q.name.endswith(".q") and weight_dq is not None:
            yield node, q, weight_dq, producer[q.input[0]].input[0]


def emitted_quantization(graph: onnx.GraphProto, q: onnx.NodeProto) -> set[str]:
    """The nodes ``emit_dynamic_quantization`` made around its Q node ``q``: named {base}blocks, ..., {base}rows."""
    base = q.name[: -len("q")]
    return {n.name for n in graph.node if n.name.startswith(base)}


def import_domain(model: onnx.ModelProto, domain: str) -> None:
    """Import ``domain`` (version 1) into ``model`` unless it is imported already."""
    if not any(o.domain == domain for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(domain, 1))


def replace_nodes(graph: onnx.GraphProto, dead: set[str], replacements: dict[str, list[onnx.NodeProto]]) -> None:
    """Drop the ``dead`` nodes, put each ``replacements`` list in its node's place, and drop the initializers no
    node reads any more (onnxruntime warns about them)."""
    nodes = [r for n in graph.node if n.name not in dead for r in replacements.get(n.name, [n])]
    del graph.node[:]
    graph.node.extend(nodes)
    used = {i for n in nodes for i in n.input}
    kept = [t for t in graph.initializer if t.name in used]
    del graph.initializer[:]
    graph.initializer.extend(kept)
