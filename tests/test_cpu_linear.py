"""The native ``trtbuild.cpu::QLinear`` (trtbuild/kernels/cpu/linear.cc) against its numpy statement.

One ``QLinear`` node run by onnxruntime with the compiled library registered must give ``qlinear_reference``'s
output bit for bit: integer sums are exact and the float steps are written in one order on both sides. Its
per-token form must equal the graph it replaces (``QuantizeRows -> MatMulInteger -> RescaleRows``) bit for bit.
Shapes cover the kernel's tiles and their edges: 1-3 rows (decode tiles), 4-row tiles with a remainder, more rows
than one task takes (64), columns that are not a whole panel or tile, in-features that are not a whole step or
block, int4 groups with a short last one.
"""

from __future__ import annotations

import subprocess

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from trtbuild.backends.onnxruntime.build.native_linear import (
    ZERO_POINT,
    LinearSimd,
    cpu_linear_simd,
    pack_weight,
    pad_scales,
    qlinear_node,
    qlinear_reference,
)
from trtbuild.kernels.library import NATIVE_DOMAIN, compile_args, library_path

CASES = [  # rows, in, out, bits, group, block
    (1, 576, 960, 8, 576, 576),  # per token, decode
    (3, 100, 33, 8, 100, 100),  # out-features not a whole panel
    (70, 1536, 576, 8, 1536, 1536),  # per token, two row chunks, 4-row tiles with a remainder of 2
    (5, 576, 100, 8, 576, 16),  # per channel, activation blocks of 16 (int8_wo / int8_sq)
    (2, 50, 48, 8, 50, 16),  # blocks of 16 with a short last block and a partial step
    (1, 576, 960, 4, 128, 128),  # int4 g128 with a short last group (576 = 4 x 128 + 64), decode
    (2, 256, 100, 4, 64, 64),  # int4 decode rows over 7 panels, the last one partial (tiles of 1 or 4 panels)
    (9, 576, 3072, 4, 128, 128),
    (66, 256, 40, 4, 32, 32),  # int4 g32, panel remainder, row chunks
    (4, 44, 17, 4, 16, 16),  # in-features not a whole step of 8
    # whole 64-in-feature blocks, 8-bit from 16 rows, int4 at 64-256: AMX tiles where the CPU has them (32 x 32)
    (40, 576, 100, 8, 576, 576),  # per token, rows padded to 64, 7 panels (a last single one, partial)
    (16, 576, 48, 8, 576, 576),  # the fewest rows on the tiles
    (130, 256, 33, 8, 256, 64),  # per channel, four blocks of 64, three row chunks
    (97, 576, 960, 4, 128, 128),  # int4 g128 with a short last group of 64, two row chunks
    (64, 256, 48, 4, 64, 64),  # int4 g64, 3 panels
]


