"""Every quantization format's checkpoint: names, dtypes and shapes of the quantized tensors, zero points and their
``MatMulNBits`` emission, and the formats the TensorRT lowering refuses with one line."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from quantize_helpers import quantized_cases

from trtbuild.checkpoint.files import load_any_checkpoint
from trtbuild.config import BuildConfig, QFormat


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """name -> (fake-quantized torch model, quantized checkpoint, engine) of each of quantize_helpers.CASES."""
    return quantized_cases(tmp_path_factory)


def test_checkpoint_layout(quantized):
    """Names, dtypes and shapes of the quantized tensors; smoothing folded into the norms; config block."""
    from safetensors import safe_open

    def tensors(name):
        with safe_open(str(quantized[name][1] / "rank0.safetensors"), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118

    assert not any(n.endswith("input_scale") for n in tensors("int8_sq"))  # dynamic: scales computed at run time
    sq = tensors("int8_sq_static")
    assert sq["layers.0.attn.qkv.weight"].dtype is torch.int8 and sq["layers.0.attn.qkv.weight"].shape == (128, 64)
    assert sq["layers.0.attn.qkv.weight_scale"].shape == (128,)
    assert sq["layers.0.attn.qkv.input_scale"].shape == ()
    assert "layers.0.attn.qkv.pre_quant_scale" not in sq  # folded into input_norm
    assert "layers.0.mlp.down.pre_quant_scale" not in sq  # folded into the up rows of gate_up
    assert sq["layers.0.attn.out.pre_quant_scale"].shape == (64,)  # explicit Mul
    assert sq["lm_head.weight"].dtype is torch.float32
    fp8 = tensors("fp8+kv_fp8")
    assert fp8["layers.1.mlp.down.weight"].dtype is torch.float8_e4m3fn
    assert fp8["layers.1.mlp.down.weight_scale"].shape == (64,)
    assert fp8["layers.1.attn.k_scale"].shape == () and float(fp8["layers.1.attn.v_scale"]) > 0
    qkv_scale = fp8["layers.1.attn.qkv.weight_scale"]  # static: per tensor per source module, q | k | v
    assert len(set(qkv_scale[:64].tolist())) == len(set(qkv_scale[64:96].tolist())) == 1
    rowwise = tensors("fp8")
    assert len(set(rowwise["layers.1.attn.qkv.weight_scale"][:64].tolist())) == 64  # one per output channel
    assert not any(n.endswith("input_scale") for n in rowwise)
    awq = tensors("int4_awq")
    assert awq["layers.0.mlp.down.weight"].dtype is torch.uint8 and awq["layers.0.mlp.down.weight"].shape == (64, 48)
    assert awq["layers.0.mlp.down.weight_scale"].shape == (64, 3)
    partial = tensors("int4_awq_g64_partial")  # 96 in-features at group 64: a full and a half group
    assert partial["layers.0.mlp.down.weight_scale"].shape == (64, 2)
    assert partial["layers.0.attn.qkv.weight_scale"].shape == (128, 1)
    cfg, weights = load_any_checkpoint(quantized["int4_awq"][1])
    assert cfg.quantization.qformat is QFormat.INT4_AWQ and cfg.quantization.group_size == 32
    assert weights["layers.0.mlp.down.weight"].dtype == ml_dtypes.int4
    assert weights["layers.0.mlp.down.weight"].shape == (64, 96)
    # unpacking inverts packing: the int4 values times their scales reproduce modelopt's fake-quantized weight
    model = quantized["int4_awq"][0]
    down = model.model.layers[0].mlp.down_proj
    with torch.no_grad():
        fq = down.weight_quantizer(down.weight).numpy()
    w = weights["layers.0.mlp.down.weight"].astype(np.float32) * np.repeat(
        weights["layers.0.mlp.down.weight_scale"], 32, 1
    )
    np.testing.assert_allclose(w, fq, atol=1e-6)


def test_tensorrt_lowering_refuses_partial_int4_groups(quantized):
    """onnxruntime runs a partial last group (above); the TensorRT lowering takes whole groups only."""
    from trtbuild.backends.build_request import portable_graph
    from trtbuild.backends.tensorrt.build.lowering import lower_for_tensorrt
    from trtbuild.errors import BuildError

    build = BuildConfig(max_seq_len=128, kv_block_size=4)
    _, _, _, whole = portable_graph(quantized["int4_awq"][1], build)
    assert sum(n.op_type == "DequantizeLinear" for n in lower_for_tensorrt(whole, build).graph.node) == 8
    _, _, _, partial = portable_graph(quantized["int4_awq_g64_partial"][1], build)
    with pytest.raises(BuildError, match="int4 groups of 64 do not divide its 96 in-features"):
        lower_for_tensorrt(partial, build)


def test_tensorrt_lowering_refuses_dynamic_activation_scales(quantized):
    """TensorRT's int8 / fp8 Q/DQ GEMMs need constant per-tensor activation scales: static ones lower, dynamic ones
    are refused with one line naming the flag."""
    from trtbuild.backends.build_request import portable_graph
    from trtbuild.backends.tensorrt.build.lowering import lower_for_tensorrt
    from trtbuild.errors import BuildError

    build = BuildConfig(max_seq_len=128, kv_block_size=4)
    _, _, _, static = portable_graph(quantized["int8_sq_static"][1], build)
    assert sum(n.op_type == "QuantizeLinear" for n in lower_for_tensorrt(static, build).graph.node) == 8
    for name in ("int8_sq", "int8_sq_per_token", "fp8"):
        _, _, _, dynamic = portable_graph(quantized[name][1], build)
        with pytest.raises(BuildError, match="--activation-scales static"):
            lower_for_tensorrt(dynamic, build)


def test_zero_point_checkpoint_layout(quantized):
    """Zero points: unsigned codes packed as before, a uint8 zero point per group in 0..15, and the codes minus
    the zero points times the scales reproduce the fake-quantized model's weight."""
    from safetensors import safe_open

    _, qckpt, _ = quantized["int4_awq_zp_g64_partial"]
    with safe_open(str(qckpt / "rank0.safetensors"), framework="pt") as f:
        zp, scale = f.get_tensor("layers.0.mlp.down.weight_zero_point"), f.get_tensor("layers.0.mlp.down.weight_scale")
        assert "layers.0.attn.qkv.weight_zero_point" in f.keys()  # noqa: SIM118
    assert zp.dtype is torch.uint8 and zp.shape == scale.shape == (64, 2) and int(zp.max()) <= 15
    cfg, weights = load_any_checkpoint(qckpt)
    assert cfg.quantization.zero_points
    codes = weights["layers.0.mlp.down.weight"]
    assert codes.dtype == ml_dtypes.uint4 and codes.shape == (64, 96)
    assert weights["layers.0.mlp.down.weight_zero_point"].dtype == ml_dtypes.uint4
    zps = np.repeat(zp.numpy().astype(np.float32), 64, 1)[:, :96]
    w = (codes.astype(np.float32) - zps) * np.repeat(scale.numpy(), 64, 1)[:, :96]
    down = quantized["int4_awq_zp_g64_partial"][0].model.layers[0].mlp.down_proj
    np.testing.assert_allclose(w, down.weight.detach().numpy(), atol=1e-6)
    with safe_open(str(quantized["int4_awq"][1] / "rank0.safetensors"), framework="pt") as f:
        assert not any(k.endswith("zero_point") for k in f.keys())  # noqa: SIM118  (symmetric: none)


