"""``trtbuild quantize --qformat int8_wo / int4_wo`` of the mixture-of-experts models (``trtbuild/quantize/moe.py``):
the checkpoint's tensors (int8 experts with a scale per row or packed int4 ones with a scale per block, float
routers), the one-line refusals of other requests, and the engines: the quantized checkpoint's onnxruntime (native
and lowered) and torch engines give the logits of a float engine built from the same weights dequantized (within
1e-4), through the paged cache. Int4 takes groups of 32, which leave a partial last block in every expert tensor of
the tiny models (hidden 48, expert widths 40 and 24)."""

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
    CpuLinear,
    DType,
    KVCacheDType,
    ModelConfig,
    QFormat,
    QuantConfig,
)
from trtbuild.convert.convert import convert
from trtbuild.errors import TrtbuildError
from trtbuild.plugins.moe import dequantize_int4
from trtbuild.quantize.quantize import check_request, quantize
from trtbuild.runtime.batch import StepBatch

# engine_forms' and the native engine on onnxruntime's linears: its MoE kernel then runs quantized experts with float
# activations (the default native engine runs them on QLinear's integer products, int8 activations per block)
BUILDS = {
    **engine_forms(),
    "native-float": (replace(engine_forms()["native"][0], cpu_linear=CpuLinear.ONNXRUNTIME), None),
}


def dequantized_twin(ckpt, out) -> None:
    """A float checkpoint at ``out`` holding the quantized checkpoint ``ckpt``'s weights dequantized (``q * scale``
    per row, or per block of ``group_size`` in-features; packed int4 experts by the op's oracle): what its engines
    must compute."""
    cfg, weights = load_any_checkpoint(ckpt)
    group = cfg.quantization.group_size
    tensors = {}
    for name, value in weights.items():
        if name.endswith(".weight_scale"):
            continue
        scale = weights.get(name + "_scale")
        if scale is None:
            w = np.asarray(value, np.float32)
        elif value.dtype == np.uint8:  # packed int4 experts [E, rows, in/2]
            w = dequantize_int4(value, scale, group)
        elif scale.ndim == value.ndim:  # int4 linear [out, in] (unpacked), a scale per block
            w = value.astype(np.float32) * np.repeat(scale, group, axis=-1)[..., : value.shape[-1]]
        else:  # int8 rows
            w = value.astype(np.float32) * scale[..., None]
        tensors[name] = torch.from_numpy(np.ascontiguousarray(w, np.float32))
    out.mkdir()
    save_checkpoint(out, replace(cfg, quantization=None), tensors)


# What is quantized: everything int8_wo / int4_wo takes (attention, dense MLPs, LM head and experts), or the experts
# alone.
INT4 = QuantConfig(QFormat.INT4_WO, group_size=32)
VARIANTS = {
    "all": QuantConfig(QFormat.INT8_WO),
    "experts": QuantConfig(QFormat.INT8_WO, exclude=["*"]),
    "int4-all": INT4,
    "int4-experts": replace(INT4, exclude=["*"]),
}


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


