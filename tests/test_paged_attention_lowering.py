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
    inputs = [qkv, kc, vc, pos, bt, qsl, cs]
    if kv_scales is not None:
        k_scale, v_scale = kv_scales
        inputs += [g.initializer("k_scale", np.array(k_scale, np.float32))]
        inputs += [g.initializer("v_scale", np.array(v_scale, np.float32))]
    g.op_multi(OP_TYPE, inputs, domain=DOMAIN, outputs=["out", "kc_out", "vc_out"], **attrs.onnx_attributes())
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


def _eager_attention(qkv, kc, vc, pos, bt, qsl, attrs):
    """The op without rotary embedding, as transformers' eager attention computes it (Gemma 2): every token against
    its sequence's whole cached context, ``q @ k^T * scale``, soft-capped, ``sliding_window_overlay``'s mask
    (``k > p - window``) and the causal one, softmax. A statement of the semantics independent of reference.py."""
    hq, hkv, d = attrs.num_heads, attrs.num_kv_heads, attrs.head_size
    k_all, v_all = kc.copy(), vc.copy()
    bs = kc.shape[1]
    seq = np.searchsorted(qsl, np.arange(len(pos)), side="right") - 1
    k_all[bt[seq, pos // bs], pos % bs] = qkv[:, hq * d : (hq + hkv) * d].reshape(-1, hkv, d)
    v_all[bt[seq, pos // bs], pos % bs] = qkv[:, (hq + hkv) * d :].reshape(-1, hkv, d)
    out = np.zeros((len(pos), hq, d))
    for t, p in enumerate(pos):
        ctx = np.arange(p + 1)
        keys, vals = k_all[bt[seq[t], ctx // bs], ctx % bs], v_all[bt[seq[t], ctx // bs], ctx % bs]
        for h in range(hq):
            w = qkv[t, h * d : (h + 1) * d].astype(np.float64) @ keys[:, h // (hq // hkv)].T * attrs.scale
            if attrs.softcap is not None:
                w = np.tanh(w / attrs.softcap) * attrs.softcap
            if attrs.sliding_window is not None:
                w = np.where(ctx > p - attrs.sliding_window, w, -np.inf)
            e = np.exp(w - w.max())
            out[t, h] = e / e.sum() @ vals[:, h // (hq // hkv)]
    return out.reshape(len(pos), hq * d)


@pytest.mark.parametrize(("window", "softcap"), [(5, None), (1, None), (None, 0.7), (6, 1.3)])
def test_reference_window_and_softcap_are_transformers_eager_attention(window, softcap):
    rng = np.random.default_rng(11)
    attrs = PagedAttentionAttrs(4, 2, 8, 0.5, sliding_window=window, softcap=softcap)
    qkv, kc, vc, pos, bt, qsl = make_case(rng, [6, 1, 3], [0, 12, 4], 4, 2, 8, 4, num_blocks=16)
    out, _, _ = paged_attention(qkv, kc, vc, pos, bt, qsl, None, attrs)
    np.testing.assert_allclose(out, _eager_attention(qkv, kc, vc, pos, bt, qsl, attrs), atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "kwargs", [dict(sliding_window=0), dict(sliding_window=2.5), dict(softcap=0.0), dict(softcap=-1.0)]
)
def test_window_and_softcap_must_be_positive(kwargs):
    with pytest.raises(ValueError):
        PagedAttentionAttrs(4, 2, 8, 0.5, **kwargs)


WINDOW_CASES = [
    # hq, hkv, d, rotary_dim, block_size, new lengths, cached lengths, sliding_window, softcap
    (4, 2, 16, 16, 4, [5, 1, 3, 1], [0, 9, 6, 22], 7, None),  # window across blocks; ragged prefill + decode
    (6, 1, 8, 8, 3, [1, 1, 9], [10, 4, 0], 2, None),  # window smaller than a block, GQA 6
    (4, 4, 16, None, 5, [13, 2], [0, 30], 16, None),  # a prefill longer than the window
    (4, 2, 16, 16, 4, [5, 1, 3], [0, 9, 6], None, 1.5),  # soft-capping alone
    (6, 2, 8, 8, 3, [4, 1, 8], [11, 20, 0], 5, 2.0),  # both
]


@pytest.mark.parametrize(("hq", "hkv", "d", "rot", "bs", "new", "ctx", "window", "softcap"), WINDOW_CASES)
def test_window_and_softcap_lowering_matches_reference(hq, hkv, d, rot, bs, new, ctx, window, softcap):
    rng = np.random.default_rng(hq * 7 + bs)
    attrs = PagedAttentionAttrs(hq, hkv, d, 1 / math.sqrt(d), sliding_window=window, softcap=softcap)
    cos_sin = rotary_cos_sin_cache(64, rot, 10000.0) if rot else None
    qkv, kc, vc, pos, bt, qsl = make_case(rng, new, ctx, hq, hkv, d, bs, num_blocks=40)
    ref_out, _, _ = paged_attention(qkv, kc, vc, pos, bt, qsl, cos_sin, attrs)
    sess = ort.InferenceSession(
        lowered_single_op(attrs, cos_sin).SerializeToString(), providers=["CPUExecutionProvider"]
    )
    feeds = {"qkv": qkv, "key_cache.0": kc, "value_cache.0": vc, "positions": pos, "query_start_loc": qsl}
    (out,) = sess.run(["out"], feeds | {"block_tables": bt})
    np.testing.assert_allclose(out, ref_out, atol=1e-5, rtol=1e-5)
    if window is None:
        return
    # The blocks wholly before each sequence's window are never read: null (0) or any other valid block there
    # changes nothing.
    first = pos[qsl[:-1]]
    before = np.arange(bt.shape[1])[None, :] < (np.maximum(first - window + 1, 0) // bs)[:, None]
    assert before.any()
    for fill in (np.zeros_like(bt), rng.integers(0, len(kc), bt.shape)):
        (moved,) = sess.run(["out"], feeds | {"block_tables": np.where(before, fill, bt)})
        np.testing.assert_array_equal(moved, out)


def test_windowed_lowering_gathers_only_the_window():
    """A decode at position 1000 with a window of 8 gathers 2 blocks of 4 (positions 992..999), not 250."""
    attrs = PagedAttentionAttrs(2, 1, 8, 0.35, sliding_window=8)
    rng = np.random.default_rng(2)
    qkv, kc, vc, pos, bt, qsl = make_case(rng, [1], [1000], 2, 1, 8, 4, num_blocks=260)
    lowered = lowered_single_op(attrs, None)
    gathered = [n.output[0] for n in lowered.graph.node if n.op_type == "GatherElements"]
    assert len(gathered) == 1
    lowered.graph.output.append(onnx.helper.make_tensor_value_info(gathered[0], INT64, None))
    sess = ort.InferenceSession(lowered.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {"qkv": qkv, "key_cache.0": kc, "value_cache.0": vc, "positions": pos, "block_tables": bt}
    out, tables = sess.run(["out", gathered[0]], feeds | {"query_start_loc": qsl})
    np.testing.assert_array_equal(tables, bt[:, 248:250])
    np.testing.assert_allclose(out, paged_attention(qkv, kc, vc, pos, bt, qsl, None, attrs)[0], atol=1e-5, rtol=0)
