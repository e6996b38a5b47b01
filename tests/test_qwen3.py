"""Qwen3 beyond the shared tiny-model tests (which run ``qwen3`` of tiny_models.py through convert, both onnxruntime
attention forms, the torch backend, the runner's greedy tokens and quantization): its config reading, the q/k norm
tensors, a tied-embedding variant, and the one-line refusals of what trtbuild does not implement."""

from __future__ import annotations

import pytest
from test_end_to_end import check_prefill_and_decode
from tiny_models import TINY_CONFIGS, make_hf_model

from trtbuild.backends.onnxruntime.session import OrtSession
from trtbuild.build import build_engine
from trtbuild.checkpoint.layout import expected_tensors
from trtbuild.config import AttentionKind, BuildConfig, CpuAttention, DType, ModelConfig
from trtbuild.configio import from_dict, to_dict
from trtbuild.convert.convert import convert
from trtbuild.errors import ConvertError
from trtbuild.models import model_config_from_hf


def qwen3_hf(**overrides) -> dict:
    spec = {**TINY_CONFIGS["qwen3"], **overrides}
    spec.pop("model_type")
    return spec


def test_config_and_layout():
    cfg = model_config_from_hf(qwen3_hf(), DType.FLOAT32)
    assert cfg.qk_norm and cfg.head_size == 16 and cfg.num_kv_heads == 2 and cfg.rope.rotary_dim == 16
    assert not cfg.qkv_bias and not cfg.attn_out_bias and cfg.norm_eps == 1e-6
    tensors = expected_tensors(cfg)
    assert tensors["layers.1.attn.q_norm.weight"] == tensors["layers.1.attn.k_norm.weight"] == (16,)
    assert tensors["layers.0.attn.qkv.weight"] == ((4 + 2 * 2) * 16, 48)
    assert tensors["layers.0.attn.out.weight"] == (48, 64)
    biased = model_config_from_hf(qwen3_hf(attention_bias=True), DType.FLOAT32)
    assert biased.qkv_bias and biased.attn_out_bias
    # the window on, but every layer below max_window_layers: full attention throughout, as in transformers
    assert model_config_from_hf(
        qwen3_hf(use_sliding_window=True, sliding_window=32, max_window_layers=2), DType.FLOAT32
    )
    no_head_dim = qwen3_hf()
    del no_head_dim["head_dim"]
    assert model_config_from_hf(no_head_dim, DType.FLOAT32).head_size == 128  # transformers' Qwen3Config default


def test_checkpoint_config_without_qk_norm_still_reads():
    """A checkpoint written before ``qk_norm`` existed (Llama, format 2) reads as one without q/k norms."""
    cfg = model_config_from_hf({**TINY_CONFIGS["llama_gqa"]}, DType.FLOAT32)
    data = to_dict(cfg)
    del data["qk_norm"]
    assert from_dict(ModelConfig, data) == cfg and not cfg.qk_norm


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (dict(use_sliding_window=True, sliding_window=6, layer_types=["full_attention", "chunked"]), "'chunked'"),
        (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}), "rope type 'yarn'"),
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(partial_rotary_factor=0.5), "partial_rotary_factor"),
    ],
)
def test_unsupported_features_are_refused_in_one_line(overrides, needle):
    with pytest.raises(ConvertError) as e:
        model_config_from_hf(qwen3_hf(**overrides), DType.FLOAT32)
    assert needle in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("attention", [CpuAttention.NATIVE, CpuAttention.LOWERED])
def test_sliding_layers_match_transformers(tmp_path, attention):
    """Layer 1 slides over 6 positions (from max_window_layers on), layer 0 attends fully, as transformers reads it;
    without use_sliding_window the window is ignored, as transformers ignores it."""
    window = dict(use_sliding_window=True, sliding_window=6, max_window_layers=1)
    cfg = model_config_from_hf(qwen3_hf(**window), DType.FLOAT32)
    assert cfg.layer_types == [AttentionKind.FULL, AttentionKind.SLIDING] and cfg.kv_window is None
    assert model_config_from_hf(qwen3_hf(sliding_window=6, max_window_layers=1), DType.FLOAT32).sliding_window is None
    model = make_hf_model("qwen3", tmp_path / "hf", seed=2, **window)
    convert(tmp_path / "hf", tmp_path / "ckpt", DType.FLOAT32)
    build = BuildConfig(max_seq_len=128, kv_block_size=4, cpu_attention=attention)
    build_engine(tmp_path / "ckpt", tmp_path / "engine", build)
    check_prefill_and_decode(OrtSession(tmp_path / "engine", kv_cache_memory=1 << 20), model, "qwen3")


def test_tied_embeddings_match_transformers(tmp_path):
    model = make_hf_model("qwen3", tmp_path / "hf", seed=1, tie_word_embeddings=True)
    convert(tmp_path / "hf", tmp_path / "ckpt", DType.FLOAT32)
    cfg = ModelConfig.load(tmp_path / "ckpt")
    assert cfg.tie_word_embeddings and "lm_head.weight" not in expected_tensors(cfg)
    build_engine(tmp_path / "ckpt", tmp_path / "engine", BuildConfig(max_seq_len=128, kv_block_size=4))
    check_prefill_and_decode(OrtSession(tmp_path / "engine", kv_cache_memory=1 << 20), model, "qwen3")
