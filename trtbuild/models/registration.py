"""The architecture table and the decorator that fills it.

Model family modules import this module, not ``registry.py``: the registry imports the families (at first use),
so a family importing the registry back would tie the two together.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..config import DType, ModelConfig

ConfigReader = Callable[[str, dict[str, Any], DType], ModelConfig]

REGISTRY: dict[str, ConfigReader] = {}


def register_architecture(*names: str) -> Callable[[ConfigReader], ConfigReader]:
    """Register ``fn(architecture, hf_config, dtype) -> ModelConfig`` under each of ``names``."""

    def wrap(fn: ConfigReader) -> ConfigReader:
        for name in names:
            if name in REGISTRY:
                raise RuntimeError(f"architecture {name} registered twice")
            REGISTRY[name] = fn
        return fn

    return wrap
