"""Reading a trtbuild checkpoint (``config.json`` + ``rank0.safetensors``), the boundary between convert and build."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .config import ModelConfig
from .errors import BuildError, ConfigError

WEIGHTS_FILE = "rank0.safetensors"


def load_checkpoint(ckpt_dir: Path) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """The checkpoint's config and its tensors as float32 numpy arrays (fp16/bf16 are widened)."""
    if not ckpt_dir.is_dir():
        from .artifacts.inspect import not_a_directory

        raise BuildError(not_a_directory(ckpt_dir, "checkpoint directory", "run `trtbuild convert` first"))
    try:
        cfg = ModelConfig.load(ckpt_dir)
    except ConfigError as e:
        raise BuildError(f"{ckpt_dir}: invalid checkpoint config: {e}") from None
    path = ckpt_dir / WEIGHTS_FILE
    if not path.is_file():
        raise BuildError(f"{ckpt_dir}: missing {WEIGHTS_FILE}")
    from safetensors import safe_open

    weights: dict[str, np.ndarray] = {}
    try:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118
                weights[name] = f.get_tensor(name).float().numpy()
    except Exception as e:  # corrupt header or truncated file
        raise BuildError(f"{path}: unreadable ({e})") from None
    from .convert.layout import expected_tensors

    expected = expected_tensors(cfg)
    for name, shape in expected.items():
        if name not in weights:
            raise BuildError(f"{path}: missing tensor {name}")
        if tuple(weights[name].shape) != shape:
            raise BuildError(f"{path}: tensor {name} has shape {weights[name].shape}, expected {shape}")
    extra = sorted(set(weights) - set(expected))
    if extra:
        raise BuildError(f"{path}: unexpected tensor {extra[0]}")
    return cfg, weights
