"""Content hashes of stage inputs/outputs and the per-stage records that make a stage "cached".

File hashes are remembered by ``(path, size, mtime_ns)`` in ``.pipeline/file-hashes.json``, so checking an
unchanged multi-GB output costs one ``stat`` per file. A stage record (``.pipeline/records/<stage id>.json``)
is written only after the stage's output is complete and in place; a stage is cached when its record's key
equals the key of its current inputs and options and its output still hashes to the recorded digest.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from pathlib import Path
from typing import Any

from ..artifacts.manifest import sha256_file

STATE_DIR = ".pipeline"


def canonical_json(data: Any) -> str:
    return json.dumps(data, sort_keys=True, separators=(",", ":"))


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def write_json_atomic(path: Path, data: Any) -> None:
    """Write ``path`` so that readers see the old or the new file, never a torn one (also after SIGKILL)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


class FileHashCache:
    """sha256 of files, remembered by (absolute path, size, mtime_ns); thread-safe; saved with ``save()``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        try:
            loaded = json.loads(path.read_text())
            self._entries: dict[str, list] = loaded if isinstance(loaded, dict) else {}
        except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
            self._entries = {}

    def sha256(self, path: Path) -> str:
        st = path.stat()
        key = str(path.absolute())
        with self._lock:
            hit = self._entries.get(key)
        if isinstance(hit, list) and hit[:2] == [st.st_size, st.st_mtime_ns]:
            return hit[2]
        digest = sha256_file(path)
        with self._lock:
            self._entries[key] = [st.st_size, st.st_mtime_ns, digest]
        return digest

    def file_table(self, root: Path) -> dict[str, dict[str, Any]]:
        """``{relative path: {sha256, size}}`` of every file below directory ``root`` (or of file ``root``)."""
        if root.is_file():
            return {root.name: {"sha256": self.sha256(root), "size": root.stat().st_size}}
        files = sorted(p for p in root.rglob("*") if p.is_file())
        return {p.relative_to(root).as_posix(): {"sha256": self.sha256(p), "size": p.stat().st_size} for p in files}

    def save(self) -> None:
        with self._lock:
            live = {k: v for k, v in self._entries.items() if os.path.exists(k)}
        write_json_atomic(self.path, live)


# Orchestration only: these modules decide which stages run, not what a stage writes.
_NOT_STAGE_CODE = ("cli", "pipeline", "recipe.py", "demo.py")


def code_digest(hashes: FileHashCache) -> str:
    """One digest of trtbuild's Python sources that stages run (plugins included, orchestration excluded).

    Part of every stage key: a changed converter, quantizer, graph emitter or runtime reruns the stages (and
    released versions differ in ``__version__`` too). Cached file hashes make this a ``stat`` per file.
    """
    import trtbuild
    import trtbuild.plugins

    files = {}
    for root in (Path(trtbuild.__file__).parent, Path(trtbuild.plugins.__file__).parent):
        for path in sorted(root.rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if rel.split("/")[0] not in _NOT_STAGE_CODE:
                files[f"{root.name}/{rel}"] = hashes.sha256(path)
    return sha256_text(canonical_json(files))


def tree_digest(files: dict[str, dict[str, Any]]) -> str:
    """One digest of a file table: names, sizes and contents (a renamed or added file changes it)."""
    return sha256_text(canonical_json(files))


def source_files(path: Path) -> list[Path]:
    """The files of a model source: the file itself, or a folder's visible files (not recursing)."""
    if path.is_file():
        return [path]
    return sorted(p for p in path.iterdir() if p.is_file() and not p.name.startswith("."))


class RecordStore:
    """Stage records under ``ARTIFACTS_DIR/.pipeline/records``, by stage id (a relative artifact path)."""

    def __init__(self, artifacts_dir: Path) -> None:
        self.root = artifacts_dir / STATE_DIR / "records"

    def path(self, stage_id: str) -> Path:
        return self.root / f"{stage_id}.json"

    def load(self, stage_id: str) -> dict[str, Any] | None:
        try:
            data = json.loads(self.path(stage_id).read_text())
        except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
            return None
        return data if isinstance(data, dict) else None

    def save(self, stage_id: str, record: dict[str, Any]) -> None:
        write_json_atomic(self.path(stage_id), record)


def explain_key_change(old: dict[str, Any], new: dict[str, Any]) -> str:
    """Why a stage's key changed, from the old and new key parts: which options, inputs or versions differ."""
    if old.get("kind") != new["kind"] or old.get("stage_key_version") != new["stage_key_version"]:
        return "stage definition changed"
    changed = sorted(
        k
        for k in set(old.get("options", {})) | set(new["options"])
        if old.get("options", {}).get(k) != new["options"].get(k)
    )
    if changed:
        return "options changed: " + ", ".join(
            _option_diff(old["options"].get(k), new["options"].get(k), k) for k in changed
        )
    inputs = sorted(
        k
        for k in set(old.get("inputs", {})) | set(new["inputs"])
        if old.get("inputs", {}).get(k) != new["inputs"].get(k)
    )
    if inputs:
        return "input changed: " + ", ".join(inputs)
    versions = sorted(
        k
        for k in set(old.get("versions", {})) | set(new["versions"])
        if old.get("versions", {}).get(k) != new["versions"].get(k)
    )
    return "versions changed: " + ", ".join(versions) if versions else "key changed"


def _option_diff(old: Any, new: Any, name: str) -> str:
    if isinstance(old, dict) and isinstance(new, dict):
        keys = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
        return ", ".join(f"{name}.{k}" for k in keys)
    return name
