"""``trtbuild quantize --qformat int8_wo --kv-cache-dtype int8|fp8`` of the mixture-of-experts models
(``trtbuild/quantize/moe_kv.py``): the int8 experts are modelopt's per-expert codes and scales; the checkpoint holds
the KV scales of modelopt's calibration; its onnxruntime engine (native attention and MoE kernels, onnxruntime's
linears with float activations) and its torch CPU engine compute what modelopt's fake-quantized model computes,
through prefill and decode steps of the quantized paged cache."""

from __future__ import annotations

import copy

import numpy as np
import pytest
from quantize_helpers import calib_file, write_char_tokenizer
from test_end_to_end import check_prefill_and_decode
from test_quantize_formats import EXACT
from tiny_models import TINY_MOE_CONFIGS, make_hf_model

from trtbuild.config import (
    Backend,
    BuildConfig,
    CpuLinear,
    DType,
    KVCacheDType,
    ModelConfig,
    QFormat,
    QuantConfig,
    TorchConfig,
    TorchDevice,
)

KV_DTYPES = [KVCacheDType.INT8, KVCacheDType.FP8]
SLOW = pytest.mark.slow  # more engines of the same code paths: each model and each cache dtype stays in the default run
CASES = {
    "onnxruntime": [
        ("mixtral", KVCacheDType.INT8),
        ("qwen3_moe", KVCacheDType.FP8),
        pytest.param("mixtral", KVCacheDType.FP8, marks=SLOW),
        pytest.param("qwen3_moe", KVCacheDType.INT8, marks=SLOW),
    ],
    "torch": [("qwen3_moe", KVCacheDType.INT8), pytest.param("mixtral", KVCacheDType.FP8, marks=SLOW)],
}
# A K or V value whose engine and reference floats (1e-7 apart) straddle a rounding tie lands one code apart: an
# int8 code moves logits by < 1e-5 here, an fp8 one by up to 1/8 of the value. On qwen3_moe's fp8 cache one key of
# the last decode step sits 8e-6 of a step from a tie, and that row's logits move by 1.2e-4 (2026-12-05; the other
# 39 rows within 2e-6).
ATOL = {KVCacheDType.INT8: 1e-4, KVCacheDType.FP8: 5e-4}


# Qwen3-MoE's head tied to its embedding: quantized, it gets its own int8 copy, and the model is rebuilt untied.
OVERRIDES = {"mixtral": {}, "qwen3_moe": dict(tie_word_embeddings=True)}


class KvQuantized:
    """The tiny MoE models (``OVERRIDES``) quantized to int8_wo (the LM head too) with a quantized KV cache,
    calibrated on 2 x 24 tokens, on first use: ``checkpoint(name, kv)`` -> (modelopt's calibrated model, quantized
    checkpoint)."""

    def __init__(self, root) -> None:
        self.root = root
        self.made: dict = {}

    def checkpoint(self, name: str, kv: KVCacheDType, qformat: QFormat = QFormat.INT8_WO):
        from trtbuild.convert.convert import convert
        from trtbuild.quantize.quantize import quantize

        if (name, kv, qformat) not in self.made:
            ckpt = self.root / f"{name}-ckpt"
            if not ckpt.is_dir():
                model = make_hf_model(name, self.root / f"{name}-hf", seed=5, **OVERRIDES[name])
                convert(self.root / f"{name}-hf", ckpt, DType.FLOAT32)
                write_char_tokenizer(ckpt, model.config.vocab_size)
            text = calib_file(self.root)
            qcfg = QuantConfig(qformat, kv, calib_dataset=str(text), calib_size=2, calib_seq_len=24, group_size=32)
            q = self.root / f"{name}-{kv.value}-{qformat.value}"
            result = quantize(ckpt, q, qcfg, progress=False, keep_model=True)
            assert result.calib_samples == 2 and result.calib_tokens == 48
            self.made[name, kv, qformat] = (result.fake_quant_model, q)
        return self.made[name, kv, qformat]


@pytest.fixture(scope="module")
def quantized(tmp_path_factory) -> KvQuantized:
    return KvQuantized(tmp_path_factory.mktemp("moe-kv"))


