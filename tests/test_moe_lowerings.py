"""``trtbuild::MoE`` with int8 activations (``activation_block``) in the standard-op lowering (``lowered_moe``), the
torch op and its importer, against the numpy oracle (plugins/moe/reference.py); the TensorRT lowering's MoE subgraph
is tests/test_tensorrt_moe.py.

Tolerance. Both forms quantize the hidden state with the oracle's own float32 arithmetic (amax, true division,
round half to even), so its codes are the same. The SwiGLU output ``a`` is computed in float32 here and in float64 by
the oracle (then rounded to float32): the two differ by a few float32 ulps, and where ``a / s`` lies that close to a
half-integer one code may differ by one. Such a flip at in-feature c of routed expert e changes the token's output
by ``w_e * s * down_e[:, c]`` with ``s <= max|a| / 127`` (the block's scale), so a token's error is at most the
float32 rounding of the products (``1e-5`` of the output's scale, as tests/test_cpu_moe.py) plus one such step for
each code that may flip: the oracle's ``|a / s|`` within ``NEAR_TIE`` (1e-3) of a half-integer, where a few ulps of
``a`` (relative 1e-6, times ``|a / s| <= 127``) or of ``s`` can round it either way; about one code in 500 is, most
tokens have none and get no allowance. Quantizing anything else differently (the hidden state, a block boundary, a
scale) moves outputs far beyond that.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from trtbuild.backends.onnxruntime.build.moe import lowered_moe
from trtbuild.backends.torch.importer import OPS, Node
from trtbuild.backends.torch.moe import moe as torch_moe
from trtbuild.errors import BuildError
from trtbuild.plugins.moe import DOMAIN, OP_TYPE, MoeAttrs, dequantize_int4, moe, quantize_activation_blocks, route
from trtbuild.quantize.moe import int4_blocks, int8_rows

# tokens, hidden, expert width, experts, top_k, renormalize, activation block, int4 group (None: int8 experts):
# shorter last blocks (40 and 20 by 16; 20 by 8), a block of the whole row (48), a decode token, more tokens than
# experts; int4 groups of two and four activation blocks, one partial (40 by 32)
CASES = [
    (1, 48, 24, 6, 2, True, 16, None),
    (7, 40, 20, 4, 4, False, 16, None),
    (33, 48, 20, 8, 2, True, 8, None),
    (5, 48, 24, 3, 1, False, 48, None),
    (1, 64, 32, 6, 2, True, 16, 32),
    (9, 40, 32, 4, 2, False, 8, 32),
    (33, 64, 48, 8, 2, True, 16, 64),
]


def _case(t, h, i, e, k, renorm, block, group, seed=0):
    """Random inputs, the experts quantized as ``trtbuild quantize`` does, the attributes and the node's inputs."""
    rng = np.random.default_rng(seed)
    hidden = rng.standard_normal((t, h)).astype(np.float32)
    logits = (2.0 * rng.standard_normal((t, e))).astype(np.float32)
    gate_up = (rng.standard_normal((e, 2 * i, h)) / np.sqrt(h)).astype(np.float32)
    down = (rng.standard_normal((e, h, i)) / np.sqrt(i)).astype(np.float32)
    quantize = int8_rows if group is None else (lambda w: int4_blocks(w, group))
    (gu_q, gu_s), (d_q, d_s) = quantize(gate_up), quantize(down)
    attrs = MoeAttrs(k, renorm, group_size=group, activation_block=block)
    return hidden, logits, (gu_q, d_q, gu_s, d_s), attrs


def _portable(experts: tuple, attrs: MoeAttrs, **override):
    """One ``trtbuild::MoE`` node as the emitter writes it, the experts and scales initializers."""
    names = ["hidden", "logits", "gate_up", "down", "gate_up_scale", "down_scale"]
    extra = {"group_size": attrs.group_size, "activation_block": attrs.activation_block} | override
    node = helper.make_node(
        OP_TYPE, names, ["out"], name="layers.0.moe.experts", domain=DOMAIN,
        top_k=attrs.top_k, renormalize=int(attrs.renormalize), activation=attrs.activation,
        **{k: v for k, v in extra.items() if v is not None},
    )  # fmt: skip
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["T", None]) for n in names[:2]]
    inits = [numpy_helper.from_array(a, n) for a, n in zip(experts, names[2:], strict=True)]
    out = helper.make_tensor_value_info("out", TensorProto.FLOAT, ["T", None])
    graph = helper.make_graph([node], "moe", inputs, [out], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23), helper.make_opsetid(DOMAIN, 1)])


def run_onnxruntime(model, hidden: np.ndarray, logits: np.ndarray) -> np.ndarray:
    """The model on onnxruntime's CPU provider (standard ops only: no trtbuild library)."""
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 2
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    return sess.run(None, {"hidden": hidden, "logits": logits})[0]


def _float_experts(experts: tuple, attrs: MoeAttrs) -> tuple[np.ndarray, np.ndarray]:
    gu_q, d_q, gu_s, d_s = experts
    if attrs.group_size is not None:
        return dequantize_int4(gu_q, gu_s, attrs.group_size), dequantize_int4(d_q, d_s, attrs.group_size)
    return gu_q * gu_s[..., None].astype(np.float64), d_q * d_s[..., None].astype(np.float64)


NEAR_TIE = 1e-3  # |a / s| within this of a half-integer: float32 ulps of a or s may round it either way


