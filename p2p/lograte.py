"""How often an event a remote peer can trigger may reach the log: a few in full per interval, then one summary.

Theory of operation. Anything a peer can cause at will (an evicted idle connection, a refused record, a bad request
body) must not cost one log line each: 1,100 idle relay upgrades wrote 1,037 warnings in 0.4 s, which fills a disk
and buries the lines that matter. :class:`EventRate` counts occurrences per key (an event name) in fixed windows of
``interval`` seconds: the first ``burst`` of a window are logged as they come (so a lone event keeps its detail, such
as the peer's address), the rest only counted; when a window that suppressed something has ended, :meth:`due` hands
back one :class:`Summary` ("1,037 more in the last 10 s"), and the next window starts with the next occurrence.

Pure: the caller passes ``now``; :mod:`p2p.lograte_edge` puts it in front of a structlog logger with a timer. Keys
are the caller's event names, a fixed set in the code, but :attr:`EventRate.max_keys` bounds them anyway (the oldest
window is summarised early when a new key would exceed it).
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_INTERVAL = 10.0  # seconds of one window
DEFAULT_BURST = 3  # occurrences per window logged in full


@dataclass(frozen=True)
class Summary:
    """``suppressed`` occurrences of ``key`` were not logged in the ``seconds`` since its window opened."""

    key: str
    suppressed: int
    seconds: float


@dataclass
class _Window:
    opened: float
    seen: int = 0


class EventRate:
    """Per-key windows of ``interval`` seconds, the first ``burst`` occurrences of each logged; see the module docstring."""

    def __init__(self, interval: float = DEFAULT_INTERVAL, burst: int = DEFAULT_BURST, max_keys: int = 256) -> None:
        if interval <= 0 or burst < 0 or max_keys < 1:
            raise ValueError("interval must be > 0, burst >= 0 and max_keys >= 1")
        self.interval, self.burst, self.max_keys = interval, burst, max_keys
        self._windows: dict[str, _Window] = {}  # oldest window first
        self._early: list[Summary] = []  # windows closed early to make room for a new key

    def admit(self, key: str, now: float) -> bool:
        """Count one occurrence of ``key`` at ``now``; True when it should be logged in full (call :meth:`due` first, so
        a window that ended is summarised before a new one opens)."""
        window = self._windows.get(key)
        if window is None or now - window.opened >= self.interval:
            if window is not None:  # ended and summarised (or suppressed nothing): a fresh window
                self._close(key, window, now)
            window = self._windows[key] = _Window(now)
            if len(self._windows) > self.max_keys:
                oldest = next(iter(self._windows))
                self._close(oldest, self._windows.pop(oldest), now)
        window.seen += 1
        return window.seen <= self.burst

    def due(self, now: float) -> list[Summary]:
        """The summaries of every window that ended by ``now`` having suppressed something (each handed out once)."""
        out, self._early = self._early, []
        for key, window in list(self._windows.items()):
            if now - window.opened >= self.interval:
                del self._windows[key]
                out.extend(self._summary(key, window, now))
        return out

    def drain(self, now: float) -> list[Summary]:
        """Every pending summary, ended windows or not (at shutdown, so no count is lost); forgets every window."""
        out = self.due(now)
        for key, window in self._windows.items():
            out.extend(self._summary(key, window, now))
        self._windows.clear()
        return out

    def next_due(self) -> float | None:
        """When the earliest window holding suppressed occurrences ends (None: none does), for the caller's timer."""
        if self._early:
            return 0.0
        return min((w.opened + self.interval for w in self._windows.values() if w.seen > self.burst), default=None)

    def _close(self, key: str, window: _Window, now: float) -> None:
        self._windows.pop(key, None)
        self._early.extend(self._summary(key, window, now))

    def _summary(self, key: str, window: _Window, now: float) -> list[Summary]:
        suppressed = window.seen - self.burst
        return [Summary(key, suppressed, round(min(now - window.opened, self.interval), 3))] if suppressed > 0 else []
