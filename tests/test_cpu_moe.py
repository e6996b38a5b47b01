"""``trtbuild::MoE`` against its numpy oracle (plugins/moe/reference.py): the native ``trtbuild.cpu::MoE``
(trtbuild/kernels/cpu/moe.cc, placed by ``native_moe``), the standard-op lowering (``lowered_moe``) and the torch op,
with float experts, int8 ones (a scale per row) and int4 ones (packed two a byte, a scale per block of in-features);
the native kernel's quantized experts both with float activations (an engine on onnxruntime's linears) and on its
integer path (``QLinear``'s products, int8 activations per block: the oracle's ``activation_block``).

Shapes cover a decode token, k = E, one expert kept, widths off the 8-lane loop, and more tokens than one routing
pass (256) with the thread split; the native kernel must not read an expert no token chose."""

from __future__ import annotations

import subprocess
from dataclasses import replace

import numpy as np
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from trtbuild.backends.onnxruntime.build.graph_edit import node_attrs
from trtbuild.backends.onnxruntime.build.moe import lowered_moe, native_moe
from trtbuild.backends.torch.moe import moe as torch_moe
from trtbuild.config import CpuLinear
from trtbuild.errors import BuildError
from trtbuild.kernels.library import MOE_OP, NATIVE_DOMAIN, compile_args, library_path
from trtbuild.plugins.moe import (
    DOMAIN,
    OP_TYPE,
    MoeAttrs,
    dequantize_int4,
    moe,
    quantize_activation_blocks,
    route,
)
from trtbuild.quantize.int4 import quantize_weight
from trtbuild.quantize.moe import int4_blocks, int8_rows

# tokens, hidden, expert width, experts, top_k, renormalize
CASES = [(1, 48, 24, 6, 2, True), (7, 40, 20, 4, 4, False), (5, 13, 9, 3, 1, False), (300, 64, 40, 8, 2, True)]


def _inputs(t: int, h: int, i: int, e: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    hidden = rng.standard_normal((t, h)).astype(np.float32)
    logits = (2.0 * rng.standard_normal((t, e))).astype(np.float32)
    gate_up = (rng.standard_normal((e, 2 * i, h)) / np.sqrt(h)).astype(np.float32)
    down = (rng.standard_normal((e, h, i)) / np.sqrt(i)).astype(np.float32)
    return hidden, logits, gate_up, down


def _portable(gate_up: np.ndarray, down: np.ndarray, attrs: MoeAttrs, scales: tuple | None = None):
    """One ``trtbuild::MoE`` node as the emitter writes it: the experts (and quantized experts' scales) are
    initializers."""
    names = ["hidden", "logits", "gate_up", "down"] + (["gate_up_scale", "down_scale"] if scales else [])
    node = helper.make_node(
        OP_TYPE, names, ["out"], name="layers.0.moe.experts", domain=DOMAIN,
        top_k=attrs.top_k, renormalize=int(attrs.renormalize), activation=attrs.activation,
        **({} if attrs.group_size is None else {"group_size": attrs.group_size}),
        **({} if attrs.activation_block is None else {"activation_block": attrs.activation_block}),
    )  # fmt: skip
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("hidden", "logits")]
    arrays = [gate_up, down, *(scales or ())]
    inits = [numpy_helper.from_array(a, n) for a, n in zip(arrays, names[2:], strict=True)]
    graph = helper.make_graph(
        [node], "moe", inputs, [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)], inits
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23), helper.make_opsetid(DOMAIN, 1)])


def _run(model, hidden: np.ndarray, logits: np.ndarray, library=None) -> np.ndarray:
    opts = ort.SessionOptions()
    opts.register_custom_ops_library(str(library or library_path()))
    opts.intra_op_num_threads = 2
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    return sess.run(None, {"hidden": hidden, "logits": logits})[0]


def _rms(a: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.square(a, dtype=np.float64))))


def _close(got: np.ndarray, want: np.ndarray) -> None:
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))


def _float_activations(portable):
    """The native node of ``portable`` as an engine on onnxruntime's linears has it: quantized experts with float
    activations (the kernel's widening / unpacking loops)."""
    return native_moe(portable, CpuLinear.ONNXRUNTIME)


