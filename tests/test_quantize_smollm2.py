"""Acceptance of every quantization format on the real SmolLM2-135M (slow: calibration and builds take minutes).

Reference: the float32 engine of the dequantized GGUF. Perplexity on 8 windows x 512 tokens of the lee_news
evaluation split; calibration on 16 x 256 tokens of its (disjoint) calibration split (4 x 512 for AWQ, its
default). The int4, W8A8 and FP8 formats are also judged on flask_docs (another domain: technical prose with
code), with issue 14's targets (llama.cpp Q8_0's and Q4_0's increases there, modelopt's AWQ, FP8 rowwise
<= 1%). int4 is judged at group 128, as the issue asks: SmolLM2's 576 in-features end in a half group.
Gates these formats do not meet on this model are marked xfail with the measured figure (docs/quantization.md
has the evidence: on this 135M model int4 at group 128 costs 2.5-8.7% for *each* linear kind on its own).
"""

from __future__ import annotations

import shutil

import pytest
from disk import scratch_dir

from trtbuild.build import build_engine
from trtbuild.cli.eval import evaluate
from trtbuild.config import ActivationScales, BuildConfig, EvalConfig, KVCacheDType, QFormat, QuantConfig

pytestmark = pytest.mark.slow

EVAL = EvalConfig(dataset="lee_news", windows=8, seq_len=512)
BUILD = BuildConfig(max_seq_len=512, max_batch_size=4)
CALIB = dict(calib_dataset="lee_news", calib_size=16, calib_seq_len=256)


@pytest.fixture(scope="module")
def smollm2_float(tmp_path_factory):
    """(float checkpoint, fp32 engine, its perplexity)."""
    from trtbuild.config import DType
    from trtbuild.convert.convert import convert
    from trtbuild.demo import smollm2_gguf_path

    with scratch_dir(tmp_path_factory, "smollm2-quant") as root:
        convert(smollm2_gguf_path(), root / "ckpt", DType.FLOAT32, dequantize=True)
        build_engine(root / "ckpt", root / "fp32", BUILD)
        yield root / "ckpt", root / "fp32", evaluate(root / "fp32", EVAL).perplexity


@pytest.fixture(scope="module")
def perplexity(smollm2_float, tmp_path_factory):
    """name -> perplexity of that format's engine (quantized and built on first use; fields override CALIB)."""
    from trtbuild.quantize.quantize import quantize

    ckpt, _, _ = smollm2_float
    cache: dict[tuple[str, EvalConfig], float] = {}
    with scratch_dir(tmp_path_factory, "formats") as root:

        def get(name: str, on: EvalConfig = EVAL, **fields) -> float:
            if (name, on) not in cache:
                # every evaluation EVALS names for it at once, then its files go: 14 formats' checkpoints and
                # engines kept to the module's end took 5 GB of disk
                assert on in EVALS.get(name, ()), f"add {on} to EVALS[{name!r}]"
                quantize(ckpt, root / f"{name}-ckpt", QuantConfig(**{**CALIB, **fields}), progress=False)
                build_engine(root / f"{name}-ckpt", root / name, BUILD)
                for each in EVALS[name]:
                    cache[name, each] = evaluate(root / name, each).perplexity
                shutil.rmtree(root / f"{name}-ckpt")
                shutil.rmtree(root / name)
            return cache[name, on]

        yield get


def increase(ppl: float, ref: float) -> float:
    return 100.0 * (ppl / ref - 1.0)


STATIC = ActivationScales.STATIC
DOWN_FLOAT = ["lm_head", "layers.*.mlp.down"]  # down_proj's input (silu(gate) * up) has the activation outliers
AWQ_CALIB = dict(calib_size=4, calib_seq_len=512)  # int4_awq's default (QuantConfig)

HEAD_FLOAT = ["lm_head"]  # each format judged on its own: the LM head in float (the CLI default until 2026-12-04)

