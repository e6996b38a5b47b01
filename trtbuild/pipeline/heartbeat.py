"""The pipeline's live status line: which stages are running, for how long, and how long they took last time.

A quantize or build stage can run for minutes with nothing to print; on a terminal a background thread redraws
one stderr line every ``INTERVAL_S``::

    running: quantize smollm2/int4_awq/checkpoint 1:23 (last run 3:05) | build smollm2/fp32/onnxruntime/cpu 0:12

Report lines (stdout) are written under the same ``output_lock`` as the redraws, after a ``clear()``, so the two
never interleave. Off the terminal (CI logs, pipes) it prints nothing.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import TextIO

from ..progress import StatusLine, clock, interactive
from .plan import Stage

INTERVAL_S = 1.0


class Heartbeat:
    """The status line of the stages running now; ``previous(stage)`` is its last run's seconds, if any."""

    def __init__(
        self, previous: Callable[[Stage], float | None], output_lock: threading.Lock, stream: TextIO | None = None
    ) -> None:
        self.output_lock = output_lock  # held by whoever writes to the terminal
        self.stream = sys.stderr if stream is None else stream
        self.enabled = interactive(self.stream)
        self._previous = previous
        self._running: dict[str, tuple[Stage, float, float | None]] = {}  # id -> (stage, start, last run's seconds)
        self._lock = threading.Lock()
        self._status = StatusLine(self.stream)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def started(self, stage: Stage) -> None:
        with self._lock:
            self._running[stage.id] = (stage, time.perf_counter(), self._previous(stage))
        if self.enabled and self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="pipeline-heartbeat", daemon=True)
            self._thread.start()

    def finished(self, stage: Stage) -> None:
        with self._lock:
            self._running.pop(stage.id, None)

    def line(self, now: float | None = None) -> str:
        """The status text for the stages running at ``now`` (empty when none is)."""
        now = time.perf_counter() if now is None else now
        with self._lock:
            parts = []
            for stage, start, last in self._running.values():
                est = "" if last is None else f" (last run {clock(last)})"
                parts.append(f"{stage.kind.value} {stage.id} {clock(now - start)}{est}")
        return "running: " + " | ".join(parts) if parts else ""

    def clear(self) -> None:
        """Erase the status line (before a report line is written)."""
        self._status.clear()

    def draw(self) -> None:
        if self.enabled:
            self._status.draw(self.line())

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with self.output_lock:
            self.clear()

    def _loop(self) -> None:
        while not self._stop.wait(INTERVAL_S):
            with self.output_lock:
                self.draw()
