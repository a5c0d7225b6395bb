"""Exponential backoff: the one formula behind every "wait longer after each failure" in the swarm.

Relay reconnection, hole-punch retries, benching a failed host, banning a worker a spot check caught and the NAT
probe's retransmission timeout all wait ``first * factor**n`` (capped at ``cap``) before attempt ``n``; only their
constants differ, and each caller keeps its own as a ``Backoff`` value. Pure: randomness is a parameter.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from experts.errors import LocalProtocolError

MAX_EXPONENT = 64  # far past every cap; keeps ``factor**n`` finite however many failures pile up


@dataclass(frozen=True)
class Backoff:
    """``first * factor**n`` capped at ``cap`` for attempt ``n`` (0 = the first wait).

    With ``jitter`` j > 0 each delay is scaled by a random factor in [1 - j, 1], so that peers cut off together do
    not come back together. ``stable_after``: a run (a connection, a direct path) that lasted this long was no
    failure, and the caller restarts its count (see ``lasted``).
    """

    first: float
    cap: float = math.inf
    factor: float = 2.0
    jitter: float = 0.0
    stable_after: float = math.inf

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        """The wait before retry number ``attempt`` (0-based); ``rng`` is required when ``jitter`` is set."""
        nominal = min(self.cap, self.first * self.factor ** max(0, min(attempt, MAX_EXPONENT)))
        if not self.jitter:
            return nominal
        if rng is None:
            raise LocalProtocolError("a jittered Backoff needs an rng")
        return nominal * rng.uniform(1.0 - self.jitter, 1.0)

    def lasted(self, seconds: float) -> bool:
        """Whether a run of ``seconds`` was long enough to reset the failure count."""
        return seconds >= self.stable_after
