"""``EngineSession``: the interface every backend's session has (``trtbuild.runtime.session.open_session`` opens one).

A session owns the KV cache memory (``num_blocks`` blocks of ``kv_block_size`` slots per layer; a model of both
sliding and full layers has ``num_sliding_blocks`` in its sliding layers, ``runtime/kv_groups.py``); the block
manager/scheduler above it only hand out block ids. The backends' sessions implement this protocol (each
``trtbuild.backends.<backend>.session``, registered in ``session.SESSION_MODULES``); this module imports none.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from ..config import RuntimeConfig
from .batch import StepBatch
from .sampling import Sampler, SamplerOutput, SamplingRequest


class StepSampler(Protocol):
    """Turns the rows of a session's ``step_logits`` into tokens (``Sampler`` on the host, or a device sampler)."""

    def sample(self, logits: Any, requests: Sequence[SamplingRequest]) -> SamplerOutput: ...

    def join(self, parts: Sequence[Any]) -> Any:
        """The rows of several ``step_logits`` results, stacked in order."""
        ...


class EngineSession(Protocol):
    """What the runner needs from an engine (``OrtSession``, ``TensorRTSession``, ``TorchSession``).

    Sessions subclass it: ``step_logits`` / ``new_sampler`` default to host logits and the numpy ``Sampler``; a
    session whose logits live on a device returns them there and a sampler that samples them there.
    """

    config: RuntimeConfig
    num_blocks: int  # blocks of every layer's cache; of the full layers' in a model of two KV-cache groups
    # Blocks of the sliding layers' caches in a model of both attention kinds (kv_groups.py: ``split_kv_blocks``
    # splits the memory), None otherwise; block ids of ``StepBatch.sliding_block_tables`` index them.
    num_sliding_blocks: int | None

    def step(self, batch: StepBatch) -> np.ndarray:
        """Run the model on ``batch``, writing its K/V into the cache; returns float32 logits ``[N, vocab]``."""
        ...

    def step_logits(self, batch: StepBatch) -> Any:
        """``step``, with the logits left where ``new_sampler``'s sampler reads them (the runner's hot path)."""
        return self.step(batch)

    def new_sampler(self, seed: int | None) -> StepSampler:
        """The sampler for ``step_logits``' rows (``seed``: for requests without their own)."""
        return Sampler(seed)
