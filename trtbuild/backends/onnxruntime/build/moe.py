"""``trtbuild::MoE`` (plugins/moe/README.md) for onnxruntime: the native kernel's node, or standard ONNX ops.

``native_moe``: each plugin node becomes one ``trtbuild.cpu::MoE`` node (``trtbuild/kernels/cpu/moe.cc``): per step
the kernel groups the tokens by routed expert and reads only those experts. Float experts keep the node's inputs
and attributes; quantized ones are packed for the kernel's integer path (``moe_experts``: ``QLinear``'s layout, int8
activations per block as the dense weight-only linears run them).

``lowered_moe``: each plugin node becomes a dense subgraph of opset-23 ops that onnxruntime runs without trtbuild's
library (no compiler needed): ``Softmax`` and ``TopK`` over the router logits (``Div`` by the kept sum when
renormalising), the kept weights scattered into a ``[T, E]`` matrix of zeros (``ScatterElements``), every expert on
every token as two batched ``MatMul`` s (``[T, H] x [E, H, 2I] -> [E, T, 2I]``, SwiGLU, ``x [E, I, H] ->
[E, T, H]``: the expert weights are stored transposed for it; int8 experts are widened and scaled in the graph
every step, int4 experts stored as ONNX int4 and dequantized per block by ``DequantizeLinear`` with ``block_size``,
opset 21+), then weighted and summed over experts. Exact, but E / k times the expert work of the routed form
(docs/decisions/moe-plugin-op.md).

Pass contracts (``passes.PASSES``): ``native-moe`` / ``lowered-moe``: ``trtbuild::MoE`` -> ``trtbuild.cpu::MoE`` /
standard ops. Every other node is kept.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
from onnx import helper, numpy_helper

from ....config import ORT_LOWERED_NODE_PREFIX, CpuLinear
from ....errors import BuildError
from ....graph.builder import GraphBuilder
from ....plugins.moe import ACTIVATION_SILU, DOMAIN, OP_TYPE, unpack_int4
from ..kernel_library import MOE_OP, NATIVE_DOMAIN
from .graph_edit import import_domain, node_attr, node_attrs, replace_nodes
from .moe_experts import packed_experts


def _moe_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    nodes = [n for n in model.graph.node if n.domain == DOMAIN and n.op_type == OP_TYPE]
    for node in nodes:
        activation = node_attr(node, "activation", ACTIVATION_SILU)
        activation = activation.decode() if isinstance(activation, bytes) else activation
        if activation != ACTIVATION_SILU or len(node.input) not in (4, 6):
            raise BuildError(f"{node.name}: a {OP_TYPE} node takes 4 or 6 inputs and activation silu (plugins/moe)")
        group = _group_size(node)
        if group is not None and (len(node.input) != 6 or group < 2 or group % 2):
            raise BuildError(f"{node.name}: int4 experts take their scales and an even group_size (plugins/moe)")
    return nodes


def quantized_experts(node: onnx.NodeProto) -> bool:
    """Whether ``node`` is a ``trtbuild::MoE`` node of int8 or int4 experts (its scales given)."""
    return node.domain == DOMAIN and node.op_type == OP_TYPE and len(node.input) == 6


def _group_size(node: onnx.NodeProto) -> int | None:
    """The node's ``group_size``: in-features per scale of its int4 experts; None for float or int8 experts."""
    found = [helper.get_attribute_value(a) for a in node.attribute if a.name == "group_size"]
    return int(found[0]) if found else None


def _int4_transposed(b: GraphBuilder, name: str, packed: np.ndarray, scale: np.ndarray, group: int) -> str:
    """Int4 experts ``[E, out, in/2]`` (scales ``[E, out, blocks]``) as an ONNX int4 ``[E, in, out]`` initializer
    dequantized per block of ``group`` in-features (axis 1) by ``DequantizeLinear``: float ``[E, in, out]``."""
    codes = unpack_int4(packed).transpose(0, 2, 1)
    w = b.initializer(name + ".t", np.ascontiguousarray(codes).astype(ml_dtypes.int4))
    s = b.initializer(name + ".t_scale", np.ascontiguousarray(np.asarray(scale, np.float32).transpose(0, 2, 1)))
    return b.op("DequantizeLinear", [w, s], name=name + ".dq", axis=1, block_size=group)


def _native_node(
    node: onnx.NodeProto, inits: dict[str, onnx.TensorProto], linear: CpuLinear
) -> tuple[onnx.NodeProto, list]:
    """The native library's ``MoE`` node for ``node`` and the initializers it adds: with ``QLinear`` for the
    engine's linears, quantized experts packed for the integer path where it takes them
    (``moe_experts.packed_experts``), else the node's own inputs."""
    own_block = "activation_block" in node_attrs(node)
    if own_block and not quantized_experts(node):
        raise BuildError(f"{node.name}: activation_block is for int8 / int4 experts; this node's are float")
    integer = quantized_experts(node) and (linear is CpuLinear.NATIVE or own_block)
    packed = packed_experts(node, inits) if integer else None
    inputs = list(node.input) if packed is None else [*node.input[:2], *packed.inputs]
    group = _group_size(node)
    attributes = ({} if group is None else {"group_size": group}) if packed is None else packed.attributes
    native = helper.make_node(
        MOE_OP,
        inputs,
        list(node.output),
        name=ORT_LOWERED_NODE_PREFIX + node.name,
        domain=NATIVE_DOMAIN,
        top_k=int(node_attr(node, "top_k")),
        renormalize=int(node_attr(node, "renormalize")),
        **attributes,
    )
    return native, [] if packed is None else packed.initializers


