"""An in-memory datagram network for the sans-IO NAT cores: hosts, home routers (``Nat``) and a hand-moved clock.

Unit tests put reachability and hole-punch cores on it as nodes: anything with ``deliver(data, src, now)``,
``timer()`` and ``fire(now)``. ``Net.run(until)`` delivers datagrams and fires timers in time order, so a whole
exchange across NATs runs in memory, deterministically, with no socket and no sleep.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

Address = tuple[str, int]


class Node(Protocol):
    """What a host on the network is: it takes datagrams and has at most one timer."""

    def deliver(self, data: bytes, src: Any, now: float) -> None: ...

    def timer(self) -> float | None: ...

    def fire(self, now: float) -> None: ...


@dataclass
class Nat:
    """A home router: ``symmetric`` maps each destination to its own port, else one port per socket; inbound passes
    only from an address the inside has sent to (address-and-port-dependent filtering)."""

    public_ip: str
    symmetric: bool = False
    ports: dict = field(default_factory=dict)  # (inside, dst or None) -> public port
    inside: dict = field(default_factory=dict)  # public port -> inside address
    allowed: set = field(default_factory=set)  # (public port, remote address)
    _next: itertools.count = field(default_factory=lambda: itertools.count(40000))

    def outbound(self, src: Address, dst: Address) -> Address:
        key = (src, dst if self.symmetric else None)
        if key not in self.ports:
            self.ports[key] = port = next(self._next)
            self.inside[port] = src
        port = self.ports[key]
        self.allowed.add((port, dst))
        return self.public_ip, port

    def inbound(self, port: int, src: Address) -> Address | None:
        return self.inside.get(port) if (port, src) in self.allowed else None


class Net:
    """Datagrams between hosts (some behind a ``Nat``) with fixed latency and a hand-moved clock."""

    def __init__(self, latency: float = 0.01) -> None:
        self.now = 0.0
        self.latency = latency
        self.nodes: dict[Address, Node] = {}
        self.nat_of: dict[Address, Nat | None] = {}
        self.nats: dict[str, Nat] = {}
        self.drop: Callable[[Address, Address, bytes], bool] = lambda src, dst, data: False
        self.delivered = 0
        self._queue: list = []
        self._seq = itertools.count()

    def add(self, addr: Address, node: Node, nat: Nat | None = None) -> None:
        self.nodes[addr] = node
        self.nat_of[addr] = nat
        if nat is not None:
            self.nats[nat.public_ip] = nat

    def send(self, src: Address, dst: Address, data: bytes) -> None:
        nat = self.nat_of[src]
        seen = nat.outbound(src, dst) if nat else src
        if self.drop(seen, dst, data):
            return
        target = self.nats[dst[0]].inbound(dst[1], seen) if dst[0] in self.nats else dst
        if target in self.nodes:
            heapq.heappush(self._queue, (self.now + self.latency, next(self._seq), target, seen, data))

    def deliver_later(self, target: Address, src: object, data: bytes, delay: float) -> None:
        """Hand ``data`` to the node at ``target`` after ``delay``, bypassing NATs (a relay, a test double)."""
        heapq.heappush(self._queue, (self.now + delay, next(self._seq), target, src, data))

    def run(self, until: float) -> None:
        """Deliver datagrams and fire node timers in time order up to ``until``."""
        while True:
            timers = [(t, addr) for addr, node in self.nodes.items() if (t := node.timer()) is not None]
            next_timer: tuple[float, Address | None] = min(timers, default=(float("inf"), None))
            next_packet = self._queue[0][0] if self._queue else float("inf")
            at = min(next_timer[0], next_packet)
            if at > until:
                self.now = until
                return
            self.now = max(self.now, at)
            if next_packet <= next_timer[0]:
                _, _, target, seen, data = heapq.heappop(self._queue)
                self.delivered += 1
                self.nodes[target].deliver(data, seen, self.now)
            else:
                assert next_timer[1] is not None  # a finite next_timer came from a node
                self.nodes[next_timer[1]].fire(self.now)
