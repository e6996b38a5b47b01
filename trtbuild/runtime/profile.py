"""Where an engine loop's time goes (``trtbuild bench --profile``).

Three sources, one table:

- the runner's own Python work, timed around each phase of ``LLM._step`` (always on: a few ``perf_counter`` calls
  per step): scheduling (``scheduler.schedule`` and the step's metadata arrays), sampling, and applying the step
  (stop checks, detokenization, block bookkeeping);
- the session's own work around the engine (``OrtSession``: binding the step's inputs, storing the new keys and
  values in the cache);
- onnxruntime's kernels by kind, from its profiler (on only when asked: it timestamps every node, which makes a
  batch-1 decode step of ~900 small nodes up to 2x slower, so read the shares): matrix products (with a per-token
  int8 linear's native row ops), the paged
  attention (the native node, or every node the lowering added with its per-step metadata; the profiler inflates a
  native custom op many times over: benchmarks/results/2026-12-01-cpu2-native-attention.md), norms, everything else. The
  rest of ``session.run``'s wall time is onnxruntime's own dispatch and thread hand-offs.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ..config import ORT_LOWERED_NODE_PREFIX

# onnxruntime op types that are matrix products (float, int8 and int4 forms, after its fusions), with the native
# row ops either side of a per-token int8 linear's MatMulInteger (its activation codes in, its rescale out)
MATMUL_OPS = frozenset(
    {
        "MatMul",
        "Gemm",
        "FusedMatMul",
        "MatMulNBits",
        "MatMulIntegerToFloat",
        "DynamicQuantizeMatMul",
        "MatMulInteger",
        "QLinear",
        "QuantizeRows",
        "RescaleRows",
    }
)
NORM_OPS = frozenset(
    {
        "LayerNormalization",
        "RMSNormalization",
        "SimplifiedLayerNormalization",
        "SkipSimplifiedLayerNormalization",
        "SkipLayerNormalization",
    }
)
KERNEL_KINDS = ("matmul", "attention", "norm", "other")


@dataclass
class PhaseTimes:
    """Seconds spent in each phase of the engine loop, summed over steps (see the module docstring)."""

    schedule: float = 0.0
    engine: float = 0.0  # session.step calls, whole
    sample: float = 0.0
    update: float = 0.0


@dataclass
class SessionTimes:
    """Seconds of ``OrtSession.step`` by part, summed over calls: ``run`` is ``session.run`` itself."""

    bind: float = 0.0
    run: float = 0.0
    cache_write: float = 0.0
    calls: int = 0

    def since(self, earlier: SessionTimes) -> SessionTimes:
        """The times accumulated after ``earlier`` (a copy taken then)."""
        return SessionTimes(
            self.bind - earlier.bind,
            self.run - earlier.run,
            self.cache_write - earlier.cache_write,
            self.calls - earlier.calls,
        )


@dataclass(frozen=True)
class KernelTimes:
    """onnxruntime's profile of a session: kernel seconds per kind over ``runs`` runs lasting ``run_total`` s."""

    runs: int
    run_total: float
    kinds: Mapping[str, float] = field(default_factory=dict)

    @property
    def dispatch(self) -> float:
        """``session.run`` time not inside any kernel (negative values, from clock granularity, read as 0)."""
        return max(0.0, self.run_total - sum(self.kinds.values()))


def kernel_kind(op_type: str, node_name: str) -> str:
    """The ``KERNEL_KINDS`` entry a profiled node counts under."""
    if node_name.startswith(ORT_LOWERED_NODE_PREFIX):
        return "attention"
    if op_type in MATMUL_OPS:
        return "matmul"
    if op_type in NORM_OPS:
        return "norm"
    return "other"


def read_ort_profile(path: Path, skip_runs: int = 0) -> KernelTimes:
    """Sum an onnxruntime profile (the JSON trace ``end_profiling`` writes) into ``KernelTimes``, leaving out its
    first ``skip_runs`` runs (a warm-up)."""
    events = json.loads(Path(path).read_text())
    run_starts = sorted(e["ts"] for e in events if e.get("cat") == "Session" and e.get("name") == "model_run")
    since = run_starts[skip_runs] if skip_runs < len(run_starts) else float("inf")
    kinds = dict.fromkeys(KERNEL_KINDS, 0.0)
    runs, run_total = 0, 0.0
    for e in events:
        if e.get("ts", 0) < since:
            continue
        if e.get("cat") == "Session" and e.get("name") == "model_run":
            runs += 1
            run_total += e["dur"] / 1e6
        elif e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time"):
            name = e["name"][: -len("_kernel_time")]
            kinds[kernel_kind(e["args"]["op_name"], name)] += e["dur"] / 1e6
    return KernelTimes(runs, run_total, kinds)


@dataclass(frozen=True)
class Breakdown:
    """One run's wall time split into parts (seconds), in the order ``rows`` prints them."""

    wall: float
    steps: int
    parts: Mapping[str, float]

    @classmethod
    def build(cls, wall: float, steps: int, phases: PhaseTimes, session: SessionTimes, kernels: KernelTimes | None):
        parts = {
            "runner: schedule": phases.schedule,
            "runner: sampling": phases.sample,
            "runner: apply step (stops, detokenize, blocks)": phases.update,
            "session: bind inputs": session.bind,
            "session: store new K/V in the cache": session.cache_write,
        }
        metadata = phases.engine - session.bind - session.run - session.cache_write
        if kernels is not None:
            for kind in KERNEL_KINDS:
                parts[f"onnxruntime kernels: {kind}"] = kernels.kinds.get(kind, 0.0)
            parts["onnxruntime dispatch and threads"] = kernels.dispatch + max(0.0, session.run - kernels.run_total)
        else:
            parts["onnxruntime run"] = session.run
        parts["runner: step inputs (StepBatch), call splitting"] = max(0.0, metadata)
        parts["outside the engine loop (waiting, output assembly)"] = max(0.0, wall - sum(parts.values()))
        return cls(wall, steps, parts)

    def rows(self) -> list[tuple[str, float, float, float]]:
        """(part, seconds, ms per step, percent of wall) per part."""
        steps = max(1, self.steps)
        return [(k, v, 1000 * v / steps, 100 * v / self.wall if self.wall else 0.0) for k, v in self.parts.items()]

    def as_dict(self) -> dict[str, float]:
        return {k: round(v, 4) for k, v in self.parts.items()}
