"""Engine sessions: run one step of the model over a ragged batch through a paged KV cache.

A session owns the KV cache memory (``num_blocks`` blocks of ``kv_block_size`` slots per layer); the block
manager/scheduler above it only hand out block ids. Every backend's session has the same interface.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
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
    num_blocks: int

    def step(self, batch: StepBatch) -> np.ndarray:
        """Run the model on ``batch``, writing its K/V into the cache; returns float32 logits ``[N, vocab]``."""
        ...

    def step_logits(self, batch: StepBatch) -> Any:
        """``step``, with the logits left where ``new_sampler``'s sampler reads them (the runner's hot path)."""
        return self.step(batch)

    def new_sampler(self, seed: int | None) -> StepSampler:
        """The sampler for ``step_logits``' rows (``seed``: for requests without their own)."""
        return Sampler(seed)


def open_session(
    engine_dir: Path,
    *,
    kv_cache_memory: int | None,
    num_threads: int | None = None,
    verify: bool = False,
    profile_kernels: bool = False,
) -> EngineSession:
    """The session for the backend ``engine_dir`` was built with (``trtbuild.backends.BACKENDS``; lazy imports).

    Every file the manifest lists must have its recorded size; ``verify`` also checks their sha256 (slower: it
    reads every byte) so that a file changed in place is refused rather than run. ``profile_kernels``: onnxruntime
    sessions run its profiler (``OrtSession.kernel_times``); others ignore it.
    """
    from ..artifacts.verify import check_engine_files
    from ..errors import EngineError

    engine_dir = Path(engine_dir)
    if not (engine_dir / "runtime_config.json").is_file():
        raise EngineError(f"{engine_dir}: not an engine directory (no runtime_config.json); run `trtbuild build`")
    try:
        config = RuntimeConfig.load(engine_dir)
    except Exception as e:
        raise EngineError(f"{engine_dir}: corrupt runtime_config.json ({e})") from None
    check_engine_files(engine_dir, hashes=verify)
    from ..backends import backend_entry

    entry = backend_entry(config.build.backend)
    return entry.open(
        engine_dir, kv_cache_memory=kv_cache_memory, num_threads=num_threads, profile_kernels=profile_kernels
    )