def test_route_renormalizes_and_breaks_ties_to_the_lower_expert():
    logits = np.array([[0.0, 1.0, 1.0, -1.0]], np.float32)
    experts, weights = route(logits, 2, renormalize=True)
    assert experts.tolist() == [[1, 2]] and np.allclose(weights, 0.5)
    experts, weights = route(logits, 3, renormalize=False)
    p = np.exp(logits[0]) / np.exp(logits[0]).sum()
    assert experts.tolist() == [[1, 2, 0]] and np.allclose(weights[0], p[[1, 2, 0]])


@pytest.mark.parametrize("form", ["native", "lowered"])
@pytest.mark.parametrize(("t", "h", "i", "e", "k", "renorm"), CASES)
def test_onnxruntime_forms_match_the_oracle(form, t, h, i, e, k, renorm):
    hidden, logits, gate_up, down = _inputs(t, h, i, e)
    attrs = MoeAttrs(k, renorm)
    portable = _portable(gate_up, down, attrs)
    model = native_moe(portable, CpuLinear.NATIVE) if form == "native" else lowered_moe(portable)
    ops = {(n.domain, n.op_type) for n in model.graph.node}
    assert ((NATIVE_DOMAIN, MOE_OP) in ops) == (form == "native") and (DOMAIN, OP_TYPE) not in ops
    _close(_run(model, hidden, logits), moe(hidden, logits, gate_up, down, attrs))


@pytest.mark.parametrize("form", ["native", "lowered", "torch"])
@pytest.mark.parametrize(("t", "h", "i", "e", "k", "renorm"), [*CASES[:3], (40, 64, 40, 8, 2, True)])
def test_int8_experts_match_the_oracle(form, t, h, i, e, k, renorm):
    """Int8 experts with a scale per row (``quantize/moe.py``'s rounding), against the oracle on the same codes."""
    hidden, logits, gate_up, down = _inputs(t, h, i, e)
    (gu_q, gu_s), (d_q, d_s) = int8_rows(gate_up), int8_rows(down)
    attrs = MoeAttrs(k, renorm)
    want = moe(hidden, logits, gu_q, d_q, attrs, gu_s, d_s)
    if form == "torch":
        tensors = (torch.from_numpy(a) for a in (hidden, logits, gu_q, d_q, gu_s, d_s))
        got = torch_moe(*tensors, k, renorm).numpy()
    else:
        portable = _portable(gu_q, d_q, attrs, scales=(gu_s, d_s))
        got = _run((_float_activations if form == "native" else lowered_moe)(portable), hidden, logits)
    _close(got, want)
    float_out = moe(hidden, logits, gate_up, down, attrs)  # int8 rows: within a percent of the float experts
    assert np.abs(want - float_out).max() < 0.02 * np.abs(float_out).max()


# tokens, hidden, expert width, experts, top_k, renormalize, group: partial last blocks (48 by 32, 20 by 16), a
# group wider than the expert's rows (24 by 32), blocks shorter than the 8- and 16-wide loops (14 by 6, 10 by 6), a
# thread split; wide groups (128: the default, 256) over in-features they do not divide (320, 136)
INT4_CASES = [
    (1, 48, 24, 6, 2, True, 32),
    (7, 40, 20, 4, 4, False, 16),
    (5, 14, 10, 3, 1, False, 6),
    (40, 64, 40, 8, 2, True, 32),
    (3, 320, 136, 4, 2, True, 128),
    (6, 320, 136, 4, 3, False, 256),
]


