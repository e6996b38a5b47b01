"""``trtbuild verify``: is an engine directory complete, unmodified and runnable on this machine?

Checks, each failure one line:

- ``manifest.json`` is present and readable (a killed build leaves none: its files are never complete);
- every file the manifest lists exists with its recorded size and sha256, and no other file is there;
- ``runtime_config.json`` loads (engine format version);
- onnxruntime engines: the installed onnxruntime has the builder's major.minor, and the engine's CPU target is
  this machine's; TensorRT engines: the GPU arch, TensorRT and plugin versions fit (``engine_select``); torch
  engines: one of them runs here, its device and target, and for an AOTInductor package the torch major.minor,
  as opening it requires (``torch_select``);
- when the directory sits in a pipeline's ARTIFACTS_DIR, its files (``manifest.json`` included) match the
  sha256s in ``index.json`` too.

``verify_artifacts`` checks a whole ARTIFACTS_DIR: every artifact of ``index.json`` and every engine in it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError
from .manifest import MANIFEST, MANIFEST_VERSION, cpu_target, manifest_digest, package_versions, sha256_file

if TYPE_CHECKING:
    from .torch_select import TorchFacts

INDEX = "index.json"  # written by ``trtbuild pipeline`` (trtbuild.pipeline.index)
_INDEX_SEARCH_DEPTH = 6  # <model>/<format>/<backend>/<target> sits four levels below ARTIFACTS_DIR


@dataclass
class Report:
    """Problems (any one fails verification) and notes (differences that do not stop the engine)."""

    path: Path
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    checked_files: int = 0
    total_bytes: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems


@dataclass(frozen=True)
class LocalVersions:
    """What this machine runs engines with (package versions by distribution name, CPU target)."""

    packages: Mapping[str, str]
    cpu_target: str
    torch: TorchFacts | None = None  # None: detected when an engine needs it (it imports torch)

    @classmethod
    def detect(cls) -> LocalVersions:
        return cls(package_versions(), cpu_target())

    def torch_facts(self) -> TorchFacts:
        from .torch_select import TorchFacts

        return self.torch or TorchFacts.detect()


def check_file(path: Path, meta: Any, report: Report, *, hashes: bool = True) -> None:
    """One file against its recorded ``{sha256, size}`` (the size only, without ``hashes``)."""
    if not path.is_file():
        report.problems.append(f"{path}: missing")
        return
    size = path.stat().st_size
    report.checked_files += 1
    report.total_bytes += size
    recorded = meta.get("size") if isinstance(meta, Mapping) else None
    if size != recorded:
        report.problems.append(f"{path}: size {size} != recorded {recorded}")
    elif hashes and sha256_file(path) != meta.get("sha256"):
        report.problems.append(f"{path}: sha256 differs from the recorded one (modified or corrupt)")


def check_files(
    root: Path, expected: Mapping[str, Any], report: Report, *, listed_in: str, exclude: tuple[str, ...] = ()
) -> None:
    """Compare the files below ``root`` with ``{relative path: {sha256, size}}``: missing, changed and extra files."""
    for rel, meta in sorted(expected.items()):
        check_file(root / rel, meta, report)
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = path.relative_to(root).as_posix()
        if rel not in expected and rel not in exclude:
            report.problems.append(f"{path}: unexpected file (not in {listed_in})")


def check_engine_files(engine_dir: Path, *, hashes: bool = False) -> None:
    """What loading an engine checks (``open_session``): ``manifest.json`` is there, and every file it lists with
    its recorded size; with ``hashes`` (``--verify``), also its sha256 and the manifest's own digest. Raises
    ``EngineError``.

    A build writes ``manifest.json`` last, inside the temporary directory that becomes the engine, so every finished
    engine has one: a directory without it is the leftover of an interrupted build, or a copy that lost it, and its
    files cannot be trusted to be whole. It is refused rather than loaded unchecked.
    """
    from ..errors import EngineError

    report = Report(engine_dir)
    if not (engine_dir / MANIFEST).is_file():
        raise EngineError(
            f"{engine_dir}: no {MANIFEST}, so not a finished engine (an interrupted build, or a copy without it); "
            "rebuild it with `trtbuild build`"
        )
    manifest = _read_manifest(engine_dir, report)
    if manifest is not None:
        for rel, meta in sorted(manifest["files"].items()):
            check_file(engine_dir / rel, meta, report, hashes=hashes)
    if report.problems:
        more = f" (and {len(report.problems) - 1} more)" if len(report.problems) > 1 else ""
        raise EngineError(
            f"{report.problems[0]}{more}: the engine changed after it was built; rebuild it "
            f"(`trtbuild verify {engine_dir}` lists every problem)"
        )


def verify_engine_dir(engine_dir: Path, local: LocalVersions | None = None, *, use_index: bool = True) -> Report:
    """Every check of the module docstring for one engine directory (``use_index``: also an enclosing index)."""
    report = Report(engine_dir)
    if not engine_dir.is_dir():
        from .inspect import not_a_directory

        report.problems.append(not_a_directory(engine_dir, "engine directory"))
        return report
    if not (engine_dir / MANIFEST).exists() and (engine_dir / "config.json").is_file():
        report.problems.append(
            f"{engine_dir}: a checkpoint, not an engine directory (verify checks engine directories and pipeline "
            "ARTIFACTS_DIRs; `trtbuild inspect` shows a checkpoint)"
        )
        return report
    manifest = _read_manifest(engine_dir, report)
    if manifest is None:
        return report
    check_files(engine_dir, manifest["files"], report, listed_in=MANIFEST, exclude=(MANIFEST,))
    _check_runtime_config(engine_dir, report)
    _check_versions_and_target(manifest, local or LocalVersions.detect(), report)
    if use_index:
        _check_enclosing_index(engine_dir, report)
    return report


def verify_artifacts(artifacts_dir: Path, local: LocalVersions | None = None) -> Report:
    """Every artifact of ``index.json`` against its recorded files, plus ``verify_engine_dir`` for each engine."""
    report = Report(artifacts_dir)
    index = _read_index(artifacts_dir / INDEX, report)
    if index is None:
        return report
    local = local or LocalVersions.detect()
    for entry in index["artifacts"]:
        path = artifacts_dir / entry["id"]
        if entry.get("status") == "not buildable here":  # the pipeline ran where the target's toolchain is missing
            report.notes.append(f"{path}: not built ({entry.get('reason', 'not buildable on that machine')})")
            continue
        if entry.get("status") in ("failed", "skipped"):
            report.problems.append(f"{path}: {entry['stage']} stage {entry['status']} in the last pipeline run")
            continue
        files = entry.get("files", {})
        sub = Report(path)
        if path.is_file():  # a single-file artifact (eval results) is recorded under its own name
            check_file(path, files.get(path.name), sub)
        elif path.is_dir():
            check_files(path, files, sub, listed_in=INDEX)
        else:
            sub.problems.append(f"{path}: missing")
        if entry.get("stage") == "build" and path.is_dir():
            engine = verify_engine_dir(path, local, use_index=False)
            sub.problems += [p for p in engine.problems if p not in sub.problems]
            sub.notes += engine.notes
        report.problems += sub.problems
        report.notes += sub.notes
        report.checked_files += sub.checked_files
        report.total_bytes += sub.total_bytes
    report.notes = list(dict.fromkeys(report.notes))
    return report


def _read_json(path: Path, report: Report, missing: str, table: tuple[str, type, str]) -> dict[str, Any] | None:
    """``path``'s JSON object, or None with a problem recorded: ``missing`` says what an absent file means;
    ``table`` is (key, type, what) of the entry the object must hold (``("files", dict, "file table")``)."""
    if not path.is_file():
        report.problems.append(f"{path}: missing ({missing})")
        return None
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        report.problems.append(f"{path}: corrupt ({type(e).__name__})")
        return None
    key, kind, what = table
    if not isinstance(data, dict):
        report.problems.append(f"{path}: corrupt (not a JSON object)")
        return None
    if not isinstance(data.get(key), kind):
        report.problems.append(f"{path}: corrupt (no {what})")
        return None
    return data


def _read_manifest(engine_dir: Path, report: Report) -> dict[str, Any] | None:
    path = engine_dir / MANIFEST
    hint = "an incomplete or interrupted build, or not an engine directory"
    manifest = _read_json(path, report, hint, ("files", dict, "file table"))
    if manifest is None:
        return None
    if manifest.get("manifest_version") != MANIFEST_VERSION:
        report.problems.append(
            f"{path}: manifest version {manifest.get('manifest_version')!r}, this trtbuild reads {MANIFEST_VERSION}"
        )
        return None
    if manifest.get("digest") != manifest_digest(manifest):
        report.problems.append(f"{path}: content does not match its digest (the manifest was modified)")
        return None
    return manifest


def _check_runtime_config(engine_dir: Path, report: Report) -> None:
    from ..config import RuntimeConfig

    if not (engine_dir / "runtime_config.json").is_file():
        return  # reported as missing by the file table (when listed)
    try:
        RuntimeConfig.load(engine_dir)
    except ConfigError as e:
        report.problems.append(f"{engine_dir / 'runtime_config.json'}: {e}")


def _major_minor(version: str) -> tuple[str, ...]:
    return tuple(version.split(".")[:2])


def _check_versions_and_target(manifest: dict[str, Any], local: LocalVersions, report: Report) -> None:
    from .engine_select import entries_from_manifest

    built = manifest.get("versions", {})
    try:
        entries = entries_from_manifest(manifest)
    except Exception as e:  # an invalid engine entry: EngineError with one line
        report.problems.append(f"{report.path / MANIFEST}: {e}")
        return
    backends = {e.backend for e in entries}
    if "onnxruntime" in backends:
        have, want = local.packages.get("onnxruntime"), built.get("onnxruntime")
        if have is None:
            report.problems.append("onnxruntime is not installed on this machine (the engine needs it)")
        elif want is None or _major_minor(have) != _major_minor(want):
            report.problems.append(f"onnxruntime {have} here, engine built with {want} (major.minor must match)")
    for entry in entries:
        if entry.backend == "onnxruntime" and entry.target != local.cpu_target:
            report.problems.append(f"built for {entry.target}, this machine is {local.cpu_target}")
    trt = [e for e in entries if e.backend == "tensorrt"]
    if trt:
        from .engine_select import detect_local_facts, mismatches

        facts = detect_local_facts()
        if facts.compute_capability is None:
            report.problems.append(f"{trt[0].describe()}: needs an NVIDIA GPU, this machine has none")
        elif facts.tensorrt_version is None:
            report.problems.append(f"{trt[0].describe()}: TensorRT is not installed on this machine")
        elif not any(not mismatches(e, facts) for e in trt):
            for e in trt:
                report.problems.append(f"{e.describe()}: " + "; ".join(mismatches(e, facts)))
    torch_engines = [e for e in entries if e.backend == "torch"]
    if torch_engines:
        from .torch_select import NO_GPU, torch_mismatches

        facts = local.torch_facts()
        why = {e: torch_mismatches(e, facts) for e in torch_engines}
        if all(why.values()):
            lines = [f"{e.describe()}: " + "; ".join(reasons) for e, reasons in why.items()]
            if all(reasons == [NO_GPU] for reasons in why.values()):  # built for a GPU on a machine without one (CI)
                report.notes += [f"{line} (checked again when opened on a GPU machine)" for line in lines]
            else:
                report.problems += lines
    for name, want in sorted(built.items()):
        have = local.packages.get(name)
        if name != "onnxruntime" and have != want:
            report.notes.append(f"{name} {have or 'absent'} here, {want} at build time")


def _read_index(path: Path, report: Report) -> dict[str, Any] | None:
    return _read_json(path, report, "not a pipeline artifacts directory", ("artifacts", list, "artifact list"))


def _check_enclosing_index(engine_dir: Path, report: Report) -> None:
    """If a pipeline's ``index.json`` lists this directory, its sha256s (manifest.json's included) must match."""
    here = engine_dir.absolute()
    for root in list(here.parents)[:_INDEX_SEARCH_DEPTH]:
        if not (root / INDEX).is_file():
            continue
        try:
            index = json.loads((root / INDEX).read_text())
            entries = {a["id"]: a for a in index["artifacts"]}
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
            return
        entry = entries.get(here.relative_to(root).as_posix())
        if entry is None or "files" not in entry:
            return
        sub = Report(engine_dir)
        check_file(engine_dir / MANIFEST, entry["files"].get(MANIFEST), sub)
        report.problems += [f"{p} (per {root / INDEX})" for p in sub.problems]
        report.checked_files += sub.checked_files
        report.total_bytes += sub.total_bytes
        return
