"""Model families; each registers its Hugging Face architecture names (see registry.py)."""

from .registry import (
    config_problems,
    hf_dtype,
    model_config_from_hf,
    register_architecture,
    supported_architectures,
)

__all__ = ["config_problems", "hf_dtype", "model_config_from_hf", "register_architecture", "supported_architectures"]