# name -> (QuantConfig fields, the issue's target increase in %, the bound measured here that guards regressions)
FORMATS = {
    # measured +0.29-0.35% (AVX2 machines); +0.36-0.45% on an AVX-512 Zen 4 (+0.41% on 32 windows), where a change of
    # float summation order alone (in the attention kernel) moved it by 0.06-0.07 (results/2026-12-03-cpu2-avx512-*.md)
    "int8_wo": (dict(qformat=QFormat.INT8_WO, exclude=HEAD_FLOAT), 0.5, 0.5),
    # W8A8, dynamic int8 activations per block of 16 (the default) with SmoothQuant at alpha 0.3
    "int8_sq": (dict(qformat=QFormat.INT8_SQ, exclude=HEAD_FLOAT), 1.0, 1.0),  # measured +0.32%
    "int8_sq_static": (dict(qformat=QFormat.INT8_SQ, activation_scales=STATIC, exclude=HEAD_FLOAT), 1.0, 5.0),  # +3.9%
    # per-token int8 activations (alpha 0.5; the integer-GEMM throughput choice): measured +1.17%
    "int8_sq_per_token": (
        dict(qformat=QFormat.INT8_SQ, activation_scales=ActivationScales.PER_TOKEN, exclude=HEAD_FLOAT),
        1.0,
        1.6,
    ),
    # the int8_sq recipe's TensorRT format (static; mlp.down in float): measured +0.84-0.88%
    "int8_sq_down_float": (dict(qformat=QFormat.INT8_SQ, activation_scales=STATIC, exclude=DOWN_FLOAT), 1.0, 1.0),
    # rowwise (per-channel searched weight scales, per-token activations): measured +1.44%
    "fp8": (dict(qformat=QFormat.FP8, exclude=HEAD_FLOAT), 1.0, 2.5),
    "fp8_static": (dict(qformat=QFormat.FP8, activation_scales=STATIC, exclude=HEAD_FLOAT), 1.0, 3.5),  # +2.4-2.7%
    "int4_awq_g128": (dict(qformat=QFormat.INT4_AWQ, group_size=128, exclude=HEAD_FLOAT, **AWQ_CALIB), 4.0, 30.0),
    # What `trtbuild quantize --qformat F` makes with nothing else: the LM head int8 weight-only too
    # (benchmarks/default_formats.py, 2026-12-04: int8_wo +0.56%, int8_sq +0.49%)
    "int8_wo_cli_default": (dict(qformat=QFormat.INT8_WO), 0.5, 0.8),
    "int8_sq_cli_default": (dict(qformat=QFormat.INT8_SQ), 1.0, 1.0),
}


@pytest.mark.parametrize("name", [n for n, spec in FORMATS.items() if spec[2] is not None])
def test_perplexity_within_measured_bound(smollm2_float, perplexity, name):
    fields, _, bound = FORMATS[name]
    assert increase(perplexity(name, **fields), smollm2_float[2]) <= bound


@pytest.mark.parametrize("name", list(FORMATS))
def test_perplexity_within_issue_target(request, smollm2_float, perplexity, name):
    fields, target, bound = FORMATS[name]
    if bound is None or bound > target:
        request.applymarker(pytest.mark.xfail(reason="not met on SmolLM2-135M: see docs/quantization.md", strict=False))
    assert increase(perplexity(name, **fields), smollm2_float[2]) <= target


# The int8 KV cache's cost is a few tenths of a percent, the size of the noise of 8 windows: two correct attention
# implementations (the native kernel and the lowered ops, equal to 3e-7 on layer 0) gave +0.69% and +0.43% there,
# as the int8 activations of MatMulNBits amplify float rounding; on 32 windows +0.37% and +0.27%.
KV_EVAL = EvalConfig(dataset="lee_news", windows=32, seq_len=512)


