"""The onnxruntime lowering of trtbuild::PagedAttention agrees with the reference implementation."""

from __future__ import annotations

import math

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from trtbuild.backends.onnxruntime.build.lowering import lower_for_onnxruntime
from trtbuild.config import EngineIO
from trtbuild.graph.builder import FLOAT, INT64, GraphBuilder
from trtbuild.plugins.paged_attention import DOMAIN, OP_TYPE, PagedAttentionAttrs, paged_attention, rotary_cos_sin_cache
from trtbuild.runtime.kv_cache import slot_mapping

IO = EngineIO()


def make_case(rng, lens_new, lens_ctx, hq, hkv, d, block_size, num_blocks):
    """Random ragged batch: sequence b has ctx[b] cached tokens and new[b] tokens this step; scrambled blocks."""
    perm = rng.permutation(np.arange(1, num_blocks))  # block 0 stays the null block
    tables, used = [], 0
    for n, c in zip(lens_new, lens_ctx, strict=True):
        need = math.ceil((n + c) / block_size)
        tables.append(perm[used : used + need])
        used += need
    width = max(len(t) for t in tables) + 1  # one extra padded column
    bt = np.zeros((len(tables), width), dtype=np.int64)
    for i, t in enumerate(tables):
        bt[i, : len(t)] = t
    qsl = np.concatenate([[0], np.cumsum(lens_new)]).astype(np.int64)
    pos = np.concatenate([np.arange(c, c + n) for n, c in zip(lens_new, lens_ctx, strict=True)]).astype(np.int64)
    t = int(qsl[-1])
    qkv = rng.standard_normal((t, (hq + 2 * hkv) * d)).astype(np.float32)
    kc = rng.standard_normal((num_blocks, block_size, hkv, d)).astype(np.float32)
    vc = rng.standard_normal((num_blocks, block_size, hkv, d)).astype(np.float32)
    return qkv, kc, vc, pos, bt, qsl


def lowered_single_op(
    attrs: PagedAttentionAttrs, cos_sin: np.ndarray | None, kv_scales: tuple[float, float] | None = None
) -> onnx.ModelProto:
    """A graph of one plugin node (caches of ``attrs.kv_cache_dtype``; scales as inputs 7/8 when given), lowered."""
    g = GraphBuilder(23)
    hq, hkv, d, kv = attrs.num_heads, attrs.num_kv_heads, attrs.head_size, attrs.kv_cache_dtype
    qkv = g.add_input("qkv", FLOAT, ["T", (hq + 2 * hkv) * d])
    kc = g.add_input("key_cache.0", kv, ["NB", "BS", hkv, d])
    vc = g.add_input("value_cache.0", kv, ["NB", "BS", hkv, d])
    pos = g.add_input("positions", INT64, ["T"])
    bt = g.add_input("block_tables", INT64, ["B", "M"])
    qsl = g.add_input("query_start_loc", INT64, ["B1"])
    cs = g.initializer("rotary.cos_sin_cache", cos_sin) if cos_sin is not None else ""
    inputs, extra = [qkv, kc, vc, pos, bt, qsl, cs], {}
    if kv_scales is not None:
        k_scale, v_scale = kv_scales
        inputs += [g.initializer("k_scale", np.array(k_scale, np.float32))]
        inputs += [g.initializer("v_scale", np.array(v_scale, np.float32))]
        extra["kv_cache_dtype"] = kv
    g.op_multi(
        OP_TYPE,
        inputs,
        domain=DOMAIN,
        outputs=["out", "kc_out", "vc_out"],
        num_heads=hq,
        num_kv_heads=hkv,
        head_size=d,
        scale=attrs.scale,
        rotary_interleaved=int(attrs.rotary_interleaved),
        **extra,
    )
    g.add_output("out", FLOAT, ["T", hq * d])
    g.add_output("kc_out", kv, ["NB", "BS", hkv, d])
    g.add_output("vc_out", kv, ["NB", "BS", hkv, d])
    lowered = lower_for_onnxruntime(g.model(), IO)
    assert not [n for n in lowered.graph.node if n.domain == DOMAIN]
    return lowered


def single_op_session(attrs: PagedAttentionAttrs, cos_sin: np.ndarray | None) -> ort.InferenceSession:
    return ort.InferenceSession(
        lowered_single_op(attrs, cos_sin).SerializeToString(), providers=["CPUExecutionProvider"]
    )


CASES = [
    # hq, hkv, d, rotary_dim (None: no rope), interleaved, block_size, new lengths, cached lengths
    (4, 2, 16, 16, False, 4, [5, 1, 3, 1], [0, 9, 6, 2]),
    (6, 1, 8, 8, True, 3, [1, 1, 7], [10, 4, 0]),
    (4, 4, 16, 8, False, 5, [13], [0]),
    (3, 3, 8, None, False, 4, [2, 6, 1], [3, 0, 11]),
    (2, 1, 32, 16, True, 16, [1, 1], [33, 0]),
]


@pytest.mark.parametrize(("hq", "hkv", "d", "rot", "inter", "bs", "new", "ctx"), CASES)
def test_lowering_matches_reference(hq, hkv, d, rot, inter, bs, new, ctx):
    rng = np.random.default_rng(hash((hq, hkv, d, bs)) % 2**32)
    attrs = PagedAttentionAttrs(hq, hkv, d, 1 / math.sqrt(d), inter)
    cos_sin = rotary_cos_sin_cache(64, rot, 10000.0) if rot else None
    qkv, kc, vc, pos, bt, qsl = make_case(rng, new, ctx, hq, hkv, d, bs, num_blocks=24)
    ref_out, ref_k, ref_v = paged_attention(qkv, kc, vc, pos, bt, qsl, cos_sin, attrs)

    sess = single_op_session(attrs, cos_sin)
    feeds = {
        "qkv": qkv,
        "key_cache.0": kc,
        "value_cache.0": vc,
        "positions": pos,
        "block_tables": bt,
        "query_start_loc": qsl,
    }
    out, new_k, new_v = sess.run(["out", "new_keys.0", "new_values.0"], feeds)
    np.testing.assert_allclose(out, ref_out, atol=1e-5, rtol=1e-5)
    slots = slot_mapping(pos, qsl, bt, bs)
    k2, v2 = kc.copy(), vc.copy()
    k2.reshape(-1, hkv, d)[slots] = new_k
    v2.reshape(-1, hkv, d)[slots] = new_v
    np.testing.assert_allclose(k2, ref_k, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(v2, ref_v, atol=1e-5, rtol=1e-5)
