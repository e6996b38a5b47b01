"""The native CPU kernel of ``trtbuild::PagedAttention`` (trtbuild/kernels/cpu/paged_attention.cc) against the oracle.

One ``trtbuild.cpu::PagedAttention`` node run by onnxruntime with the compiled library registered, its caches
bound as OrtValues over numpy arrays (as ``OrtSession`` binds them): the output must equal ``reference.py``'s and
the caches must hold what the reference writes, in place.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from trtbuild.backends.onnxruntime.build.native import single_node_model
from trtbuild.kernels.library import library_path
from trtbuild.plugins.paged_attention import (
    KV_FLOAT,
    KV_FP8,
    KV_INT8,
    PagedAttentionAttrs,
    dequantize_kv,
    paged_attention,
    quantize_kv,
    rotary_cos_sin_cache,
)

ATOL = 2e-5


SCALES = (0.05, 0.03)  # k_scale, v_scale of the quantized caches: random normal values span about +-4


def _session(attrs: PagedAttentionAttrs, rotary: bool, threads: int) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.register_custom_ops_library(str(library_path()))
    opts.intra_op_num_threads = threads
    model = single_node_model(attrs, rotary)
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def _run(sess, qkv, key_cache, value_cache, positions, tables, qsl, cos_sin, scales=SCALES) -> np.ndarray:
    binding = sess.io_binding()
    caches = [ort.OrtValue.ortvalue_from_numpy(a) for a in (key_cache, value_cache)]  # written in place
    binding.bind_ortvalue_input("key_cache", caches[0])
    binding.bind_ortvalue_input("value_cache", caches[1])
    feeds = {"qkv": qkv, "positions": positions, "block_tables": tables, "query_start_loc": qsl}
    if cos_sin is not None:
        feeds["cos_sin"] = cos_sin
    if key_cache.dtype != np.float32:
        feeds["k_scale"], feeds["v_scale"] = (np.array(x, dtype=np.float32) for x in scales)
    for name, arr in feeds.items():
        binding.bind_cpu_input(name, arr)
    binding.bind_output("out", "cpu")
    sess.run_with_iobinding(binding)
    return binding.get_outputs()[0].numpy()


# (query heads, kv heads, head size, block size, rotary, interleaved, rotary dim, threads)
CASES = {
    "gqa3_rope": (9, 3, 64, 16, True, False, 64, 2),
    "mha_no_rope": (4, 4, 32, 4, False, False, 0, 2),
    "gqa8_interleaved_partial": (8, 1, 32, 8, True, True, 16, 1),
    "gqa2_one_thread": (4, 2, 16, 5, True, False, 16, 1),
    "head_size_12": (4, 4, 12, 4, False, False, 0, 2),  # GPT-2 tiny: not a multiple of 8 (scalar tail)
    # three 4-key score tiles in a block of 12; the values in a 32-wide pass and an 8-wide one (40 = 32 + 8). The other
    # cases cover the 1- and 2-row tiles (mha, gqa2, gqa8: 8 = 3 + 3 + 2 rows), the 16-wide pass and a lone key (gqa2)
    "head_size_40_block_12": (6, 2, 40, 12, True, False, 40, 2),
    # whole blocks of 16 take the register path (scores and softmax without a trip through memory) for 3-row tiles
    # (gqa3) and here for 1-row (mha) and 2-row ones (gqa2: a decode's 2 rows, prefill tiles' last 2)
    "mha_block_16": (4, 4, 32, 16, False, False, 0, 2),
    "gqa2_block_16": (8, 4, 32, 16, True, False, 32, 1),
}


def _ragged_step(rng, lens: list[int], firsts: list[int], attrs: PagedAttentionAttrs, bs: int) -> tuple:
    """A step of sequences of ``lens`` new tokens from positions ``firsts``: (caches, reference caches, block tables,
    query_start_loc, positions, qkv). Each sequence gets disjoint, scrambled blocks (block 0 unused), as the block
    manager hands them out."""
    hq, hkv, d = attrs.num_heads, attrs.num_kv_heads, attrs.head_size
    max_blocks = max((f + n + bs - 1) // bs for f, n in zip(firsts, lens, strict=True))
    num_blocks = 1 + len(lens) * max_blocks
    caches, refs = _caches(rng, (num_blocks, bs, hkv, d), attrs.kv_cache_dtype)
    tables = rng.permutation(np.arange(1, num_blocks)).reshape(len(lens), max_blocks).astype(np.int64)
    qsl = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    positions = np.concatenate([np.arange(f, f + n) for f, n in zip(firsts, lens, strict=True)]).astype(np.int64)
    qkv = rng.standard_normal((int(qsl[-1]), (hq + 2 * hkv) * d)).astype(np.float32)
    return caches, refs, tables, qsl, positions, qkv


def _caches(rng, shape, kv_type):
    """Random caches in the op's storage type, and the same in the reference's (fp8: ml_dtypes.float8_e4m3fn)."""
    k, v = (rng.standard_normal(shape).astype(np.float32) for _ in range(2))
    if kv_type == KV_FLOAT:
        return (k, v), (k.copy(), v.copy())
    ref = (quantize_kv(k, SCALES[0], kv_type), quantize_kv(v, SCALES[1], kv_type))
    ours = tuple(x.view(np.uint8) if kv_type == KV_FP8 else x.copy() for x in ref)
    return ours, ref


def _check(out, caches, ref_out, ref_k, ref_v, kv_type):
    np.testing.assert_allclose(out, ref_out.reshape(out.shape), atol=ATOL, rtol=0)
    if kv_type == KV_FLOAT:
        np.testing.assert_allclose(caches[0], ref_k, atol=ATOL, rtol=0)  # written in place, keys rotated
        np.testing.assert_array_equal(caches[1], ref_v)
        return
    # Quantized: the same codes, but a rotated key computed in float32 here and float64 in the reference may sit
    # on the other side of a rounding boundary: allow one code step on a rare element.
    for ours, ref in zip(caches, (ref_k, ref_v), strict=True):
        a, b = ours.view(ref.dtype).astype(np.float32), ref.astype(np.float32)
        step = 1.0 if kv_type == KV_INT8 else np.maximum(np.abs(b) / 8, 2.0**-9)
        assert np.all(np.abs(a - b) <= step + 1e-6) and np.mean(a != b) < 1e-3


@pytest.mark.parametrize("kv_type", [KV_FLOAT, KV_INT8, KV_FP8], ids=["float", "int8", "fp8"])
@pytest.mark.parametrize("case", list(CASES))
def test_native_kernel_matches_reference(case, kv_type):
    hq, hkv, d, bs, rotary, interleaved, rot_dim, threads = CASES[case]
    attrs = PagedAttentionAttrs(hq, hkv, d, d**-0.5, interleaved, kv_type)
    rng = np.random.default_rng(0)
    # A ragged step: a fresh 37-token prompt, a decode at position 50, a 5-token chunk after 20 cached positions,
    # a 100-token chunk after 3 (large enough for the kernel's parallel path), a decode at position 0.
    step = _ragged_step(rng, [37, 1, 5, 100, 1], [0, 50, 20, 3, 0], attrs, bs)
    caches, (ref_kc, ref_vc), tables, qsl, positions, qkv = step
    cos_sin = rotary_cos_sin_cache(256, rot_dim, 10000.0) if rotary else None

    scales = SCALES if kv_type != KV_FLOAT else (None, None)
    ref, ref_k, ref_v = paged_attention(qkv, ref_kc, ref_vc, positions, tables, qsl, cos_sin, attrs, *scales)
    out = _run(_session(attrs, rotary, threads), qkv, *caches, positions, tables, qsl, cos_sin)
    _check(out, caches, ref, ref_k, ref_v, kv_type)


# (CASES entry, KV cache type, sliding_window, softcap). The windows end mid-block and are shorter than most contexts;
# the 100-token chunk's rows each start their window elsewhere (one work item: rows of several starts per block).
WINDOW_CASES = {
    "window_gqa3_block16": ("gqa3_rope", KV_FLOAT, 20, None),  # whole blocks of 16: the register path
    "window_mha_block4": ("mha_no_rope", KV_FLOAT, 7, None),
    "window_1_gqa2": ("gqa2_one_thread", KV_FLOAT, 1, None),  # each token sees only itself
    "window_gqa8_int8": ("gqa8_interleaved_partial", KV_INT8, 13, None),
    "window_gqa2_block16_fp8": ("gqa2_block_16", KV_FP8, 5, None),  # a window shorter than a block
    "window_head_size_12": ("head_size_12", KV_FLOAT, 9, None),  # plain loops
    "softcap_gqa3": ("gqa3_rope", KV_FLOAT, None, 1.5),
    "softcap_head_size_12": ("head_size_12", KV_FLOAT, None, 1.0),
    "softcap_block12_int8": ("head_size_40_block_12", KV_INT8, None, 2.0),
    "both_mha_block16": ("mha_block_16", KV_FLOAT, 11, 1.5),
    "both_block12_fp8": ("head_size_40_block_12", KV_FP8, 30, 3.0),
    "both_gqa2_block16_int8": ("gqa2_block_16", KV_INT8, 40, 0.8),
}


@pytest.mark.parametrize("case", list(WINDOW_CASES))
def test_native_kernel_window_and_softcap_match_reference(case):
    """A ragged step like the one above with a sliding window and/or soft-capping. With a window, the block-table
    entries of the blocks wholly before each sequence's window are then pointed at block 0 (the runner's null block)
    filled with NaN (or the largest codes), or at other valid blocks, some of them written by this step: the output
    must not change by a bit (the kernel skips those blocks)."""
    base, kv_type, window, softcap = WINDOW_CASES[case]
    hq, hkv, d, bs, rotary, interleaved, rot_dim, threads = CASES[base]
    attrs = PagedAttentionAttrs(hq, hkv, d, d**-0.5, interleaved, kv_type, sliding_window=window, softcap=softcap)
    rng = np.random.default_rng(1)
    firsts = [0, 90, 60, 3, 0, 150]  # later decodes and a chunk than above: more blocks skipped
    step = _ragged_step(rng, [37, 1, 5, 100, 1, 2], firsts, attrs, bs)
    caches, (ref_kc, ref_vc), tables, qsl, positions, qkv = step
    num_blocks, max_blocks = caches[0].shape[0], tables.shape[1]
    if kv_type != KV_FLOAT:  # new values (and unrotated keys) on the cache's grid: both sides store the same codes
        for head, scale in [(hq + hkv, SCALES[1])] + ([] if rotary else [(hq, SCALES[0])]):
            x = qkv[:, head * d : (head + hkv) * d]
            x[:] = dequantize_kv(quantize_kv(x, scale, kv_type), scale)
    cos_sin = rotary_cos_sin_cache(256, rot_dim, 10000.0) if rotary else None
    scales = SCALES if kv_type != KV_FLOAT else (None, None)
    ref, ref_k, ref_v = paged_attention(qkv, ref_kc, ref_vc, positions, tables, qsl, cos_sin, attrs, *scales)
    sess = _session(attrs, rotary, threads)
    fresh = [c.copy() for c in caches]
    out = _run(sess, qkv, *caches, positions, tables, qsl, cos_sin)
    _check(out, caches, ref, ref_k, ref_v, kv_type)
    if window is None:
        return
    before = np.arange(max_blocks)[None, :] < (np.maximum(np.array(firsts) - window + 1, 0) // bs)[:, None]
    assert before.sum() >= 3
    for cache in fresh:  # the null block: garbage that would show if it were read
        cache[0] = np.nan if kv_type == KV_FLOAT else 0x7E if kv_type == KV_FP8 else 127
    for fill in (np.zeros_like(tables), rng.integers(0, num_blocks, tables.shape)):
        caches = [c.copy() for c in fresh]
        moved = _run(sess, qkv, *caches, positions, np.where(before, fill, tables), qsl, cos_sin)
        np.testing.assert_array_equal(moved, out)


def test_lower_to_native_carries_window_and_softcap():
    """The build step that places the native op keeps the optional attributes (absent stays absent) and refuses a
    non-positive window; the placed op then computes what the reference does."""
    from onnx import TensorProto, helper

    from trtbuild.backends.onnxruntime.build.native import lower_to_native
    from trtbuild.plugins.paged_attention import DOMAIN, OP_TYPE

    def portable(**optional):
        names = ["qkv", "key_cache", "value_cache", "positions", "block_tables", "query_start_loc"]
        types = [TensorProto.FLOAT] * 3 + [TensorProto.INT64] * 3
        node = helper.make_node(
            OP_TYPE, names, ["out", "kc_out", "vc_out"], domain=DOMAIN, num_heads=4, num_kv_heads=2, head_size=16,
            scale=0.25, **optional,
        )  # fmt: skip
        inputs = [helper.make_tensor_value_info(n, t, None) for n, t in zip(names, types, strict=True)]
        outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in node.output]
        graph = helper.make_graph([node], "attention", inputs, outputs)
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23), helper.make_opsetid(DOMAIN, 1)])

    plain = {a.name for a in lower_to_native(portable()).graph.node[0].attribute}
    assert not plain & {"sliding_window", "softcap"}
    with pytest.raises(ValueError, match="sliding_window"):
        lower_to_native(portable(sliding_window=0))
    native = lower_to_native(portable(sliding_window=6, softcap=1.25))
    attrs = {a.name: helper.get_attribute_value(a) for a in native.graph.node[0].attribute}
    assert (attrs["sliding_window"], attrs["softcap"]) == (6, 1.25)
    opts = ort.SessionOptions()
    opts.register_custom_ops_library(str(library_path()))
    sess = ort.InferenceSession(native.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(4)
    caches = [rng.standard_normal((8, 4, 2, 16)).astype(np.float32) for _ in range(2)]
    tables = np.array([[1, 2, 3, 4], [5, 6, 7, 0]], np.int64)
    positions, qsl = np.array([9, 10, 11, 12, 0, 1, 2], np.int64), np.array([0, 4, 7], np.int64)
    qkv = rng.standard_normal((7, 128)).astype(np.float32)
    ref = paged_attention(qkv, *caches, positions, tables, qsl, None, PagedAttentionAttrs.from_onnx(attrs))[0]
    np.testing.assert_allclose(_run(sess, qkv, *caches, positions, tables, qsl, None), ref, atol=ATOL, rtol=0)


def test_native_kernel_reads_shared_prefix_blocks():
    """Two sequences whose tables share their first blocks (a prefix-cache hit) each read the shared positions."""
    hq, hkv, d, bs = 6, 2, 16, 4
    attrs = PagedAttentionAttrs(hq, hkv, d, d**-0.5)
    rng = np.random.default_rng(3)
    key_cache = rng.standard_normal((12, bs, hkv, d)).astype(np.float32)
    value_cache = rng.standard_normal((12, bs, hkv, d)).astype(np.float32)
    tables = np.array([[5, 7, 2, 0], [5, 7, 9, 11]], dtype=np.int64)  # positions 0-7 shared, then their own
    positions = np.array([8, 9, 8, 9, 10, 11, 12], dtype=np.int64)
    qsl = np.array([0, 2, 7], dtype=np.int64)
    qkv = rng.standard_normal((7, (hq + 2 * hkv) * d)).astype(np.float32)
    cos_sin = rotary_cos_sin_cache(64, d, 10000.0)
    ref, ref_k, ref_v = paged_attention(qkv, key_cache, value_cache, positions, tables, qsl, cos_sin, attrs)
    out = _run(_session(attrs, True, 2), qkv, key_cache, value_cache, positions, tables, qsl, cos_sin)
    _check(out, (key_cache, value_cache), ref, ref_k, ref_v, KV_FLOAT)


def test_fp8_cache_codes_and_values_are_exact():
    """Every E4M3 value, the midpoints between neighbours (ties to even), points just off them, subnormals,
    overflow and NaN: stored as ml_dtypes' codes, read back as their exact values (one token per sequence attends
    only to itself, so its output is its own dequantized value row)."""
    import ml_dtypes

    codes = np.arange(256, dtype=np.uint8)
    values = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    finite = np.sort(values[np.isfinite(values)])
    mids = (finite[:-1] + finite[1:]) / 2
    sweep = np.concatenate(
        [values, mids, np.nextafter(mids, np.inf), np.nextafter(mids, -np.inf), [448.0, 464.0, 1e6, np.inf, -np.inf]]
    ).astype(np.float32)
    d = 32
    sweep = np.concatenate([sweep, np.zeros(-len(sweep) % d, np.float32)]).reshape(-1, d)
    n = len(sweep)
    attrs = PagedAttentionAttrs(1, 1, d, d**-0.5, False, KV_FP8)
    qkv = np.concatenate([np.ones((n, d), np.float32), np.ones((n, d), np.float32), sweep], axis=1)
    key_cache, value_cache = (np.zeros((n, 4, 1, d), np.uint8) for _ in range(2))
    tables = np.arange(n, dtype=np.int64)[:, None]
    out = _run(
        _session(attrs, False, 2),
        qkv,
        key_cache,
        value_cache,
        np.zeros(n, np.int64),
        tables,
        np.arange(n + 1, dtype=np.int64),
        None,
        scales=(1.0, 1.0),
    )
    clipped = np.clip(np.nan_to_num(sweep, nan=0.0, posinf=448.0, neginf=-448.0), -448.0, 448.0)
    expected = np.where(np.isnan(sweep), np.uint8(0x7F), clipped.astype(ml_dtypes.float8_e4m3fn).view(np.uint8))
    np.testing.assert_array_equal(value_cache[:, 0, 0, :], expected)
    decoded = expected.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    np.testing.assert_array_equal(out.reshape(n, d), decoded)


def test_library_is_cached_per_source_and_machine():
    """The second call finds the first build (no recompilation) and the file is an onnxruntime-loadable library."""
    first = library_path()
    assert first.is_file() and library_path() == first
    assert first.stat().st_mtime == library_path().stat().st_mtime


def test_loading_the_library_leaves_subnormals_alone():
    """The library must not set flush-to-zero for the process (what -ffast-math's crtfastmath.o does on load)."""
    import subprocess
    import sys

    script = (
        "import ctypes, numpy as np, sys\n"
        f"ctypes.CDLL({str(library_path())!r})\n"
        "tiny = np.float32(np.finfo(np.float32).smallest_subnormal)\n"
        "sys.exit(0 if float(tiny * np.float32(1.0)) > 0.0 else 3)\n"
    )
    assert subprocess.run([sys.executable, "-c", script]).returncode == 0


# --- the row ops around MatMulInteger of per-token int8 linears (onnxruntime/weights.integer_gemms_per_token) ---


def _row_op_session(op: str, inputs: list, outputs: list, threads: int) -> ort.InferenceSession:
    from onnx import helper

    from trtbuild.kernels.library import NATIVE_DOMAIN

    node = helper.make_node(op, [i.name for i in inputs], [o.name for o in outputs], domain=NATIVE_DOMAIN)
    graph = helper.make_graph([node], op, inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(NATIVE_DOMAIN, 1)])
    opts = ort.SessionOptions()
    opts.register_custom_ops_library(str(library_path()))
    opts.intra_op_num_threads = threads
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("rows, width, threads", [(1, 576, 1), (7, 64, 2), (300, 1536, 2)])
def test_quantize_rows_gives_the_graphs_int8_codes_and_scales(rows, width, threads):
    """Per row s = max(amax / 127, FLT_MIN) and round_half_even(x / s) + 128, bit for bit what the portable graph's
    ReduceMax / Div / Max / QuantizeLinear compute (numpy's float32 division and rint here), ties included."""
    from onnx import TensorProto, helper

    rng = np.random.default_rng(rows)
    x = (rng.standard_normal((rows, width)) * rng.uniform(0.01, 30, (rows, 1))).astype(np.float32)
    x[0, :5] = [127.0, 0.5, -0.5, 1.5, -2.5]  # amax 127 -> s = 1: exact ties, which go to even
    if rows > 2:
        x[1] = 0.0  # an all-zero row: the smallest normal scale, codes 128
        x[2, 3] = np.finfo(np.float32).smallest_subnormal
    sess = _row_op_session(
        "QuantizeRows",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", width])],
        [
            helper.make_tensor_value_info("codes", TensorProto.UINT8, ["M", width]),
            helper.make_tensor_value_info("scale", TensorProto.FLOAT, ["M", 1]),
        ],
        threads,
    )
    codes, scale = sess.run(None, {"x": x})
    expected_scale = np.maximum(np.abs(x).max(-1, keepdims=True) / np.float32(127), np.finfo(np.float32).tiny)
    np.testing.assert_array_equal(scale, expected_scale)
    expected = (np.rint(x / expected_scale) + 128).astype(np.uint8)
    np.testing.assert_array_equal(codes, expected)
    assert list(codes[0, :5]) == [255, 128, 128, 130, 126]


@pytest.mark.parametrize("rows, width, threads", [(1, 49152, 1), (64, 3072, 2)])
def test_rescale_rows_is_the_graphs_cast_and_two_multiplies(rows, width, threads):
    from onnx import TensorProto, helper

    rng = np.random.default_rng(width)
    sums = rng.integers(-(1 << 20), 1 << 20, (rows, width), dtype=np.int32)
    row = rng.uniform(1e-3, 1e-1, (rows, 1)).astype(np.float32)
    col = rng.uniform(1e-3, 1e-1, width).astype(np.float32)
    sess = _row_op_session(
        "RescaleRows",
        [
            helper.make_tensor_value_info("sums", TensorProto.INT32, ["M", width]),
            helper.make_tensor_value_info("row", TensorProto.FLOAT, ["M", 1]),
            helper.make_tensor_value_info("col", TensorProto.FLOAT, [width]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", width])],
        threads,
    )
    (y,) = sess.run(None, {"sums": sums, "row": row, "col": col})
    np.testing.assert_array_equal(y, (sums.astype(np.float32) * row) * col)