def native_moe(model: onnx.ModelProto, linear: CpuLinear) -> onnx.ModelProto:
    """A copy of ``model`` with every ``trtbuild::MoE`` node replaced by the native library's ``MoE`` node; its
    quantized experts run as the engine's ``linear`` s: on ``QLinear`` (``NATIVE``: packed for the kernel's integer
    path, int8 activations; ``moe_experts``), else with float activations (an ``activation_block`` of the node's
    own always takes the integer path)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    nodes = _moe_nodes(out)
    if not nodes:
        return out
    inits = {t.name: t for t in out.graph.initializer}
    replacements, added = {}, {}
    for node in nodes:
        native, tensors = _native_node(node, inits, linear)
        replacements[node.name] = [native]
        added.update((t.name, t) for t in tensors)  # experts shared by two nodes: packed once
    out.graph.initializer.extend(added.values())
    replace_nodes(out.graph, set(), replacements)
    import_domain(out, NATIVE_DOMAIN)
    return out


def lowered_moe(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` with every ``trtbuild::MoE`` node expanded into dense standard ops (the module doc)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    nodes = _moe_nodes(out)
    if not nodes:
        return out
    opset = next(o.version for o in out.opset_import if o.domain in ("", "ai.onnx"))
    inits = {t.name: t for t in out.graph.initializer}
    replacements = {}
    for node in nodes:
        b = GraphBuilder(opset, prefix=ORT_LOWERED_NODE_PREFIX + node.name + "/")
        hidden, logits, gate_up, down = node.input[:4]
        expert_weights = {}
        group = _group_size(node)
        for i, name in enumerate((gate_up, down)):  # [E, out, in] -> [E, in, out] for the batched MatMuls
            if name not in inits or (len(node.input) == 6 and node.input[4 + i] not in inits):
                raise BuildError(f"{node.name}: the lowered {OP_TYPE} needs its expert weights as initializers")
            if group is not None:
                scale = numpy_helper.to_array(inits[node.input[4 + i]])
                expert_weights[name] = _int4_transposed(b, name, numpy_helper.to_array(inits[name]), scale, group)
                continue
            w = b.initializer(name + ".t", np.ascontiguousarray(numpy_helper.to_array(inits[name]).transpose(0, 2, 1)))
            if len(node.input) == 6:  # int8 rows: widened, times their scales [E, 1, out]
                scale = numpy_helper.to_array(inits[node.input[4 + i]])
                scale = b.initializer(node.input[4 + i] + ".rows", scale[:, None, :].astype(np.float32))
                w = b.op("Mul", [b.op("Cast", [w], name=f"widen{i}", to=onnx.TensorProto.FLOAT), scale], name=f"dq{i}")
            expert_weights[name] = w
        top_k, inter = int(node_attr(node, "top_k")), inits[gate_up].dims[1] // 2
        probs = b.op("Softmax", [logits], name="probs", axis=-1)
        kept, experts = b.op_multi("TopK", [probs, b.const([top_k])], outputs=2, name="top_k", axis=-1)
        if int(node_attr(node, "renormalize")):
            total = b.op("ReduceSum", [kept, b.const([-1])], name="kept_sum", keepdims=1)
            kept = b.op("Div", [kept, total], name="renormalize")
        zeros = b.op("ConstantOfShape", [b.op("Shape", [probs], name="shape")], name="zeros")
        dense = b.op("ScatterElements", [zeros, experts, kept], name="weights", axis=1)  # [T, E], 0 where not kept
        per_expert = b.op("Unsqueeze", [b.op("Transpose", [dense], name="weights_t", perm=[1, 0]), b.const([2])])
        gu = b.op("MatMul", [hidden, expert_weights[gate_up]], name="gate_up")  # [E, T, 2I]
        g, u = b.op_multi("Split", [gu, b.const([inter, inter])], outputs=2, name="split", axis=-1)
        act = b.op("Mul", [b.op("Mul", [g, b.op("Sigmoid", [g], name="sigmoid")], name="silu"), u], name="gated")
        down_y = b.op("MatMul", [act, expert_weights[down]], name="down")
        y = b.op("Mul", [down_y, per_expert], name="weighted")  # [E, T, H]
        b.rename_output(b.op("ReduceSum", [y, b.const([0])], name="sum", keepdims=0), node.output[0])
        replacements[node.name] = b.nodes
        out.graph.initializer.extend(b.initializers)
    replace_nodes(out.graph, set(), replacements)
    return out
