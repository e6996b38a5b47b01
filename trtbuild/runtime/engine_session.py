"""``EngineSession``: the interface every backend's session has (``trtbuild.runtime.session.open_session`` opens one).

A session owns the KV cache memory (``num_blocks`` blocks of ``kv_block_size`` slots per layer); the block
manager/scheduler above it only hand out block ids. This module imports no backend and not the registry, so the
registry (``trtbuild.backends``) can name the type that its entries' ``open`` return.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from ..config import RuntimeConfig
from .batch import StepBatch


class EngineSession(Protocol):
    """What the runner needs from an engine (``OrtSession``, ``TensorRTSession``, ``TorchSession``)."""

    config: RuntimeConfig
    num_blocks: int

    def step(self, batch: StepBatch) -> np.ndarray:
        """Run the model on ``batch``, writing its K/V into the cache; returns float32 logits ``[N, vocab]``."""
        ...
