"""A checkpoint directory's files: writing one (convert, quantize), reading one (quantize, build), passing the
tokenizer files along (every stage)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from ..config import ModelConfig
from ..errors import BuildError, ConfigError
from .formats import Numeric, linear_format, unpack_int4
from .layout import expected_quantized_tensors, expected_tensors, expert_weight_names, unsigned_codes

WEIGHTS_FILE = "rank0.safetensors"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def copy_tokenizer_files(src: Path, dest: Path) -> None:
    """Copy the ``TOKENIZER_FILES`` that ``src`` has into ``dest`` (each stage passes them along)."""
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, dest / name)


def save_checkpoint(out_dir: Path, cfg: ModelConfig, tensors: dict[str, Any]) -> None:
    """Write ``tensors`` (torch tensors, canonical names) as ``WEIGHTS_FILE`` and ``cfg`` as ``config.json`` into
    the existing directory ``out_dir`` (the caller's atomic output directory); the tokenizer files are the caller's."""
    from safetensors.torch import save_file

    save_file(tensors, str(out_dir / WEIGHTS_FILE), metadata={"format": "pt"})
    cfg.save(out_dir)


def load_checkpoint(ckpt_dir: Path) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """The checkpoint's config and its tensors as float32 numpy arrays (fp16/bf16 are widened)."""
    if not ckpt_dir.is_dir():
        from ..artifacts.inspect import not_a_directory

        raise BuildError(not_a_directory(ckpt_dir, "checkpoint directory", "run `trtbuild convert` first"))
    cfg = _config(ckpt_dir)
    return cfg, _float_weights(ckpt_dir, cfg)


def _float_weights(ckpt_dir: Path, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """The tensors of float checkpoint ``cfg``, as float32, checked against its layout."""
    path = _weights_file(ckpt_dir)
    from safetensors import safe_open

    weights: dict[str, np.ndarray] = {}
    try:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118
                weights[name] = f.get_tensor(name).float().numpy()
    except Exception as e:  # corrupt header or truncated file
        raise BuildError(f"{path}: unreadable ({e})") from None
    expected = expected_tensors(cfg)
    for name, shape in expected.items():
        if name not in weights:
            raise BuildError(f"{path}: missing tensor {name}")
        if tuple(weights[name].shape) != shape:
            raise BuildError(f"{path}: tensor {name} has shape {weights[name].shape}, expected {shape}")
    extra = sorted(set(weights) - set(expected))
    if extra:
        raise BuildError(f"{path}: unexpected tensor {extra[0]}")
    return weights


def load_any_checkpoint(ckpt_dir: Path) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """A float or quantized checkpoint for the graph: float tensors as float32, quantized weights as int8, uint8
    (``int8_min_wo``), ``ml_dtypes.float8_e4m3fn`` or ``ml_dtypes.int4`` ``[out, in]`` (unpacked;
    ``ml_dtypes.uint4`` with zero points, which load as ``ml_dtypes.uint4`` ``[out, groups]``); int4 experts stay
    packed (uint8 ``[E, rows, in/2]``, the ``trtbuild::MoE`` op's input)."""
    if not (ckpt_dir / "config.json").is_file():
        return load_checkpoint(ckpt_dir)  # its errors name what is missing
    cfg = _config(ckpt_dir)
    if cfg.quantization is None:
        return cfg, _float_weights(ckpt_dir, cfg)
    path = _weights_file(ckpt_dir)
    import torch
    from safetensors import safe_open

    expected = expected_quantized_tensors(cfg)
    experts = set(expert_weight_names(cfg))
    weights: dict[str, np.ndarray] = {}
    try:
        with safe_open(str(path), framework="pt") as f:
            names = set(f.keys())
            for name, (shape, dtype) in expected.items():
                if name not in names:
                    raise BuildError(f"{path}: missing tensor {name}")
                t = f.get_tensor(name)
                if tuple(t.shape) != shape:
                    raise BuildError(f"{path}: tensor {name} has shape {tuple(t.shape)}, expected {shape}")
                want = {"F8_E4M3": torch.float8_e4m3fn, "U8": torch.uint8, "I8": torch.int8}.get(dtype)
                if (want is not None and t.dtype is not want) or (want is None and not t.dtype.is_floating_point):
                    raise BuildError(f"{path}: tensor {name} has dtype {t.dtype}, expected {dtype}")
                if t.dtype is torch.float8_e4m3fn:
                    weights[name] = t.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)
                elif name in experts:  # int8, or packed int4 as the MoE op takes them (plugins/moe)
                    weights[name] = t.numpy()
                elif name.endswith(".weight_zero_point"):
                    weights[name] = t.numpy().astype(ml_dtypes.uint4)
                elif dtype == "U8":
                    spec = linear_format(cfg.quantization, name.removesuffix(".weight"))
                    if spec.weights is Numeric.INT8:  # uint8 codes with offsets (int8_min_wo), as stored
                        weights[name] = t.numpy()
                    else:
                        weights[name] = unpack_int4(t.numpy(), signed=not unsigned_codes(cfg.quantization, spec))
                elif dtype == "I8":
                    weights[name] = t.numpy()
                else:
                    weights[name] = t.float().numpy()
    except BuildError:
        raise
    except Exception as e:  # corrupt header or truncated file
        raise BuildError(f"{path}: unreadable ({e})") from None
    extra = sorted(names - set(expected))
    if extra:
        raise BuildError(f"{path}: unexpected tensor {extra[0]}")
    return cfg, weights


def _config(ckpt_dir: Path) -> ModelConfig:
    try:
        return ModelConfig.load(ckpt_dir)
    except ConfigError as e:
        raise BuildError(f"{ckpt_dir}: invalid checkpoint config: {e}") from None


def _weights_file(ckpt_dir: Path) -> Path:
    path = ckpt_dir / WEIGHTS_FILE
    if not path.is_file():
        raise BuildError(f"{ckpt_dir}: missing {WEIGHTS_FILE}")
    return path