@pytest.mark.parametrize("name", ["int4_wo_zp", "int4_awq_zp_g64_partial", "int4_awq_zp_g128"])
def test_zero_point_int4_round_trips_through_matmulnbits(quantized, name, tmp_path):
    """A zero-point linear of the checkpoint, emitted as the portable graph states it (uint4 weight, blocked scale
    and uint4 zero point), becomes one ``MatMulNBits`` with zero points computing ``x @ ((q - zp) * s).T``."""
    from onnx import TensorProto

    from trtbuild.checkpoint.graph import emit_quantized_linear
    from trtbuild.graph.builder import GraphBuilder

    cfg, weights = load_any_checkpoint(quantized[name][1])
    group = cfg.quantization.group_size
    for prefix in ("layers.1.attn.qkv", "layers.1.mlp.down"):
        codes, scale, zp = (weights[prefix + s] for s in (".weight", ".weight_scale", ".weight_zero_point"))
        rows, cols = codes.shape
        g = GraphBuilder(21)
        y = emit_quantized_linear(g, weights, g.add_input("x", TensorProto.FLOAT, [5, cols]), prefix, cfg.quantization)
        g.add_output(y, TensorProto.FLOAT, [5, rows])
        opts = ort.SessionOptions()
        opts.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "0")
        opts.optimized_model_filepath = str(tmp_path / "optimized.onnx")
        model = g.model(with_plugin_domain=False).SerializeToString()
        sess = ort.InferenceSession(model, opts, providers=["CPUExecutionProvider"])
        nodes = onnx.load(str(tmp_path / "optimized.onnx")).graph.node
        assert [n.op_type for n in nodes] == ["MatMulNBits"] and len(nodes[0].input) >= 4 and nodes[0].input[3]
        xs = np.random.default_rng(0).standard_normal((5, cols)).astype(np.float32)
        zps = np.repeat(zp.astype(np.float32), group, 1)[:, :cols]
        w = (codes.astype(np.float32) - zps) * np.repeat(scale, group, 1)[:, :cols]
        np.testing.assert_allclose(sess.run(None, {"x": xs})[0], xs @ w.T, rtol=1e-5, atol=1e-5)


