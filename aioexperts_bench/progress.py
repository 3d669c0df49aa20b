"""Progress on stderr: a bar on a terminal, plain periodic lines otherwise (logs, CI, pipes)."""

from __future__ import annotations

import sys
import time
from typing import TextIO

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

__all__ = ("Reporter",)


class Reporter:
    """Counts the steps of a run and shows where it is.

    Args:
        stream: where to write (stderr by default).
        interval: seconds between plain lines when ``stream`` is not a terminal.
        quiet: show nothing.
    """

    def __init__(self, stream: TextIO | None = None, *, interval: float = 5.0, quiet: bool = False) -> None:
        self.stream = stream or sys.stderr
        self.interval = interval
        self.quiet = quiet
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._bar: Progress | None = None
        self._task: TaskID | None = None
        self._total = 0
        self._done = 0
        self._last = -1e9
        self._t0 = time.perf_counter()

    def start(self, total: int) -> None:
        """Begin a run of ``total`` steps."""
        self._total, self._done = total, 0
        self._t0 = time.perf_counter()
        if self.quiet:
            return
        if self.tty:
            console = Console(file=self.stream)
            self._bar = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                console=console,
                transient=True,
            )
            self._bar.start()
            self._task = self._bar.add_task("starting", total=total)

    def step(self, text: str) -> None:
        """One more step begins: ``text`` says which (e.g. ``"round 2/5: fio"``)."""
        self._done += 1
        if self.quiet:
            return
        if self._bar is not None and self._task is not None:
            self._bar.update(self._task, description=text, completed=self._done - 1)
            return
        now = time.perf_counter()
        if now - self._last >= self.interval or self._done == 1:
            self._last = now
            elapsed = now - self._t0
            print(f"[{self._done}/{self._total}, {elapsed:.0f} s] {text}", file=self.stream, flush=True)

    def note(self, text: str) -> None:
        """A line that is always shown (above the bar on a terminal)."""
        if self.quiet:
            return
        if self._bar is not None:
            self._bar.console.print(text, markup=False, highlight=False)
        else:
            print(text, file=self.stream, flush=True)

    def stop(self) -> None:
        """End the run (removes the bar)."""
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
