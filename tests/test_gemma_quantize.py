"""Gemma 2 and Gemma 3 through ``trtbuild quantize``'s rebuild of the transformers model (``quantize/hf_model.py``):
the config and logits round trip, AWQ's layer-by-layer replay, and the one-line refusals of what transformers'
Gemma would not compute. The quantized engines against modelopt's fake-quantized models are the ``gemma2_*`` and
``gemma3_*`` cases of quantize_helpers.CASES (test_quantize_formats*.py); Gemma 2's other formats and caches
(quantize_helpers.SLOW_CASES) are checked the same way here, behind the slow marker."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from quantize_helpers import SLOW_CASES, calib_file, find_case, quantize_case, tiny_checkpoint
from test_quantize_formats import ImportedSession, check_against_fake_quant, check_engine
from tiny_models import TINY_CONFIGS, make_hf_model, tiny_config

from trtbuild.checkpoint.files import load_checkpoint
from trtbuild.config import AttentionKind, DType, KVCacheDType, MlpKind, RopeConfig
from trtbuild.convert.convert import convert
from trtbuild.errors import TrtbuildError
from trtbuild.models import model_config_from_hf
from trtbuild.quantize.awq import _layer_inputs
from trtbuild.quantize.hf_config import hf_config
from trtbuild.quantize.hf_model import build_hf_model, check_quantizable

FULL, SLIDING = AttentionKind.FULL, AttentionKind.SLIDING


def gemma_config(name: str, **overrides):
    """The ModelConfig of tiny ``name`` (``gemma2`` or ``gemma3``) with ``overrides`` of its HF config keys."""
    spec = {**tiny_config(name), **overrides}
    spec.pop("model_type")
    return model_config_from_hf(spec, DType.FLOAT32)


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_quantize_rebuilds_the_transformers_model(tmp_path, name):
    """``quantize.hf_model`` inverts the conversion: the config it writes reads back to the checkpoint's, and the
    model it rebuilds from the checkpoint ((1 + w) norms minus one, sandwich norms, Gemma 3's q/k norms and
    per-layer-kind rotary, a window shorter than the sequence, both soft-caps) computes the original transformers
    model's logits."""
    overrides = dict(sliding_window=5, attn_logit_softcapping=3.0, final_logit_softcapping=2.5)
    model = make_hf_model(name, tmp_path / "hf", seed=5, **overrides)
    convert(tmp_path / "hf", tmp_path / "ckpt", DType.FLOAT32)
    cfg, weights = load_checkpoint(tmp_path / "ckpt")
    assert (cfg.attn_softcap, cfg.final_softcap, cfg.sliding_window) == (3.0, 2.5, 5)
    assert model_config_from_hf(hf_config(cfg), DType.FLOAT32) == cfg
    rebuilt = build_hf_model(cfg, weights)
    assert type(rebuilt).__name__ == cfg.architecture
    ids = torch.tensor([[int(t) for t in np.random.default_rng(0).integers(0, 113, 17)]])
    with torch.no_grad():
        expected, got = model(ids).logits, rebuilt(ids).logits
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_awq_replays_each_layer_with_its_own_mask_and_rotary_tables(tmp_path, name):
    """AWQ runs the decoder layer by layer (``quantize.awq._layer_inputs``): each layer called with what the model
    passes that layer (sliding layers: a window of 5; the full layer: no window; Gemma 3's bases 10^4 and 10^6
    scaled) reproduces the model's own hidden states."""
    model = make_hf_model(name, tmp_path / "hf", seed=6, sliding_window=5)
    samples = np.random.default_rng(1).integers(0, 113, (2, 17))
    with torch.no_grad():
        expected = model(torch.from_numpy(samples), output_hidden_states=True).hidden_states
        hidden, per_layer = _layer_inputs(model, samples)
        for n, layer in enumerate(model.model.layers):
            torch.testing.assert_close(hidden, expected[n], atol=1e-5, rtol=0, msg=f"layer {n} input")
            hidden = layer(hidden, **per_layer[n])
        # the last hidden state transformers reports is after the final norm
        torch.testing.assert_close(model.model.norm(hidden), expected[-1], atol=1e-5, rtol=0, msg="model output")


