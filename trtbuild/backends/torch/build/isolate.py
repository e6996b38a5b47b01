"""Run Python code that may crash the interpreter (load compiled code, capture CUDA graphs) in a child process.

A segmentation fault in native code cannot be caught in the process it happens in; in a child it becomes an exit
status (``-11``) and the child's last lines, which ``python3 -X faulthandler`` fills with the Python stack of the
fault. Used by the AOTInductor load check at build time (``writer.py``), ``benchmarks/aoti_probe.py`` and
``benchmarks/gpu_check.py``.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

RESULT_PREFIX = "ISOLATED-RESULT "  # a child's line carrying its JSON result (see ``report``)


@dataclass(frozen=True)
class IsolatedRun:
    """What one child process did: ``ok`` (exit status 0), ``rc`` (negative: killed by that signal, e.g. -11 for
    SIGSEGV; 124: timed out), ``seconds``, the last lines of its output (``trace``) and the JSON results it
    printed with ``report``."""

    ok: bool
    rc: int
    seconds: float
    trace: list[str]
    results: list[dict[str, Any]] = field(default_factory=list)

    def summary(self) -> str:
        """One line: the exit status and the last line of output that says something."""
        if self.ok:
            return f"ok in {self.seconds:.1f}s"
        what = {124: "timed out", -11: "segmentation fault", -6: "aborted", -9: "killed"}.get(self.rc, "failed")
        last = next((line for line in reversed(self.trace) if line.strip()), "no output")
        return f"{what} (exit status {self.rc}): {last.strip()[:300]}"


def run_isolated(
    code: str,
    *,
    args: Sequence[str] = (),
    timeout: float = 600.0,
    env: Mapping[str, str] | None = None,
    tail: int = 40,
    cwd: str | None = None,
) -> IsolatedRun:
    """Run ``code`` (a Python program; ``sys.argv[1:]`` is ``args``) in ``python -X faulthandler``.

    The child inherits this environment plus ``env``; its stdout and stderr are read together. Never raises for
    what the child does: a crash, a non-zero exit or the ``timeout`` are the returned ``IsolatedRun``.
    """
    child_env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1", **(env or {})}
    # -P: not the current folder first on sys.path (a source tree there has no trtbuild.plugins: the installed
    # package maps plugins/ into it), so the child imports what this process imports
    cmd = [sys.executable, "-X", "faulthandler", "-P", "-c", code, *args]
    start = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd, env=child_env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout, check=False
        )
        rc, out = proc.returncode, proc.stdout
    except subprocess.TimeoutExpired as e:
        rc, out = 124, e.stdout or b""
    lines = out.decode(errors="replace").splitlines()
    results = []
    for line in lines:
        if line.startswith(RESULT_PREFIX):
            with contextlib.suppress(json.JSONDecodeError):
                results.append(json.loads(line[len(RESULT_PREFIX) :]))
    trace = [line for line in lines if not line.startswith(RESULT_PREFIX)][-tail:]
    return IsolatedRun(rc == 0, rc, time.perf_counter() - start, trace, results)


def report(result: Mapping[str, Any]) -> None:
    """In a child: print ``result`` (JSON) where ``run_isolated`` collects it into ``IsolatedRun.results``."""
    print(RESULT_PREFIX + json.dumps(result, default=str), flush=True)
