"""Phi-3 beyond the shared tiny-model tests (which run ``phi3`` of tiny_models.py through convert, both onnxruntime
attention forms, the torch backend and the runner's greedy tokens; test_quantize_formats quantizes it): its config
reading (partial rotary from either transformers' spelling), the fused source tensors, the sliding window of every
layer, a tied-embedding variant (as Phi-4-mini), and the one-line refusals of what trtbuild does not implement."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import load_file
from test_cli_errors import assert_clean_failure, run_cli
from test_end_to_end import check_prefill_and_decode
from tiny_models import TINY_CONFIGS, make_hf_model

from trtbuild.backends.onnxruntime.session import OrtSession
from trtbuild.build import build_engine
from trtbuild.checkpoint.layout import expected_tensors
from trtbuild.config import AttentionKind, BuildConfig, DType, ModelConfig, RuntimeConfig
from trtbuild.convert.convert import convert
from trtbuild.errors import ConvertError
from trtbuild.models import model_config_from_hf

LONGROPE = {"type": "longrope", "short_factor": [1.0] * 6, "long_factor": [2.0] * 6}


def phi3_hf(**overrides) -> dict:
    spec = {**TINY_CONFIGS["phi3"], **overrides}
    spec.pop("model_type")
    return spec


def test_config_and_layout():
    cfg = model_config_from_hf(phi3_hf(), DType.FLOAT32)
    assert cfg.head_size == 16 and cfg.num_kv_heads == 2 and cfg.rope.rotary_dim == 12 and not cfg.rope.interleaved
    assert not cfg.qkv_bias and not cfg.attn_out_bias and not cfg.mlp_bias and not cfg.qk_norm
    assert cfg.max_position_embeddings == 128 and cfg.eos_token_ids == [2]
    tensors = expected_tensors(cfg)
    assert tensors["layers.0.attn.qkv.weight"] == ((4 + 2 * 2) * 16, 64)
    assert tensors["layers.1.mlp.gate_up.weight"] == (2 * 80, 64)
    # transformers 5 writes the factor into rope_parameters, 4.x at the top level: either is read
    nested = phi3_hf(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5})
    del nested["partial_rotary_factor"]
    assert model_config_from_hf(nested, DType.FLOAT32).rope.rotary_dim == 8
    assert model_config_from_hf(phi3_hf(partial_rotary_factor=1.0), DType.FLOAT32).rope.rotary_dim == 16


def test_sliding_window_slides_every_layer():
    """Phi-3-mini-4k: every layer attends over the last 2047 of its 4096 positions."""
    cfg = model_config_from_hf(phi3_hf(sliding_window=2047, max_position_embeddings=4096), DType.FLOAT32)
    assert cfg.max_position_embeddings == 4096 and cfg.kv_window == cfg.sliding_window == 2047
    assert set(cfg.layer_types) == {AttentionKind.SLIDING}
    assert model_config_from_hf(phi3_hf(), DType.FLOAT32).kv_window is None


def test_fused_source_tensors_convert_in_their_row_order(tmp_path):
    """``qkv_proj`` (q | k | v rows) and ``gate_up_proj`` (gate | up, as Phi3MLP's chunk reads them) are the canonical
    fused tensors as stored."""
    make_hf_model("phi3", tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "ckpt", DType.FLOAT32)
    src = load_file(str(tmp_path / "hf" / "model.safetensors"))
    out = load_file(str(tmp_path / "ckpt" / "rank0.safetensors"))
    for n in range(2):
        h = f"model.layers.{n}."
        np.testing.assert_array_equal(out[f"layers.{n}.attn.qkv.weight"], src[h + "self_attn.qkv_proj.weight"])
        np.testing.assert_array_equal(out[f"layers.{n}.mlp.gate_up.weight"], src[h + "mlp.gate_up_proj.weight"])
    assert set(out) == set(expected_tensors(ModelConfig.load(tmp_path / "ckpt")))


def test_windowed_model_matches_transformers_past_its_window(tmp_path):
    """A 6-token window, far shorter than the sequences: the engine attends as transformers' windowed model does."""
    model = make_hf_model("phi3", tmp_path / "hf", seed=2, sliding_window=6)
    convert(tmp_path / "hf", tmp_path / "ckpt", DType.FLOAT32)
    build_engine(tmp_path / "ckpt", tmp_path / "engine", BuildConfig(max_seq_len=128, kv_block_size=4))
    assert RuntimeConfig.load(tmp_path / "engine").model.kv_window == 6
    check_prefill_and_decode(OrtSession(tmp_path / "engine", kv_cache_memory=1 << 20), model, "phi3")


def test_tied_embeddings_match_transformers(tmp_path):
    model = make_hf_model("phi3", tmp_path / "hf", seed=1, tie_word_embeddings=True)
    convert(tmp_path / "hf", tmp_path / "ckpt", DType.FLOAT32)
    cfg = ModelConfig.load(tmp_path / "ckpt")
    assert cfg.tie_word_embeddings and "lm_head.weight" not in expected_tensors(cfg)
    build_engine(tmp_path / "ckpt", tmp_path / "engine", BuildConfig(max_seq_len=128, kv_block_size=4))
    check_prefill_and_decode(OrtSession(tmp_path / "engine", kv_cache_memory=1 << 20), model, "phi3")


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (dict(rope_scaling=LONGROPE), "rope scaling 'longrope' (LongRoPE) is not supported"),
        (dict(rope_scaling={**LONGROPE, "type": "su"}), "rope scaling 'su'"),
        (dict(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, **LONGROPE}), "'longrope'"),
        (dict(rope_scaling={"type": "linear", "factor": 2.0}), "rope scaling 'linear'"),
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(attention_bias=True), "attention_bias is not supported"),
        (dict(mlp_bias=True), "mlp_bias is not supported"),
        (dict(head_dim=8), "head_dim 8"),
    ],
)
def test_unsupported_features_are_refused_in_one_line(overrides, needle):
    with pytest.raises(ConvertError) as e:
        model_config_from_hf(phi3_hf(**overrides), DType.FLOAT32)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_longrope_checkpoint_is_refused_by_the_cli(tmp_path):
    """A Phi-3-128k / Phi-4-mini style config.json: one line, no checkpoint left."""
    make_hf_model("phi3", tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config.pop("rope_parameters", None)
    config.update(rope_scaling=LONGROPE, original_max_position_embeddings=64)
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    assert_clean_failure(run_cli("convert", tmp_path / "hf", "-o", tmp_path / "ckpt"), "'longrope' (LongRoPE)")
    assert not (tmp_path / "ckpt").exists()
