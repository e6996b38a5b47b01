"""``trtbuild::MoE`` (plugins/moe/README.md) for TensorRT: the dense standard-op form (``backends/moe_dense.py``)
in ops TensorRT's ONNX parser imports (onnx-tensorrt ``docs/operators.md``, TensorRT 10).

Every expert runs on every token: E / k times the expert work of the routed form, and all E experts' weights read
every step (docs/decisions/moe-plugin-op.md: a TensorRT plugin is the routed form's place, not written yet).
The routing is ``Softmax``, ``TopK`` (``K`` a constant, ``sorted``, far below the parser's 3840), ``Div`` /
``ReduceSum`` (axes constant), ``Shape`` -> ``ConstantOfShape`` -> ``ScatterElements`` (float data, int64
indices); the experts ``MatMul``, ``Split``, ``Sigmoid``, ``Mul``, ``Transpose``, ``Unsqueeze`` (axes constant).

The experts' weights enter as TensorRT takes quantized weights. TensorRT has no ``Cast`` from int8 (int8 and int4
are quantized types it reaches only through ``DequantizeLinear``) and its ``DequantizeLayer`` takes scales of rank 2
at most (block quantization: 2-D weights blocked along one axis), so each quantized ``[E, out, in]`` matrix is
stored as ONE 2-D ``[in, E * out]`` initializer (column ``e * out + r`` is row r of expert e) and dequantized as the
portable graph's dense linears are (``checkpoint/graph.py``): int8 per channel (``axis=1``, the row scales
flattened to ``[E * out]``), int4 per block of ``group_size`` in-features (``axis=0``, ``block_size``, scales
``[in / g, E * out]``); then ``Reshape [in, E, out]`` -> ``Transpose`` gives the ``[E, in, out]`` the batched
``MatMul`` reads. Float experts are ``[E, in, out]`` initializers.

Refused, one line each: int8 activations (``activation_block``: run-time scales, as ``_check_static_activations``
refuses for dense linears); int4 groups that do not divide the in-features (``lowering._check_whole_blocks`` reads
the ``DequantizeLinear`` nodes made here).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
from onnx import numpy_helper

from ....errors import BuildError
from ....graph.builder import GraphBuilder
from ....plugins.moe import DOMAIN, OP_TYPE, MoeAttrs, unpack_int4
from ... import moe_dense

NODE_PREFIX = "trt/"  # the lowered subgraph of node n is named trt/{n}/...


def lower_moe(graph: onnx.GraphProto, opset: int) -> None:
    """Replace, in ``graph``, each ``trtbuild::MoE`` node by its dense standard-op subgraph (the module doc)."""
    inits = {t.name: t for t in graph.initializer}
    new_nodes: list[onnx.NodeProto] = []
    replaced: set[str] = set()  # the nodes' own [E, out, in] experts and scales, now stored in TensorRT's layout
    for node in list(graph.node):
        if not (node.domain == DOMAIN and node.op_type == OP_TYPE):
            new_nodes.append(node)
            continue
        attrs = moe_dense.node_attrs(node)
        if attrs.activation_block is not None:
            raise BuildError(
                f"{node.name}: experts with int8 activations quantized with dynamic scales (activation_block), which "
                "the TensorRT backend does not take; quantize with --qformat int8_wo or int4_wo, or build with "
                "--backend onnxruntime or torch"
            )
        b = GraphBuilder(opset, prefix=f"{NODE_PREFIX}{node.name}/")
        weights = [_experts(b, node, i, inits, attrs) for i in range(2)]
        widths = (int(inits[node.input[3]].dims[1]), int(inits[node.input[2]].dims[1]) // 2)  # (H, I)
        moe_dense.emit_dense_moe(b, node, attrs, weights[0], weights[1], widths)
        replaced |= set(node.input[2:])
        new_nodes.extend(b.nodes)
        graph.initializer.extend(b.initializers)
    del graph.node[:]
    graph.node.extend(new_nodes)
    replaced -= {name for n in graph.node for name in n.input}
    kept = [t for t in graph.initializer if t.name not in replaced]
    del graph.initializer[:]
    graph.initializer.extend(kept)


def _experts(b: GraphBuilder, node: onnx.NodeProto, i: int, inits: dict, attrs: MoeAttrs) -> str:
    """Float ``[E, in, out]`` of the node's ``gate_up`` (``i`` 0) or ``down`` (1) experts (the module doc)."""
    name, quantized = node.input[2 + i], len(node.input) == 6
    if name not in inits or (quantized and node.input[4 + i] not in inits):
        raise BuildError(f"{node.name}: the TensorRT {OP_TYPE} needs its expert weights as initializers")
    w = numpy_helper.to_array(inits[name])
    if not quantized:
        return b.initializer(name + ".t", np.ascontiguousarray(w.transpose(0, 2, 1)))
    scale = np.asarray(numpy_helper.to_array(inits[node.input[4 + i]]), np.float32)
    if attrs.group_size is None:  # int8 rows [E, out, in], scales [E, out]: per channel of [in, E * out]
        codes, scale, dq = w, scale.reshape(-1), {"axis": 1}
    else:  # int4 [E, out, in / 2], scales [E, out, blocks]: blocks along axis 0 of [in, E * out]
        codes = unpack_int4(w).astype(ml_dtypes.int4)
        scale, dq = scale.transpose(2, 0, 1).reshape(scale.shape[2], -1), {"axis": 0, "block_size": attrs.group_size}
    experts, rows, width = codes.shape
    stored = b.initializer(name + ".trt", np.ascontiguousarray(codes.transpose(2, 0, 1).reshape(width, -1)))
    scales = b.initializer(name + ".trt_scale", np.ascontiguousarray(scale))
    x = b.op("DequantizeLinear", [stored, scales], name=f"{'gate_up' if i == 0 else 'down'}.dq", **dq)
    x = b.op("Reshape", [x, b.const([width, experts, rows])], name=f"experts{i}")
    return b.op("Transpose", [x], name=f"experts{i}_t", perm=[1, 0, 2])