def test_quantize_takes_gemma_features_for_gemma_only():
    """GeGLU, sandwich norms, an attention scale, soft-capping and an embedding multiplier are what Gemma's
    transformers models compute; on another architecture the rebuilt model would not: one line each."""
    check_quantizable(gemma_config("gemma3"))
    llama = model_config_from_hf({**TINY_CONFIGS["llama_gqa"]}, DType.FLOAT32)
    check_quantizable(llama)
    for changes, needle in (
        (dict(mlp=MlpKind.GEGLU), "unexpected norm/MLP/position layout"),
        (dict(sandwich_norms=True), "unexpected norm layout"),
        (dict(layer_types=[SLIDING, FULL], sliding_window=4), "sliding-window layers"),
        (dict(attention_scale=0.5), "an attention scale"),
        (dict(final_softcap=30.0), "soft-capping"),
        (dict(embed_multiplier=2.0), "an embedding multiplier"),
    ):
        with pytest.raises(TrtbuildError, match=needle) as e:
            check_quantizable(replace(llama, **changes))
        assert "\n" not in str(e.value)


def test_quantize_refuses_what_transformers_gemma_would_not_compute():
    """Gemma 2 has no q/k norms, one rotary embedding and heads dividing hidden_size; Gemma 3 has q/k norms; both
    scale by an integer query_pre_attn_scalar: one line each."""
    gemma2, gemma3 = gemma_config("gemma2"), gemma_config("gemma3")
    check_quantizable(gemma2)
    assert gemma2.local_rope is None and not gemma2.qk_norm and gemma2.attn_softcap == 1.5
    for cfg, changes, needle in (
        (gemma2, dict(qk_norm=True), "Gemma2ForCausalLM checkpoint has an unexpected norm layout"),
        (gemma3, dict(qk_norm=False), "Gemma3ForCausalLM checkpoint has an unexpected norm layout"),
        (gemma2, dict(local_rope=RopeConfig(1e6, 16)), "a rotary embedding of its own for the sliding layers"),
        (gemma2, dict(num_heads=5, num_kv_heads=5), "hidden_size 48 is not a multiple of num_heads 5"),
        (gemma2, dict(attention_scale=0.3), r"integer query_pre_attn_scalar \(what transformers' Gemma 2 takes\)"),
        (gemma3, dict(attention_scale=0.3), r"integer query_pre_attn_scalar \(what transformers' Gemma 3 takes\)"),
    ):
        with pytest.raises(TrtbuildError, match=needle) as e:
            check_quantizable(replace(cfg, **changes))
        assert "\n" not in str(e.value)


@pytest.fixture(scope="module")
def gemma2_float(tmp_path_factory):
    """(float checkpoint of tiny Gemma 2 with a tokenizer, calibration text)."""
    root = tmp_path_factory.mktemp("gemma2")
    return tiny_checkpoint(root, "gemma2")[1], calib_file(root)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SLOW_CASES))
def test_gemma2_formats_match_modelopt_fake_quant(gemma2_float, name, tmp_path):
    """Gemma 2 in the formats and caches the default suite leaves out: the engine (and, with a quantized cache, the
    torch importer) computes what modelopt's fake-quantized model computes, as test_quantize_formats checks."""
    checkpoint, text = gemma2_float
    model, qckpt, engine = quantize_case(tmp_path, name, checkpoint, text)
    check_engine(model, qckpt, engine, name, tmp_path)
    if find_case(name).kv is not KVCacheDType.FLOAT32:
        check_against_fake_quant(ImportedSession(qckpt), model, name)
