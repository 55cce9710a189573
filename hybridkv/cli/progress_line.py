"""A progress line for long runs: drawn on a terminal's stderr, into a pipe or a file only when
asked.

On a terminal the line is redrawn in place (carriage return, then erase to the end of the line)
at most once per ``interval`` seconds and erased when the run ends, so the command's output (on
stdout) reads the same with or without it. Anywhere else nothing is written, unless the caller
forces it (a flag such as ``hybridkv check --progress``): then each update is a plain line, so a
log that captures stderr gets the progress and no control codes.
"""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Callable
from types import TracebackType
from typing import TextIO

__all__ = ["ProgressLine"]

_ERASE = "\r\x1b[K"  # back to column 0, erase to the end of the line


class ProgressLine:
    """One self-erasing status line on ``stream`` (stderr by default), shown on a terminal only.

    Attributes:
        enabled: whether anything is written: ``stream`` is a terminal, or ``force`` was given.
        in_place: whether the line is redrawn in place (a terminal) rather than appended.
        drawn: how many times the line was drawn.
    """

    def __init__(
        self,
        stream: TextIO | None = None,
        interval: float = 1.0,
        clock: Callable[[], float] | None = None,
        *,
        force: bool = False,
    ) -> None:
        """Pre: ``interval >= 0``. Post: nothing is written until :meth:`update` is due.

        ``stream`` and ``clock`` default to ``sys.stderr`` and ``time.monotonic`` as they are
        when the line is made (so a test can stand in for either). ``force`` writes the updates
        off a terminal too, one plain line each.
        """
        self.stream = sys.stderr if stream is None else stream
        self.in_place = self.stream.isatty()
        self.enabled = self.in_place or force
        self.interval = interval
        self.clock = time.monotonic if clock is None else clock
        self.started = self.clock()
        self.drawn = 0
        self._visible = False
        self._last = self.started

    def elapsed(self) -> float:
        """Seconds since the line was created."""
        return self.clock() - self.started

    def update(self, text: str) -> None:
        """Draw ``text`` if ``interval`` seconds passed since the last draw (or the start).

        A run shorter than ``interval`` never draws. The text is cut to the terminal's width so
        it never wraps (a wrapped line cannot be erased in place).
        """
        if not self.enabled:
            return
        now = self.clock()
        if now - self._last < self.interval:
            return
        self._last = now
        self.drawn += 1
        if not self.in_place:
            self.stream.write(text + "\n")
            self.stream.flush()
            return
        width = max(shutil.get_terminal_size().columns - 1, 10)
        self.stream.write(_ERASE + text[:width])
        self.stream.flush()
        self._visible = True

    def close(self) -> None:
        """Erase the line if it was drawn. Idempotent."""
        if self._visible:
            self.stream.write(_ERASE)
            self.stream.flush()
            self._visible = False

    def __enter__(self) -> ProgressLine:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.close()
