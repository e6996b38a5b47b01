"""Helpers of the quantization tests: a tiny checkpoint with a character-level tokenizer and calibration text; the
formats' cases of the test_quantize_formats*.py files and their engines, made once per session."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from tiny_models import make_hf_model, tiny_config

from trtbuild.config import ActivationScales, KVCacheDType, QFormat

TEXT = (
    "The quick brown fox jumps over the lazy dog. A stitch in time saves nine. "
    "Rain in the hills sent the river over its banks, and the town woke to water in the streets. "
    "Markets rose on Monday as traders bet that rates would fall before the end of the year. "
) * 6


def write_char_tokenizer(folder: Path, vocab_size: int) -> None:
    """A BPE tokenizer trained on ``TEXT`` with at most ``vocab_size`` tokens, saved as ``tokenizer.json``."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="?"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["?"], show_progress=False)
    tok.train_from_iterator([TEXT], trainer)
    assert tok.get_vocab_size() <= vocab_size
    tok.save(str(folder / "tokenizer.json"))


def tiny_checkpoint(root: Path, name: str = "llama_gqa") -> tuple[object, Path]:
    """(hf model, float checkpoint dir with tokenizer.json) for tiny config ``name``."""
    from trtbuild.config import DType
    from trtbuild.convert.convert import convert

    model = make_hf_model(name, root / f"{name}-hf")
    ckpt = root / f"{name}-ckpt"
    convert(root / f"{name}-hf", ckpt, DType.FLOAT32)
    write_char_tokenizer(ckpt, model.config.vocab_size)
    return model, ckpt


def calib_file(root: Path) -> Path:
    path = root / "calib.txt"
    path.write_text("\n\n".join([TEXT] * 4))
    return path


class Case(NamedTuple):
    qformat: QFormat
    kv: KVCacheDType = KVCacheDType.FLOAT32
    group: int = 32
    model: str = "llama_gqa"  # in-features 64 (qkv, gate_up, out) and 96 (down); untied lm_head
    exclude: tuple[str, ...] = ("lm_head",)
    zero_points: bool = False  # int4: unsigned codes and a zero point per group
    activations: ActivationScales = ActivationScales.DYNAMIC  # int8_sq / fp8 only


# Group 64 leaves llama_gqa's mlp.down a partial last group (64 + 32), as group 128 does on SmolLM2's 576.
# qwen2_bias has q/k/v biases and a tied lm_head, which `exclude=()` quantizes (int8 weight-only, its own copy).
STATIC, PER_TOKEN = ActivationScales.STATIC, ActivationScales.PER_TOKEN
CASES = {
    "int8_sq": Case(QFormat.INT8_SQ),  # dynamic int8 activations per block of 16: W8A8 on MatMulNBits
    "int8_sq_per_token": Case(QFormat.INT8_SQ, activations=PER_TOKEN),  # W8A8 on MatMulInteger
    "int8_sq_static": Case(QFormat.INT8_SQ, activations=STATIC),
    "fp8": Case(QFormat.FP8),  # rowwise: per-channel weights, per-token activations
    "fp8_static": Case(QFormat.FP8, activations=STATIC),
    "int8_wo": Case(QFormat.INT8_WO),
    "int4_wo": Case(QFormat.INT4_WO),
    "int4_awq": Case(QFormat.INT4_AWQ),
    "int4_awq_g64_partial": Case(QFormat.INT4_AWQ, group=64),
    "int8_wo+kv_int8": Case(QFormat.INT8_WO, KVCacheDType.INT8),
    # static: per-token fp8 scales of values read back from an fp8 cache put some quotients exactly on rounding ties,
    # which the engine and modelopt break differently (both engines agree; one flip moves a logit by ~0.1 here)
    "fp8+kv_fp8": Case(QFormat.FP8, KVCacheDType.FP8, activations=STATIC),
    "int8_sq+kv_fp8": Case(QFormat.INT8_SQ, KVCacheDType.FP8),
    "int4_awq+head": Case(QFormat.INT4_AWQ, exclude=()),
    "int4_wo_zp": Case(QFormat.INT4_WO, zero_points=True),
    "int4_awq_zp_g64_partial": Case(QFormat.INT4_AWQ, group=64, zero_points=True),
    "int4_awq_zp_g128": Case(QFormat.INT4_AWQ, group=128, zero_points=True),  # one partial group of 64 or 96
    # static: at the default MatMulNBits level (which dynamic int8 runs at) the head's activations are int8 too
    "int8_sq+tied_head": Case(QFormat.INT8_SQ, group=16, model="qwen2_bias", exclude=(), activations=STATIC),
    # Qwen3: per-head q/k norms (float) between the quantized qkv and the (int8) cache; head_dim 16 != 48 / 4
    "qwen3_int8_wo+kv_int8": Case(QFormat.INT8_WO, KVCacheDType.INT8, group=16, model="qwen3"),
    "qwen3_int4_awq": Case(QFormat.INT4_AWQ, group=16, model="qwen3"),
    "qwen3_int8_sq_static": Case(QFormat.INT8_SQ, group=16, model="qwen3", activations=STATIC),
    # Phi-3: fused qkv_proj / gate_up_proj modules calibrated as one each; rotary over 12 of 16 dims
    "phi3_int8_wo+kv_int8": Case(QFormat.INT8_WO, KVCacheDType.INT8, model="phi3"),
    "phi3_int4_awq": Case(QFormat.INT4_AWQ, group=16, model="phi3"),
    "phi3_int8_sq_static": Case(QFormat.INT8_SQ, group=16, model="phi3", activations=STATIC),
    # Gemma 3: (1 + w) norms that absorb the pre-quant scales, sandwich norms, GeGLU (down's scale folds into the up
    # rows), q/k norms, sliding and full layers with their own rotary tables; 3 layers. The window (6) is shorter
    # than the sequences checked
    "gemma3_int8_wo+kv_int8": Case(QFormat.INT8_WO, KVCacheDType.INT8, group=16, model="gemma3"),
    "gemma3_int4_awq": Case(QFormat.INT4_AWQ, group=16, model="gemma3"),
    "gemma3_int8_sq_static": Case(QFormat.INT8_SQ, group=16, model="gemma3", activations=STATIC),
    # Gemma 2 (tiny_models.TINY_GEMMA2_CONFIGS): Gemma 3's layout without q/k norms, one rotary base, attention
    # scores soft-capped at 1.5 after the quantized cache (int8, fp8) is read, logits at 3. Its other formats:
    # SLOW_CASES
    "gemma2_int8_wo+kv_int8": Case(QFormat.INT8_WO, KVCacheDType.INT8, group=16, model="gemma2"),
    "gemma2_int4_awq": Case(QFormat.INT4_AWQ, group=16, model="gemma2"),
    "gemma2_int8_sq_static": Case(QFormat.INT8_SQ, group=16, model="gemma2", activations=STATIC),
    "gemma2_fp8+kv_fp8": Case(QFormat.FP8, KVCacheDType.FP8, model="gemma2", activations=STATIC),
}
# The rest of Gemma 2's formats and caches, quantized one at a time by test_gemma_quantize.py's slow test (not by
# ``quantized_cases``): with CASES' gemma2 entries, every format and KV-cache dtype
SLOW_CASES = {
    "gemma2_int4_wo": Case(QFormat.INT4_WO, group=16, model="gemma2"),
    "gemma2_int4_awq+kv_int8": Case(QFormat.INT4_AWQ, KVCacheDType.INT8, group=16, model="gemma2"),
    "gemma2_int8_sq": Case(QFormat.INT8_SQ, group=16, model="gemma2"),
    "gemma2_int8_sq_per_token": Case(QFormat.INT8_SQ, group=16, model="gemma2", activations=PER_TOKEN),
    "gemma2_int8_sq+kv_fp8": Case(QFormat.INT8_SQ, KVCacheDType.FP8, group=16, model="gemma2"),
    "gemma2_fp8": Case(QFormat.FP8, model="gemma2"),
}


