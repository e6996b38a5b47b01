"""Checkpoint format (sharded sources, dtypes) and the portable graph's structure."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from safetensors.numpy import load_file
from tiny_models import TINY_CONFIGS, make_hf_model

from trtbuild.backends.onnxruntime.build.lowering import lower_for_onnxruntime
from trtbuild.checkpoint.files import load_checkpoint
from trtbuild.checkpoint.layout import expected_tensors
from trtbuild.config import BuildConfig, DType, EngineIO, ModelConfig
from trtbuild.convert.convert import convert
from trtbuild.graph.emit import emit_portable_graph
from trtbuild.plugins.paged_attention import DOMAIN, OP_TYPE


def test_sharded_source_converts_like_single_file(tmp_path):
    model = make_hf_model("llama_gqa", tmp_path / "single")
    model.save_pretrained(str(tmp_path / "sharded"), max_shard_size="40KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    convert(tmp_path / "single", tmp_path / "a")
    convert(tmp_path / "sharded", tmp_path / "b")
    a, b = load_file(str(tmp_path / "a" / "rank0.safetensors")), load_file(str(tmp_path / "b" / "rank0.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])


def test_fused_tensors_are_concatenated_parts(tmp_path):
    model = make_hf_model("qwen2_bias", tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "ckpt")
    cfg, w = load_checkpoint(tmp_path / "ckpt")
    sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    attn = "model.layers.1.self_attn."
    qkv = np.concatenate([sd[attn + f"{p}_proj.weight"] for p in "qkv"])
    np.testing.assert_array_equal(w["layers.1.attn.qkv.weight"], qkv)
    np.testing.assert_array_equal(
        w["layers.1.attn.qkv.bias"], np.concatenate([sd[attn + f"{p}_proj.bias"] for p in "qkv"])
    )
    gate_up = np.concatenate([sd["model.layers.1.mlp.gate_proj.weight"], sd["model.layers.1.mlp.up_proj.weight"]])
    np.testing.assert_array_equal(w["layers.1.mlp.gate_up.weight"], gate_up)
    assert set(w) == set(expected_tensors(cfg))
    assert cfg.tie_word_embeddings and "lm_head.weight" not in w


@pytest.mark.parametrize("dtype", [DType.FLOAT16, DType.BFLOAT16])
def test_half_precision_checkpoints(tmp_path, dtype):
    make_hf_model("llama_gqa", tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "ckpt", dtype)
    cfg = ModelConfig.load(tmp_path / "ckpt")
    assert cfg.dtype is dtype
    header_len = int.from_bytes((tmp_path / "ckpt" / "rank0.safetensors").read_bytes()[:8], "little")
    header = json.loads((tmp_path / "ckpt" / "rank0.safetensors").read_bytes()[8 : 8 + header_len])
    want = {DType.FLOAT16: "F16", DType.BFLOAT16: "BF16"}[dtype]
    assert {v["dtype"] for k, v in header.items() if k != "__metadata__"} == {want}


@pytest.mark.parametrize("name", list(TINY_CONFIGS))
def test_portable_graph_has_one_plugin_node_per_layer(tmp_path, name):
    make_hf_model(name, tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "ckpt")
    cfg, weights = load_checkpoint(tmp_path / "ckpt")
    build = BuildConfig(max_seq_len=128)
    portable = emit_portable_graph(cfg, weights, build, EngineIO())
    onnx.checker.check_model(portable)
    assert {o.domain: o.version for o in portable.opset_import}[""] >= 21
    plugins = [n for n in portable.graph.node if n.domain == DOMAIN and n.op_type == OP_TYPE]
    assert len(plugins) == cfg.num_layers
    for node in plugins:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert attrs["num_heads"] == cfg.num_heads and attrs["num_kv_heads"] == cfg.num_kv_heads
        assert attrs["head_size"] == cfg.head_size
        assert (node.input[6] != "") == (cfg.rope is not None)  # rotary table only for RoPE models
    lowered = lower_for_onnxruntime(portable, EngineIO())
    onnx.checker.check_model(lowered, full_check=True)
    assert not [n for n in lowered.graph.node if n.domain == DOMAIN]
