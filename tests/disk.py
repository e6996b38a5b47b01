"""Disk hygiene for the fixtures of the real models: their checkpoints and engines take GBs, and a CI machine may
have only a few GB free (a slow run died of ENOSPC on 2026-12-06 when every module's folders stayed to the end)."""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def scratch_dir(factory: pytest.TempPathFactory, name: str) -> Iterator[Path]:
    """A ``factory.mktemp(name)`` folder removed when the block ends, for a module-scoped fixture of the real models.

    Their checkpoints and engines take GBs (the slow suite wrote 12 GB when each module's stayed to the session's
    end) and a CI machine may have a few GB of disk free: each module's go when the module is done."""
    root = factory.mktemp(name)
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)
