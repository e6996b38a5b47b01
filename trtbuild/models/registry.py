"""Architecture registry: a Hugging Face ``architectures`` string -> the function reading its config.

Each model family lives in its own module and registers its names with ``@register_architecture`` (from
``registration.py``); aliases (Mistral, Qwen2 for Llama) are plain extra names. The registry imports the family
modules at first use.
"""

from __future__ import annotations

from typing import Any

from ..config import DType, ModelConfig
from ..errors import ConvertError
from .registration import REGISTRY as _REGISTRY
from .registration import ConfigReader, Refusals, register_architecture

__all__ = [
    "ConfigReader",
    "Refusals",
    "config_problems",
    "hf_dtype",
    "model_config_from_hf",
    "register_architecture",
    "supported_architectures",
]


def supported_architectures() -> list[str]:
    _load_families()
    return sorted(_REGISTRY)


def hf_dtype(hf_config: dict[str, Any]) -> DType:
    """The dtype a checkpoint of a Hugging Face config keeps by default: its ``dtype`` (``torch_dtype`` before
    transformers 5) when that is one of ``DType``, else float32."""
    value = hf_config.get("dtype", hf_config.get("torch_dtype"))
    return DType(value) if value in {d.value for d in DType} else DType.FLOAT32


def model_config_from_hf(hf_config: dict[str, Any], dtype: DType) -> ModelConfig:
    """Translate a Hugging Face ``config.json`` into our ``ModelConfig`` (clear error when unsupported)."""
    arch, reader = _reader_of(hf_config)
    try:
        return reader(arch, hf_config, dtype, Refusals())
    except (KeyError, ValueError, TypeError) as e:
        raise ConvertError(_config_error(arch, e)) from None


def config_problems(hf_config: dict[str, Any], dtype: DType) -> tuple[ModelConfig | None, list[str]]:
    """Every reason ``model_config_from_hf`` would refuse ``hf_config`` (its family's refusals, collected rather
    than stopping at the first, then an inconsistency if one stops the reading), and the ``ModelConfig`` when
    there is none; the messages are ``model_config_from_hf``'s."""
    try:
        arch, reader = _reader_of(hf_config)
    except ConvertError as e:
        return None, [str(e)]
    refusals = Refusals(collect=True)
    try:
        cfg = reader(arch, hf_config, dtype, refusals)
    except (KeyError, ValueError, TypeError) as e:
        return None, [*refusals.reasons, _config_error(arch, e)]
    return (None if refusals.reasons else cfg), refusals.reasons


def _reader_of(hf_config: dict[str, Any]) -> tuple[str, ConfigReader]:
    _load_families()
    archs = hf_config.get("architectures") or []
    if not isinstance(archs, list) or len(archs) != 1 or not isinstance(archs[0], str):
        raise ConvertError(f"config.json must name exactly one architecture, got {archs!r}")
    arch = archs[0]
    reader = _REGISTRY.get(arch)
    if reader is None:
        raise ConvertError(f"unsupported architecture {arch}; supported: {', '.join(supported_architectures())}")
    return arch, reader


def _config_error(arch: str, e: Exception) -> str:
    if isinstance(e, KeyError):
        return f"config.json of {arch} lacks {e.args[0]!r}"
    return f"inconsistent config.json for {arch}: {e}"


def _load_families() -> None:
    from . import gemma, gpt2, llama, mixtral, phi3, qwen3, qwen3_moe  # noqa: F401  (registration side effect)