def _model(k: int, n: int, bits: int, group: int, block: int, codes: np.ndarray, scale: np.ndarray):
    node = qlinear_node("lin", "x", "y", k=k, n=n, bits=bits, group=group, block=block)
    inits = [
        numpy_helper.from_array(pack_weight(codes, bits), "lin.packed"),
        numpy_helper.from_array(pad_scales(scale), "lin.scales"),
    ]
    graph = helper.make_graph(
        [node],
        "qlinear",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", n])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(NATIVE_DOMAIN, 1)])


def _session(model, threads: int, library: str | None = None) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.register_custom_ops_library(library or str(library_path()))
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def _case(rows: int, k: int, n: int, bits: int, group: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, k)) * rng.uniform(0.1, 20, (rows, 1))).astype(np.float32)
    x[0, : min(k, 3)] = 0.0
    if rows > 1:
        x[1] = 0.0  # an all-zero row: the smallest normal scale, zero codes
    codes = rng.integers(-(1 << (bits - 1)), 1 << (bits - 1), (k, n)).astype(np.int8)
    groups = -(-k // group) if group < k else 1
    scale = (rng.uniform(0.001, 0.02, (groups, n))).astype(np.float32)
    return x, codes, scale if group < k else scale[0]


@pytest.mark.parametrize("rows, k, n, bits, group, block", CASES)
@pytest.mark.parametrize("threads", [1, 2])
def test_qlinear_matches_reference_bit_for_bit(rows, k, n, bits, group, block, threads):
    x, codes, scale = _case(rows, k, n, bits, group)
    y = _session(_model(k, n, bits, group, block, codes, scale), threads).run(None, {"x": x})[0]
    ref = qlinear_reference(x, codes, scale, bits=bits, group=group, block=block)
    np.testing.assert_array_equal(y, ref)
    # and the reference is the linear it stands for: close to the float product of the dequantized weight
    w = codes.astype(np.float32) * (np.repeat(scale, group, axis=0)[:k] if group < k else scale[None, :])
    exact = x @ w
    assert np.abs(ref - exact).max() < 0.05 * np.abs(exact).max()


def test_qlinear_takes_any_leading_shape():
    x, codes, scale = _case(6, 64, 32, 8, 64)
    sess = _session(_model(64, 32, 8, 64, 64, codes, scale), 2)
    flat = sess.run(None, {"x": x})[0]
    model3 = _model(64, 32, 8, 64, 64, codes, scale)
    model3.graph.input[0].CopyFrom(helper.make_tensor_value_info("x", TensorProto.FLOAT, ["A", "B", 64]))
    model3.graph.output[0].CopyFrom(helper.make_tensor_value_info("y", TensorProto.FLOAT, ["A", "B", 32]))
    shaped = _session(model3, 2).run(None, {"x": x.reshape(2, 3, 64)})[0]
    np.testing.assert_array_equal(shaped.reshape(6, 32), flat)
    empty = sess.run(None, {"x": np.zeros((0, 64), np.float32)})[0]
    assert empty.shape == (0, 32)


@pytest.mark.parametrize("rows", [1, 64])
def test_per_token_qlinear_equals_the_integer_gemm_it_replaces(rows):
    """One block per row: the same codes, exact sums and (sum * row) * col as QuantizeRows -> MatMulInteger ->
    RescaleRows (its weight in uint8 with zero point 128, as ``integer_gemms_per_token`` emits it: exact on every
    CPU), so a per-token engine's outputs do not move by one bit."""
    k, n = 1536, 576
    x, codes, scale = _case(rows, k, n, 8, k, seed=3)
    nodes = [
        helper.make_node("QuantizeRows", ["x"], ["codes", "row"], domain=NATIVE_DOMAIN),
        helper.make_node("MatMulInteger", ["codes", "w", "zp", "zp"], ["sums"]),
        helper.make_node("RescaleRows", ["sums", "row", "col"], ["y"], domain=NATIVE_DOMAIN),
    ]
    inits = [
        numpy_helper.from_array((codes.astype(np.int16) + 128).astype(np.uint8), "w"),
        numpy_helper.from_array(np.array(128, np.uint8), "zp"),
        numpy_helper.from_array(scale, "col"),
    ]
    graph = helper.make_graph(
        nodes,
        "chain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", n])],
        inits,
    )
    chain = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(NATIVE_DOMAIN, 1)])
    expected = _session(chain, 2).run(None, {"x": x})[0]
    got = _session(_model(k, n, 8, k, k, codes, scale), 2).run(None, {"x": x})[0]
    np.testing.assert_array_equal(got, expected)


def test_tiles_share_threads_with_onnxruntimes_own_integer_gemm():
    """On an AMX CPU both ``QLinear``'s tiles and onnxruntime's uint8 x int8 ``MatMulInteger`` (MLAS's AMX GEMM) run
    on the same threads, each loading its own tile configuration: interleaved calls of the two stay exact.
    (onnxruntime 1.32's MLAS loads its configuration per call: a library that left its own loaded passed too.
    Elsewhere: the same check on the VNNI/AVX2 loops.)"""
    k, n, rows = 576, 960, 64
    x, codes, scale = _case(rows, k, n, 8, k, seed=5)
    qlinear = _session(_model(k, n, 8, k, k, codes, scale), 2)
    graph = helper.make_graph(
        [helper.make_node("MatMulInteger", ["a", "w"], ["y"])],
        "mlas",
        [helper.make_tensor_value_info("a", TensorProto.UINT8, ["M", k])],
        [helper.make_tensor_value_info("y", TensorProto.INT32, ["M", n])],
        [numpy_helper.from_array(codes, "w")],
    )
    mlas = _session(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), 2)
    a = np.random.default_rng(6).integers(0, 256, (rows, k)).astype(np.uint8)
    exact = a.astype(np.int64) @ codes.astype(np.int64)
    reference = qlinear_reference(x, codes, scale, bits=8, group=k, block=k)
    for _ in range(3):
        np.testing.assert_array_equal(mlas.run(None, {"a": a})[0], exact)
        np.testing.assert_array_equal(qlinear.run(None, {"x": x})[0], reference)


# The library's product loops other than this machine's own (-march=native less an ISA: linear_work.h's #if chain)
NO_AMX = ["-mno-amx-tile"] if cpu_linear_simd() is LinearSimd.AMX else []
OTHER_LOOPS = {
    "vnni": NO_AMX,  # on an AMX CPU: the VNNI tiles at every row count; elsewhere the default library
    "avx2": ["-mno-avx512f", *NO_AMX],  # on an AVX-512 CPU: its AVX2 tiles; elsewhere the default library
    "plain": ["-mno-avx2", *NO_AMX],  # GCC turns AVX-512 off with AVX2: the plain loops
}