def test_int8_kv_cache_on_top_of_its_weights(perplexity):
    base = perplexity("int8_wo", KV_EVAL, **FORMATS["int8_wo"][0])
    kv = perplexity("int8_wo+kv_int8", KV_EVAL, **FORMATS["int8_wo"][0], kv_cache_dtype=KVCacheDType.INT8)
    assert increase(kv, base) <= 0.5


def test_int4_awq_beats_round_to_nearest(perplexity):
    rtn = perplexity("int4_wo_g128", **INT4_CROSS["int4_wo_g128"][0])  # measured +58.6%
    awq = perplexity("int4_awq_g128", **FORMATS["int4_awq_g128"][0])  # calibrated on 4 x 256 tokens only
    assert awq < rtn


# --- int4 across domains (issue 14): calibrated on lee_news, judged on flask_docs (technical prose with code) ---
CROSS = EvalConfig(dataset="flask_docs", windows=8, seq_len=512)
Q4_0_CROSS = 23.68  # llama.cpp Q4_0 (symmetric, group 32, 4.5 bits per weight) here (benchmarks/quant_vs_llamacpp.py)
MODELOPT_AWQ_CROSS = 35.3  # modelopt's AWQ at group 128 (4 x 256; benchmarks/awq_vs_modelopt.py reproduces it)
ZP = dict(zero_points=True)

# name -> (QuantConfig fields, bound measured on flask_docs that guards regressions, in %)
INT4_CROSS = {
    "int4_wo_g128": (dict(qformat=QFormat.INT4_WO, group_size=128, exclude=HEAD_FLOAT), 72.0),  # measured +68.0%
    "int4_wo_zp_g128": (dict(qformat=QFormat.INT4_WO, group_size=128, exclude=HEAD_FLOAT, **ZP), 42.0),  # +38.3%
    "int4_awq_g128": (FORMATS["int4_awq_g128"][0], 38.0),  # measured +35.6%
    "int4_awq_zp_g128": (
        dict(qformat=QFormat.INT4_AWQ, group_size=128, exclude=HEAD_FLOAT, **AWQ_CALIB, **ZP),
        27.0,
    ),  # measured +24.5%
}


@pytest.fixture(scope="module")
def cross_reference(smollm2_float):
    return evaluate(smollm2_float[1], CROSS).perplexity


@pytest.mark.parametrize("name", list(INT4_CROSS))
def test_int4_cross_domain_within_measured_bound(perplexity, cross_reference, name):
    fields, bound = INT4_CROSS[name]
    assert increase(perplexity(name, CROSS, **fields), cross_reference) <= bound


@pytest.mark.parametrize("zp", ["", "_zp"])
def test_int4_awq_cross_domain_beats_round_to_nearest(perplexity, zp):
    awq = perplexity(f"int4_awq{zp}_g128", CROSS, **INT4_CROSS[f"int4_awq{zp}_g128"][0])
    rtn = perplexity(f"int4_wo{zp}_g128", CROSS, **INT4_CROSS[f"int4_wo{zp}_g128"][0])
    assert awq < rtn  # measured +35.6% < +68.0% (symmetric), +24.5% < +38.3% (zero points)


@pytest.mark.parametrize("zp", ["", "_zp"])
def test_int4_awq_cross_domain_beats_modelopt_awq(request, perplexity, cross_reference, zp):
    """The issue's target: AWQ at group 128 < modelopt's own AWQ at group 128 (+35.3%)."""
    if not zp:
        reason = "symmetric: measured +35.6% vs modelopt's +35.3% (zero points: +24.5%); see docs/quantization.md"
        request.applymarker(pytest.mark.xfail(reason=reason, strict=False))
    awq = perplexity(f"int4_awq{zp}_g128", CROSS, **INT4_CROSS[f"int4_awq{zp}_g128"][0])
    assert increase(awq, cross_reference) < MODELOPT_AWQ_CROSS