@pytest.mark.parametrize("kv", KV_DTYPES)
@pytest.mark.parametrize("name", list(TINY_MOE_CONFIGS))
def test_checkpoint_holds_modelopt_kv_scales(quantized, name, kv):
    """Every expected tensor (int8 experts and linears, float routers, a K and V scale per layer), the scales being
    modelopt's calibrated ranges over the dtype's bound."""
    from safetensors.numpy import load_file

    from trtbuild.checkpoint.layout import expected_quantized_tensors

    model, q = quantized.checkpoint(name, kv)
    cfg = ModelConfig.load(q)
    tensors = load_file(str(q / "rank0.safetensors"))
    assert set(tensors) == set(expected_quantized_tensors(cfg))
    bound = {KVCacheDType.INT8: 127.0, KVCacheDType.FP8: 448.0}[kv]
    for n in range(cfg.num_layers):
        attn = model.get_submodule(f"model.layers.{n}.self_attn")
        for k in ("k", "v"):
            amax = getattr(attn, f"{k}_bmm_quantizer").amax
            assert amax > 0 and tensors[f"layers.{n}.attn.{k}_scale"] == np.float32(float(amax) / bound)


@pytest.mark.parametrize(("name", "kv"), CASES["onnxruntime"])
def test_onnxruntime_engine_matches_modelopt_fake_quant(quantized, name, kv, tmp_path):
    """Ragged prefill with a chunk, then mixed chunk + decode steps on scrambled blocks of the int8 / fp8 cache (and
    Qwen3-MoE's window of 8 sliding past them): every logit row within ``ATOL`` of the fake-quantized model's. The
    native attention and MoE kernels, onnxruntime's linears with float activations (the native ones quantize
    activations per block of 16, which modelopt's weight-only model does not)."""
    from trtbuild.backends.onnxruntime.session import OrtSession
    from trtbuild.build import build_engine

    model, q = quantized.checkpoint(name, kv)
    build_engine(
        q, tmp_path / "engine", BuildConfig(max_seq_len=128, kv_block_size=4, cpu_linear=CpuLinear.ONNXRUNTIME)
    )
    session = OrtSession(tmp_path / "engine", kv_cache_memory=1 << 20, session_config=EXACT)
    check_prefill_and_decode(session, model, f"{name} {kv.value}", atol=ATOL[kv])


@pytest.mark.parametrize(
    ("name", "kv"), [("qwen3_moe", KVCacheDType.INT8), pytest.param("mixtral", KVCacheDType.FP8, marks=SLOW)]
)
def test_int4_experts_with_a_quantized_cache(quantized, name, kv, tmp_path):
    """int4_wo (groups of 32: partial last blocks) with an int8 / fp8 cache: modelopt calibrates the K/V ranges of
    the model rebuilt from the int4 weights dequantized (``moe_kv.dequantized_weights``), and the onnxruntime engine
    computes what that model computes."""
    from trtbuild.backends.onnxruntime.session import OrtSession
    from trtbuild.build import build_engine

    model, q = quantized.checkpoint(name, kv, QFormat.INT4_WO)
    build_engine(
        q, tmp_path / "engine", BuildConfig(max_seq_len=128, kv_block_size=4, cpu_linear=CpuLinear.ONNXRUNTIME)
    )
    session = OrtSession(tmp_path / "engine", kv_cache_memory=1 << 20, session_config=EXACT)
    check_prefill_and_decode(session, model, f"{name} int4 {kv.value}", atol=ATOL[kv])


@pytest.mark.parametrize(("name", "kv"), CASES["torch"])
def test_torch_engine_matches_modelopt_fake_quant(quantized, name, kv, tmp_path):
    """The same through the torch CPU engine's module, run eagerly."""
    from trtbuild.backends.torch.session import TorchSession
    from trtbuild.build import build_engine

    model, q = quantized.checkpoint(name, kv)
    build = BuildConfig(backend=Backend.TORCH, max_seq_len=128, kv_block_size=4)
    build_engine(q, tmp_path / "engine", build, torch=TorchConfig(TorchDevice.CPU))
    session = TorchSession(tmp_path / "engine", kv_cache_memory=1 << 20, compile=False)
    check_prefill_and_decode(session, model, f"{name} {kv.value}", atol=ATOL[kv])


