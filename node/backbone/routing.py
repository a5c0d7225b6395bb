"""Which host answers for which experts: replica choice by measured RTT, load and health (sans-IO).

The backbone turns the DHT's host records for a layer into a :class:`Partition`
(the announced expert ranges, plus local groups for any gap) and, per group, an
ordered list of candidate hosts. Scores come from round trips the backbone itself
measured; a host that failed is benched with exponential backoff so dispatch
does not keep paying its timeout.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from experts.moe import Partition
from p2p.backoff import Backoff
from p2p.identity import PeerId
from p2p.pathkind import Path
from p2p.records import HostRecord, RelayAddress

LEAVING_S = 60.0  # longer than a drain (withdraw, then finish within its deadline); a worker restarted under the same key is used again after it
DEFAULT_RTT_MS = 50.0  # prior for a host never measured: tried, but after measured fast ones
EWMA = 0.2
BENCH = Backoff(first=1.0, cap=60.0)  # seconds a failed host gets no work, doubling per consecutive failure
SIMILAR_RTT = 1.25  # replicas whose expected waits differ by less than this factor compete on price


def scarcity_price(base: int, live_replicas: int) -> int:
    """A worker's announced price per work unit: its base price, raised when few others host the same slice.

    price = base * (1 + 1/n) rounded up, n = live hosts of the slice including this one: a sole host
    asks double, one of two asks 1.5x, and the premium fades as replicas join.
    """
    n = max(live_replicas, 1)
    return -(-base * (n + 1) // n)


@dataclass
class HostHealth:
    rtt_ms: float | None = None
    inflight: int = 0
    failures: int = 0
    benched_until: float = 0.0
    banned_until: float = 0.0  # caught returning wrong answers: no work at all until then
    dispatches: int = 0

    def score(self) -> float:
        """Expected wait: RTT inflated by requests already queued on that host."""
        return (self.rtt_ms if self.rtt_ms is not None else DEFAULT_RTT_MS) * (1 + self.inflight)


@dataclass(frozen=True)
class Host:
    peer_id: PeerId
    addr: tuple[str, int] | None  # direct QUIC address; None: reachable through its relay only (NAT-bound)
    ranges: tuple[tuple[int, int], ...]
    price: int
    relay: RelayAddress | None = None
    kernel: str = ""  # the worker's kernel identity from its record: its sums are bit-comparable with ours if equal

    @property
    def path(self) -> Path:
        """Path policy: publicly reachable hosts are dialled directly, NAT-bound ones through their relay."""
        return Path.DIRECT if self.addr is not None else Path.RELAY

    @classmethod
    def from_record(cls, r: HostRecord) -> Host | None:
        addr = None
        if r.hosted.quic_addr is not None:
            host, _, port = r.hosted.quic_addr.rpartition(":")
            addr = (host.strip("[]"), int(port))
        elif r.hosted.relay is None:
            return None
        return cls(r.peer_id, addr, r.hosted.expert_ranges, r.hosted.price, r.hosted.relay, r.hosted.kernel)

    def covers(self, start: int, stop: int) -> bool:
        return any(a <= start and stop <= b for a, b in self.ranges)


@dataclass
class LayerRoute:
    partition: Partition
    hosts: list[list[Host]]  # per group, every host that can answer for it (unordered)


@dataclass
class Router:
    """Per-layer partitions and candidates, and per-host health, fed by lookups and dispatch results."""

    n_expert: int
    max_price: int | None = None  # hosts asking more per work unit are never used
    routes: dict[int, LayerRoute] = field(default_factory=dict)
    health: dict[PeerId, HostHealth] = field(default_factory=dict)

    def update(self, layer: int, records: list[HostRecord]) -> LayerRoute:
        hosts = [h for h in (Host.from_record(r) for r in records) if h is not None]
        if self.max_price is not None:
            hosts = [h for h in hosts if h.price <= self.max_price]
        part = Partition.covering([rg for h in hosts for rg in h.ranges], self.n_expert)
        route = LayerRoute(part, [[h for h in hosts if h.covers(a, b)] for a, b in part.bounds])
        self.routes[layer] = route
        for h in hosts:
            self.health.setdefault(h.peer_id, HostHealth())
        return route

    def candidates(self, layer: int, group: int, now: float, prefer: PeerId | None = None) -> list[Host]:
        """Hosts to try for a group, best first; benched hosts only when nothing else is left.

        *prefer* (slot affinity: the host a session used before) goes first while it is ready.
        """
        hosts = [h for h in self.routes[layer].hosts[group] if self.health[h.peer_id].banned_until <= now]
        ready = [h for h in hosts if self.health[h.peer_id].benched_until <= now]
        benched = [h for h in hosts if h not in ready]
        best = min((self.health[h.peer_id].score() for h in hosts), default=1.0)

        def key(h: Host) -> tuple:
            score = self.health[h.peer_id].score()
            return (score > best * SIMILAR_RTT, h.price, score, h.peer_id)

        return sorted(ready, key=lambda h: (h.peer_id != prefer, *key(h))) + sorted(benched, key=key)

    def expected_ms(self, layer: int, group: int, now: float) -> float:
        """Expected round trip of a group's dispatch: its best candidate's measured RTT (0 if nobody can take it)."""
        best = next(iter(self.candidates(layer, group, now)), None)
        return self.health[best.peer_id].score() if best else 0.0

    def started(self, peer: PeerId) -> None:
        self.health[peer].inflight += 1

    def succeeded(self, peer: PeerId, rtt_ms: float) -> None:
        h = self.health[peer]
        h.inflight -= 1
        h.failures = 0
        h.benched_until = 0.0
        h.dispatches += 1
        h.rtt_ms = rtt_ms if h.rtt_ms is None else (1 - EWMA) * h.rtt_ms + EWMA * rtt_ms

    def ban(self, peer: PeerId, now: float, seconds: float) -> None:
        """Give *peer* no work for *seconds* (a spot check caught it)."""
        h = self.health[peer]
        h.banned_until = max(h.banned_until, now + seconds)

    def leaving(self, peer: PeerId, now: float) -> None:
        """*peer* refused because it is draining (shutting down): no work for ``LEAVING_S``, no failure counted."""
        h = self.health[peer]
        h.inflight -= 1
        h.banned_until = max(h.banned_until, now + LEAVING_S)

    def failed(self, peer: PeerId, now: float) -> float:
        """Bench the host; returns for how long (doubling per consecutive failure)."""
        h = self.health[peer]
        h.inflight -= 1
        h.failures += 1
        wait = BENCH.delay(h.failures - 1)
        h.benched_until = now + wait
        return wait
