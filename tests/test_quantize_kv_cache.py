"""The onnxruntime lowering of ``trtbuild::PagedAttention`` with an int8 / fp8 KV cache against the reference."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto
from test_paged_attention_lowering import lowered_single_op, make_case

from trtbuild.plugins.paged_attention import (
    KV_FP8,
    KV_INT8,
    PagedAttentionAttrs,
    dequantize_kv,
    paged_attention,
    quantize_kv,
    rotary_cos_sin_cache,
)
from trtbuild.runtime.kv_cache import slot_mapping

STORAGE = {KV_INT8: np.int8, KV_FP8: ml_dtypes.float8_e4m3fn}


def session(attrs: PagedAttentionAttrs, cos_sin: np.ndarray, k_scale: float, v_scale: float):
    lowered = lowered_single_op(attrs, cos_sin, (k_scale, v_scale))
    if attrs.kv_cache_dtype == KV_FP8:  # onnxruntime reads an fp8 cache as its uint8 bit patterns
        assert {i.name: i.type.tensor_type.elem_type for i in lowered.graph.input}["key_cache.0"] == TensorProto.UINT8
    return ort.InferenceSession(lowered.SerializeToString(), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("kv_type", [KV_INT8, KV_FP8])
@pytest.mark.parametrize(
    ("hq", "hkv", "d", "bs", "new", "ctx", "window", "softcap"),
    [
        (4, 2, 16, 4, [5, 1, 3], [0, 9, 6], None, None),
        (6, 1, 8, 3, [1, 7], [10, 0], None, None),
        (4, 2, 16, 4, [5, 1, 3], [0, 19, 6], 6, 1.5),  # a sliding window and soft-capping
    ],
)
def test_quantized_cache_lowering_matches_reference(kv_type, hq, hkv, d, bs, new, ctx, window, softcap):
    rng = np.random.default_rng(7)
    attrs = PagedAttentionAttrs(hq, hkv, d, 1 / math.sqrt(d), False, kv_type, window, softcap)
    cos_sin = rotary_cos_sin_cache(64, d, 10000.0)
    qkv, kc, vc, pos, bt, qsl = make_case(rng, new, ctx, hq, hkv, d, bs, num_blocks=24)
    k_scale, v_scale = 3.5 / 127, 2.5 / 127
    kq, vq = quantize_kv(kc, k_scale, kv_type), quantize_kv(vc, v_scale, kv_type)  # a cache written earlier
    ref_out, ref_k, ref_v = paged_attention(qkv, kq, vq, pos, bt, qsl, cos_sin, attrs, k_scale, v_scale)

    raw = (lambda a: a.view(np.uint8)) if kv_type == KV_FP8 else (lambda a: a)
    feeds = {
        "qkv": qkv,
        "key_cache.0": raw(kq),
        "value_cache.0": raw(vq),
        "positions": pos,
        "block_tables": bt,
        "query_start_loc": qsl,
    }
    out, new_k, new_v = session(attrs, cos_sin, k_scale, v_scale).run(["out", "new_keys.0", "new_values.0"], feeds)
    np.testing.assert_allclose(out, ref_out, atol=1e-4, rtol=1e-4)
    slots = slot_mapping(pos, qsl, bt, bs)
    for cache, written, ref, scale in ((kq, new_k, ref_k, k_scale), (vq, new_v, ref_v, v_scale)):
        assert written.dtype == (np.uint8 if kv_type == KV_FP8 else np.int8)
        got = raw(cache.copy())
        got.reshape(-1, hkv, d)[slots] = written
        got = got.view(STORAGE[kv_type])
        # equal codes, except where float32 rounding of the rotation sits on a rounding boundary (one step apart)
        diff = np.abs(dequantize_kv(got, scale) - dequantize_kv(ref, scale))
        assert np.mean(diff == 0) > 0.999
        assert diff.max() <= 32 * scale  # one fp8 step at the top of the range is 32 units of the scale


def test_reference_quantization_saturates_and_rounds_to_even():
    x = np.array([0.5, 1.5, 2.5, -300.0, 1000.0])
    assert quantize_kv(x, 1.0, KV_INT8).tolist() == [0, 2, 2, -128, 127]
    assert quantize_kv(x, 1.0, KV_FP8).astype(np.float32).tolist() == [0.5, 1.5, 2.5, -288.0, 448.0]
    with pytest.raises(ValueError, match="k_scale and v_scale"):
        paged_attention(
            np.zeros((1, 48), np.float32),
            np.zeros((2, 4, 1, 16), np.int8),
            np.zeros((2, 4, 1, 16), np.int8),
            np.zeros(1, np.int64),
            np.ones((1, 1), np.int64),
            np.array([0, 1]),
            None,
            PagedAttentionAttrs(1, 1, 16, 0.25, False, KV_INT8),
        )