@pytest.mark.parametrize("name", list(TINY_MOE_CONFIGS))
def test_experts_are_modelopt_int8_weight_only_codes(name, tmp_path):
    """moe.py's round-to-nearest experts are exactly modelopt's: ``INT8_WEIGHT_ONLY_CFG`` on the rebuilt model gives
    each expert (``_QuantFusedExperts``' per-expert quantizers) the same int8 codes and per-row scales."""
    import modelopt.torch.quantization as mtq
    import torch

    from trtbuild.checkpoint.files import load_checkpoint
    from trtbuild.convert.convert import convert
    from trtbuild.quantize.calibrate import third_party_quiet
    from trtbuild.quantize.hf_moe import build_moe_hf_model
    from trtbuild.quantize.moe import int8_rows

    make_hf_model(name, tmp_path / "hf", seed=5)
    convert(tmp_path / "hf", tmp_path / "ckpt", DType.FLOAT32)
    cfg, weights = load_checkpoint(tmp_path / "ckpt")
    model = build_moe_hf_model(cfg, weights)
    with third_party_quiet():
        mtq.quantize(model, copy.deepcopy(mtq.INT8_WEIGHT_ONLY_CFG), None)
    checked = 0
    for n in cfg.moe.sparse_layers:
        experts = model.get_submodule(f"model.layers.{n}.mlp.experts")
        assert type(experts).__name__.startswith("Quant")  # modelopt's wrapper, not the float module
        for hf_name, w in (("gate_up_proj", "gate_up"), ("down_proj", "down")):
            codes, scales = int8_rows(weights[f"layers.{n}.moe.{w}.weight"])
            for e, quantizer in enumerate(getattr(experts, f"{hf_name}_weight_quantizers")):
                weight = getattr(experts, hf_name)[e].detach()
                with torch.no_grad():
                    fake = quantizer(weight)
                scale = quantizer.amax.reshape(-1) / 127.0
                np.testing.assert_array_equal(scale.numpy(), scales[e])
                np.testing.assert_array_equal(torch.round(fake / scale[:, None]).numpy(), codes[e])
                checked += 1
    assert checked == 2 * cfg.moe.num_experts * len(cfg.moe.sparse_layers)


@pytest.mark.parametrize(
    ("name", "overrides"),
    [
        ("mixtral", dict(sliding_window=6)),  # a window over every layer, shorter than the sequence
        ("qwen3_moe", dict(decoder_sparse_step=2, mlp_only_layers=[])),  # dense by the step: rebuilt as mlp_only_layers
        ("qwen3_moe", dict(norm_topk_prob=True, use_sliding_window=False)),
    ],
)
def test_rebuilt_model_is_the_transformers_model(name, overrides, tmp_path):
    """``hf_moe.build_moe_hf_model`` of the converted checkpoint computes the source model's logits exactly."""
    import torch
    from tiny_models import hf_logits

    from trtbuild.checkpoint.files import load_checkpoint
    from trtbuild.convert.convert import convert
    from trtbuild.quantize.hf_moe import build_moe_hf_model

    source = make_hf_model(name, tmp_path / "hf", seed=7, **overrides)
    convert(tmp_path / "hf", tmp_path / "ckpt", DType.FLOAT32)
    cfg, weights = load_checkpoint(tmp_path / "ckpt")
    rebuilt = build_moe_hf_model(cfg, weights)
    assert [type(layer.mlp).__name__ for layer in rebuilt.model.layers] == [
        type(layer.mlp).__name__ for layer in source.model.layers
    ]
    ids = [int(t) for t in torch.randint(0, cfg.vocab_size, (12,), generator=torch.Generator().manual_seed(1))]
    np.testing.assert_array_equal(hf_logits(rebuilt, ids), hf_logits(source, ids))
