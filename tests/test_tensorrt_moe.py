"""The TensorRT lowering of ``trtbuild::MoE`` (``backends/tensorrt/build/moe.py``), without TensorRT.

Its subgraph of one node runs on onnxruntime's CPU provider against the numpy oracle (float, int8 and int4 experts),
uses only ops and forms TensorRT's ONNX parser takes (onnx-tensorrt ``docs/operators.md``; 2-D ``DequantizeLinear``
weights); ``lower_for_tensorrt`` of the tiny Mixtral and Qwen3-MoE graphs (float and int8 experts) leaves no
``trtbuild`` node, passes ``onnx.checker`` and gives the portable graph's logits in onnx's reference evaluator, each
plugin implemented by its numpy oracle. Refused in one line: int8 activations, int4 groups that do not divide the
experts' in-features.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator
from onnx.reference.op_run import OpRun
from test_moe_lowerings import run_onnxruntime
from test_tensorrt_lowering import _plugin_op, ragged_step

from trtbuild.backends.tensorrt.build.lowering import PLUGIN_DOMAIN, _check_whole_blocks, lower_for_tensorrt
from trtbuild.backends.tensorrt.build.moe import lower_moe
from trtbuild.config import BuildConfig
from trtbuild.errors import BuildError
from trtbuild.plugins.moe import DOMAIN, OP_TYPE, MoeAttrs, moe
from trtbuild.quantize.moe import int4_blocks, int8_rows

# onnx-tensorrt docs/operators.md (TensorRT 10): every op the lowered MoE may use is listed as supported, with
# float data (Cast, which has no int8, is not among them: int8 and int4 reach TensorRT through DequantizeLinear)
TENSORRT_OPS = {
    "ConstantOfShape", "DequantizeLinear", "Div", "MatMul", "Mul", "ReduceSum", "Reshape", "ScatterElements",
    "Shape", "Sigmoid", "Softmax", "Split", "TopK", "Transpose", "Unsqueeze",
}  # fmt: skip
CONSTANT_INPUTS = {"TopK": 1, "ReduceSum": 1, "Unsqueeze": 1, "Split": 1, "Reshape": 1}  # the parser needs these


def _node_model(t, h, i, e, k, renorm, experts: str, group: int | None = None, **node_attrs):
    """One ``trtbuild::MoE`` node of random float / int8 / int4 experts, its feeds and the oracle's output."""
    rng = np.random.default_rng(0)
    hidden = rng.standard_normal((t, h)).astype(np.float32)
    logits = (2.0 * rng.standard_normal((t, e))).astype(np.float32)
    gate_up = (rng.standard_normal((e, 2 * i, h)) / np.sqrt(h)).astype(np.float32)
    down = (rng.standard_normal((e, h, i)) / np.sqrt(i)).astype(np.float32)
    arrays = [gate_up, down]
    if experts != "float":
        quantize = int8_rows if experts == "int8" else (lambda w: int4_blocks(w, group))
        (gu_q, gu_s), (d_q, d_s) = quantize(gate_up), quantize(down)
        arrays = [gu_q, d_q, gu_s, d_s]
    attrs = MoeAttrs(k, renorm, group_size=group)
    names = ["hidden", "logits", "gate_up", "down", "gate_up_scale", "down_scale"][: 2 + len(arrays)]
    extra = {"group_size": group} if group else {}
    node = helper.make_node(
        OP_TYPE, names, ["out"], name="layers.0.moe.experts", domain=DOMAIN,
        top_k=k, renormalize=int(renorm), activation="silu", **extra, **node_attrs,
    )  # fmt: skip
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["T", None]) for n in names[:2]]
    inits = [numpy_helper.from_array(a, n) for a, n in zip(arrays, names[2:], strict=True)]
    out = helper.make_tensor_value_info("out", TensorProto.FLOAT, ["T", h])
    graph = helper.make_graph([node], "moe", inputs, [out], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23), helper.make_opsetid(DOMAIN, 1)])
    return model, hidden, logits, moe(hidden, logits, *arrays[:2], attrs, *arrays[2:])


def _lowered(model: onnx.ModelProto) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    lower_moe(out.graph, 23)
    return out


# tokens, hidden, expert width, experts, top_k, renormalize, format, int4 group (whole groups only)
CASES = [
    (1, 48, 24, 6, 2, True, "float", None),
    (7, 40, 20, 4, 4, False, "int8", None),
    (33, 64, 40, 8, 2, True, "int8", None),
    (1, 48, 24, 6, 2, True, "int4", 8),
    (9, 64, 32, 4, 3, False, "int4", 32),
]


@pytest.mark.parametrize(("t", "h", "i", "e", "k", "renorm", "experts", "group"), CASES)
def test_lowered_subgraph_matches_the_oracle_in_tensorrt_forms(t, h, i, e, k, renorm, experts, group):
    model, hidden, logits, want = _node_model(t, h, i, e, k, renorm, experts, group)
    lowered = _lowered(model)
    onnx.checker.check_model(lowered, full_check=True)
    assert {n.op_type for n in lowered.graph.node} <= TENSORRT_OPS and {n.domain for n in lowered.graph.node} == {""}
    inits = {x.name: x for x in lowered.graph.initializer}
    assert not {"gate_up", "down", "gate_up_scale", "down_scale"} & set(inits)  # restored in TensorRT's layout
    for node in lowered.graph.node:
        if node.op_type in CONSTANT_INPUTS:
            assert node.input[CONSTANT_INPUTS[node.op_type]] in inits, node.name
        if node.op_type == "DequantizeLinear":  # 2-D weights, scales of rank <= 2, no zero point
            weight, scale = inits[node.input[0]], inits[node.input[1]]
            assert len(node.input) == 2 and len(weight.dims) == 2 and len(scale.dims) <= 2, node.name
            assert weight.data_type == (TensorProto.INT8 if experts == "int8" else TensorProto.INT4)
    assert any(n.op_type == "DequantizeLinear" for n in lowered.graph.node) == (experts != "float")
    got = run_onnxruntime(lowered, hidden, logits)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))


