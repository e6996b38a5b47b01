"""The TensorRT lowering on a small hand-made portable graph (no TensorRT needed).

Structure is checked against what TensorRT's ONNX parser needs; semantics by running the portable and the lowered
graph in onnx's reference evaluator, each plugin form implemented with the numpy oracle, and comparing outputs.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator
from onnx.reference.op_run import OpRun

from trtbuild.backends.tensorrt.build.lowering import (
    NO_ROPE_TABLE,
    PLUGIN_DOMAIN,
    cache_aliases,
    lower_for_tensorrt,
    profile_shapes,
)
from trtbuild.config import BuildConfig
from trtbuild.errors import BuildError
from trtbuild.plugins.paged_attention import tensorrt_plugin
from trtbuild.plugins.paged_attention.reference import PagedAttentionAttrs, paged_attention, rotary_cos_sin_cache

HQ, HKV, D, HIDDEN, BS = 4, 2, 8, 32, 4
CACHE_SHAPE = ["num_blocks", "block_size", HKV, D]
META = ["positions", "block_tables", "query_start_loc"]
PARSER_ATTRS = {"plugin_namespace", "plugin_version", "aot"}


def portable_graph(
    rope: bool, rotary_dim: int = D, interleaved: bool = False, layer0: dict | None = None
) -> onnx.ModelProto:
    """2 layers of MatMul -> trtbuild::PagedAttention -> MatMul (+ residual); layer 0's QKV weight is int8 Q/DQ,
    layer 1 quantizes its activation; only layer 0 exposes its cache outputs as graph outputs. ``layer0``: optional
    attributes of layer 0's attention (``sliding_window``, ``softcap``)."""
    rng = np.random.default_rng(0)
    inits, nodes = [], []
    inputs = [
        helper.make_tensor_value_info("hidden", TensorProto.FLOAT, ["num_tokens", HIDDEN]),
        helper.make_tensor_value_info("positions", TensorProto.INT64, ["num_tokens"]),
        helper.make_tensor_value_info("block_tables", TensorProto.INT64, ["num_seqs", "max_blocks_per_seq"]),
        helper.make_tensor_value_info("query_start_loc", TensorProto.INT64, ["num_seqs_plus_1"]),
    ]
    outputs = []
    cos_sin = ""
    if rope:
        inits.append(numpy_helper.from_array(rotary_cos_sin_cache(64, rotary_dim, 10000.0), "rotary.cos_sin_cache"))
        cos_sin = "rotary.cos_sin_cache"
    x = "hidden"
    for n in range(2):
        for kind in ("key", "value"):
            inputs.append(helper.make_tensor_value_info(f"{kind}_cache.{n}", TensorProto.FLOAT, CACHE_SHAPE))
        w_qkv = rng.standard_normal((HIDDEN, (HQ + 2 * HKV) * D)).astype(np.float32) * 0.2
        if n == 0:  # weight-only int8: DequantizeLinear(int8 weight, scale) -> MatMul
            scale = np.float32(np.abs(w_qkv).max() / 127)
            inits.append(numpy_helper.from_array(np.round(w_qkv / scale).astype(np.int8), "l0.qkv.w_q"))
            inits.append(numpy_helper.from_array(np.array(scale, np.float32), "l0.qkv.w_scale"))
            nodes.append(helper.make_node("DequantizeLinear", ["l0.qkv.w_q", "l0.qkv.w_scale"], ["l0.qkv.w"]))
            matmul_in = x
        else:  # activation Q/DQ
            inits.append(numpy_helper.from_array(np.array(0.05, np.float32), "l1.act_scale"))
            inits.append(numpy_helper.from_array(np.array(0, np.int8), "l1.act_zp"))
            nodes.append(helper.make_node("QuantizeLinear", [x, "l1.act_scale", "l1.act_zp"], ["l1.act_q"]))
            nodes.append(helper.make_node("DequantizeLinear", ["l1.act_q", "l1.act_scale", "l1.act_zp"], ["l1.act"]))
            inits.append(numpy_helper.from_array(w_qkv, "l1.qkv.w"))
            matmul_in = "l1.act"
        nodes.append(helper.make_node("MatMul", [matmul_in, f"l{n}.qkv.w"], [f"l{n}.qkv"], name=f"l{n}.qkv"))
        nodes.append(
            helper.make_node(
                "PagedAttention",
                [f"l{n}.qkv", f"key_cache.{n}", f"value_cache.{n}", *META, cos_sin],
                [f"l{n}.attn", f"key_cache_out.{n}", f"value_cache_out.{n}"],
                name=f"layers.{n}.attn.paged",
                domain="trtbuild",
                num_heads=HQ,
                num_kv_heads=HKV,
                head_size=D,
                scale=1 / np.sqrt(D),
                rotary_interleaved=int(interleaved),
                **((layer0 or {}) if n == 0 else {}),
            )
        )
        w_o = rng.standard_normal((HQ * D, HIDDEN)).astype(np.float32) * 0.2
        inits.append(numpy_helper.from_array(w_o, f"l{n}.o.w"))
        nodes.append(helper.make_node("MatMul", [f"l{n}.attn", f"l{n}.o.w"], [f"l{n}.o"], name=f"l{n}.o"))
        nodes.append(helper.make_node("Add", [x, f"l{n}.o"], [f"l{n}.res"], name=f"l{n}.residual"))
        x = f"l{n}.res"
        if n == 0:
            for kind in ("key", "value"):
                outputs.append(helper.make_tensor_value_info(f"{kind}_cache_out.0", TensorProto.FLOAT, CACHE_SHAPE))
    outputs.insert(0, helper.make_tensor_value_info(x, TensorProto.FLOAT, ["num_tokens", HIDDEN]))
    graph = helper.make_graph(nodes, "tiny", inputs, outputs, initializer=inits)
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 23), helper.make_opsetid("trtbuild", 1)], ir_version=10
    )
    onnx.checker.check_model(model, full_check=False)
    return model


