"""The engine loop's counters behind ``LLM.stats`` (``EngineStats``), kept since the LLM was made or its stats
reset: steps, session calls, tokens computed, peak KV blocks in use, KV slots allocated and wasted, and the loop's
time by phase (``PhaseTimes``, ``trtbuild bench --profile``).

The scheduler's and the prefix cache's own counters (preemptions, queries, hits) run for the scheduler's life; a
reset records their values as the base the stats subtract.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .outputs import EngineStats
from .profile import PhaseTimes
from .scheduler import Scheduler, SchedulerOutput


@dataclass
class StepCounters:
    """Counters of the steps since ``start`` (a fresh instance per reset)."""

    base: tuple[int, int, int]  # the scheduler's preemptions, prefix-cache queries and hits at the reset
    steps: int = 0
    calls: int = 0  # session.step calls (a step can be split into several)
    computed: int = 0
    peak_blocks: int = 0
    peak_sliding_blocks: int = 0
    waste: int = 0
    allocated: int = 0
    phase_times: PhaseTimes = field(default_factory=PhaseTimes)

    @classmethod
    def start(cls, scheduler: Scheduler) -> StepCounters:
        """Counters from now on (the scheduler's running counters taken as their base)."""
        kv = scheduler.kv_cache
        return cls((scheduler.num_preemptions, kv.prefix_cache_queries, kv.prefix_cache_hits))

    def scheduled(self, scheduler: Scheduler) -> None:
        """After a step's schedule (its blocks allocated): the peaks of blocks in use."""
        self.peak_blocks = max(self.peak_blocks, scheduler.kv_cache.num_used_blocks)
        if scheduler.sliding_kv_cache is not None:
            self.peak_sliding_blocks = max(self.peak_sliding_blocks, scheduler.sliding_kv_cache.num_used_blocks)

    def stepped(self, scheduler: Scheduler, out: SchedulerOutput) -> None:
        """After a step's results were applied: its tokens, and the KV slots allocated and wasted then."""
        kv = scheduler.kv_cache
        self.steps += 1
        self.computed += out.num_batched_tokens
        self.waste += kv.kv_waste_slots()
        self.allocated += kv.num_used_blocks * kv.block_size

    def stats(self, scheduler: Scheduler, offloader: Any) -> EngineStats:
        """``EngineStats`` of these counters (``offloader``: the LLM's KV offloader, or None)."""
        kv, sliding = scheduler.kv_cache, scheduler.sliding_kv_cache
        return EngineStats(
            num_steps=self.steps,
            num_engine_calls=self.calls,
            num_computed_tokens=self.computed,
            num_preemptions=scheduler.num_preemptions - self.base[0],
            prefix_cache_queries=kv.prefix_cache_queries - self.base[1],
            prefix_cache_hits=kv.prefix_cache_hits - self.base[2],
            peak_used_blocks=self.peak_blocks,
            num_blocks=kv.num_usable_blocks,
            peak_used_sliding_blocks=None if sliding is None else self.peak_sliding_blocks,
            num_sliding_blocks=None if sliding is None else sliding.num_usable_blocks,
            waste_slots=self.waste,
            allocated_slots=self.allocated,
            kv_offload=offloader.stats() if offloader is not None else (),
            kv_offload_loaded_blocks=offloader.loaded_blocks if offloader is not None else 0,
        )
