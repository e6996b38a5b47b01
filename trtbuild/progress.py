"""One progress bar for every long command (quantize's calibration, run --input, eval, bench).

On a terminal it redraws one stderr line, ``desc  12/64 [###.......] 3.1 sample/s, 0:13 left``, at most ten times
a second and clears it when done; when stderr is not a terminal, or the command prints JSON, it prints nothing.
A bar can also show the rate of another quantity than the one it counts (``run --input`` counts requests and
shows tokens/s: ``generating  3/200 [.......] 412.5 tok/s, 0:31 left``).
Standard library only: the runtime commands use it, and the runtime does not depend on tqdm.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import TextIO, TypeVar

T = TypeVar("T")
BAR_WIDTH = 24
REDRAW_S = 0.1


def interactive(stream: TextIO | None = None) -> bool:
    """Whether ``stream`` (default: stderr) is a terminal, where a progress bar belongs."""
    stream = sys.stderr if stream is None else stream
    return bool(getattr(stream, "isatty", lambda: False)())


class StatusLine:
    """One terminal line redrawn in place (the bars and status lines here share it): ``draw(text)`` overwrites it,
    padding over what a longer text left, ``clear()`` erases it. ``stream`` None: stderr, looked up at each write."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self._stream = stream
        self._width = 0  # of the text on the line now (0: the line is clear)

    def draw(self, text: str) -> None:
        if not text:
            self.clear()
            return
        out = sys.stderr if self._stream is None else self._stream
        out.write("\r" + text + " " * max(0, self._width - len(text)))
        out.flush()
        self._width = len(text)

    def clear(self) -> None:
        if self._width:
            out = sys.stderr if self._stream is None else self._stream
            out.write("\r" + " " * self._width + "\r")
            out.flush()
            self._width = 0


class Progress:
    """A progress bar over ``total`` units; ``update(n)`` as work completes, ``close()`` (or ``with``) at the end.

    ``enabled=None`` shows it when stderr is a terminal; False never shows it (``--json``, ``--quiet``). With a
    ``work_unit`` the rate shown is of that quantity, which ``update(work=..., work_left=...)`` reports (the amount
    so far, and at most how much is left): the estimate is then the sooner of ``work_left`` at that rate and the
    counted units left at theirs. ``update(0)`` draws the bar before any unit completes.
    """

    def __init__(
        self, total: int, desc: str, unit: str = "it", *, enabled: bool | None = None, work_unit: str | None = None
    ) -> None:
        self.total, self.desc, self.unit, self.work_unit = total, desc, unit, work_unit
        self.enabled = interactive() if enabled is None else enabled
        self.count = 0
        self.work = 0.0  # of work_unit, so far
        self.work_left: float | None = None  # of work_unit, at most
        self._start = time.perf_counter()
        self._drawn = 0.0
        self._line = StatusLine()

    def update(self, n: int = 1, *, work: float | None = None, work_left: float | None = None) -> None:
        self.count += n
        if work is not None:
            self.work = work
        if work_left is not None:
            self.work_left = work_left
        now = time.perf_counter()
        if self.enabled and (now - self._drawn >= REDRAW_S or self.count >= self.total):
            self._drawn = now
            self._line.draw(self.line(now - self._start))

    def line(self, elapsed: float) -> str:
        """The bar's text after ``elapsed`` seconds: count, bar, rate and the estimated time left."""
        frac = min(1.0, self.count / self.total) if self.total else 1.0
        filled = int(frac * BAR_WIDTH)
        rate = self.count / elapsed if elapsed > 0 else 0.0
        estimates = [(self.total - self.count) / rate] if rate > 0 else []
        shown = f"{rate:.2f} {self.unit}/s"
        if self.work_unit is not None:
            work_rate = self.work / elapsed if elapsed > 0 else 0.0
            shown = f"{work_rate:.1f} {self.work_unit}/s"
            if self.work_left is not None and work_rate > 0:
                estimates.append(self.work_left / work_rate)
        eta = f", {clock(min(estimates))} left" if estimates else ""
        bar = "#" * filled + "." * (BAR_WIDTH - filled)
        return f"{self.desc}  {self.count}/{self.total} [{bar}] {shown}{eta}"

    def close(self) -> None:
        """Clear the bar's line (the command prints its own summary)."""
        self._line.clear()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def progress(
    items: Iterable[T], total: int, desc: str, unit: str = "it", *, enabled: bool | None = None
) -> Iterator[T]:
    """``items``, advancing a ``Progress`` bar by one per item."""
    with Progress(total, desc, unit, enabled=enabled) as bar:
        for item in items:
            yield item
            bar.update()


def clock(seconds: float) -> str:
    """``m:ss`` (``h:mm:ss`` from an hour)."""
    s = int(seconds + 0.5)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


class Elapsed:
    """A status line for work that cannot count its steps (building an engine, converting a model): ``desc  0:12``
    redrawn every ``interval`` seconds on a terminal by a background thread, cleared when the ``with`` block ends.

    ``enabled=None`` shows it when stderr is a terminal; False never does (``--json``, ``--quiet``).
    """

    def __init__(self, desc: str, *, enabled: bool | None = None, interval: float = 0.5) -> None:
        import threading

        self.desc, self.interval = desc, interval
        self.enabled = interactive() if enabled is None else enabled
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="elapsed", daemon=True)
        self._line = StatusLine()

    def _loop(self) -> None:
        start = time.perf_counter()
        while not self._stop.wait(self.interval):
            self._line.draw(f"{self.desc}  {clock(time.perf_counter() - start)}")

    def __enter__(self) -> Elapsed:
        if self.enabled:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.enabled:
            self._stop.set()
            self._thread.join()
            self._line.clear()
