"""A clock that moves only when the test moves it, for the sans-IO cores that take ``clock`` or ``now``."""

from __future__ import annotations


class FakeClock:
    """Callable like ``time.time``/``time.monotonic``; returns ``now`` until the test sets or advances it."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        """Move forward by ``seconds`` and return the new time."""
        self.now += seconds
        return self.now
