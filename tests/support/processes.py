"""Running `moeswarm` as a real process, and waiting on node processes by what they log, never by a sleep.

Long-running nodes are started with :class:`node.launcher.Cluster` (it waits for their ready files and always stops
them); one-shot commands go through ``moeswarm``. A node's log file (``NodeProcess.log_file``) is appended to across
restarts, so ``log_offset`` marks where a restart begins and ``wait_for_log`` looks only past it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.support.polling import until

MOESWARM = [sys.executable, "-m", "node"]  # the `moeswarm` command of this checkout's interpreter, for Popen


def moeswarm(*args: str, timeout: float = 120, **kwargs) -> subprocess.CompletedProcess:
    """Run ``moeswarm ARGS`` to completion, capturing text output (``kwargs`` go to ``subprocess.run``)."""
    return subprocess.run([*MOESWARM, *args], capture_output=True, text=True, timeout=timeout, check=False, **kwargs)


def log_offset(path: Path) -> int:
    """The current size of a log file (0 if it does not exist yet): pass it as ``since`` to see only newer lines."""
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _lines(path: Path, since: int) -> list[str]:
    try:
        with path.open("rb") as f:
            f.seek(since)
            return f.read().decode(errors="replace").splitlines()
    except FileNotFoundError:
        return []


def wait_for_log(path: Path, *needles: str, timeout: float, since: int = 0, interval: float = 0.2) -> str:
    """The first line of ``path`` after byte ``since`` that contains every one of ``needles``, waiting up to
    ``timeout`` s; fails the test with the log's tail if none appears."""

    def found() -> str | None:
        return next((line for line in _lines(path, since) if all(n in line for n in needles)), None)

    try:
        line = until(found, timeout=timeout, interval=interval)
    except AssertionError:
        tail = "\n".join(_lines(path, since)[-30:])
        raise AssertionError(f"no line with {needles} in {path} after {timeout:.0f} s:\n{tail}") from None
    assert line is not None  # until returns only a truthy value
    return line
