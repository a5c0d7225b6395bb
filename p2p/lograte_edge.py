"""A structlog logger whose events a remote peer can trigger, with :class:`p2p.lograte.EventRate` in front of it.

``ThrottledLog(log).warning("relay.evicted", remote=...)`` logs the first few of an interval as usual and counts the
rest; once the interval has ended, one ``log.suppressed`` line at the same level says how many were left out
(``of=relay.evicted suppressed=1037 seconds=10.0``). In an asyncio loop a timer (``loop.call_at``) writes that
summary when the interval ends even if the flood stopped; without a running loop (libp2p's trio thread) it comes
with the event's next occurrence, or from :meth:`ThrottledLog.flush`. A lock makes one instance safe to share
between threads (a module's logger used by two DHT nodes of one test process).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

from p2p.lograte import DEFAULT_BURST, DEFAULT_INTERVAL, EventRate, Summary

SUMMARY_EVENT = "log.suppressed"


class ThrottledLog:
    """``debug``/``info``/``warning``/``error`` as structlog's, each event name rate-limited (see the module docstring)."""

    def __init__(self, log: Any, interval: float = DEFAULT_INTERVAL, burst: int = DEFAULT_BURST, *, clock: Callable[[], float] | None = None) -> None:
        self.log = log
        self.rate = EventRate(interval, burst)
        self._clock = clock
        self._levels: dict[str, str] = {}  # the level each event was last logged at, for its summary
        self._timer: asyncio.TimerHandle | None = None
        self._timer_loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.RLock()  # flush runs inside _emit, hence reentrant

    # ``per``: a few distinct causes of one event (an enum's value) each get their own window, summarised as
    # ``of=EVENT/PER``, so a flood of one cause cannot hide the first line of another.
    def debug(self, event: str, *, per: str = "", **fields: Any) -> None:
        self._emit("debug", event, per, fields)

    def info(self, event: str, *, per: str = "", **fields: Any) -> None:
        self._emit("info", event, per, fields)

    def warning(self, event: str, *, per: str = "", **fields: Any) -> None:
        self._emit("warning", event, per, fields)

    def error(self, event: str, *, per: str = "", **fields: Any) -> None:
        self._emit("error", event, per, fields)

    def flush(self) -> None:
        """Write the summaries of every interval that has ended."""
        with self._lock:
            self._write(self.rate.due(self._now()))

    def close(self) -> None:
        """Write every pending summary now and stop the timer (the owner is shutting down)."""
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            self._write(self.rate.drain(self._now()))

    def _write(self, summaries: list[Summary]) -> None:
        for s in summaries:
            getattr(self.log, self._levels.get(s.key, "info"))(SUMMARY_EVENT, of=s.key, suppressed=s.suppressed, seconds=s.seconds)

    def _emit(self, level: str, event: str, per: str, fields: dict[str, Any]) -> None:
        key = f"{event}/{per}" if per else event
        with self._lock:
            self.flush()
            self._levels[key] = level
            if self.rate.admit(key, self._now()):
                getattr(self.log, level)(event, **fields)
            self._arm()

    def _now(self) -> float:
        if self._clock is not None:
            return self._clock()
        try:
            return asyncio.get_running_loop().time()
        except RuntimeError:
            return time.monotonic()

    def _arm(self) -> None:
        """Set the timer for the next summary, in the running loop if there is one (else the next event writes it);
        one timer at a time, replaced when it belongs to another loop (a module's logger outlives ``asyncio.run``)."""
        when = self.rate.next_due()
        if when is None or self._clock is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        if self._timer is not None and self._timer_loop is loop:
            return
        self._timer, self._timer_loop = loop.call_at(when, self._on_timer), loop

    def _on_timer(self) -> None:
        with self._lock:
            self._timer = None
            self.flush()
            self._arm()
