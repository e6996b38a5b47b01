"""``trtbuild::MoE`` (plugins/moe/README.md) for onnxruntime: the native kernel's node, or standard ONNX ops.

``native_moe``: each plugin node becomes one ``trtbuild.cpu::MoE`` node (``trtbuild/kernels/cpu/moe.cc``): per step
the kernel groups the tokens by routed expert and reads only those experts. Float experts keep the node's inputs
and attributes; quantized ones are packed for the kernel's integer path (``moe_experts``: ``QLinear``'s layout, int8
activations per block as the dense weight-only linears run them).

``lowered_moe``: each plugin node becomes the dense subgraph of opset-23 ops that ``backends/moe_dense.py`` writes,
which onnxruntime runs without trtbuild's library (no compiler needed): routing by ``Softmax`` / ``TopK`` /
``ScatterElements``, every expert on every token as two batched ``MatMul`` s, the experts' weights stored
transposed ``[E, in, out]`` for them: int8 experts widened and scaled in the graph every step (``Cast``, ``Mul``),
int4 experts stored as ONNX int4 and dequantized per block by ``DequantizeLinear`` with ``block_size`` (opset 21+).
With ``activation_block`` both products read int8 activations quantized in the graph (``QuantizeLinear`` /
``DequantizeLinear`` per block; a shorter last block is padded). Exact, but E / k times the expert work of the
routed form (docs/decisions/moe-plugin-op.md).

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
from ....kernels.library import MOE_OP, NATIVE_DOMAIN
from ....plugins.moe import DOMAIN, OP_TYPE, unpack_int4
from ... import moe_dense
from .graph_edit import import_domain, replace_nodes
from .moe_experts import packed_experts


def _moe_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    nodes = [n for n in model.graph.node if n.domain == DOMAIN and n.op_type == OP_TYPE]
    for node in nodes:
        moe_dense.node_attrs(node)  # validated: one BuildError line for a malformed node
    return nodes


def quantized_experts(node: onnx.NodeProto) -> bool:
    """Whether ``node`` is a ``trtbuild::MoE`` node of int8 or int4 experts (its scales given)."""
    return node.domain == DOMAIN and node.op_type == OP_TYPE and len(node.input) == 6


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
    attrs = moe_dense.node_attrs(node)  # an activation_block only with quantized experts (validated there)
    integer = quantized_experts(node) and (linear is CpuLinear.NATIVE or attrs.activation_block is not None)
    packed = packed_experts(node, inits) if integer else None
    inputs = list(node.input) if packed is None else [*node.input[:2], *packed.inputs]
    group = {} if attrs.group_size is None else {"group_size": attrs.group_size}
    attributes = group if packed is None else packed.attributes
    native = helper.make_node(
        MOE_OP,
        inputs,
        list(node.output),
        name=ORT_LOWERED_NODE_PREFIX + node.name,
        domain=NATIVE_DOMAIN,
        top_k=attrs.top_k,
        renormalize=int(attrs.renormalize),
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
        attrs, (gate_up, down) = moe_dense.node_attrs(node), node.input[2:4]
        expert_weights = {}
        for i, name in enumerate((gate_up, down)):  # [E, out, in] -> [E, in, out] for the batched MatMuls
            if name not in inits or (len(node.input) == 6 and node.input[4 + i] not in inits):
                raise BuildError(f"{node.name}: the lowered {OP_TYPE} needs its expert weights as initializers")
            if attrs.group_size is not None:
                scale = numpy_helper.to_array(inits[node.input[4 + i]])
                packed = numpy_helper.to_array(inits[name])
                expert_weights[name] = _int4_transposed(b, name, packed, scale, attrs.group_size)
                continue
            w = b.initializer(name + ".t", np.ascontiguousarray(numpy_helper.to_array(inits[name]).transpose(0, 2, 1)))
            if len(node.input) == 6:  # int8 rows: widened, times their scales [E, 1, out]
                scale = numpy_helper.to_array(inits[node.input[4 + i]])
                scale = b.initializer(node.input[4 + i] + ".rows", scale[:, None, :].astype(np.float32))
                w = b.op("Mul", [b.op("Cast", [w], name=f"widen{i}", to=onnx.TensorProto.FLOAT), scale], name=f"dq{i}")
            expert_weights[name] = w
        widths = (int(inits[down].dims[1]), int(inits[gate_up].dims[1]) // 2)  # (H, I): down is [E, H, I(/2)]
        moe_dense.emit_dense_moe(b, node, attrs, expert_weights[gate_up], expert_weights[down], widths)
        replacements[node.name] = b.nodes
        out.graph.initializer.extend(b.initializers)
    replace_nodes(out.graph, set(), replacements)
    return out
