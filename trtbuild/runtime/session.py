"""Engine sessions: run one step of the model over a ragged batch through a paged KV cache.

A session owns the KV cache memory (``num_blocks`` blocks of ``kv_block_size`` slots per layer); the block
manager/scheduler above it only hand out block ids. Every backend's session has the same interface.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from ..config import RuntimeConfig
from .batch import StepBatch


class EngineSession(Protocol):
    """What the runner needs from an engine (``OrtSession`` for onnxruntime; a TensorRT session later)."""

    config: RuntimeConfig
    num_blocks: int

    def step(self, batch: StepBatch) -> np.ndarray:
        """Run the model on ``batch``, writing its K/V into the cache; returns float32 logits ``[N, vocab]``."""
        ...