def find_case(name: str) -> Case:
    """The case ``name`` of CASES or SLOW_CASES."""
    return CASES[name] if name in CASES else SLOW_CASES[name]


def quantized_linear_count(name: str) -> int:
    """The decoder linears case ``name`` quantizes: layers x (qkv, out, gate_up, down); the cases exclude lm_head
    unless they say "+head", and that one is not counted."""
    return 4 * int(tiny_config(find_case(name).model)["num_hidden_layers"])


_QUANTIZED: dict[str, tuple] = {}


def quantized_cases(tmp_path_factory) -> dict[str, tuple]:
    """name -> (fake-quantized torch model, quantized checkpoint, engine) for every case, made once per session
    (the ``quantized`` fixture of each test_quantize_formats*.py file)."""
    if _QUANTIZED:
        return _QUANTIZED
    root = tmp_path_factory.mktemp("quant")
    checkpoints = {name: tiny_checkpoint(root, name)[1] for name in {case.model for case in CASES.values()}}
    text = calib_file(root)
    out = {name: quantize_case(root, name, checkpoints[case.model], text) for name, case in CASES.items()}
    _QUANTIZED.update(out)
    return _QUANTIZED


def quantize_case(root: Path, name: str, checkpoint: Path, text: Path) -> tuple:
    """(fake-quantized torch model, quantized checkpoint, engine) of case ``name`` of float ``checkpoint``,
    calibrated on ``text``, written under ``root``."""
    from trtbuild.build import build_engine
    from trtbuild.config import BuildConfig, QuantConfig
    from trtbuild.quantize.quantize import quantize

    case = find_case(name)
    qcfg = QuantConfig(
        qformat=case.qformat,
        kv_cache_dtype=case.kv,
        group_size=case.group,
        exclude=list(case.exclude),
        zero_points=case.zero_points,
        calib_dataset=str(text),
        calib_size=2,
        calib_seq_len=24,
        activation_scales=case.activations,
    )
    qckpt, engine = root / f"{name}-ckpt", root / f"{name}-engine"
    result = quantize(checkpoint, qckpt, qcfg, progress=False, keep_model=True)
    build_engine(qckpt, engine, BuildConfig(max_seq_len=128, kv_block_size=4))
    return result.fake_quant_model, qckpt, engine
