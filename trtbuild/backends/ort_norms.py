"""onnxruntime lowering of norms: residual ``Add`` + ``RMSNormalization`` -> ``SkipSimplifiedLayerNormalization``.

onnxruntime runs opset 23's ``RMSNormalization`` as a standalone kernel and its graph optimizer does not fuse it
with the residual ``Add`` before it (its fusions know only its own ops, and only 3-D inputs; ours are
``[tokens, hidden]``). This pass states the decoder's norms in onnxruntime's own ops:

- ``Add(a, b) -> RMSNormalization`` becomes one ``com.microsoft.SkipSimplifiedLayerNormalization(a, b, scale)``
  whose fourth output is the sum ``a + b``, which the residual stream reads on (two nodes -> one, one pass over
  the activations instead of two);
- ``Add(a, b) -> Gather(rows) -> RMSNormalization`` (the last layer's residual, then the rows whose logits are
  wanted, then the final norm) becomes ``Gather(a, rows), Gather(b, rows) -> SkipSimplifiedLayerNormalization``:
  the add runs on the wanted rows only, and no ``Add`` is left after the last linear, which onnxruntime would
  otherwise fuse with it into a float ``Gemm`` (losing an int8 ``MatMulIntegerToFloat``);
- any other ``RMSNormalization`` becomes ``SimplifiedLayerNormalization`` (the same kernel family).

Same math, float32 throughout: ``x / sqrt(mean(x^2, axis=-1) + eps) * scale`` with ``x = a + b``. Only adds of two
computed tensors (the residual stream) fuse: an add of an initializer (a bias) may broadcast, which the fused op
does not.
"""

from __future__ import annotations

import onnx
from onnx import helper

MS_DOMAIN = "com.microsoft"


def use_ort_norms(model: onnx.ModelProto) -> onnx.ModelProto:
    """Rewrite, in place, the last-axis ``RMSNormalization`` nodes of ``model`` (see the module docstring)."""
    graph = model.graph
    initializers = {t.name for t in graph.initializer}
    producers = {o: n for n in graph.node for o in n.output}
    consumers: dict[str, int] = {}
    for n in graph.node:
        for i in n.input:
            consumers[i] = consumers.get(i, 0) + 1
    graph_outputs = {o.name for o in graph.output}

    def residual_add(name: str) -> onnx.NodeProto | None:
        """The ``Add`` of two computed tensors producing ``name``, if this pass may fold it away."""
        add = producers.get(name)
        if add is None or add.op_type != "Add" or initializers.intersection(add.input):
            return None
        return add if consumers.get(name, 0) == 1 and name not in graph_outputs else None

    fused: set[int] = set()  # ids of nodes folded into a fused norm
    out: list[onnx.NodeProto] = []
    for node in graph.node:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if (
            node.op_type != "RMSNormalization"
            or node.domain not in ("", "ai.onnx")
            or attrs.get("axis", -1) != -1
            or attrs.get("stash_type", 1) != 1
        ):
            out.append(node)
            continue
        eps = attrs.get("epsilon", 1e-5)
        add = producers.get(node.input[0])
        gather = add if add is not None and add.op_type == "Gather" and _axis(add) == 0 else None
        if gather is not None and (add := residual_add(gather.input[0])) is not None:  # add, rows, norm
            fused.update((id(add), id(gather)))
            rows = [f"{gather.output[0]}/{k}" for k in ("a", "b")]
            for x, y in zip(add.input, rows, strict=True):
                out.append(helper.make_node("Gather", [x, gather.input[1]], [y], name=y, axis=0))
            out.append(
                helper.make_node(
                    "SkipSimplifiedLayerNormalization",
                    [*rows, node.input[1]],
                    [node.output[0]],
                    name=node.name,
                    domain=MS_DOMAIN,
                    epsilon=eps,
                )
            )
        elif add is not None and add.op_type == "Add" and not initializers.intersection(add.input):
            fused.add(id(add))
            out.append(
                helper.make_node(
                    "SkipSimplifiedLayerNormalization",
                    [add.input[0], add.input[1], node.input[1]],
                    [node.output[0], "", "", add.output[0]],
                    name=node.name,
                    domain=MS_DOMAIN,
                    epsilon=eps,
                )
            )
        else:
            out.append(
                helper.make_node(
                    "SimplifiedLayerNormalization",
                    list(node.input),
                    list(node.output),
                    name=node.name,
                    axis=-1,
                    epsilon=eps,
                )
            )
    kept = [n for n in out if id(n) not in fused]
    del graph.node[:]
    graph.node.extend(kept)
    if fused and not any(o.domain == MS_DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    return model


def _axis(node: onnx.NodeProto) -> int:
    return next((int(helper.get_attribute_value(a)) for a in node.attribute if a.name == "axis"), 0)
