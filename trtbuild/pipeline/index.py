"""``ARTIFACTS_DIR/index.json`` and the accuracy gate.

The index lists every artifact of the run: its stage, labels (model/format/backend/target), status, content digest,
file table (sha256 + size), total size, eval metrics, this run's time and the time it took to build. ``trtbuild
verify ARTIFACTS_DIR`` checks the files against it. The accuracy gate compares each format's perplexity with the
baseline format's on the same backend and target.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

from .. import __version__
from ..recipe import recipe_to_dict
from .cache import write_json_atomic
from .plan import Plan, Stage, StageKind

INDEX = "index.json"
INDEX_VERSION = 1
PERPLEXITY_KEY = "perplexity"  # the metric of ``trtbuild eval --json`` that the gate compares


class StageOutcome(Protocol):
    """What the index reads of one stage's outcome (``runner.Outcome``)."""

    @property
    def stage(self) -> Stage: ...
    @property
    def status(self) -> enum.Enum: ...
    @property
    def seconds(self) -> float: ...
    @property
    def reason(self) -> str: ...
    @property
    def record(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class GateResult:
    model: str
    format: str
    backend: str
    target: str
    baseline: str
    perplexity: float | None
    baseline_perplexity: float | None
    max_increase: float  # percent
    passed: bool
    message: str


def check_gates(outcomes: Mapping[str, StageOutcome], plan: Plan) -> list[GateResult]:
    """Gate results of every evaluated engine whose recipe has an accuracy gate (baselines themselves excluded)."""
    metrics: dict[tuple[str, ...], dict[str, Any]] = {}
    for outcome in outcomes.values():
        st = outcome.stage
        if st.kind is StageKind.EVAL and "metrics" in outcome.record:
            key = (st.labels["model"], st.labels["format"], st.labels["backend"], st.labels["target"])
            metrics[key] = outcome.record["metrics"]
    results = []
    for recipe in plan.recipes:
        gate = recipe.accuracy_gate
        if gate is None:
            continue
        for (model, fmt, backend, target), m in sorted(metrics.items()):
            if model != recipe.model.name or fmt == gate.baseline or fmt not in {f.name for f in recipe.formats}:
                continue
            base = metrics.get((model, gate.baseline, backend, target))
            results.append(_gate_one(model, fmt, backend, target, gate.baseline, gate.max_ppl_increase, m, base))
    return results


def _gate_one(
    model: str,
    fmt: str,
    backend: str,
    target: str,
    baseline: str,
    max_increase: float,
    m: dict[str, Any],
    base: dict[str, Any] | None,
) -> GateResult:
    where = f"{model}/{fmt}/{backend}/{target}"
    ppl = m.get(PERPLEXITY_KEY)
    base_ppl = None if base is None else base.get(PERPLEXITY_KEY)
    if not isinstance(ppl, int | float) or not isinstance(base_ppl, int | float):
        missing = where if not isinstance(ppl, int | float) else f"{model}/{baseline}/{backend}/{target}"
        msg = f"accuracy gate: no {PERPLEXITY_KEY} for {missing}"
        return GateResult(model, fmt, backend, target, baseline, None, None, max_increase, False, msg)
    increase = (ppl / base_ppl - 1.0) * 100.0
    passed = increase <= max_increase
    msg = (
        f"accuracy gate {'passed' if passed else 'failed'}: {where} perplexity {ppl:.3f} is {increase:+.1f}% "
        f"vs {baseline} {base_ppl:.3f} (max +{max_increase:g}%)"
    )
    return GateResult(model, fmt, backend, target, baseline, ppl, base_ppl, max_increase, passed, msg)


def write_index(
    artifacts_dir: Path, plan: Plan, outcomes: Mapping[str, StageOutcome], seconds: float, gates: list[GateResult]
) -> dict[str, Any]:
    """Write ``artifacts_dir/index.json`` for a run of ``plan`` that took ``seconds``; returns what it wrote."""
    artifacts = []
    for outcome in outcomes.values():
        st, rec = outcome.stage, outcome.record
        entry: dict[str, Any] = {
            "id": st.id,
            "stage": st.kind.value,
            **st.labels,
            "status": outcome.status.value,
            "seconds": round(outcome.seconds, 3),
        }
        if outcome.reason:
            entry["reason"] = outcome.reason
        if rec:
            entry.update({k: rec[k] for k in ("key", "digest", "size", "build_seconds", "files") if k in rec})
            if "metrics" in rec:
                entry["metrics"] = rec["metrics"]
        if st.source is not None:
            entry["source"] = str(st.source)
        artifacts.append(entry)
    index = {
        "index_version": INDEX_VERSION,
        "trtbuild_version": __version__,
        "written_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "seconds": round(seconds, 3),
        "recipes": [recipe_to_dict(r) for r in plan.recipes],
        "artifacts": artifacts,
        "accuracy_gate": [asdict(g) for g in gates],
    }
    write_json_atomic(artifacts_dir / INDEX, index)
    return index
