"""The native CPU kernel of ``trtbuild::PagedAttention`` (plugins/paged_attention/cpu_kernel.cc) against the oracle.

One ``trtbuild.cpu::PagedAttention`` node run by onnxruntime with the compiled library registered, its caches
bound as OrtValues over numpy arrays (as ``OrtSession`` binds them): the output must equal ``reference.py``'s and
the caches must hold what the reference writes, in place.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from trtbuild.backends.ort_native import NATIVE_DOMAIN, library_path
from trtbuild.plugins.paged_attention import PagedAttentionAttrs, paged_attention, rotary_cos_sin_cache

ATOL = 2e-5


def _session(attrs: PagedAttentionAttrs, rotary: bool, threads: int) -> ort.InferenceSession:
    names = [
        ("qkv", TensorProto.FLOAT),
        ("key_cache", TensorProto.FLOAT),
        ("value_cache", TensorProto.FLOAT),
        ("positions", TensorProto.INT64),
        ("block_tables", TensorProto.INT64),
        ("query_start_loc", TensorProto.INT64),
    ] + ([("cos_sin", TensorProto.FLOAT)] if rotary else [])
    inputs = [helper.make_tensor_value_info(n, t, None) for n, t in names]
    node = helper.make_node(
        "PagedAttention",
        [n for n, _ in names],
        ["out"],
        domain=NATIVE_DOMAIN,
        num_heads=attrs.num_heads,
        num_kv_heads=attrs.num_kv_heads,
        head_size=attrs.head_size,
        scale=attrs.scale,
        rotary_interleaved=int(attrs.rotary_interleaved),
    )
    graph = helper.make_graph([node], "g", inputs, [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23), helper.make_opsetid(NATIVE_DOMAIN, 1)])
    opts = ort.SessionOptions()
    opts.register_custom_ops_library(str(library_path()))
    opts.intra_op_num_threads = threads
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def _run(sess, qkv, key_cache, value_cache, positions, tables, qsl, cos_sin) -> np.ndarray:
    binding = sess.io_binding()
    caches = [ort.OrtValue.ortvalue_from_numpy(a) for a in (key_cache, value_cache)]  # written in place
    binding.bind_ortvalue_input("key_cache", caches[0])
    binding.bind_ortvalue_input("value_cache", caches[1])
    feeds = {"qkv": qkv, "positions": positions, "block_tables": tables, "query_start_loc": qsl}
    if cos_sin is not None:
        feeds["cos_sin"] = cos_sin
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
}


@pytest.mark.parametrize("case", list(CASES))
def test_native_kernel_matches_reference(case):
    hq, hkv, d, bs, rotary, interleaved, rot_dim, threads = CASES[case]
    attrs = PagedAttentionAttrs(hq, hkv, d, d**-0.5, interleaved)
    rng = np.random.default_rng(0)
    # A ragged step: a fresh 37-token prompt, a decode at position 50, a 5-token chunk after 20 cached positions,
    # a 100-token chunk after 3 (large enough for the kernel's parallel path), a decode at position 0.
    lens, firsts = [37, 1, 5, 100, 1], [0, 50, 20, 3, 0]
    max_blocks = max((f + n + bs - 1) // bs for f, n in zip(firsts, lens, strict=True))
    num_blocks = 1 + len(lens) * max_blocks
    key_cache = rng.standard_normal((num_blocks, bs, hkv, d)).astype(np.float32)
    value_cache = rng.standard_normal((num_blocks, bs, hkv, d)).astype(np.float32)
    # Disjoint, scrambled blocks per sequence (block 0 unused), as the block manager hands them out.
    tables = rng.permutation(np.arange(1, num_blocks)).reshape(len(lens), max_blocks).astype(np.int64)
    qsl = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    positions = np.concatenate([np.arange(f, f + n) for f, n in zip(firsts, lens, strict=True)]).astype(np.int64)
    qkv = rng.standard_normal((int(qsl[-1]), (hq + 2 * hkv) * d)).astype(np.float32)
    cos_sin = rotary_cos_sin_cache(256, rot_dim, 10000.0) if rotary else None

    ref, ref_k, ref_v = paged_attention(qkv, key_cache, value_cache, positions, tables, qsl, cos_sin, attrs)
    out = _run(_session(attrs, rotary, threads), qkv, key_cache, value_cache, positions, tables, qsl, cos_sin)
    np.testing.assert_allclose(out, ref.reshape(out.shape), atol=ATOL, rtol=0)
    np.testing.assert_allclose(key_cache, ref_k, atol=ATOL, rtol=0)  # written in place, keys rotated
    np.testing.assert_array_equal(value_cache, ref_v)


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
    np.testing.assert_allclose(out, ref.reshape(out.shape), atol=ATOL, rtol=0)
    np.testing.assert_allclose(key_cache, ref_k, atol=ATOL, rtol=0)
    np.testing.assert_array_equal(value_cache, ref_v)


def test_library_is_cached_per_source_and_machine():
    """The second call finds the first build (no recompilation) and the file is an onnxruntime-loadable library."""
    first = library_path()
    assert first.is_file() and library_path() == first
    assert first.stat().st_mtime == library_path().stat().st_mtime
