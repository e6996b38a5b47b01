"""Request state: one ``Sequence`` per generation request, from arrival through preemptions to its finish."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np

from .block_pool import BlockHash
from .sampling import SamplingParams


class FinishReason(enum.StrEnum):
    """Why a request stopped generating. A string enum, as vLLM's plain strings: ``print`` and f-strings show
    ``stop``, and ``out.finish_reason == "stop"`` holds."""

    STOP = "stop"  # an EOS token, a stop token id or a stop string
    LENGTH = "length"  # max_tokens reached, or the engine's max_seq_len
    ABORT = "abort"  # cancelled by the caller


class RequestStatus(enum.Enum):
    """Where a request is in its life; the FINISHED_* states carry the finish reason."""

    WAITING = "waiting"  # in the waiting queue, never run
    RUNNING = "running"  # in the running queue, holding KV-cache blocks
    PREEMPTED = "preempted"  # back in the waiting queue with its blocks freed; recomputes its tokens when readmitted
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def is_finished(self) -> bool:
        return self in _FINISH_REASONS

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self)

    @classmethod
    def finished(cls, reason: FinishReason) -> RequestStatus:
        """The FINISHED_* status for ``reason``."""
        return next(status for status, r in _FINISH_REASONS.items() if r is reason)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
}


@dataclass(frozen=True)
class KVReuse:
    """Prompt positions ``[start, end)`` whose K/V is written from elsewhere instead of computed (``runtime/blend.py``):
    the K/V a chunk's own computation left at its positions ``[source_start, source_start + end - start)``, moved."""

    start: int
    end: int
    source_hashes: tuple[BlockHash, ...]  # the chunk's own full blocks' chained hashes (their prefix-cache keys)
    source_start: int


@dataclass(slots=True, eq=False)
class Sequence:
    """One request's tokens and scheduling state. Created by ``Scheduler.add_request``; identity is the request.

    Invariants: ``0 <= num_computed_tokens <= num_tokens``, and ``num_computed_tokens < num_tokens`` while the
    request is unfinished (the newest token's K/V is computed by the next step); tokens are append-only.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_index: int  # FCFS order: the scheduler's count of requests added before this one
    cache_salt: str | None = None  # prefix-cache namespace: blocks are shared only between equal salts
    output_token_ids: list[int] = field(default_factory=list)  # generated tokens, stop/EOS token included
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0  # leading tokens whose K/V is in the cache; back to 0 on preemption
    num_cached_tokens: int = 0  # tokens found in the prefix cache at first admission (metrics)
    num_preemptions: int = 0  # times this request was preempted (its K/V freed and recomputed later)
    stop_reason: int | str | None = None  # the stop token id or stop string that finished it; None otherwise
    # The block table, written only by KVCacheManager: block i holds positions [i * block_size, (i + 1) * block_size).
    # Grows only at the end while the request holds blocks; empty while waiting or preempted, and once finished.
    # With a KV window W (ModelConfig.kv_window) its leading entries lying wholly before num_computed_tokens - W + 1
    # become 0, the null block, as KVCacheManager.free_outside_window releases them: a step of n new tokens then
    # holds only the blocks meeting positions [num_computed_tokens - W + 1, num_computed_tokens + n), at most
    # ceil((W + n - 2) / block_size) + 1 (KVCacheManager.max_blocks_held; 33 for a decode at W 512, block 16).
    block_ids: list[int] = field(default_factory=list)
    # The sliding layers' block table in a model of both attention kinds (ModelConfig.has_sliding_kv_group; written
    # only by the sliding group's KVCacheManager, KVCacheGroup.SLIDING): the same positions as block_ids, blocks of
    # the sliding layers' own pool, with the entries before num_computed_tokens - sliding_window + 1 released to the
    # null block as above, so it holds at most KVCacheManager.max_blocks_held blocks at once. Empty in a model of one
    # kind, and whenever block_ids is empty (both groups are allocated and freed together, kv_groups.py).
    sliding_block_ids: list[int] = field(default_factory=list)
    # Chained hashes of the full blocks of the tokens, extended by KVCacheManager; tokens are append-only, so a
    # hash never changes and survives preemption.
    block_hashes: list[BlockHash] = field(default_factory=list)
    # Prompt ranges whose K/V is written from elsewhere instead of computed (runtime/blend.py): sorted, disjoint,
    # each after at least one computed token and ending before the last prompt token. That K/V is approximate, so
    # prefix-cache hits and registrations stay below ``prefix_cache_limit`` (hits also below ``prefix_hit_limit``).
    kv_reuse: tuple[KVReuse, ...] = ()
    # The request's own generator when sampling_params.seed is set: one draw per sampled token, so the same seed
    # gives the same tokens whatever the batch and however often the request is preempted.
    generator: np.random.Generator | None = field(init=False)

    def __post_init__(self) -> None:
        seed = self.sampling_params.seed
        self.generator = None if seed is None else np.random.default_rng(seed)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def prefix_cache_limit(self) -> int:
        """Tokens the prefix cache may cover: all, or those before the one before the first reused range (so a hit
        always leaves a token to compute before it)."""
        return self.kv_reuse[0].start - 1 if self.kv_reuse else self.num_tokens

    @property
    def prefix_hit_limit(self) -> int:
        """Tokens a prefix-cache hit may cover: those below ``prefix_cache_limit`` and, with prompt logprobs, before
        the position of the first scored row (a hit computes no logits: runtime/prompt_logprobs.py)."""
        params = self.sampling_params
        scored = self.num_tokens if params.prompt_logprobs is None else params.prompt_logprobs_from - 1
        return min(self.prefix_cache_limit, scored)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> FinishReason | None:
        return self.status.finish_reason

    def token_ids(self, start: int, stop: int) -> list[int]:
        """Tokens ``start:stop`` of prompt + output, without copying the whole sequence."""
        p = len(self.prompt_token_ids)
        if stop <= p:
            return self.prompt_token_ids[start:stop]
        if start >= p:
            return self.output_token_ids[start - p : stop - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: stop - p]
