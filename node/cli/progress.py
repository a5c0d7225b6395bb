"""Progress bars for long CLI work (model load, slice, verify, benchmarks), drawn by tqdm on stderr.

Only a person at a terminal wants them: piped or redirected output (a log file, a test, ``--json``) gets none,
not even tqdm's plain-text fallback, so logs and machine-read output stay free of carriage returns and escape
codes. Library code takes an ``experts.moe.Progress`` callback and never draws; this module makes them.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TextIO

from tqdm import tqdm

from experts.moe import Progress


def wanted(stream: TextIO | None = None, *, as_json: bool = False) -> bool:
    """Whether to draw bars: never for ``--json`` output, else only when *stream* (default stderr) is a terminal."""
    stream = sys.stderr if stream is None else stream
    if as_json:
        return False
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


class Bars:
    """One bar per phase, called as ``bars(phase, done, total)``; a bar goes away once its phase is done, so
    what is printed next starts on a clean line."""

    def __init__(self) -> None:
        self._phase: str | None = None
        self._bar: tqdm | None = None

    def __call__(self, phase: str, done: int, total: int) -> None:
        if phase != self._phase or self._bar is None:
            self.close()
            self._phase, self._bar = phase, tqdm(desc=phase, total=total, file=sys.stderr, leave=False, dynamic_ncols=True)
        self._bar.update(done - self._bar.n)
        if done >= total:
            self.close()

    def stage(self, phase: str) -> Progress:
        """A plain ``Progress`` callback for one phase."""
        return lambda done, total: self(phase, done, total)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        self._bar = None


@contextmanager
def bars(enabled: bool) -> Iterator[Bars | None]:
    """``Bars`` when *enabled* (see ``wanted``), else None so that callers pass no callback at all."""
    if not enabled:
        yield None
        return
    shown = Bars()
    try:
        yield shown
    finally:
        shown.close()


def stage(shown: Bars | None, phase: str) -> Progress | None:
    return shown.stage(phase) if shown else None