@pytest.mark.parametrize(("variant", "codes"), [("all", torch.int8), ("int4-all", torch.uint8)])
@pytest.mark.parametrize("name", list(TINY_MOE_CONFIGS))
def test_checkpoint_holds_quantized_experts_and_a_float_router(quantized, name, variant, codes):
    """int8: int8 experts and linears; int4: packed (uint8) experts and linears, an int8 LM head (every format's)."""
    from safetensors import safe_open

    q = quantized.checkpoint(name, variant)
    cfg = ModelConfig.load(q)
    with safe_open(str(q / "rank0.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not a mapping)
    assert {k: tuple(t.shape) for k, t in tensors.items()} == {
        k: shape for k, (shape, _) in expected_quantized_tensors(cfg).items()
    }
    h, i_e = cfg.hidden_size, cfg.moe.intermediate_size
    for n in cfg.moe.sparse_layers:
        assert tensors[f"layers.{n}.moe.router.weight"].dtype == torch.float32
        gate_up, down = (tensors[f"layers.{n}.moe.{w}.weight"] for w in ("gate_up", "down"))
        assert gate_up.dtype == down.dtype == codes
        if codes is torch.uint8:
            assert tuple(gate_up.shape) == (cfg.moe.num_experts, 2 * i_e, h // 2)
            assert tensors[f"layers.{n}.moe.down.weight_scale"].shape[-1] == -(-i_e // 32)
    assert tensors["layers.0.attn.qkv.weight"].dtype == codes and tensors["lm_head.weight"].dtype == torch.int8


SLOW = pytest.mark.slow  # the whole-model variants: more engines of the same code paths
CHECKS = [
    ("experts", "native"),
    ("experts", "native-float"),
    ("experts", "lowered"),
    ("experts", "torch"),
    pytest.param("all", "torch", marks=SLOW),
    pytest.param("all", "native", marks=SLOW),
    pytest.param("all", "native-float", marks=SLOW),
]
# int4: the torch engines (20 s each to build) once by default, the other model's and the whole model's when slow
INT4_CHECKS = [
    *((name, "int4-experts", form) for name in TINY_MOE_CONFIGS for form in ("native", "native-float", "lowered")),
    ("mixtral", "int4-experts", "torch"),
    pytest.param("qwen3_moe", "int4-experts", "torch", marks=SLOW),
    *(
        pytest.param(name, "int4-all", form, marks=SLOW)
        for name in TINY_MOE_CONFIGS
        for form in ("torch", "native", "native-float")
    ),
]


@pytest.mark.parametrize(("name", "variant", "form"), INT4_CHECKS)
def test_int4_engines_compute_the_dequantized_weights(quantized, name, variant, form):
    """``test_engines_compute_the_dequantized_weights`` for int4 experts (and linears) in groups of 32."""
    check_against_reference(quantized, name, variant, form)


@pytest.mark.parametrize(("variant", "form"), CHECKS)
@pytest.mark.parametrize("name", list(TINY_MOE_CONFIGS))
def test_engines_compute_the_dequantized_weights(quantized, name, variant, form):
    """``check_against_reference`` for int8 experts (and linears)."""
    check_against_reference(quantized, name, variant, form)


def check_against_reference(quantized: Quantized, name: str, variant: str, form: str) -> None:
    """A ragged prefill, then decode steps, on scrambled blocks: the quantized engine's logits are the twin's within
    1e-4. The onnxruntime engines' quantized linears outside the experts (``all``, ``int4-all``) also quantize their
    activations per block of 16, as every int8_wo / int4_wo onnxruntime engine does, which moves the routers' inputs
    enough to flip close routing choices (logits then differ by tenths): there the native engine on onnxruntime's
    linears (``native-float``) is checked against the lowered one, which quantizes its activations alike
    (MatMulNBits), within 1e-2 (the two attentions' float-level differences may flip an activation's rounding).
    The default native engine runs its experts (and linears) on QLinear's integer products, int8 activations per
    block: exact to the op's oracle with those activations (tests/test_cpu_moe.py), and here as far from the twin
    as that rounding puts it (``near_twin``). torch's linears dequantize the weights only."""
    from trtbuild.runtime.session import open_session

    integer = form == "native"
    against_lowered = form == "native-float" and VARIANTS[variant].exclude != ["*"]
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
    (near_twin if integer else np.testing.assert_allclose)(got, want, atol=atol, rtol=0)
    for _ in range(4):
        steps = [[int(rng.integers(0, vocab))] for _ in seqs]
        batch = StepBatch.build(steps, [len(s) for s in seqs], tables)
        got, want = (s.step(batch) for s in sessions)
        (near_twin if integer else np.testing.assert_allclose)(got, want, atol=atol, rtol=0)
        for s, t in zip(seqs, steps, strict=True):
            s.extend(t)


def near_twin(got: np.ndarray, want: np.ndarray, **_) -> None:
    """Logits of int8 activations against the twin's float ones, row by row (relative RMS): int8 blocks round each
    activation by up to half of amax / 127, which moves these logits by ~1% (0.3-2.2% measured), so at most 3% but
    where a close routing choice flipped (the ``all`` variants, whose routers read QLinear's outputs: ~25%), one
    row in ten (at least one) at most; and above 1e-6 (the activations were quantized)."""
    rows = np.sqrt(np.mean((got - want) ** 2, axis=1) / np.mean(want**2, axis=1))
    assert (rows > 1e-6).all() and (rows > 0.03).sum() <= max(1, len(rows) // 10), np.round(rows, 3)


@pytest.mark.parametrize(
    ("qcfg", "needle"),
    [
        (QuantConfig(QFormat.INT4_AWQ), "int4_wo or int8_sq (int4_awq is not supported for its experts)"),
        (QuantConfig(QFormat.INT8_SQ), "per 16 in-features, which 40 is not a multiple of; use int8_wo"),
        (QuantConfig(QFormat.FP8, kv_cache_dtype=KVCacheDType.FP8), "(fp8 is not supported for its experts)"),
        (QuantConfig(QFormat.INT4_WO, zero_points=True), "--zero-points is not supported"),
        (QuantConfig(QFormat.INT4_WO, group_size=48), "--group-size 48 is not a power of two"),
    ],
)
def test_other_requests_are_refused_in_one_line(qcfg, needle):
    from trtbuild.models import model_config_from_hf

    spec = {k: v for k, v in TINY_MOE_CONFIGS["mixtral"].items() if k != "model_type"}
    with pytest.raises(TrtbuildError) as e:
        check_request(model_config_from_hf(spec, DType.FLOAT32), qcfg)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_int4_note_does_not_suggest_zero_points_for_moe(tmp_path):
    """The CLI's int4 accuracy note: MoE experts' int4 is symmetric, so ``--zero-points`` is not offered."""
    from trtbuild.cli.quantize import int4_note

    assert "--zero-points costs less" in int4_note(INT4, tmp_path)
    note = int4_note(INT4, tmp_path, zero_points_possible=False)
    assert "+68.0%" in note and "--zero-points" not in note
