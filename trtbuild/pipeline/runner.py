"""Run a plan: each stage is cached by the content hash of its inputs and options, independent stages in parallel.

A stage's key hashes its kind, options, the digests of the artifacts it reads (for convert: the source files), the
trtbuild version and source (``code_digest``) and the package versions. Keys use input *content*, so a stage whose
input was rebuilt to the same bytes stays cached. The first failure stops new stages from starting; stages already
running finish and keep their artifacts; ``index.json`` is written either way. One pipeline at a time per
ARTIFACTS_DIR (an ``flock``).
"""

from __future__ import annotations

import enum
import fcntl
import os
import re
import shutil
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import __version__
from ..artifacts.manifest import package_versions
from ..errors import TrtbuildError
from .cache import (
    STATE_DIR,
    FileHashCache,
    RecordStore,
    canonical_json,
    code_digest,
    explain_key_change,
    sha256_text,
    source_files,
    tree_digest,
)
from .heartbeat import Heartbeat
from .index import GateResult, check_gates, write_index
from .plan import Plan, Stage
from .stages import StageContext, StageError, missing_toolchain, run_stage

STAGE_KEY_VERSION = 1  # bump when a stage's meaning changes without its options changing
_STALE = re.compile(r"^\..+\.(tmp|old)-[A-Za-z0-9_]+$")  # atomic_output_dir leftovers of a killed run

Report = Callable[[str], None]


class PipelineError(TrtbuildError):
    """A stage failed (the message names it) or the artifacts directory is in use."""


class Status(enum.Enum):
    BUILT = "built"
    CACHED = "cached"
    FAILED = "failed"
    SKIPPED = "skipped"  # not started because an earlier stage failed
    WOULD_RUN = "would run"  # --dry-run
    NOT_BUILDABLE = "not buildable here"  # its toolchain (TensorRT) is missing on this machine, or an input's is


@dataclass
class Outcome:
    """What happened to one stage in this run."""

    stage: Stage
    status: Status
    seconds: float = 0.0  # this run's wall time for the stage (hash checks included)
    reason: str = ""  # why it ran (or why it failed)
    record: dict[str, Any] = field(default_factory=dict)


@dataclass
class PipelineRun:
    plan: Plan
    artifacts_dir: Path
    outcomes: dict[str, Outcome]
    seconds: float
    gates: list[GateResult] = field(default_factory=list)  # accuracy gate results (empty: no gate or dry run)