def test_int8_activations_are_refused_in_one_line():
    model, *_ = _node_model(2, 32, 16, 2, 1, False, "int8", activation_block=16)
    with pytest.raises(BuildError, match=r"dynamic scales .*--qformat int8_wo or int4_wo") as caught:
        _lowered(model)
    assert "\n" not in str(caught.value)


def test_partial_int4_groups_are_refused_in_one_line():
    """Groups of 32 over in-features 48 (gate_up) end in a partial block: whole blocks only on TensorRT."""
    model, *_ = _node_model(2, 48, 32, 2, 1, False, "int4", 32)
    lowered = _lowered(model)  # the refusal is lower_for_tensorrt's _check_whole_blocks, reading the DQ made here
    with pytest.raises(BuildError, match="int4 groups of 32 do not divide its 48 in-features") as caught:
        _check_whole_blocks(lowered.graph, {x.name: x for x in lowered.graph.initializer})
    assert "\n" not in str(caught.value)


def _moe_op() -> type[OpRun]:
    """The portable node in onnx's reference evaluator: the numpy oracle."""

    def _run(self, hidden, logits, gate_up, down, gate_up_scale=None, down_scale=None, **attrs):  # type: ignore[no-untyped-def]
        a = MoeAttrs(int(attrs["top_k"]), bool(attrs["renormalize"]), group_size=attrs.get("group_size"))
        return (moe(hidden, logits, gate_up, down, a, gate_up_scale, down_scale),)

    attrs = {"top_k": None, "renormalize": None, "activation": None, "group_size": None}
    return type("MoE", (OpRun,), {"op_domain": DOMAIN, "_run": _run, **{f"{k}_default": v for k, v in attrs.items()}})


@pytest.mark.parametrize("qformat", [None, "int8_wo", "int4_wo"])
@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_tiny_moe_models_lower_for_tensorrt(arch: str, qformat: str | None, tmp_path: Path) -> None:
    """The graph ``trtbuild build`` emits for a tiny Mixtral / Qwen3-MoE (float, int8 or int4 experts; for int4 the
    MLP widths are made multiples of 16 so that its groups of 16 are whole) lowers to standard ops and the TensorRT
    plugin, and gives the portable graph's logits."""
    pytest.importorskip("transformers", reason="building the tiny checkpoint needs transformers")
    from tiny_models import make_hf_model

    from trtbuild.backends.build_request import portable_graph
    from trtbuild.config import DType, QFormat, QuantConfig
    from trtbuild.convert.convert import convert
    from trtbuild.quantize.quantize import quantize

    whole_groups = {
        "mixtral": dict(intermediate_size=32),
        "qwen3_moe": dict(intermediate_size=64, moe_intermediate_size=32),
    }
    make_hf_model(arch, tmp_path / "hf", **(whole_groups[arch] if qformat == "int4_wo" else {}))
    convert(tmp_path / "hf", tmp_path / "ckpt", DType.FLOAT32)
    ckpt = tmp_path / "ckpt"
    if qformat is not None:
        quantize(ckpt, tmp_path / "q", QuantConfig(QFormat(qformat), group_size=16), progress=False)
        ckpt = tmp_path / "q"
    build = BuildConfig(max_seq_len=64, kv_block_size=4, max_batch_size=4, max_num_tokens=32)
    cfg, build, _, portable = portable_graph(ckpt, build)
    nodes = [n for n in portable.graph.node if n.op_type == OP_TYPE]
    assert len(nodes) == len(cfg.moe.sparse_layers) and {len(n.input) for n in nodes} == {4 if qformat is None else 6}
    lowered = lower_for_tensorrt(portable, build)
    onnx.checker.check_model(lowered, full_check=False)
    assert not [n.name for n in lowered.graph.node if n.domain not in ("", PLUGIN_DOMAIN)]
    rng = np.random.default_rng(0)
    step = ragged_step()
    for vi in portable.graph.input:
        if vi.name not in step:  # the caches: [num_blocks, block_size, kv heads, head size]
            dims = [d.dim_value for d in vi.type.tensor_type.shape.dim]
            step[vi.name] = rng.standard_normal((8, build.kv_block_size, *dims[2:])).astype(np.float32)
    ops = [_plugin_op("trtbuild"), _plugin_op(PLUGIN_DOMAIN), _moe_op()]
    want = ReferenceEvaluator(portable, new_ops=ops).run(["logits"], step)[0]
    got = ReferenceEvaluator(lowered, new_ops=ops).run(["logits"], step)[0]
    np.testing.assert_allclose(got, want, atol=1e-4 * float(np.abs(want).max()), rtol=1e-4)
