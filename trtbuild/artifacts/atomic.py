"""Atomic output directories: write into a temporary sibling, rename into place only when complete.

A failed or killed stage therefore never leaves a half-written ``-o`` directory behind.
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
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)  # mkdtemp makes 0700; the finished directory gets the usual permissions
    try:
        yield tmp
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
