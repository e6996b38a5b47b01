"""The architecture table and the decorator that fills it.

Model family modules import this module, not ``registry.py``: the registry imports the families (at first use),
so a family importing the registry back would tie the two together.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..config import DType, ModelConfig


@dataclass
class Refusals:
    """Where a family's config reader reports a config feature it does not implement (``refuse``).

    By default (``trtbuild convert``) the first refusal raises ``ValueError`` with its one-line reason. Collecting
    (``collect=True``, ``trtbuild inspect``), each reason is appended to ``reasons`` and the reader carries on as if
    the feature were absent, so one pass lists every reason; the config it returns then describes no real model.
    """

    collect: bool = False
    reasons: list[str] = field(default_factory=list)

    def refuse(self, reason: str) -> None:
        if not self.collect:
            raise ValueError(reason)
        self.reasons.append(reason)


ConfigReader = Callable[[str, dict[str, Any], DType, Refusals], ModelConfig]

REGISTRY: dict[str, ConfigReader] = {}


def register_architecture(*names: str) -> Callable[[ConfigReader], ConfigReader]:
    """Register ``fn(architecture, hf_config, dtype, refusals) -> ModelConfig`` under each of ``names``: it reads
    the Hugging Face ``config.json`` (``hf_config``), refuses each feature it does not implement with
    ``refusals.refuse(reason)`` and raises ``ValueError`` / ``KeyError`` where the config is inconsistent."""

    def wrap(fn: ConfigReader) -> ConfigReader:
        for name in names:
            if name in REGISTRY:
                raise RuntimeError(f"architecture {name} registered twice")
            REGISTRY[name] = fn
        return fn

    return wrap
