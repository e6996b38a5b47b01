"""``trtbuild quantize --qformat int8_sq`` of the mixture-of-experts models (``trtbuild/quantize/moe.py``,
``export_experts``): modelopt's SmoothQuant on the rebuilt transformers model, the experts int8 per row with int8
activations per block of 16 (the ``trtbuild::MoE`` node's ``activation_block``). The op's oracle with that
attribute computes what modelopt's fake-quantized experts compute; the checkpoint holds modelopt's codes; the
onnxruntime (native and standard-op) and torch engines compute what the calibrated model computes, through the
paged cache. The tiny models' widths are multiples of 16 here (the format quantizes activations per 16 in-features).
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from quantize_helpers import calib_file, write_char_tokenizer
from test_end_to_end import check_prefill_and_decode
from test_moe import engine_forms
from tiny_models import TINY_MOE_CONFIGS, make_hf_model

from trtbuild.checkpoint.files import load_any_checkpoint
from trtbuild.checkpoint.layout import expected_quantized_tensors
from trtbuild.config import ActivationScales, DType, ModelConfig, QFormat, QuantConfig
from trtbuild.errors import TrtbuildError
from trtbuild.plugins.moe import MoeAttrs, moe, quantize_activation_blocks
from trtbuild.quantize.quantize import check_request

# expert and dense widths that are multiples of 16 (the tiny configs' 40 / 24 are refused: test_refusals)
WIDTHS = {"mixtral": dict(intermediate_size=32), "qwen3_moe": dict(intermediate_size=64, moe_intermediate_size=32)}
# The calibrated model's own Q/DQ rounds x / (amax / 127) in its arithmetic, the engines in theirs: a value within
# float rounding of a tie lands one code apart, which moves the tiny models' logits by ~1e-3 (the dense int8_sq
# engines' bound, tests/test_quantize_formats.py: 5e-3 for onnxruntime's kernels, 1e-3 for the graph's own Q/DQ).
ATOL = {"native": 5e-3, "lowered": 5e-3, "torch": 1e-3}


@contextlib.contextmanager
def head_reads_int8_blocks(model, form: str):
    """The onnxruntime engines run the int8 LM head (weight-only in every format) on ``QLinear`` or ``MatMulNBits``,
    whose activations are int8 per block of 16 (docs/quantization.md's table: what ``int8_wo`` runs with); the
    torch engine runs the graph's float activations. For the onnxruntime forms the calibrated model's head reads
    its input so quantized (by the op's oracle rule) while the block runs: without it the head alone moves the tiny
    models' logits by ~0.017."""
    if form == "torch":
        yield
        return

    def quantized_input(module, args):
        x = args[0]
        rows = quantize_activation_blocks(x.reshape(-1, x.shape[-1]).numpy(), 16)
        return (torch.from_numpy(rows.astype(np.float32)).reshape(x.shape),)

    hook = model.lm_head.register_forward_pre_hook(quantized_input)
    try:
        yield
    finally:
        hook.remove()


class SmoothQuantized:
    """The tiny MoE models (``WIDTHS``) quantized to int8_sq on 2 x 24 tokens on first use: ``checkpoint(name)`` ->
    (modelopt's calibrated model, the quantized checkpoint)."""

    def __init__(self, root) -> None:
        self.root = root
        self.made: dict = {}

    def checkpoint(self, name: str):
        from trtbuild.convert.convert import convert
        from trtbuild.quantize.quantize import quantize

        if name not in self.made:
            model = make_hf_model(name, self.root / f"{name}-hf", seed=5, **WIDTHS[name])
            convert(self.root / f"{name}-hf", self.root / f"{name}-ckpt", DType.FLOAT32)
            write_char_tokenizer(self.root / f"{name}-ckpt", model.config.vocab_size)
            qcfg = QuantConfig(
                QFormat.INT8_SQ, calib_dataset=str(calib_file(self.root)), calib_size=2, calib_seq_len=24
            )
            result = quantize(
                self.root / f"{name}-ckpt", self.root / f"{name}-q", qcfg, progress=False, keep_model=True
            )
            self.made[name] = (result.fake_quant_model, self.root / f"{name}-q")
        return self.made[name]


@pytest.fixture(scope="module")
def quantized(tmp_path_factory) -> SmoothQuantized:
    return SmoothQuantized(tmp_path_factory.mktemp("moe-sq"))


@pytest.mark.parametrize("name", list(TINY_MOE_CONFIGS))
def test_checkpoint_and_oracle_are_modelopts_experts(quantized, name):
    """Every expected tensor (int8 experts per row, smoothed int8 linears, float routers); each expert's codes and
    scales are its modelopt quantizer's; and the op's oracle with ``activation_block=16`` on those codes computes
    what modelopt's fake-quantized experts module computes on the same routing (float32 rounding apart)."""
    model, q = quantized.checkpoint(name)
    cfg, weights = load_any_checkpoint(q)
    assert {k: v.shape for k, v in weights.items()} == {k: s for k, (s, _) in expected_quantized_tensors(cfg).items()}
    assert any(k.endswith("attn.out.pre_quant_scale") for k in weights)  # SmoothQuant smoothed the attention
    rng = np.random.default_rng(0)
    for n in cfg.moe.sparse_layers:
        experts = model.get_submodule(f"model.layers.{n}.mlp.experts")
        assert weights[f"layers.{n}.moe.router.weight"].dtype == np.float32
        for hf_name, w in (("gate_up_proj", "gate_up"), ("down_proj", "down")):
            assert getattr(experts, f"{hf_name}_input_quantizer").block_sizes == {-1: 16}
            codes, scales = weights[f"layers.{n}.moe.{w}.weight"], weights[f"layers.{n}.moe.{w}.weight_scale"]
            for e, quantizer in enumerate(getattr(experts, f"{hf_name}_weight_quantizers")):
                with torch.no_grad():
                    fake = quantizer(getattr(experts, hf_name)[e].detach()).numpy()
                np.testing.assert_allclose(codes[e] * scales[e][:, None], fake, rtol=1e-6, atol=0)
        hidden = rng.standard_normal((9, cfg.hidden_size)).astype(np.float32)
        logits = (3 * rng.standard_normal((9, cfg.moe.num_experts))).astype(np.float32)
        probs = torch.softmax(torch.from_numpy(logits), -1)
        kept, chosen = torch.topk(probs, cfg.moe.top_k, -1)
        if cfg.moe.renormalize:
            kept = kept / kept.sum(-1, keepdim=True)
        with torch.no_grad():
            expected = experts(torch.from_numpy(hidden), chosen, kept).numpy()
        got = moe(
            hidden,
            logits,
            weights[f"layers.{n}.moe.gate_up.weight"],
            weights[f"layers.{n}.moe.down.weight"],
            MoeAttrs(cfg.moe.top_k, cfg.moe.renormalize, activation_block=16),
            weights[f"layers.{n}.moe.gate_up.weight_scale"],
            weights[f"layers.{n}.moe.down.weight_scale"],
        )
        assert np.abs(expected).max() > 0.1
        np.testing.assert_allclose(got, expected, atol=1e-5 * np.abs(expected).max(), rtol=0)


@pytest.mark.parametrize(
    ("name", "form"),
    [
        ("mixtral", "native"),
        ("qwen3_moe", "native"),
        ("qwen3_moe", "lowered"),
        ("mixtral", "torch"),
        pytest.param("mixtral", "lowered", marks=pytest.mark.slow),
        pytest.param("qwen3_moe", "torch", marks=pytest.mark.slow),
    ],
)
def test_engines_match_modelopt_fake_quant(quantized, name, form, tmp_path):
    """Ragged prefill with a chunk, then mixed chunk + decode steps on scrambled blocks (Qwen3-MoE's window sliding
    past them): every logit row within ``ATOL[form]`` of the calibrated model's (its head reading int8 blocks as the
    onnxruntime engines' head does: ``head_reads_int8_blocks``)."""
    from trtbuild.backends.onnxruntime.session import OrtSession
    from trtbuild.backends.torch.session import TorchSession
    from trtbuild.build import build_engine

    model, q = quantized.checkpoint(name)
    build, torch_cfg = engine_forms()[form]
    build_engine(q, tmp_path / "engine", build, **({"torch": torch_cfg} if torch_cfg else {}))
    if torch_cfg is not None:
        session = TorchSession(tmp_path / "engine", kv_cache_memory=1 << 20, compile=False)
    else:
        session = OrtSession(tmp_path / "engine", kv_cache_memory=1 << 20)
    with head_reads_int8_blocks(model, form):
        check_prefill_and_decode(session, model, f"{name} int8_sq {form}", atol=ATOL[form])


@pytest.mark.parametrize(
    ("overrides", "qcfg", "message"),
    [
        ({}, QuantConfig(QFormat.INT8_SQ), "which 24 is not a multiple of; use int8_wo"),
        (WIDTHS["qwen3_moe"], QuantConfig(QFormat.INT8_SQ, activation_scales=ActivationScales.STATIC), "dynamic only"),
        (WIDTHS["qwen3_moe"], QuantConfig(QFormat.INT8_SQ, activation_scales=ActivationScales.PER_TOKEN), "dynamic"),
    ],
)
def test_refusals(overrides, qcfg, message, tmp_path):
    """What int8_sq of an MoE model does not take, each a one-line error before any work (other formats:
    tests/test_moe_quantize.py)."""
    from trtbuild.convert.convert import convert

    make_hf_model("qwen3_moe", tmp_path / "hf", seed=1, **overrides)
    convert(tmp_path / "hf", tmp_path / "ckpt", DType.FLOAT32)
    with pytest.raises(TrtbuildError, match=message) as e:
        check_request(ModelConfig.load(tmp_path / "ckpt"), qcfg)
    assert "\n" not in str(e.value)