@pytest.mark.parametrize("form", ["native", "lowered", "torch"])
@pytest.mark.parametrize(("t", "h", "i", "e", "k", "renorm", "group"), INT4_CASES)
def test_int4_experts_match_the_oracle(form, t, h, i, e, k, renorm, group):
    """Int4 experts, a scale per block of ``group`` in-features (``quantize/moe.py``'s rounding), against the oracle
    on the same codes; the oracle's unpacking gives ``int4.quantize_weight``'s dequantized weights."""
    hidden, logits, gate_up, down = _inputs(t, h, i, e)
    (gu_q, gu_s), (d_q, d_s) = int4_blocks(gate_up, group), int4_blocks(down, group)
    assert gu_q.shape == (e, 2 * i, h // 2) and gu_s.shape == (e, 2 * i, -(-h // group))
    dense = quantize_weight(torch.from_numpy(down[1]), group, zero_points=False).dequantized(group).numpy()
    np.testing.assert_array_equal(dequantize_int4(d_q, d_s, group)[1].astype(np.float32), dense)
    attrs = MoeAttrs(k, renorm, group_size=group)
    want = moe(hidden, logits, gu_q, d_q, attrs, gu_s, d_s)
    if form == "torch":
        tensors = (torch.from_numpy(a) for a in (hidden, logits, gu_q, d_q, gu_s, d_s))
        got = torch_moe(*tensors, k, renorm, group).numpy()
    else:
        portable = _portable(gu_q, d_q, attrs, scales=(gu_s, d_s))
        got = _run((_float_activations if form == "native" else lowered_moe)(portable), hidden, logits)
    _close(got, want)
    float_out = moe(hidden, logits, gate_up, down, MoeAttrs(k, renorm))
    # int4 blocks of Gaussian weights: coarse (relative RMS error 0.1-0.2 here) but near the float experts
    assert _rms(want - float_out) < 0.3 * _rms(float_out)


# The int4 loops (and QLinear's) other than this machine's own (-march=native less an ISA): on an AVX-512 CPU, the
# AVX2 loop; the plain loops (GCC turns AVX-512 off with AVX2)
OTHER_INT4_LOOPS = {"avx2": ["-mno-avx512f"], "plain": ["-mno-avx2"]}


@pytest.mark.parametrize("loops", [pytest.param("avx2"), pytest.param("plain", marks=pytest.mark.slow)])
def test_every_int4_loop_matches_the_oracle(tmp_path, loops):
    """The library built for a CPU without AVX-512 (AVX2 unpacking, QLinear's AVX2 tiles) or without AVX2 (plain
    loops): int4 experts with float activations, and the integer path's cases, against the oracle."""
    lib = tmp_path / f"{loops}.so"
    subprocess.run(["g++", *compile_args(lib, tuple(OTHER_INT4_LOOPS[loops]))], check=True, capture_output=True)
    for t, h, i, e, k, renorm, group in INT4_CASES:
        hidden, logits, gate_up, down = _inputs(t, h, i, e)
        (gu_q, gu_s), (d_q, d_s) = int4_blocks(gate_up, group), int4_blocks(down, group)
        attrs = MoeAttrs(k, renorm, group_size=group)
        got = _run(_float_activations(_portable(gu_q, d_q, attrs, scales=(gu_s, d_s))), hidden, logits, lib)
        _close(got, moe(hidden, logits, gu_q, d_q, attrs, gu_s, d_s))
    for t, h, i, e, k, renorm, group, block in INTEGER_CASES:  # QLinear's loops of that CPU
        hidden, logits, gate_up, down = _inputs(t, h, i, e)
        gu_q, d_q, scales = _quantized(gate_up, down, group)
        attrs = MoeAttrs(k, renorm, group_size=group, activation_block=block or group or 16)
        got = _run(native_moe(_portable(gu_q, d_q, attrs, scales), CpuLinear.NATIVE), hidden, logits, lib)
        want = moe(hidden, logits, gu_q, d_q, attrs, *scales)
        _close_integer(got, want, _code_steps(hidden, logits, gu_q, d_q, attrs, scales))


def test_native_kernel_reads_only_the_routed_experts():
    """A decode token routed to experts 1 and 3: the other experts' weights are NaN and must not be read."""
    hidden, logits, gate_up, down = _inputs(1, 32, 16, 6)
    logits[:] = [[0.0, 5.0, 0.0, 4.0, 0.0, 0.0]]
    want = moe(hidden, logits, gate_up, down, MoeAttrs(2, True))
    for unused in (0, 2, 4, 5):
        gate_up[unused] = np.nan
        down[unused] = np.nan
    got = _run(native_moe(_portable(gate_up, down, MoeAttrs(2, True)), CpuLinear.NATIVE), hidden, logits)
    _close(got, want)


def test_native_int4_kernel_reads_only_the_routed_experts():
    """Int4 experts, a decode token routed to experts 1 and 3: the other experts' block scales are NaN (and their
    codes garbage) and must not be read."""
    hidden, logits, gate_up, down = _inputs(1, 64, 32, 6)
    logits[:] = [[0.0, 5.0, 0.0, 4.0, 0.0, 0.0]]
    (gu_q, gu_s), (d_q, d_s) = int4_blocks(gate_up, 16), int4_blocks(down, 16)
    attrs = MoeAttrs(2, True, group_size=16)
    want = moe(hidden, logits, gu_q, d_q, attrs, gu_s, d_s)
    for unused in (0, 2, 4, 5):
        gu_s[unused] = d_s[unused] = np.nan
        gu_q[unused] = d_q[unused] = 0x88
    _close(_run(_float_activations(_portable(gu_q, d_q, attrs, scales=(gu_s, d_s))), hidden, logits), want)


@pytest.mark.parametrize(("t", "h", "i", "e", "k", "renorm"), CASES)
def test_torch_op_matches_the_oracle(t, h, i, e, k, renorm):
    hidden, logits, gate_up, down = _inputs(t, h, i, e)
    got = torch_moe(*(torch.from_numpy(a) for a in (hidden, logits, gate_up, down)), None, None, k, renorm)
    _close(got.numpy(), moe(hidden, logits, gate_up, down, MoeAttrs(k, renorm)))


# The integer path (QLinear's products; its packing: backends/onnxruntime/build/moe_experts.py). tokens, hidden,
# expert width, experts, top_k, renormalize, int4 group (None: int8 rows), the portable activation_block (None: the
# weight-only experts' block: 16 for int8, the group for int4). Partial last activation blocks (24 and 20 by 16, 40
# by 32, 320 and 136 by 128), blocks finer than the int4 group (16 in 32) and coarser than the in-features (32 over
# 20: one block a row), a decode token, k = E, and 300 tokens ragged over 8 experts (a second routing pass, threads).
INTEGER_CASES = [
    (1, 48, 24, 6, 2, True, None, None),
    (5, 40, 20, 4, 4, False, None, 8),
    (300, 64, 40, 8, 2, True, None, None),
    (1, 48, 24, 6, 2, True, 16, None),
    (5, 40, 20, 4, 4, False, 32, None),
    (7, 64, 32, 4, 2, True, 32, 16),
    (300, 64, 40, 8, 2, True, 16, None),
    (3, 320, 136, 4, 2, True, 128, None),
]


def _quantized(gate_up: np.ndarray, down: np.ndarray, group: int | None):
    """(gate_up codes, down codes, their scales) of float experts: int8 rows, or int4 blocks of ``group``."""
    (gu_q, gu_s), (d_q, d_s) = (int8_rows(w) if group is None else int4_blocks(w, group) for w in (gate_up, down))
    return gu_q, d_q, (gu_s, d_s)


def _code_steps(hidden, logits, gate_up, down, attrs: MoeAttrs, scales) -> list[np.ndarray]:
    """Per token ``[k * I, H]``: how one code of in-feature c of its j-th routed expert's down input moves its
    output, ``w_j * s * down[e_j][:, c]`` (s: that code's activation-block scale; the oracle's quantities)."""
    if attrs.group_size is None:
        gate_up, down = gate_up * scales[0][..., None], down * scales[1][..., None]
    else:
        gate_up, down = (dequantize_int4(w, s, attrs.group_size) for w, s in zip((gate_up, down), scales, strict=True))
    block, inter = attrs.activation_block, down.shape[-1]
    x = quantize_activation_blocks(hidden, block)
    experts, weights = route(logits, attrs.top_k, attrs.renormalize)
    steps = []
    for t in range(len(hidden)):
        moves = []
        for e, w in zip(experts[t], weights[t], strict=True):
            g, u = np.split(gate_up[e] @ x[t], 2)
            act = np.abs(g / (1.0 + np.exp(-g)) * u).astype(np.float32)
            s = np.repeat([act[c : c + block].max() / np.float32(127) for c in range(0, inter, block)], block)
            moves.append(w * s[:inter, None] * down[e].T)
        steps.append(np.concatenate(moves))
    return steps


def _close_integer(got: np.ndarray, want: np.ndarray, steps: list[np.ndarray]) -> None:
    """``_close`` but for the rows where the kernel's float32 SwiGLU and the oracle's float64 one round a down input
    to adjacent codes (a value within ~1e-6 relative of a code's half-way point, ~3e-5 of the codes): such a row
    differs by one of its ``steps`` (``_code_steps``), and few do."""
    tol = 1e-5 * float(np.abs(want).max()) + 1e-5 * np.abs(want)
    rows = np.nonzero((np.abs(got - want) > tol).any(axis=1))[0]
    assert len(rows) <= max(1, len(want) // 50), f"{len(rows)} of {len(want)} rows differ"
    for t in rows:
        d = got[t] - want[t]
        assert any((np.abs(d - sign * steps[t]) <= 2 * tol[t]).all(axis=1).any() for sign in (1, -1)), t


@pytest.mark.parametrize(("t", "h", "i", "e", "k", "renorm", "group", "block"), INTEGER_CASES)
def test_integer_experts_match_the_oracle(t, h, i, e, k, renorm, group, block):
    """The native node on QLinear's products (an engine whose linears are QLinear's) against the oracle with the
    node's ``activation_block``: weight-only experts take the dense weight-only linears' block, a portable one is
    kept. QLinear is exact to its numpy statement, so the one difference from the float64 oracle is a rare one-code
    flip of the down input (``_close_integer``)."""
    hidden, logits, gate_up, down = _inputs(t, h, i, e)
    gu_q, d_q, scales = _quantized(gate_up, down, group)
    model = native_moe(
        _portable(gu_q, d_q, MoeAttrs(k, renorm, group_size=group, activation_block=block), scales), CpuLinear.NATIVE
    )
    (node,) = model.graph.node
    expected_block = block or group or 16
    assert node_attrs(node)["activation_block"] == expected_block and node.input[2] == "gate_up.packed"
    attrs = MoeAttrs(k, renorm, group_size=group, activation_block=expected_block)
    want = moe(hidden, logits, gu_q, d_q, attrs, *scales)
    _close_integer(_run(model, hidden, logits), want, _code_steps(hidden, logits, gu_q, d_q, attrs, scales))
    float_acts = moe(hidden, logits, gu_q, d_q, MoeAttrs(k, renorm, group_size=group), *scales)
    # int8 activations per block: near the float-activation experts (relative RMS error ~1e-2 here), not equal
    assert 0 < _rms(want - float_acts) < 0.05 * _rms(float_acts)


def test_native_build_picks_the_integer_path_where_qlinear_takes_the_experts():
    """Weight-only experts take the integer path on an engine of QLinear's linears only, int4 ones only with a group
    of whole packed steps (8 in-features; else float activations, as QLinear leaves such dense linears); a portable
    ``activation_block`` always takes it, and one QLinear does not take is refused in one line."""
    _, _, gate_up, down = _inputs(1, 48, 24, 4)

    def native(group, block=None, linear=CpuLinear.NATIVE):
        gu_q, d_q, scales = _quantized(gate_up, down, group)
        portable = _portable(gu_q, d_q, MoeAttrs(2, True, group_size=group, activation_block=block), scales)
        return node_attrs(native_moe(portable, linear).graph.node[0]).get("activation_block")

    assert [native(None), native(16), native(None, linear=CpuLinear.ONNXRUNTIME), native(6)] == [16, 16, None, None]
    assert native(None, 16, CpuLinear.ONNXRUNTIME) == 16
    with pytest.raises(BuildError, match=r"^layers.0.moe.experts: activation_block 6 is not one") as err:
        native(12, 6)
    assert "\n" not in str(err.value)
    with pytest.raises(BuildError, match=r"activation_block is for quantized \(int8 / int4\) experts only"):
        native_moe(_portable(gate_up, down, MoeAttrs(2, True, activation_block=16)), CpuLinear.NATIVE)


def test_native_integer_kernel_reads_only_the_routed_experts():
    """The integer path, a decode token routed to experts 1 and 3: the other experts' scales are NaN (and their codes
    garbage) and must not be read."""
    hidden, logits, gate_up, down = _inputs(1, 64, 32, 6)
    logits[:] = [[0.0, 5.0, 0.0, 4.0, 0.0, 0.0]]
    for group in (None, 16):
        gu_q, d_q, (gu_s, d_s) = _quantized(gate_up, down, group)
        attrs = MoeAttrs(2, True, group_size=group, activation_block=group or 16)
        want = moe(hidden, logits, gu_q, d_q, attrs, gu_s, d_s)
        steps = _code_steps(hidden, logits, gu_q, d_q, attrs, (gu_s, d_s))
        for unused in (0, 2, 4, 5):
            gu_s[unused] = d_s[unused] = np.nan
            gu_q[unused] = d_q[unused] = 0x88 if group else -128
        model = native_moe(_portable(gu_q, d_q, replace(attrs, activation_block=None), (gu_s, d_s)), CpuLinear.NATIVE)
        _close_integer(_run(model, hidden, logits), want, steps)
