"""The native ``trtbuild.cpu::SwiGLU`` (trtbuild/kernels/cpu/swiglu.cc) and the rewrite that places it.

The op is checked against ``(g * sigmoid(g)) * u`` in float64, and the rewritten gated MLP (``fuse_swiglu``) against
the four onnxruntime nodes it replaces; widths cover the 8-lane loop and its tail, rows the thread split.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from trtbuild.backends.onnxruntime.build.native import fuse_swiglu
from trtbuild.kernels.library import NATIVE_DOMAIN, SWIGLU_OP, library_path


def _run(model, x: np.ndarray) -> np.ndarray:
    opts = ort.SessionOptions()
    opts.register_custom_ops_library(str(library_path()))
    opts.intra_op_num_threads = 2
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})[0]


def _mlp_model(width: int, extra_use: bool = False):
    """x [M, 2 width] -> Split -> Sigmoid -> Mul -> Mul -> y (as trtbuild's emitter writes it); ``extra_use`` also
    makes the gate a graph output, which must keep the pattern unfused."""
    nodes = [
        helper.make_node("Split", ["x", "sizes"], ["gate", "up"], name="mlp.split", axis=-1),
        helper.make_node("Sigmoid", ["gate"], ["sig"]),
        helper.make_node("Mul", ["gate", "sig"], ["silu"]),
        helper.make_node("Mul", ["silu", "up"], ["h"]),
        helper.make_node("Neg", ["h"], ["y"]),
    ]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]
    if extra_use:
        outputs.append(helper.make_tensor_value_info("gate", TensorProto.FLOAT, None))
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", 2 * width])],
        outputs,
        [numpy_helper.from_array(np.array([width, width], np.int64), "sizes")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def _swiglu_model():
    node = helper.make_node(SWIGLU_OP, ["x"], ["y"], domain=NATIVE_DOMAIN)
    graph = helper.make_graph(
        [node],
        "swiglu",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, None)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(NATIVE_DOMAIN, 1)])


@pytest.mark.parametrize("rows,width", [(1, 1536), (3, 13), (64, 1536), (70, 24), (2, 5)])
def test_swiglu_matches_float64(rows, width):
    rng = np.random.default_rng(rows * 1000 + width)
    x = (rng.standard_normal((rows, 2 * width)) * 4).astype(np.float32)
    x[0, : min(width, 6)] = [0.0, -0.0, 95.0, -95.0, -30.0, 1e-30][: min(width, 6)]  # exp(-|g|) clamped, tiny or 1
    y = _run(_swiglu_model(), x)
    g, u = x[:, :width].astype(np.float64), x[:, width:].astype(np.float64)
    want = g / (1.0 + np.exp(-g)) * u
    assert y.shape == (rows, width) and y.dtype == np.float32
    np.testing.assert_allclose(y, want, rtol=1e-6, atol=1e-30)  # measured: <= 3e-7 (5 ulp)


def test_swiglu_keeps_leading_axes():
    x = np.random.default_rng(0).standard_normal((2, 3, 16)).astype(np.float32)
    assert _run(_swiglu_model(), x).shape == (2, 3, 8)


def test_fuse_swiglu_replaces_the_four_nodes_and_agrees_with_them():
    model = _mlp_model(1536)
    fused = fuse_swiglu(model)
    assert [n.op_type for n in fused.graph.node] == [SWIGLU_OP, "Neg"]
    assert not fused.graph.initializer  # the split sizes went with the split (onnxruntime warns of unused ones)
    x = np.random.default_rng(1).standard_normal((64, 3072)).astype(np.float32)
    np.testing.assert_allclose(_run(fused, x), _run(model, x), rtol=1e-5, atol=1e-6)


def test_fuse_swiglu_leaves_a_pattern_whose_tensors_are_used_elsewhere():
    model = _mlp_model(8, extra_use=True)
    assert [n.op_type for n in fuse_swiglu(model).graph.node] == [n.op_type for n in model.graph.node]