def test_int4_symmetric_within_q4_0_cross_domain(request, perplexity, cross_reference):
    """The issue's target: symmetric int4 at <= 4.5 bits per weight (group 128: 4.25) <= llama.cpp Q4_0's increase."""
    reason = "measured +35.6% at group 128 (zero points, 4.28 bits: +24.5%); see docs/quantization.md"
    request.applymarker(pytest.mark.xfail(reason=reason, strict=False))
    assert increase(perplexity("int4_awq_g128", CROSS, **INT4_CROSS["int4_awq_g128"][0]), cross_reference) <= Q4_0_CROSS


# --- W8A8 and FP8 across domains (issue 14): calibrated on lee_news, judged on flask_docs ---
# llama.cpp Q8_0 (int8 weights and activations per block of 32, 8.5 bits per weight) on these windows, measured by
# benchmarks/quant_vs_llamacpp.py (benchmarks/README.md)
Q8_0_CROSS = 0.33

# name -> (the issue's target increase on flask_docs in %, the bound measured here that guards regressions)
W8A8_CROSS = {
    "int8_wo": (0.5, 0.5),  # measured +0.23%
    "int8_sq": (Q8_0_CROSS, Q8_0_CROSS),  # dynamic W8A8: measured +0.04%
    "fp8": (1.0, 3.5),  # FP8 rowwise: measured +2.78% (E4M3's 3 mantissa bits on a 135M model: docs/quantization.md)
}


@pytest.mark.parametrize("name", list(W8A8_CROSS))
def test_w8a8_cross_domain_within_measured_bound(perplexity, cross_reference, name):
    _, bound = W8A8_CROSS[name]
    assert increase(perplexity(name, CROSS, **FORMATS[name][0]), cross_reference) <= bound


@pytest.mark.parametrize("name", list(W8A8_CROSS))
def test_w8a8_cross_domain_within_issue_target(request, perplexity, cross_reference, name):
    target, bound = W8A8_CROSS[name]
    if bound > target:
        request.applymarker(pytest.mark.xfail(reason="not met on SmolLM2-135M: see docs/quantization.md", strict=False))
    assert increase(perplexity(name, CROSS, **FORMATS[name][0]), cross_reference) <= target


def test_dynamic_activation_scales_hold_across_domains(perplexity, cross_reference):
    """Static per-tensor int8 ranges calibrated on news clip technical text's outliers; dynamic ones do not."""
    dynamic = perplexity("int8_sq", CROSS, **FORMATS["int8_sq"][0])
    static = perplexity("int8_sq_static", CROSS, **FORMATS["int8_sq_static"][0])
    assert increase(dynamic, cross_reference) < increase(static, cross_reference) / 4


@pytest.mark.parametrize("name", ["int8_wo", "int8_sq"])
def test_quantized_lm_head_costs_little_on_another_domain(perplexity, name):
    """Issue 39: quantizing the LM head by default (int8 weight-only) costs <= 0.3% perplexity on flask_docs over the
    same format with the head in float; measured +0.28% (int8_wo) and +0.27% (int8_sq), guarded at 0.4%."""
    default = perplexity(f"{name}_cli_default", CROSS, **FORMATS[f"{name}_cli_default"][0])
    head_float = perplexity(name, CROSS, **FORMATS[name][0])
    assert increase(default, head_float) <= 0.4


# name -> the evaluations its tests ask for (the perplexity fixture runs them all when it builds that format)
EVALS: dict[str, tuple[EvalConfig, ...]] = {name: (EVAL,) for name in FORMATS}
EVALS["int8_wo"] += (KV_EVAL,)
EVALS["int8_wo+kv_int8"] = (KV_EVAL,)
for name in [*INT4_CROSS, *W8A8_CROSS, "int8_sq_static", "int8_wo_cli_default", "int8_sq_cli_default"]:
    EVALS[name] = (*EVALS.get(name, ()), CROSS)
EVALS["int4_wo_g128"] = (EVAL, *EVALS["int4_wo_g128"])  # test_int4_awq_beats_round_to_nearest