class _Runner:
    def __init__(self, plan: Plan, artifacts_dir: Path, report: Report, lock_fd: int | None) -> None:
        self.plan, self.dir, self.report, self.lock_fd = plan, artifacts_dir, report, lock_fd
        self.hashes = FileHashCache(artifacts_dir / STATE_DIR / "file-hashes.json")
        self.records = RecordStore(artifacts_dir)
        self.versions = {"trtbuild": __version__, "trtbuild_code": code_digest(self.hashes), **package_versions()}
        self.digests: dict[str, str] = {}  # stage id -> digest of its artifact, once complete
        self.total = len(plan.stages)
        self.done = 0
        self._report_lock = threading.Lock()  # progress lines come from worker threads too
        self.heartbeat = Heartbeat(self._last_seconds, self._report_lock)  # the live status line, on a terminal

    def _last_seconds(self, stage: Stage) -> float | None:
        """How long ``stage`` took when it was last built (any key), for the status line's estimate."""
        rec = self.records.load(stage.id)
        return None if rec is None else rec.get("build_seconds")

    def key_inputs(self, stage: Stage) -> dict[str, Any]:
        if stage.source is not None:
            src = stage.source
            if not src.exists():
                raise StageError(f"{stage.describe()}: model source {src} not found")
            if src.is_file():  # content only: moving or renaming the source keeps the stage cached
                inputs = {"source": self.hashes.sha256(src)}
            else:
                inputs = {
                    "source": tree_digest(
                        {p.name: {"sha256": self.hashes.sha256(p), "size": p.stat().st_size} for p in source_files(src)}
                    )
                }
        else:
            inputs = {dep: self.digests[dep] for dep in stage.deps}
        for path in stage.data_files:
            if not path.is_file():
                raise StageError(f"{stage.describe()}: data file {path} not found")
            inputs[f"file:{path.name}"] = self.hashes.sha256(path)
        return inputs

    def describe_key(self, stage: Stage) -> dict[str, Any]:
        return {
            "kind": stage.kind.value,
            "options": stage.options,
            "inputs": self.key_inputs(stage),
            "versions": self.versions,
            "stage_key_version": STAGE_KEY_VERSION,
        }

    def cached(self, stage: Stage, key: str) -> tuple[dict[str, Any] | None, str]:
        """(record, "") when ``stage`` is up to date, else (None, why it must run)."""
        rec = self.records.load(stage.id)
        if rec is None:
            return None, "not built yet"
        if rec.get("key") != key:
            return None, explain_key_change(rec.get("key_parts", {}), self.describe_key(stage))
        out = self.dir / stage.id
        if not out.exists():
            return None, "artifact missing"
        if tree_digest(self.hashes.file_table(out)) != rec.get("digest"):
            return None, "artifact modified since it was built"
        return rec, ""

    def execute(self, stage: Stage) -> Outcome:
        start = time.perf_counter()
        parts = self.describe_key(stage)
        key = sha256_text(canonical_json(parts))
        rec, why = self.cached(stage, key)
        if rec is not None:
            self.digests[stage.id] = rec["digest"]
            return Outcome(stage, Status.CACHED, time.perf_counter() - start, record=rec)
        self._progress(stage, f"running ({why})")
        ctx = StageContext(self.dir, self.dir / STATE_DIR / "logs" / f"{stage.id}.log", self.lock_fd)
        self.heartbeat.started(stage)
        try:
            facts = run_stage(stage, ctx)
        finally:
            self.heartbeat.finished(stage)
        seconds = time.perf_counter() - start
        out = self.dir / stage.id
        files = self.hashes.file_table(out)
        rec = {
            "id": stage.id,
            "kind": stage.kind.value,
            "key": key,
            "key_parts": parts,
            "digest": tree_digest(files),
            "files": files,
            "size": sum(f["size"] for f in files.values()),
            "build_seconds": round(seconds, 3),
            **facts,
        }
        self.records.save(stage.id, rec)
        self.digests[stage.id] = rec["digest"]
        return Outcome(stage, Status.BUILT, seconds, why, rec)

    def not_buildable(self, stage: Stage, outcomes: dict[str, Outcome]) -> Outcome | None:
        """An outcome for ``stage`` when it cannot run on this machine (missing toolchain here or upstream)."""
        missing = missing_toolchain(stage)
        if missing is None:
            blocked = [d for d in stage.deps if d in outcomes and outcomes[d].status is Status.NOT_BUILDABLE]
            if not blocked:
                return None
            missing = f"needs {blocked[0]}, which is not buildable here"
        outcome = Outcome(stage, Status.NOT_BUILDABLE, reason=missing)
        self._progress(stage, f"not buildable here ({missing})", count=True)
        return outcome

    def dry_run(self) -> dict[str, Outcome]:
        outcomes: dict[str, Outcome] = {}
        for stage in self.plan.stages:
            skip = self.not_buildable(stage, outcomes)
            if skip is not None:
                outcomes[stage.id] = skip
                continue
            if any(outcomes[d].status is Status.WOULD_RUN for d in stage.deps):
                outcomes[stage.id] = Outcome(stage, Status.WOULD_RUN, reason="an input will be rebuilt")
                self._progress(stage, "would run (an input will be rebuilt)", count=True)
                continue
            key = sha256_text(canonical_json(self.describe_key(stage)))
            rec, why = self.cached(stage, key)
            if rec is not None:
                self.digests[stage.id] = rec["digest"]
                outcomes[stage.id] = Outcome(stage, Status.CACHED, record=rec)
            else:
                outcomes[stage.id] = Outcome(stage, Status.WOULD_RUN, reason=why)
            self._progress(stage, outcomes[stage.id].status.value + (f" ({why})" if why else ""), count=True)
        return outcomes

    def run(self, jobs: int) -> dict[str, Outcome]:
        outcomes: dict[str, Outcome] = {}
        pending = list(self.plan.stages)
        running: dict[Future[Outcome], Stage] = {}
        failed = False
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            while pending or running:
                for stage in [] if failed else list(pending):
                    skip = self.not_buildable(stage, outcomes)
                    if skip is not None:
                        pending.remove(stage)
                        outcomes[stage.id] = skip
                ready = [] if failed else [s for s in pending if all(d in self.digests for d in s.deps)]
                for stage in ready[: max(0, jobs - len(running))]:
                    pending.remove(stage)
                    running[pool.submit(self._guarded, stage)] = stage
                if not running:
                    break
                finished, _ = wait(running, return_when=FIRST_COMPLETED)
                for fut in finished:
                    outcome = fut.result()
                    del running[fut]
                    outcomes[outcome.stage.id] = outcome
                    failed = failed or outcome.status is Status.FAILED
                    self._finish(outcome)
        for stage in pending:
            outcomes[stage.id] = Outcome(stage, Status.SKIPPED, reason="an earlier stage failed")
        return {s.id: outcomes[s.id] for s in self.plan.stages}  # plan order, not completion order

    def _guarded(self, stage: Stage) -> Outcome:
        start = time.perf_counter()
        try:
            return self.execute(stage)
        except TrtbuildError as e:
            message = str(e) if str(e).startswith(stage.describe()) else f"{stage.describe()} failed: {e}"
        except Exception as e:  # a bug in a stage: keep the traceback, fail the pipeline with one line
            log = self.dir / STATE_DIR / "logs" / f"{stage.id}.log"
            log.parent.mkdir(parents=True, exist_ok=True)
            log.write_text(traceback.format_exc())
            message = f"{stage.describe()} failed: {type(e).__name__}: {e} (traceback: {log})"
        return Outcome(stage, Status.FAILED, time.perf_counter() - start, message)

    def _finish(self, outcome: Outcome) -> None:
        status = outcome.status
        if status is Status.BUILT:
            self._progress(outcome.stage, f"done in {outcome.seconds:.1f}s", count=True)
        elif status is Status.CACHED:
            self._progress(outcome.stage, "cached", count=True)
        else:
            self._progress(outcome.stage, "FAILED", count=True)

    def _progress(self, stage: Stage, what: str, *, count: bool = False) -> None:
        with self._report_lock:
            if count:
                self.done += 1
            width = len(str(self.total))
            prefix = f"[{self.done:>{width}}/{self.total}]" if count else " " * (2 * width + 3)
            self.heartbeat.clear()
            self.report(f"{prefix} {stage.kind.value:<8} {stage.id}: {what}")


