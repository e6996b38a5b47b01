"""Prometheus text exposition of the server's counters, histograms and the engine's gauges (no extra package).

Histograms and counters are written by the engine thread and read by ``/metrics``; a lock keeps each consistent.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from ..runtime.kv_offload.tiers import TierStats
from ..runtime.outputs import CompletionState

PREFIX = "trtbuild"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine's gauges after its latest iteration (read by /metrics)."""

    running: int = 0
    waiting: int = 0
    kv_used_blocks: int = 0
    kv_total_blocks: int = 0
    # A model of sliding and full layers (runtime/kv_groups.py): the sliding group's blocks; None without one.
    sliding_kv_used_blocks: int | None = None
    sliding_kv_total_blocks: int | None = None
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    preemptions: int = 0
    steps: int = 0
    kv_offload: tuple[TierStats, ...] = ()  # the KV offload tiers' counters (none when it is off)


class Counter:
    def __init__(self, name: str, help: str) -> None:
        self.name, self.help, self.value = name, help, 0
        self._lock = threading.Lock()

    def inc(self, amount: int = 1) -> None:
        with self._lock:
            self.value += amount

    def render(self) -> list[str]:
        return counter(self.name, self.help, self.value)


class Histogram:
    def __init__(self, name: str, help: str, buckets: Sequence[float] = LATENCY_BUCKETS) -> None:
        self.name, self.help, self.buckets = name, help, tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)  # the last one is +Inf
        self.sum, self.count = 0.0, 0
        self._lock = threading.Lock()

    def observe(self, value: float, count: int = 1) -> None:
        """Record ``value`` ``count`` times (e.g. one inter-token latency per token of a multi-token update)."""
        if not math.isfinite(value):
            return
        i = next((k for k, b in enumerate(self.buckets) if value <= b), len(self.buckets))
        with self._lock:
            self.counts[i] += count
            self.sum += value * count
            self.count += count

    def render(self) -> list[str]:
        with self._lock:
            counts, total, n = list(self.counts), self.sum, self.count
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        cumulative = 0
        for bound, c in zip((*self.buckets, math.inf), counts, strict=True):
            cumulative += c
            le = "+Inf" if math.isinf(bound) else repr(bound)
            lines.append(f'{self.name}_bucket{{le="{le}"}} {cumulative}')
        lines += [f"{self.name}_sum {total}", f"{self.name}_count {n}"]
        return lines


def sample(kind: str, name: str, help: str, value: float) -> list[str]:
    """One metric without labels in the text format."""
    return [f"# HELP {name} {help}", f"# TYPE {name} {kind}", f"{name} {value}"]


def gauge(name: str, help: str, value: float) -> list[str]:
    return sample("gauge", name, help, value)


def counter(name: str, help: str, value: float) -> list[str]:
    return sample("counter", name, help, value)


KV_OFFLOAD_COUNTERS = {  # TierStats field -> (metric name, help); each with a tier="memory"|"disk" label
    "hits": ("kv_offload_hits_total", "KV blocks found in the offload tier"),
    "misses": ("kv_offload_misses_total", "KV block lookups that reached the offload tier and missed"),
    "bytes_loaded": ("kv_offload_loaded_bytes_total", "bytes of KV blocks loaded from the offload tier"),
    "bytes_stored": ("kv_offload_stored_bytes_total", "bytes of KV blocks stored in the offload tier"),
    "evictions": ("kv_offload_evictions_total", "KV blocks dropped from the offload tier to stay under its cap"),
    "store_errors": ("kv_offload_store_errors_total", "KV blocks the offload tier failed to store"),
}


def sliding_group_lines(snap: EngineSnapshot) -> list[str]:
    """The sliding layers' KV-cache group of a model of both kinds (its blocks are apart from the gauges above,
    which are the full layers'); nothing for other models."""
    used, total = snap.sliding_kv_used_blocks, snap.sliding_kv_total_blocks
    if used is None or total is None:
        return []
    p = PREFIX
    return [
        *gauge(f"{p}_kv_cache_sliding_used_blocks", "sliding-window layers' KV-cache blocks held by sequences", used),
        *gauge(f"{p}_kv_cache_sliding_total_blocks", "usable KV-cache blocks of the sliding-window layers", total),
        *gauge(
            f"{p}_kv_cache_sliding_usage_ratio",
            "fraction of the sliding-window layers' usable KV-cache blocks in use",
            used / total if total else 0.0,
        ),
    ]