def flip_allowance(hidden, logits, experts: tuple, attrs: MoeAttrs) -> np.ndarray:
    """``[T, H]``: how far the SwiGLU codes that lie within ``NEAR_TIE`` of a rounding tie may move each output if
    each flips by one (the module doc): ``sum w_e * s * |down_e[:, c]|`` over those codes; 0 for a token without."""
    gate_up, down = _float_experts(experts, attrs)
    routed, weights = route(logits, attrs.top_k, attrs.renormalize)
    block = attrs.activation_block
    x = quantize_activation_blocks(hidden, block)
    inter = gate_up.shape[1] // 2
    allowance = np.zeros(hidden.shape)
    for t in range(hidden.shape[0]):
        for e, w in zip(routed[t], weights[t], strict=True):
            gu = gate_up[e] @ x[t]
            act = (gu[:inter] / (1.0 + np.exp(-gu[:inter])) * gu[inter:]).astype(np.float32)
            for start in range(0, inter, block):
                part = act[start : start + block]
                s = max(np.abs(part).max() / np.float32(127.0), np.finfo(np.float32).tiny)
                r = np.abs(part / np.float32(s)).astype(np.float64)
                near = np.flatnonzero(np.abs(r - np.floor(r) - 0.5) < NEAR_TIE)
                allowance[t] += w * float(s) * np.abs(down[e][:, start + near]).sum(axis=1)
    return allowance


def check_against_oracle(got: np.ndarray, hidden, logits, experts: tuple, attrs: MoeAttrs) -> None:
    """``got`` is the oracle's output within float32 rounding, plus one step of each SwiGLU code that lies within
    float32 rounding of a tie (the module doc); and int8 activations are not a no-op at this tolerance."""
    want = moe(hidden, logits, *experts[:2], attrs, *experts[2:])
    tol = 1e-5 * float(np.abs(want).max()) + 1e-5 * np.abs(want)
    err = np.abs(got.astype(np.float64) - want)
    flipped = np.flatnonzero((err > tol).any(axis=1))
    bound = tol + flip_allowance(hidden, logits, experts, attrs)
    assert (err <= bound).all(), f"tokens off beyond float32 rounding and near-tie codes: {flipped.tolist()}"
    float_attrs = MoeAttrs(attrs.top_k, attrs.renormalize, group_size=attrs.group_size)
    float_activations = moe(hidden, logits, *experts[:2], float_attrs, *experts[2:])
    assert (np.abs(float_activations - want) > tol).any(axis=1).all(), "int8 activations changed no token"


@pytest.mark.parametrize(("t", "h", "i", "e", "k", "renorm", "block", "group"), CASES)
@pytest.mark.parametrize("form", ["lowered", "torch", "torch-import"])
def test_int8_activations_match_the_oracle(form, t, h, i, e, k, renorm, block, group):
    hidden, logits, experts, attrs = _case(t, h, i, e, k, renorm, block, group)
    if form == "lowered":
        model = lowered_moe(_portable(experts, attrs))
        assert {n.domain for n in model.graph.node} == {""}
        got = run_onnxruntime(model, hidden, logits)
    else:
        tensors = [torch.from_numpy(a) for a in (hidden, logits, *experts)]
        if form == "torch":
            got = torch_moe(*tensors, k, renorm, group, block)
        else:  # the torch importer's handler, given the node's attributes as the ONNX model has them
            attributes = {"top_k": k, "renormalize": int(renorm), "activation": "silu", "activation_block": block}
            node = Node(
                f"{DOMAIN}::{OP_TYPE}", (), ("out",), attributes | ({} if group is None else {"group_size": group})
            )
            (got,) = OPS[node.op](None, node, tensors)  # fmt: skip
        got = got.numpy()
    check_against_oracle(got, hidden, logits, experts, attrs)


@pytest.mark.parametrize(
    ("override", "group", "needle"),
    [
        ({"activation_block": 0}, None, "must be positive"),
        ({"activation_block": 24}, 32, "must divide group_size"),
        ({"group_size": 5}, 32, "group_size 5"),
    ],
)
def test_malformed_nodes_are_refused_in_one_line(override, group, needle):
    _, _, experts, attrs = _case(1, 32, 16, 2, 1, False, 16, group)
    with pytest.raises(BuildError, match=needle) as caught:
        lowered_moe(_portable(experts, attrs, **override))
    assert "\n" not in str(caught.value)


def test_torch_import_refuses_activation_block_on_float_experts_in_one_line():
    node = Node(f"{DOMAIN}::{OP_TYPE}", (), ("out",), {"top_k": 1, "renormalize": 0, "activation_block": 16})
    tensors = [torch.zeros(2, 8), torch.zeros(2, 2), torch.zeros(2, 8, 8), torch.zeros(2, 8, 4)]
    with pytest.raises(BuildError, match="needs quantized experts") as caught:
        OPS[node.op](None, node, tensors)
    assert "\n" not in str(caught.value)


def test_activation_block_without_quantized_experts_is_refused():
    _, _, experts, attrs = _case(1, 32, 16, 2, 1, False, 16, None)
    model = _portable(experts, attrs)
    node = model.graph.node[0]
    del node.input[4:]
    node.attribute.append(helper.make_attribute("activation_block", 4))
    with pytest.raises(BuildError, match=r"quantized \(int8 / int4\) experts only"):
        lowered_moe(model)
