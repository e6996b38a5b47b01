"""``trtbuild quantize --qformat int8_wo`` of the mixture-of-experts models (``trtbuild/quantize/moe.py``): the
checkpoint's tensors (int8 experts with a scale per row, float routers), the one-line refusals of other requests,
and the engines: the quantized checkpoint's onnxruntime (native and lowered) and torch engines give the logits of a
float engine built from the same weights dequantized (within 1e-4), through the paged cache."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from test_moe import engine_forms
from tiny_models import TINY_MOE_CONFIGS, make_hf_model

from trtbuild.build import build_engine
from trtbuild.checkpoint.files import load_any_checkpoint, save_checkpoint
from trtbuild.checkpoint.layout import expected_quantized_tensors
from trtbuild.config import (
    DType,
    KVCacheDType,
    ModelConfig,
    QFormat,
    QuantConfig,
)
from trtbuild.convert.convert import convert
from trtbuild.errors import TrtbuildError
from trtbuild.quantize.quantize import check_request, quantize
from trtbuild.runtime.batch import StepBatch

BUILDS = engine_forms()


def dequantized_twin(ckpt, out) -> None:
    """A float checkpoint at ``out`` holding the quantized checkpoint ``ckpt``'s weights dequantized (``q * scale``
    per row): what its engines must compute."""
    cfg, weights = load_any_checkpoint(ckpt)
    tensors = {}
    for name, value in weights.items():
        if name.endswith(".weight_scale"):
            continue
        scale = weights.get(name + "_scale")
        w = np.asarray(value, np.float32) if scale is None else value.astype(np.float32) * scale[..., None]
        tensors[name] = torch.from_numpy(np.ascontiguousarray(w))
    out.mkdir()
    save_checkpoint(out, replace(cfg, quantization=None), tensors)


# What is quantized: everything int8_wo takes (attention, dense MLPs, LM head and experts), or the experts alone.
VARIANTS = {"all": QuantConfig(QFormat.INT8_WO), "experts": QuantConfig(QFormat.INT8_WO, exclude=["*"])}


class Quantized:
    """The tiny MoE models quantized and built on first use: ``checkpoint(name, variant)``, the float ``twin``
    engine of its weights dequantized, and its ``engine(name, variant, form)``."""

    def __init__(self, root) -> None:
        self.root = root

    def checkpoint(self, name: str, variant: str):
        q = self.root / f"{name}-{variant}"
        if not q.is_dir():
            ckpt = self.root / f"{name}-ckpt"
            if not ckpt.is_dir():
                make_hf_model(name, self.root / f"{name}-hf", seed=5)
                convert(self.root / f"{name}-hf", ckpt, DType.FLOAT32)
            quantize(ckpt, q, VARIANTS[variant], progress=False)
        return q

    def twin(self, name: str, variant: str):
        engine = self.root / f"{name}-{variant}-twin-engine"
        if not engine.is_dir():
            dequantized_twin(self.checkpoint(name, variant), self.root / f"{name}-{variant}-twin")
            build_engine(self.root / f"{name}-{variant}-twin", engine, BUILDS["native"][0])
        return engine

    def engine(self, name: str, variant: str, form: str):
        engine = self.root / f"{name}-{variant}-{form}"
        if not engine.is_dir():
            build, torch_cfg = BUILDS[form]
            kwargs = {"torch": torch_cfg} if torch_cfg else {}
            build_engine(self.checkpoint(name, variant), engine, build, **kwargs)
        return engine


@pytest.fixture(scope="module")
def quantized(tmp_path_factory) -> Quantized:
    return Quantized(tmp_path_factory.mktemp("moe-int8"))


@pytest.mark.parametrize("name", list(TINY_MOE_CONFIGS))
def test_checkpoint_holds_int8_experts_and_a_float_router(quantized, name):
    from safetensors import safe_open

    q = quantized.checkpoint(name, "all")
    cfg = ModelConfig.load(q)
    with safe_open(str(q / "rank0.safetensors"), framework="pt") as f:
        dtypes = {k: f.get_tensor(k).dtype for k in f.keys()}  # noqa: SIM118 (safe_open is not a mapping)
    assert set(dtypes) == set(expected_quantized_tensors(cfg))
    for n in cfg.moe.sparse_layers:
        assert dtypes[f"layers.{n}.moe.router.weight"] == torch.float32
        assert dtypes[f"layers.{n}.moe.gate_up.weight"] == dtypes[f"layers.{n}.moe.down.weight"] == torch.int8
    assert dtypes["layers.0.attn.qkv.weight"] == dtypes["lm_head.weight"] == torch.int8


SLOW = pytest.mark.slow  # the whole-model variant: more engines of the same code paths
CHECKS = [
    ("experts", "native"),
    ("experts", "lowered"),
    ("experts", "torch"),
    pytest.param("all", "torch", marks=SLOW),
    pytest.param("all", "native", marks=SLOW),
]


@pytest.mark.parametrize(("variant", "form"), CHECKS)
@pytest.mark.parametrize("name", list(TINY_MOE_CONFIGS))
def test_engines_compute_the_dequantized_weights(quantized, name, variant, form):
    """A ragged prefill, then decode steps, on scrambled blocks: the int8 engine's logits are the twin's within
    1e-4. The onnxruntime engines' int8 linears outside the experts (``all``) also quantize their activations per
    block of 16, as every int8_wo onnxruntime engine does, which moves the routers' inputs enough to flip close
    routing choices (logits then differ by tenths): there the native engine is checked against the lowered one,
    which quantizes its activations alike (MatMulNBits, QLinear), within 1e-2 (the two attentions' float-level
    differences may flip an activation's rounding). torch's linears dequantize the weights only."""
    from trtbuild.runtime.session import open_session

    against_lowered = (variant, form) == ("all", "native")
    reference = quantized.engine(name, variant, "lowered") if against_lowered else quantized.twin(name, variant)
    engine = quantized.engine(name, variant, form)
    sessions = [open_session(path, kv_cache_memory=1 << 20) for path in (engine, reference)]
    atol = 1e-2 if against_lowered else 1e-4
    rng = np.random.default_rng(2)
    vocab = sessions[0].config.model.vocab_size
    seqs = [[int(t) for t in rng.integers(0, vocab, n)] for n in (9, 1, 5)]
    blocks = [int(b) for b in rng.permutation(np.arange(1, 40))]  # scrambled, each block one sequence's
    tables = [blocks[i * 6 : i * 6 + 6] for i in range(3)]
    batch = StepBatch.build(seqs, [0, 0, 0], tables, all_logits=True)
    got, want = (s.step(batch) for s in sessions)
    np.testing.assert_allclose(got, want, atol=atol, rtol=0)
    for _ in range(4):
        steps = [[int(rng.integers(0, vocab))] for _ in seqs]
        batch = StepBatch.build(steps, [len(s) for s in seqs], tables)
        got, want = (s.step(batch) for s in sessions)
        np.testing.assert_allclose(got, want, atol=atol, rtol=0)
        for s, t in zip(seqs, steps, strict=True):
            s.extend(t)


@pytest.mark.parametrize(
    ("qcfg", "needle"),
    [
        (QuantConfig(QFormat.INT4_WO), "int8_wo only (not int4_wo)"),
        (QuantConfig(QFormat.INT8_SQ), "int8_wo only (not int8_sq)"),
        (QuantConfig(QFormat.FP8, kv_cache_dtype=KVCacheDType.FP8), "int8_wo only (not fp8)"),
    ],
)
def test_other_requests_are_refused_in_one_line(qcfg, needle):
    from trtbuild.models import model_config_from_hf

    spec = {k: v for k, v in TINY_MOE_CONFIGS["mixtral"].items() if k != "model_type"}
    with pytest.raises(TrtbuildError) as e:
        check_request(model_config_from_hf(spec, DType.FLOAT32), qcfg)
    assert needle in str(e.value) and "\n" not in str(e.value)
