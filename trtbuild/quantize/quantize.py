"""Stage ``trtbuild quantize``: a float checkpoint (or HF folder / GGUF) -> a quantized checkpoint, atomically.

1. load the float checkpoint (converting an HF folder or GGUF file into a temporary one first);
2. check the request against the architecture (supported family, int4 group size a power of two >= 16);
3. tokenize ``calib_size`` windows of ``calib_seq_len`` tokens of the calibration split;
4. rebuild the transformers model and calibrate it with modelopt (``calibrate.py``); a mixture-of-experts model is
   int8 or int4 weight-only by round to nearest instead (``moe.py``), with no model and no data, unless its KV
   cache is quantized: modelopt then calibrates the K/V ranges of the model rebuilt from those weights (``moe_kv.py``);
   its int8_sq goes modelopt's way as a dense model's (``hf_moe.py`` rebuilds it; ``moe.export_experts``);
5. export every quantized linear, fold pre-quant scales, add KV scales (``export.py``);
6. write ``rank0.safetensors`` + ``config.json`` (with its ``quantization`` block) + tokenizer files
   (``checkpoint.files``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from ..artifacts.atomic import atomic_output_dir, scratch_dir
from ..checkpoint.files import WEIGHTS_FILE, copy_tokenizer_files, load_checkpoint, save_checkpoint
from ..checkpoint.formats import FORMATS, activation_block, dynamic_activations
from ..checkpoint.layout import canonical_linears, excluded_linears
from ..config import DType, KVCacheDType, ModelConfig, QFormat, QuantConfig
from ..errors import ConfigError, TrtbuildError
from .calibrate import calibrate, modelopt_reads_tokens
from .export import export_tensors
from .hf_model import build_hf_model, check_quantizable
from .hf_moe import build_moe_hf_model
from .moe import MOE_WEIGHT_ONLY, check_moe_request, moe_weight_only_tensors
from .moe_kv import moe_kv_scales


@dataclass(frozen=True)
class QuantizeResult:
    config: ModelConfig  # of the quantized checkpoint (``config.quantization`` is set)
    calib_samples: int
    calib_tokens: int
    calib_seconds: float  # modelopt calibration alone
    seconds: float  # the whole stage
    fake_quant_model: Any = None  # the calibrated modelopt torch model (the oracle), only when asked for


def quantize(
    src: Path,
    out: Path,
    qcfg: QuantConfig,
    *,
    overwrite: bool = False,
    progress: bool = True,
    keep_model: bool = False,
    modelopt_int4: bool = False,
    cache_dir: Path | None = None,
) -> QuantizeResult:
    """Quantize ``src`` into the checkpoint directory ``out`` (``modelopt_int4``: int4 calibrated by modelopt's own
    round-to-nearest / AWQ instead of ``awq.py``, symmetric only; for comparisons)."""
    start = time.perf_counter()
    out = out.absolute()
    if out.exists() and not overwrite and (not out.is_dir() or any(out.iterdir())):
        raise TrtbuildError(f"{out}: already exists (use --overwrite to replace it)")
    with _float_checkpoint(src, out) as ckpt_dir:
        if (ckpt_dir / "config.json").is_file():  # else load_checkpoint says what is missing
            check_request(_load_config(ckpt_dir), qcfg)  # before reading the weights
        cfg, weights = load_checkpoint(ckpt_dir)
        samples = calibration_samples(ckpt_dir, qcfg, cache_dir) if needs_data(qcfg) else np.zeros((0, 0), np.int64)
        if cfg.moe is not None and qcfg.qformat in MOE_WEIGHT_ONLY:  # round to nearest (moe.py), KV by moe_kv.py
            new_cfg = replace(cfg, quantization=replace(qcfg, exclude=list(qcfg.exclude)))
            tensors = moe_weight_only_tensors(new_cfg, weights)
            t, model = time.perf_counter(), None
            if qcfg.kv_cache_dtype is not KVCacheDType.FLOAT32:
                kv_scales, model = moe_kv_scales(new_cfg, tensors, samples, progress=progress)
                tensors.update(kv_scales)
            calib_seconds = time.perf_counter() - t
            with atomic_output_dir(out, overwrite=overwrite) as tmp:
                save_checkpoint(tmp, new_cfg, tensors)
                copy_tokenizer_files(ckpt_dir, tmp)
            n, size, seconds = int(samples.shape[0]), int(samples.size), time.perf_counter() - start
            return QuantizeResult(new_cfg, n, size, calib_seconds, seconds, model if keep_model else None)
        model = build_hf_model(cfg, weights) if cfg.moe is None else build_moe_hf_model(cfg, weights)
        t = time.perf_counter()
        calibrate(model, cfg, qcfg, samples, progress=progress, modelopt_int4=modelopt_int4)
        calib_seconds = time.perf_counter() - t
        qcfg_out = replace(qcfg, exclude=list(qcfg.exclude))
        new_cfg = replace(cfg, quantization=qcfg_out)
        tensors = export_tensors(model, new_cfg, weights)
        with atomic_output_dir(out, overwrite=overwrite) as tmp:
            save_checkpoint(tmp, new_cfg, tensors)
            copy_tokenizer_files(ckpt_dir, tmp)
    return QuantizeResult(
        new_cfg,
        int(samples.shape[0]),
        int(samples.size),
        calib_seconds,
        time.perf_counter() - start,
        model if keep_model else None,
    )


@contextmanager
def _float_checkpoint(src: Path, out: Path) -> Iterator[Path]:
    """``src`` itself when it is a trtbuild checkpoint, else a temporary one converted from the HF folder / GGUF,
    in a scratch directory next to ``out`` (removed on exit; after a SIGKILL, by the next run)."""
    if src.is_dir() and (src / WEIGHTS_FILE).is_file():
        yield src
        return
    from ..convert.convert import convert

    with scratch_dir(out) as tmp:
        convert(src, tmp / "ckpt", DType.FLOAT32, dequantize=True)  # calibration starts from float weights
        yield tmp / "ckpt"


def needs_data(qcfg: QuantConfig) -> bool:
    """Whether calibration runs the model: what modelopt or the smoothing reads tokens for
    (``calibrate.modelopt_reads_tokens``) and fp8's rowwise scale search (``fp8.py``); round-to-nearest int8 / int4
    weights read weights only."""
    searched = qcfg.qformat is QFormat.FP8 and dynamic_activations(qcfg)
    return modelopt_reads_tokens(qcfg) or searched


def _load_config(ckpt_dir: Path) -> ModelConfig:
    try:
        return ModelConfig.load(ckpt_dir)
    except ConfigError as e:
        raise TrtbuildError(f"{ckpt_dir}: invalid checkpoint config: {e}") from None


def check_request(cfg: ModelConfig, qcfg: QuantConfig) -> None:
    """One-line errors for requests the checkpoint cannot take (before any expensive work)."""
    if cfg.quantization is not None:
        raise TrtbuildError(
            f"the checkpoint is already quantized ({cfg.quantization.qformat.value}); "
            "quantize its float checkpoint instead"
        )
    if FORMATS[qcfg.qformat].modelopt_config is None:
        raise TrtbuildError(
            f"{qcfg.qformat.value} is a llama.cpp block format that `trtbuild convert` keeps from GGUF files; "
            "trtbuild quantize does not make it (int8_wo or int4_wo are the nearest)"
        )
    if cfg.moe is not None:
        check_moe_request(cfg, qcfg)
    if cfg.moe is None or needs_data(qcfg):  # a model is rebuilt (for an MoE one, to calibrate its KV ranges)
        check_quantizable(cfg)
    excluded = set(excluded_linears(cfg, qcfg.exclude))
    linears = [n for n in canonical_linears(cfg) if n not in excluded]
    if not linears and cfg.moe is None:  # an MoE model's experts are quantized whatever is excluded
        raise TrtbuildError(f"--exclude {' '.join(qcfg.exclude)} leaves no linear layer to quantize")
    block = activation_block(qcfg)
    if dynamic_activations(qcfg) and block is not None:
        in_features = {cfg.hidden_size, cfg.num_heads * cfg.head_size, cfg.intermediate_size}
        if cfg.moe is not None:  # the experts' activations too (trtbuild::MoE's activation_block)
            in_features.add(cfg.moe.intermediate_size)
        widths = sorted(w for w in in_features if w % block)
        if widths:
            other = "int8_wo" if cfg.moe is not None else "--activation-scales static"  # MoE: dynamic only
            raise TrtbuildError(
                f"{qcfg.qformat.value} with dynamic activation scales quantizes activations per {block} in-features, "
                f"which {widths[0]} is not a multiple of; use {other}"
            )
    group = qcfg.group_size
    if FORMATS[qcfg.qformat].blocked and (group < 16 or group & (group - 1)):
        raise TrtbuildError(
            f"--group-size {group} is not a power of two >= 16 (what onnxruntime's MatMulNBits and TensorRT's "
            "blocked int4 take); in-features that are not a multiple of it end in a partial group"
        )


def calibration_samples(ckpt_dir: Path, qcfg: QuantConfig, cache_dir: Path | None = None) -> np.ndarray:
    """``[n <= calib_size, calib_seq_len]`` token ids from the calibration split of ``qcfg.calib_dataset``."""
    from ..calibration_data import Split, load_documents, token_windows, tokenize_documents

    docs = load_documents(qcfg.calib_dataset, Split.CALIBRATION, cache_dir=cache_dir)
    ids = tokenize_documents(ckpt_dir / "tokenizer.json", docs, qcfg.calib_size * qcfg.calib_seq_len)
    return token_windows(ids, qcfg.calib_size, qcfg.calib_seq_len)
