"""``manifest.json``: what an engine directory holds and how it was made.

It records the sha256 and size of every file, the tool and package versions, the build options, the backend and
the target. It contains no timestamps or absolute paths, so rebuilding the same checkpoint gives the same bytes.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import platform
import sys
from pathlib import Path
from typing import Any

from ..configio import read_json, write_json

MANIFEST = "manifest.json"
MANIFEST_VERSION = 1
PACKAGES = ("trtbuild", "numpy", "onnx", "onnxruntime", "tokenizers", "torch", "transformers", "safetensors", "gguf")


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def file_table(directory: Path) -> dict[str, dict[str, Any]]:
    """sha256 and size of every file below ``directory`` except the manifest itself, by relative path."""
    out = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST):
        out[path.relative_to(directory).as_posix()] = {"sha256": sha256_file(path), "size": path.stat().st_size}
    return out


def package_versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions


def cpu_target() -> str:
    return f"cpu-{platform.machine().lower()}-{sys.platform}"


def write_manifest(directory: Path, **sections: Any) -> dict[str, Any]:
    """Write ``manifest.json`` for the finished files of ``directory`` plus the given sections."""
    manifest = {
        "manifest_version": MANIFEST_VERSION,
        "versions": package_versions(),
        **sections,
        "files": file_table(directory),
    }
    manifest["digest"] = manifest_digest(manifest)
    write_json(directory / MANIFEST, manifest)
    return manifest


def manifest_digest(manifest: dict[str, Any]) -> str:
    """sha256 of the manifest's content without its own ``digest`` entry (canonical JSON): a changed byte anywhere
    in ``manifest.json`` no longer matches the digest it carries."""
    body = {k: v for k, v in manifest.items() if k != "digest"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def read_manifest(directory: Path) -> dict[str, Any]:
    return read_json(directory / MANIFEST)