def kv_offload_lines(tiers: Sequence[TierStats]) -> list[str]:
    """The KV offload tiers' counters, one labelled sample per tier (nothing when the tier is off)."""
    lines: list[str] = []
    if not tiers:
        return lines
    for field, (name, help) in KV_OFFLOAD_COUNTERS.items():
        lines += [f"# HELP {PREFIX}_{name} {help}", f"# TYPE {PREFIX}_{name} counter"]
        lines += [f'{PREFIX}_{name}{{tier="{t.name}"}} {getattr(t, field)}' for t in tiers]
    return lines


class ServerMetrics:
    """Everything ``GET /metrics`` reports."""

    def __init__(self) -> None:
        p = PREFIX
        self.ttft = Histogram(f"{p}_time_to_first_token_seconds", "arrival at the server to the first output token")
        self.itl = Histogram(f"{p}_inter_token_latency_seconds", "time between output tokens of a completion")
        self.e2e = Histogram(f"{p}_e2e_request_latency_seconds", "arrival at the server to the request's end")
        self.prompt_tokens = Counter(f"{p}_prompt_tokens_total", "prompt tokens admitted")
        self.output_tokens = Counter(f"{p}_generation_tokens_total", "tokens generated")
        self.finished = {
            reason: Counter(f"{p}_requests_{reason}_total", f"completions finished with finish_reason {reason}")
            for reason in ("stop", "length", "abort")
        }
        self.rejected = Counter(f"{p}_requests_rejected_total", "requests answered 429 (queue full)")
        self.engine_errors = Counter(f"{p}_engine_errors_total", "engine steps that failed (their requests aborted)")

    def observe_request(self, arrival: float, now: float, states: Sequence[CompletionState]) -> None:
        """A request finished: its end-to-end latency and the finish reason of each completion."""
        self.e2e.observe(now - arrival)
        for state in states:
            reason = state.seq.finish_reason
            if reason is not None:
                self.finished[reason.value].inc()

    def render(self, snap: EngineSnapshot) -> str:
        p = PREFIX
        hit_rate = snap.prefix_cache_hits / snap.prefix_cache_queries if snap.prefix_cache_queries else 0.0
        usage = snap.kv_used_blocks / snap.kv_total_blocks if snap.kv_total_blocks else 0.0
        lines = [
            *gauge(f"{p}_num_requests_running", "sequences in the running batch", snap.running),
            *gauge(f"{p}_num_requests_waiting", "sequences waiting (queued or preempted)", snap.waiting),
            *gauge(f"{p}_kv_cache_used_blocks", "KV-cache blocks held by sequences", snap.kv_used_blocks),
            *gauge(f"{p}_kv_cache_total_blocks", "usable KV-cache blocks", snap.kv_total_blocks),
            *gauge(f"{p}_kv_cache_usage_ratio", "fraction of the usable KV-cache blocks in use", usage),
            *sliding_group_lines(snap),
            *gauge(f"{p}_prefix_cache_hit_rate", "prompt tokens found in the prefix cache / looked up", hit_rate),
            *counter(
                f"{p}_prefix_cache_queries_total",
                "prompt tokens looked up in the prefix cache",
                snap.prefix_cache_queries,
            ),
            *counter(f"{p}_prefix_cache_hits_total", "prompt tokens found in the prefix cache", snap.prefix_cache_hits),
            *counter(f"{p}_num_preemptions_total", "sequences preempted (recomputed later)", snap.preemptions),
            *counter(f"{p}_engine_steps_total", "scheduler steps", snap.steps),
            *kv_offload_lines(snap.kv_offload),
        ]
        for metric in (
            self.ttft,
            self.itl,
            self.e2e,
            self.prompt_tokens,
            self.output_tokens,
            *self.finished.values(),
            self.rejected,
            self.engine_errors,
        ):
            lines += metric.render()
        return "\n".join(lines) + "\n"
