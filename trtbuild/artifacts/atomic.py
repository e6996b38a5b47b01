"""Atomic outputs: write into a temporary sibling, rename into place only when complete.

A failed or killed stage therefore never leaves a half-written ``-o`` directory (or ``--output`` file) behind.
Outputs get the modes the user's umask gives (like ``cp`` or ``tar``), whatever the writer used (``mkstemp`` and
safetensors make 0600 files). Scratch space for intermediate work lives next to the output too (``scratch_dir``),
so a run killed where no cleanup code can run (SIGKILL) leaves it where the next run finds and removes it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ..errors import TrtbuildError


@contextmanager
def atomic_output_dir(target: Path, *, overwrite: bool = False) -> Iterator[Path]:
    """Yield a fresh temporary directory next to ``target``; on success it replaces ``target``.

    Refuses an existing non-empty ``target`` unless ``overwrite``; on any exception the temporary directory is
    removed and ``target`` is untouched.
    """
    target = target.absolute()
    if target.exists() and not overwrite and (not target.is_dir() or any(target.iterdir())):
        raise TrtbuildError(f"{target}: already exists (use --overwrite to replace it)")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        yield tmp
        apply_umask(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if target.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
        target.rename(old / "x")
        tmp.rename(target)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(target)


def current_umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def apply_umask(path: Path) -> None:
    """Give ``path`` (and everything below it) the modes a plain ``open``/``mkdir`` would: 0666 / 0777 minus the
    umask, executable bits kept as the writer set them."""
    umask = current_umask()
    paths = [path, *path.rglob("*")] if path.is_dir() else [path]
    for p in paths:
        if p.is_symlink():
            continue
        base = 0o777 if p.is_dir() or p.stat().st_mode & 0o111 else 0o666
        p.chmod(base & ~umask)


def write_file_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` via a temporary sibling and a rename: readers see the old file or the new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        apply_umask(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


SCRATCH = ".{name}.scratch-{pid}-"


@contextmanager
def scratch_dir(target: Path) -> Iterator[Path]:
    """A temporary directory next to ``target`` for intermediate work, removed on exit (exceptions included).

    Its name carries this process's id; scratch directories of ``target`` whose process is gone (a run killed
    with SIGKILL) are removed first, so leftovers never outlive the next run.
    """
    target = target.absolute()
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_scratch(target)
    tmp = Path(tempfile.mkdtemp(prefix=SCRATCH.format(name=target.name, pid=os.getpid()), dir=target.parent))
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def remove_stale_scratch(target: Path) -> list[Path]:
    """Delete the scratch directories of ``target`` left by processes that no longer run; returns them."""
    prefix = f".{target.name}.scratch-"
    removed = []
    for entry in target.parent.glob(prefix + "*"):
        pid = entry.name[len(prefix) :].split("-", 1)[0]
        if entry.is_dir() and pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