def test_tensorrt_lowering_refuses_zero_points(quantized):
    from trtbuild.backends.build_request import portable_graph
    from trtbuild.backends.tensorrt.build.lowering import lower_for_tensorrt
    from trtbuild.errors import BuildError

    build = BuildConfig(max_seq_len=128, kv_block_size=4)
    _, _, _, graph = portable_graph(quantized["int4_wo_zp"][1], build)  # whole groups of 32: only the zero points
    with pytest.raises(BuildError, match="int4 with zero points, which TensorRT's DequantizeLayer does not take"):
        lower_for_tensorrt(graph, build)


@pytest.mark.parametrize("name", ["gemma3_int8_sq_static", "gemma2_int8_sq_static"])
def test_gemma_smoothing_folds_into_the_stored_one_plus_w_norms(quantized, name):
    """Gemma's norms scale by 1 + w and the checkpoint stores 1 + w: SmoothQuant's pre-quant scales multiply that
    (HF's w is 1 + w less one), into the norm before each smoothed linear (the pre-MLP one is HF's
    pre_feedforward_layernorm); the sandwich norms stay as converted."""
    model, qckpt, _ = quantized[name]
    _, weights = load_any_checkpoint(qckpt)
    for n, layer in enumerate(model.model.layers):
        for norm, hf_norm, linear in (
            ("input_norm", layer.input_layernorm, layer.self_attn.q_proj),
            ("post_attn_norm", layer.pre_feedforward_layernorm, layer.mlp.gate_proj),
            ("attn.post_norm", layer.post_attention_layernorm, None),
        ):
            expected = 1 + hf_norm.weight.detach()
            if linear is not None:
                expected = expected * linear.input_quantizer.pre_quant_scale
            np.testing.assert_allclose(weights[f"layers.{n}.{norm}.weight"], expected.numpy(), rtol=1e-6, err_msg=norm)


@pytest.mark.parametrize("name", ["gemma3_int8_wo+kv_int8", "gemma2_int8_wo+kv_int8"])
def test_gemma_kv_cache_scales_are_calibrated_per_layer(quantized, name):
    """Each layer's K and V ranges, as modelopt calibrated them on keys after rotary (and Gemma 3's k norm)."""
    model, qckpt, _ = quantized[name]
    _, weights = load_any_checkpoint(qckpt)
    for n, layer in enumerate(model.model.layers):
        for kv in ("k", "v"):
            amax = float(getattr(layer.self_attn, f"{kv}_bmm_quantizer").amax)
            np.testing.assert_allclose(weights[f"layers.{n}.attn.{kv}_scale"], amax / 127, rtol=1e-6, err_msg=kv)
    assert len({float(weights[f"layers.{n}.attn.k_scale"]) for n in range(len(model.model.layers))}) == 3