def _remove_stale_temporaries(plan: Plan, artifacts_dir: Path) -> None:
    """Delete the temporary directories that a killed run's atomic writes left next to the artifacts."""
    parents = {(artifacts_dir / s.id).parent for s in plan.stages}
    for parent in parents:
        if parent.is_dir():
            for entry in parent.iterdir():
                if _STALE.match(entry.name) and entry.is_dir():
                    shutil.rmtree(entry, ignore_errors=True)


def _lock(fd: int, artifacts_dir: Path) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise PipelineError(
            f"{artifacts_dir} is in use by another trtbuild pipeline (or by a stage of a killed "
            "one that is still finishing); try again when it is done"
        ) from None


def _dry_run(plan: Plan, artifacts_dir: Path, report: Report) -> dict[str, Outcome]:
    """Classify every stage without writing anything (the file-hash cache is read, not saved)."""
    lock_path = artifacts_dir / STATE_DIR / "lock"
    lock = os.open(lock_path, os.O_RDONLY) if lock_path.is_file() else None
    try:
        if lock is not None:
            _lock(lock, artifacts_dir)
        return _Runner(plan, artifacts_dir, report, lock).dry_run()
    finally:
        if lock is not None:
            os.close(lock)


def run_pipeline(
    plan: Plan, artifacts_dir: Path, *, jobs: int = 1, dry_run: bool = False, report: Report = print
) -> PipelineRun:
    """Run (or with ``dry_run`` only classify) every stage of ``plan`` and write ``ARTIFACTS_DIR/index.json``.

    Raises ``PipelineError`` after writing the index when a stage failed or the accuracy gate did not pass.
    """
    start = time.perf_counter()
    artifacts_dir = artifacts_dir.absolute()
    state = artifacts_dir / STATE_DIR
    if dry_run:  # writes nothing: no state directory, no lock file, no index
        return PipelineRun(plan, artifacts_dir, _dry_run(plan, artifacts_dir, report), time.perf_counter() - start)
    state.mkdir(parents=True, exist_ok=True)
    lock = os.open(state / "lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        _lock(lock, artifacts_dir)
        runner = _Runner(plan, artifacts_dir, report, lock)
        _remove_stale_temporaries(plan, artifacts_dir)
        try:
            outcomes = runner.run(max(1, jobs))
        finally:
            runner.heartbeat.close()
            runner.hashes.save()
        result = PipelineRun(plan, artifacts_dir, outcomes, time.perf_counter() - start)
        result.gates = check_gates(outcomes, plan)
        write_index(artifacts_dir, plan, outcomes, result.seconds, result.gates)
    finally:
        os.close(lock)
    failures = [o.reason for o in outcomes.values() if o.status is Status.FAILED]
    failures += [g.message for g in result.gates if not g.passed]
    if failures:
        more = f" (and {len(failures) - 1} more; see {artifacts_dir / 'index.json'})" if len(failures) > 1 else ""
        raise PipelineError(failures[0] + more)
    return result