@pytest.mark.parametrize("loops", sorted(OTHER_LOOPS))
def test_every_product_loop_gives_the_same_integers(tmp_path, loops):
    """The library built for a CPU without AVX-512 VNNI (AVX2 tiles) or without AVX2 (plain loops) gives the same
    output, bit for bit."""
    lib = tmp_path / f"{loops}.so"
    cmd = ["g++", *compile_args(lib, tuple(OTHER_LOOPS[loops]))]
    subprocess.run(cmd, check=True, capture_output=True)
    dis = subprocess.run(["objdump", "-d", str(lib)], capture_output=True, text=True).stdout
    assert "tdpbsud" not in dis and ("vpmaddubsw" in dis) == (loops == "avx2")
    assert ("vpdpbusd" in dis) == (loops == "vnni" and cpu_linear_simd() in (LinearSimd.AVX512_VNNI, LinearSimd.AMX))
    for rows, k, n, bits, group, block in CASES:
        x, codes, scale = _case(rows, k, n, bits, group)
        model = _model(k, n, bits, group, block, codes, scale)
        got = _session(model, 2, str(lib)).run(None, {"x": x})[0]
        np.testing.assert_array_equal(got, qlinear_reference(x, codes, scale, bits=bits, group=group, block=block))
    for rows, k, n, bits, group in OFFSET_CASES:
        x, codes, scale, offset, model = _offset_case(rows, k, n, bits, group)
        got = _session(model, 2, str(lib)).run(None, {"x": x})[0]
        ref = qlinear_reference(x, codes, scale, bits=bits, group=group, block=group, offset=offset)
        np.testing.assert_array_equal(got, ref, err_msg=f"offsets {rows, k, n, bits, group}")


def test_this_machine_runs_a_simd_loop():
    """The library compiled here has the product loop ``cpu_linear_simd`` names (engines record
    cpu_linear=onnxruntime on a CPU with neither AVX-512 VNNI nor AVX2)."""
    simd = cpu_linear_simd()
    if simd is LinearSimd.NONE:
        pytest.skip("neither AVX-512 VNNI nor AVX2 on this CPU: engines record cpu_linear=onnxruntime")
    dis = subprocess.run(["objdump", "-d", str(library_path())], capture_output=True, text=True).stdout
    loops = {
        LinearSimd.AMX: ["tdpbsud", "vpdpbusd"],
        LinearSimd.AVX512_VNNI: ["vpdpbusd"],
        LinearSimd.AVX2: ["vpmaddubsw"],
    }
    assert all(instruction in dis for instruction in loops[simd])


OFFSET_CASES = [  # rows, in, out, bits, group: unsigned codes and a float offset per group
    (1, 576, 960, 4, 32),  # GGUF Q4_1 / Q4_K: int4 g32, decode
    (3, 1536, 33, 4, 32),
    (70, 576, 100, 4, 32),
    (1, 576, 960, 8, 32),  # GGUF Q5_K (int8_min_wo): uint8 codes 0..255 g32
    (5, 512, 48, 8, 16),  # a fused Q4_K / Q6_K tensor: uint8 codes g16
    (70, 256, 100, 8, 32),
]


def _offset_case(rows: int, k: int, n: int, bits: int, group: int):
    """(x, codes u ``[K, N]`` 0..2^bits - 1, scale, offset, the ``QLinear`` model: u packed as ``c = u - zero
    point``, which the packing adds back, so the stored codes are u)."""
    x, _, scale = _case(rows, k, n, bits, group)
    rng = np.random.default_rng(5)
    codes = rng.integers(0, 1 << bits, (k, n)).astype(np.int32)
    offset = rng.uniform(-0.1, 0.0, scale.shape).astype(np.float32) * (1 << (bits - 4))
    model = _model(k, n, bits, group, group, codes - ZERO_POINT[bits], scale)
    model.graph.node[0].input.append("lin.offsets")
    model.graph.initializer.append(numpy_helper.from_array(pad_scales(offset), "lin.offsets"))
    return x, codes, scale, offset, model


@pytest.mark.parametrize("rows, k, n, bits, group", OFFSET_CASES)
@pytest.mark.parametrize("threads", [1, 2])
def test_qlinear_with_offsets_matches_reference_bit_for_bit(rows, k, n, bits, group, threads):
    """Unsigned codes (zero point 0) and offsets (the fourth input): ``w = u * scale + offset`` per group."""
    x, codes, scale, offset, model = _offset_case(rows, k, n, bits, group)
    y = _session(model, threads).run(None, {"x": x})[0]
    ref = qlinear_reference(x, codes, scale, bits=bits, group=group, block=group, offset=offset)
    np.testing.assert_array_equal(y, ref)
    w = codes.astype(np.float32) * np.repeat(scale, group, axis=0) + np.repeat(offset, group, axis=0)
    exact = x @ w
    assert np.abs(ref - exact).max() < 0.05 * np.abs(exact).max()
