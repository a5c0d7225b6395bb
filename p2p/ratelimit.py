"""Token buckets: the relay's per-session byte and packet budgets and the NAT protocols' per-source limits.

``TokenBucket`` is one budget (``rate`` tokens per second, at most ``burst`` saved up, starts full);
``RateLimiter`` keeps one bucket per key (a peer, an IP) and forgets the least recently used past ``max_keys``, so a
flood of spoofed sources cannot grow it. Pure: the caller passes ``now``.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass


@dataclass
class TokenBucket:
    """``rate`` tokens per second, at most ``burst`` saved up; starts full."""

    rate: float
    burst: float
    tokens: float
    updated: float

    @classmethod
    def full(cls, rate: float, burst: float, now: float) -> TokenBucket:
        return cls(rate, burst, burst, now)

    def refill(self, now: float) -> None:
        if now > self.updated:
            self.tokens = min(self.burst, self.tokens + (now - self.updated) * self.rate)
            self.updated = now

    def take(self, n: float, now: float) -> bool:
        """Refill to ``now``, then spend ``n`` tokens if there are that many (else spend nothing)."""
        self.refill(now)
        if self.tokens < n:
            return False
        self.tokens -= n
        return True

    def borrow(self, n: float, now: float) -> float:
        """Refill to ``now``, then spend ``n`` tokens, going into debt if need be (so a cost larger than the burst
        still goes, later); the seconds until that debt is paid (0: none)."""
        self.refill(now)
        self.tokens -= n
        return max(0.0, -self.tokens / self.rate)


class RateLimiter:
    """Token buckets by key (``rate`` per second, up to ``burst``), at most ``max_keys`` remembered (LRU)."""

    def __init__(self, rate: float, burst: float, max_keys: int = 4096) -> None:
        self.rate, self.burst, self.max_keys = rate, burst, max_keys
        self._buckets: collections.OrderedDict[object, TokenBucket] = collections.OrderedDict()

    def allow(self, key: object, now: float) -> bool:
        """Spend one token of ``key``'s bucket (a new key starts full); False when it has none."""
        bucket = self._buckets.pop(key, None) or TokenBucket.full(self.rate, self.burst, now)
        allowed = bucket.take(1.0, now)
        self._buckets[key] = bucket
        if len(self._buckets) > self.max_keys:
            self._buckets.popitem(last=False)
        return allowed
