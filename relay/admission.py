"""Which WebSocket connections the relay keeps when it is full: sans-IO, no clock needed (order is enough).

Theory of operation. Two caps: ``max_clients`` connections in all and ``max_per_ip`` from one remote IP (0: no
per-IP cap). A connection is *pending* until its client proves a peer id (the session's ``Authenticated``), and a
pending one is closed anyway after the session's auth deadline. When a newcomer would exceed a cap, the oldest
pending connection in that cap's scope (the same IP, or anyone) is evicted to make room; only when that scope holds
authenticated connections alone is the newcomer refused (HTTP 503). So idle unauthenticated connections, from
one IP or many, cannot keep a real client out: each newcomer displaces the stalest of them, and a real client
authenticates within a round trip. Keys are opaque (the server passes its per-connection record).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass


@dataclass(frozen=True)
class Verdict:
    """``admit`` True: take the newcomer, after closing ``evict`` (pending connections, oldest first). False:
    refuse it, because ``reason``."""

    admit: bool
    evict: tuple[Hashable, ...] = ()
    reason: str = ""


class Admission:
    """The relay's open connections by IP and authentication; see the module docstring."""

    def __init__(self, max_clients: int, max_per_ip: int) -> None:
        if max_clients < 1 or max_per_ip < 0:
            raise ValueError("max_clients must be >= 1 and max_per_ip >= 0 (0: no per-IP cap)")
        self.max_clients = max_clients
        self.max_per_ip = max_per_ip
        self._ip: dict[Hashable, str] = {}  # every open connection, oldest first (dicts keep insertion order)
        self._pending: dict[Hashable, None] = {}  # not yet authenticated, oldest first
        self._per_ip: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._ip)

    def from_ip(self, ip: str) -> int:
        return self._per_ip.get(ip, 0)

    def check(self, ip: str) -> Verdict:
        """What ``open`` would do for a newcomer from ``ip``, changing nothing (e.g. to answer 503 before the
        WebSocket handshake)."""
        evict: list[Hashable] = []
        if self.max_per_ip and self.from_ip(ip) >= self.max_per_ip:
            victim = next((k for k in self._pending if self._ip[k] == ip), None)
            if victim is None:
                return Verdict(False, reason=f"{self.from_ip(ip)} connections from {ip} (limit {self.max_per_ip})")
            evict.append(victim)
        if len(self._ip) - len(evict) >= self.max_clients:
            victim = next((k for k in self._pending if k not in evict), None)
            if victim is None:
                return Verdict(False, reason=f"relay full: {len(self._ip)} authenticated connections")
            evict.append(victim)
        return Verdict(True, tuple(evict))

    def open(self, key: Hashable, ip: str) -> Verdict:
        """Admit ``key`` (pending) from ``ip`` if ``check`` allows it, forgetting the connections it evicts (the
        caller closes them)."""
        verdict = self.check(ip)
        if verdict.admit:
            for victim in verdict.evict:
                self.close(victim)
            self._ip[key] = ip
            self._pending[key] = None
            self._per_ip[ip] = self.from_ip(ip) + 1
        return verdict

    def authenticated(self, key: Hashable) -> None:
        """``key`` proved a peer id: it is never evicted for a newcomer."""
        self._pending.pop(key, None)

    def close(self, key: Hashable) -> None:
        """``key`` is gone (or evicted); unknown keys are ignored."""
        ip = self._ip.pop(key, None)
        if ip is None:
            return
        self._pending.pop(key, None)
        if (left := self._per_ip[ip] - 1) > 0:
            self._per_ip[ip] = left
        else:
            del self._per_ip[ip]