def _plugin_op(domain: str) -> type[OpRun]:
    """A reference-evaluator op for one form of the plugin node, implemented with the numpy oracle."""

    def _run(self, qkv, kc, vc, positions, tables, qsl, cos_sin=None, **attrs):  # type: ignore[no-untyped-def]
        if domain == PLUGIN_DOMAIN:  # the TensorRT form: what the plugin's autotune declares
            assert {positions.dtype, tables.dtype, qsl.dtype} == {np.dtype(np.int32)}
            assert cos_sin.dtype == np.float32
            if not attrs["has_rope"]:
                cos_sin = None
        if domain == PLUGIN_DOMAIN:  # the plugin's fields: 0 for an absent optional attribute
            a = tensorrt_plugin.op_attrs(*(attrs[k] for k in tensorrt_plugin.ATTRIBUTES if k != "has_rope"))
        else:
            a = PagedAttentionAttrs.from_onnx(attrs)
        return paged_attention(qkv, kc, vc, positions, tables, qsl, cos_sin, a)

    return type("PagedAttention", (OpRun,), {"op_domain": domain, "_run": _run})


def feeds(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """A ragged step: a continuation chunk after a 5-token prefix and a decode token, scrambled blocks."""
    perm = rng.permutation(8)
    f = {
        "hidden": rng.standard_normal((4, HIDDEN)).astype(np.float32),
        "positions": np.array([5, 6, 7, 9], np.int64),
        "block_tables": np.stack([perm[:3], perm[3:6]]).astype(np.int64),
        "query_start_loc": np.array([0, 3, 4], np.int64),
    }
    for n in range(2):
        for kind in ("key", "value"):
            f[f"{kind}_cache.{n}"] = rng.standard_normal((8, BS, HKV, D)).astype(np.float32)
    return f


def run(model: onnx.ModelProto, inputs: dict[str, np.ndarray], outputs: list[str]) -> list[np.ndarray]:
    ops = [_plugin_op("trtbuild"), _plugin_op(PLUGIN_DOMAIN)]
    return ReferenceEvaluator(model, new_ops=ops).run(outputs, inputs)


@pytest.mark.parametrize(
    ("rope", "rotary_dim", "interleaved", "layer0"),
    [
        (True, D, False, None),
        (True, D // 2, True, None),
        (False, D, False, None),
        (True, D, False, dict(sliding_window=3, softcap=0.8)),  # layer 1 has neither: absent stays absent
    ],
)
def test_lowering_preserves_semantics(rope: bool, rotary_dim: int, interleaved: bool, layer0: dict | None) -> None:
    portable = portable_graph(rope, rotary_dim, interleaved, layer0)
    lowered = lower_for_tensorrt(portable, BuildConfig(kv_block_size=BS))
    onnx.checker.check_model(lowered, full_check=False)
    names = ["l1.res", "key_cache_out.0", "value_cache_out.0", "key_cache_out.1", "value_cache_out.1"]
    inputs = feeds(np.random.default_rng(1))
    for want, got in zip(run(portable, inputs, names), run(lowered, inputs, names), strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


def test_lowered_structure() -> None:
    portable = portable_graph(rope=True)
    before = portable.SerializeToString()
    lowered = lower_for_tensorrt(portable, BuildConfig(kv_block_size=BS), aot=True)
    assert portable.SerializeToString() == before, "the input model must not be modified"
    plugins = [n for n in lowered.graph.node if n.op_type == "PagedAttention"]
    assert len(plugins) == 2 and all(n.domain == PLUGIN_DOMAIN for n in plugins)
    assert not [n for n in lowered.graph.node if n.domain == "trtbuild"]
    assert {o.domain: o.version for o in lowered.opset_import} == {"": 23, PLUGIN_DOMAIN: 1}
    for n, node in enumerate(plugins):
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        assert set(attrs) == set(tensorrt_plugin.ATTRIBUTES) | PARSER_ATTRS  # what the plugin registers
        assert attrs["plugin_namespace"] == tensorrt_plugin.PLUGIN_NAMESPACE.encode()
        assert attrs["plugin_version"] == tensorrt_plugin.TENSORRT_CREATOR_VERSION.encode()
        assert node.op_type == tensorrt_plugin.PLUGIN_NAME
        assert (attrs["aot"], attrs["has_rope"], attrs["num_heads"], attrs["head_size"]) == (1, 1, HQ, D)
        assert list(node.input[:3]) == [f"l{n}.qkv", f"key_cache.{n}", f"value_cache.{n}"]
        assert list(node.input[3:]) == [
            "positions.int32",
            "block_tables.int32",
            "query_start_loc.int32",
            "rotary.cos_sin_cache",
        ]
        assert list(node.output) == [f"l{n}.attn", f"key_cache_out.{n}", f"value_cache_out.{n}"]
    casts = [n for n in lowered.graph.node if n.op_type == "Cast"]
    assert len(casts) == 3 and all(helper.get_attribute_value(c.attribute[0]) == TensorProto.INT32 for c in casts)
    # every other node is byte-identical and in the same order (Q/DQ included)
    kept = [n.SerializeToString() for n in lowered.graph.node if n.op_type not in ("PagedAttention", "Cast")]
    assert kept == [n.SerializeToString() for n in portable.graph.node if n.op_type != "PagedAttention"]
    assert [n.op_type for n in lowered.graph.node].count("QuantizeLinear") == 1
    # caches: graph outputs aliased to their inputs, block size pinned
    assert cache_aliases(lowered) == {f"{k}_cache_out.{n}": f"{k}_cache.{n}" for k in ("key", "value") for n in (0, 1)}
    shapes = {vi.name: vi.type.tensor_type.shape.dim for vi in [*lowered.graph.input, *lowered.graph.output]}
    for name in cache_aliases(lowered).items():
        for tensor in name:
            assert [d.dim_value or d.dim_param for d in shapes[tensor]] == ["num_blocks", BS, HKV, D]


def test_no_rope_gets_a_dummy_table_and_aot_is_optional() -> None:
    lowered = lower_for_tensorrt(portable_graph(rope=False), BuildConfig(kv_block_size=BS))
    plugins = [n for n in lowered.graph.node if n.op_type == "PagedAttention"]
    assert all(n.input[6] == NO_ROPE_TABLE for n in plugins)
    assert [i.name for i in lowered.graph.initializer].count(NO_ROPE_TABLE) == 1
    for node in plugins:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        assert attrs["has_rope"] == 0 and "aot" not in attrs


def test_non_float32_cos_sin_is_cast() -> None:
    model = portable_graph(rope=True)
    table = next(i for i in model.graph.initializer if i.name == "rotary.cos_sin_cache")
    table.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(table).astype(np.float16), table.name))
    lowered = lower_for_tensorrt(model, BuildConfig(kv_block_size=BS), aot=False)
    plugins = [n for n in lowered.graph.node if n.op_type == "PagedAttention"]
    assert {n.input[6] for n in plugins} == {"rotary.cos_sin_cache.float32"}
    onnx.checker.check_model(lowered, full_check=False)


def test_window_and_softcap_become_plugin_fields() -> None:
    lowered = lower_for_tensorrt(portable_graph(True, layer0=dict(sliding_window=3, softcap=0.8)), BuildConfig())
    plugins = [n for n in lowered.graph.node if n.op_type == "PagedAttention"]
    fields = [{a.name: helper.get_attribute_value(a) for a in n.attribute} for n in plugins]
    assert [(f["sliding_window"], f["softcap"]) for f in fields] == [(3, pytest.approx(0.8)), (0, 0.0)]
    with pytest.raises(BuildError, match="softcap"):
        lower_for_tensorrt(portable_graph(True, layer0=dict(softcap=-1.0)), BuildConfig())


def test_errors() -> None:
    model = portable_graph(rope=True)
    with pytest.raises(BuildError, match="block size 4, build says 16"):
        bad = onnx.ModelProto()
        bad.CopyFrom(model)
        bad.graph.input[4].type.tensor_type.shape.dim[1].dim_value = BS
        lower_for_tensorrt(bad, BuildConfig(kv_block_size=16))
    no_plugin = onnx.ModelProto()
    no_plugin.CopyFrom(model)
    for node in no_plugin.graph.node:
        node.domain = "" if node.domain == "trtbuild" else node.domain
    with pytest.raises(BuildError, match="no trtbuild::PagedAttention node"):
        lower_for_tensorrt(no_plugin, BuildConfig())
    missing = onnx.ModelProto()
    missing.CopyFrom(model)
    node = next(n for n in missing.graph.node if n.domain == "trtbuild")
    del node.attribute[0]
    with pytest.raises(BuildError, match="missing attribute"):
        lower_for_tensorrt(missing, BuildConfig(kv_block_size=BS))


def test_profile_shapes() -> None:
    build = BuildConfig(max_batch_size=8, max_seq_len=100, max_num_tokens=256, kv_block_size=BS)
    lowered = lower_for_tensorrt(portable_graph(rope=True), build)
    shapes = profile_shapes(lowered, build)
    assert shapes["positions"] == ((1,), (8,), (256,))
    assert shapes["block_tables"] == ((1, 1), (8, 25), (8, 25))
    assert shapes["query_start_loc"] == ((2,), (9,), (9,))
    assert shapes["key_cache.1"] == ((1, BS, HKV, D), (200, BS, HKV, D), (200, BS, HKV, D))
    assert shapes["hidden"] == ((1, HIDDEN), (8, HIDDEN), (256, HIDDEN))
    lowered.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "mystery"
    with pytest.raises(BuildError, match="mystery"):
        profile_shapes(lowered, build)


@pytest.mark.parametrize("arch", ["llama_gqa", "gpt2"])
def test_real_emitted_graph(arch: str, tmp_path: Path) -> None:
    """The graph ``trtbuild build`` emits (tiny random Llama with RoPE/GQA, GPT-2 without RoPE) lowers to the same
    logits and caches."""
    pytest.importorskip("transformers", reason="building the tiny checkpoint needs transformers")
    from tiny_models import make_hf_model

    from trtbuild.checkpoint.files import load_checkpoint
    from trtbuild.config import DType, EngineIO
    from trtbuild.convert.convert import convert
    from trtbuild.graph.emit import emit_portable_graph

    make_hf_model(arch, tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "ckpt", DType.FLOAT32)
    cfg, weights = load_checkpoint(tmp_path / "ckpt")
    build = BuildConfig(max_seq_len=64, kv_block_size=BS, max_batch_size=4, max_num_tokens=32)
    portable = emit_portable_graph(cfg, weights, build, EngineIO())
    lowered = lower_for_tensorrt(portable, build, aot=True)
    onnx.checker.check_model(lowered, full_check=False)
    assert sum(n.op_type == "PagedAttention" for n in lowered.graph.node) == cfg.num_layers
    assert set(profile_shapes(lowered, build)) == {i.name for i in lowered.graph.input}
    rng = np.random.default_rng(0)
    step = ragged_step()
    for n in range(cfg.num_layers):
        for kind in ("key", "value"):
            shape = (8, BS, cfg.num_kv_heads, cfg.head_size)
            step[f"{kind}_cache.{n}"] = rng.standard_normal(shape).astype(np.float32)
    names = ["logits", *sorted(cache_aliases(lowered))]
    assert len(names) == 1 + 2 * cfg.num_layers
    for want, got in zip(run(portable, step, names), run(lowered, step, names), strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


def test_quantized_kv_cache_is_refused_not_silently_dropped():
    """The TensorRT plugin does not read KV-cache scales yet: lowering such a graph must fail loudly."""
    model = _quantized_kv_model()
    with pytest.raises(BuildError, match="quantized KV cache"):
        lower_for_tensorrt(model, BuildConfig(max_seq_len=64, kv_block_size=4))


def _quantized_kv_model() -> onnx.ModelProto:
    from trtbuild.plugins.paged_attention import DOMAIN, OP_TYPE

    names = ["qkv", "key_cache.0", "value_cache.0", "positions", "block_tables", "query_start_loc"]
    types = [TensorProto.FLOAT, TensorProto.INT8, TensorProto.INT8] + [TensorProto.INT64] * 3
    shapes = [["T", 32], ["NB", "BS", 2, 8], ["NB", "BS", 2, 8], ["T"], ["B", "M"], ["B1"]]
    inputs = [helper.make_tensor_value_info(n, t, s) for n, t, s in zip(names, types, shapes, strict=True)]
    scales = [helper.make_tensor(n, TensorProto.FLOAT, [], [0.1]) for n in ("k_scale", "v_scale")]
    node = helper.make_node(
        OP_TYPE, [*names, "", "k_scale", "v_scale"], ["out", "kc_out", "vc_out"], domain=DOMAIN, name="attn",
        num_heads=2, num_kv_heads=1, head_size=8, scale=0.35, rotary_interleaved=0, kv_cache_dtype=TensorProto.INT8,
    )  # fmt: skip
    outputs = [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["T", 16])]
    graph = helper.make_graph([node], "g", inputs, outputs, scales)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23), helper.make_opsetid(DOMAIN, 1)])


def ragged_step() -> dict[str, np.ndarray]:
    """A step's graph inputs but the caches: a 3-token continuation (positions 5-7) and a decode token (position 9)
    on scrambled blocks of 4, both sequences' last rows as logits."""
    return {
        "input_ids": np.array([3, 4, 5, 6], np.int64),
        "positions": np.array([5, 6, 7, 9], np.int64),
        "block_tables": np.array([[3, 0, 5], [1, 2, 4]], np.int64),
        "query_start_loc": np.array([0, 3, 4], np.int64),
        "logits_indices": np.array([2, 3], np.int64),
    }
