"""The lookup side of eclipse resistance: which announced hosts a backbone uses (policy sans-IO, plus a thin adapter).

Theory of operation
  A DHT answer is whatever signed records its providers hold; signing one costs nothing, serving costs a
  worker. So a backbone uses a host only once it has shown it is one:

  * **verified**: it answered a QUIC Ping on the address its record announces (the QUIC handshake proves the
    peer id there is the one that signed), within ``reverify_after`` seconds; or
  * **served**: dispatches to it succeeded (the dispatcher's count, injected as ``served``).

  Unverified hosts are pinged — at most ``max_probes`` per lookup, spread over networks first, a failed one
  again only after a backoff — and join the answer only once they answered. Incumbents go first (hosts that
  served, then the longest verified), so a newly verified host fills free room and never displaces one that
  works; the answer holds at most ``per_group`` hosts per network of their QUIC address (/24, /48; loopback
  per port, so tests on 127.0.0.1 see each worker as its own network) and ``max_hosts`` in all.

  Ties among equals break on a keyed hash of the peer id with a per-node random ``salt``: a sybil cannot grind
  identities that sort first everywhere.

``HostVetting`` is the policy (the clock a parameter); ``VettedDiscovery`` wraps a ``Discovery`` and runs the
probes; ``ping_probe`` is the probe over a ``p2p.connector.Connector``.
"""

from __future__ import annotations

import asyncio
import hashlib
import secrets
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import structlog

from experts.errors import RemoteProtocolError
from p2p.backoff import Backoff
from p2p.connector import Connector
from p2p.dht.discovery import Discovery
from p2p.dht.records import HostedSlice, HostRecord
from p2p.dht.slots import address_group
from p2p.identity import PeerId
from p2p.lograte_edge import ThrottledLog
from p2p.quic.errors import TransportError
from p2p.wire import messages as wire

log = structlog.get_logger(__name__)

PER_GROUP = 4  # hosts of one (model, layer) answered from one network
MAX_HOSTS = 32  # hosts of one (model, layer) answered at all
MAX_PROBES = 16  # unverified hosts pinged per lookup
PROBE_TIMEOUT = 1.0  # seconds a ping may take (a worker answers in milliseconds; a WAN round trip is < 0.5 s)
REVERIFY_AFTER = 600.0  # a host that answered a ping but never served is pinged again after this
RETRY = Backoff(first=30.0, cap=600.0)  # after a failed ping: no second ping for this long, doubling
MAX_STANDING = 4096  # peers whose ping outcome is remembered; past it, failed ones whose backoff ran out go first

Probe = Callable[[HostRecord], Awaitable[None]]  # returns once the host answered; raises why not


class ProbeFailed(RemoteProtocolError):
    """The host answered a ping with something else than its pong."""


def host_group(hosted: HostedSlice, peer: PeerId) -> str:
    """The network of a host's QUIC address; a relay-only host or a DNS name counts as its own network."""
    if hosted.quic_addr is None:
        return f"relayed/{peer}"
    host, _, port = hosted.quic_addr.rpartition(":")
    try:
        return address_group(host, port)
    except ValueError:
        return f"name/{host.lower()}"


@dataclass
class _Standing:
    verified_at: float | None = None
    failures: int = 0
    retry_at: float = 0.0


@dataclass(frozen=True)
class Selection:
    accepted: list[HostRecord]  # the lookup answer, sorted by peer id
    to_probe: list[HostRecord]  # hosts worth a ping now


@dataclass
class HostVetting:
    """Per-peer standing (verified when, failed how often) and the selection rule of the module docstring."""

    per_group: int = PER_GROUP
    max_hosts: int = MAX_HOSTS
    max_probes: int = MAX_PROBES
    reverify_after: float = REVERIFY_AFTER
    retry: Backoff = RETRY
    salt: bytes = field(default_factory=lambda: secrets.token_bytes(16))
    _standing: dict[PeerId, _Standing] = field(default_factory=dict)

    def select(self, records: Sequence[HostRecord], served: Callable[[PeerId], int], now: float) -> Selection:
        trusted: list[HostRecord] = []
        untrusted: list[HostRecord] = []
        for record in records:
            (trusted if served(record.peer_id) > 0 or self._verified(record.peer_id, now) else untrusted).append(record)

        def rank(r: HostRecord) -> tuple:
            verified_at = self._standing[r.peer_id].verified_at if r.peer_id in self._standing else None
            return (-served(r.peer_id), verified_at if verified_at is not None else now, self._tiebreak(r.peer_id))

        counts: dict[str, int] = {}
        accepted: list[HostRecord] = []
        for record in sorted(trusted, key=rank):
            group = host_group(record.hosted, record.peer_id)
            if counts.get(group, 0) < self.per_group and len(accepted) < self.max_hosts:
                counts[group] = counts.get(group, 0) + 1
                accepted.append(record)
        room = self.max_hosts > len(accepted)
        due = [
            r
            for r in untrusted
            if room
            and counts.get(host_group(r.hosted, r.peer_id), 0) < self.per_group
            and self._standing.get(r.peer_id, _Standing()).retry_at <= now
        ]
        probes: list[HostRecord] = []
        per_network = dict(counts)
        for record in sorted(due, key=lambda r: (counts.get(host_group(r.hosted, r.peer_id), 0), self._tiebreak(r.peer_id))):
            group = host_group(record.hosted, record.peer_id)
            if len(probes) < self.max_probes and per_network.get(group, 0) < self.per_group:
                per_network[group] = per_network.get(group, 0) + 1
                probes.append(record)
        return Selection(sorted(accepted, key=lambda r: r.peer_id), probes)

    def probed(self, peer: PeerId, answered: bool, now: float) -> None:
        """Record a ping's outcome."""
        standing = self._standing.setdefault(peer, _Standing())
        if answered:
            standing.verified_at, standing.failures, standing.retry_at = now, 0, 0.0
        else:
            standing.verified_at = None
            standing.retry_at = now + self.retry.delay(standing.failures)
            standing.failures += 1
        if len(self._standing) > MAX_STANDING:
            self._standing = {p: s for p, s in self._standing.items() if s.verified_at is not None or s.retry_at > now}

    def _verified(self, peer: PeerId, now: float) -> bool:
        standing = self._standing.get(peer)
        return bool(standing and standing.verified_at is not None and now - standing.verified_at < self.reverify_after)

    def _tiebreak(self, peer: PeerId) -> bytes:
        return hashlib.blake2b(peer.raw, key=self.salt, digest_size=8).digest()


class VettedDiscovery:
    """A Discovery whose lookups answer only vetted hosts (``HostVetting``), pinging new ones with ``probe``.

    ``served`` is read on every lookup: the backbone hands in its dispatch counts once its dispatcher exists.
    """

    def __init__(
        self,
        inner: Discovery,
        probe: Probe,
        *,
        vetting: HostVetting | None = None,
        served: Callable[[PeerId], int] = lambda peer: 0,
        pinged: Callable[[PeerId, float], None] = lambda peer, rtt_ms: None,
        probe_timeout: float = PROBE_TIMEOUT,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._inner, self._probe, self._probe_timeout, self._clock = inner, probe, probe_timeout, clock
        self.vetting = vetting if vetting is not None else HostVetting()
        self._peer_log = ThrottledLog(log)  # sybils that never answer: a few lines per interval, then a count
        self.served = served
        self.pinged = pinged  # told each answered ping's round trip

    async def announce(self, slices: Sequence[HostedSlice]) -> None:
        await self._inner.announce(slices)

    async def withdraw(self) -> None:
        await self._inner.withdraw()

    async def lookup(self, model_digest: str, layer: int, *, fresh: bool = False) -> list[HostRecord]:
        records = await self._inner.lookup(model_digest, layer, fresh=fresh)
        selection = self.vetting.select(records, self.served, self._clock())
        if selection.to_probe:
            await asyncio.gather(*(self._ping(r) for r in selection.to_probe))
            selection = self.vetting.select(records, self.served, self._clock())
        return selection.accepted

    async def announced(self, model_digest: str, layer: int) -> list[HostRecord]:
        """Every live host the DHT lists for (model, layer), vetted or not, from the network: what a caller waiting
        for workers to announce counts (a host that cannot be reached is still computed around, not waited on)."""
        return await self._inner.lookup(model_digest, layer, fresh=True)

    async def close(self) -> None:
        await self._inner.close()

    async def _ping(self, record: HostRecord) -> None:
        """Ping one host and record the outcome (concurrent lookups of a layer may both ping it: harmless)."""
        started = time.perf_counter()
        try:
            async with asyncio.timeout(self._probe_timeout):
                await self._probe(record)
        except (TransportError, RemoteProtocolError, TimeoutError) as exc:
            self._peer_log.info("discovery.host_unverified", peer=str(record.peer_id), addr=record.hosted.quic_addr, error=repr(exc))
            self.vetting.probed(record.peer_id, False, self._clock())
            return
        rtt_ms = (time.perf_counter() - started) * 1e3
        log.debug("discovery.host_verified", peer=str(record.peer_id), addr=record.hosted.quic_addr, rtt_ms=round(rtt_ms, 3))
        self.vetting.probed(record.peer_id, True, self._clock())
        self.pinged(record.peer_id, rtt_ms)


def ping_probe(connector: Connector, clock: Callable[[], float] = time.time) -> Probe:
    """A probe that sends a host a ``wire.Ping`` by whichever path its record announces and wants its ``Pong``."""

    async def probe(record: HostRecord) -> None:
        h = record.hosted
        direct = None
        if h.quic_addr is not None:
            host, _, port = h.quic_addr.rpartition(":")
            direct = (host.strip("[]"), int(port))
        ping = wire.Ping(secrets.randbits(64), int(clock() * 1e6))
        reply = await connector.request(record.peer_id, direct, h.relay, ping.encode(), timeout=PROBE_TIMEOUT)
        if wire.decode(reply.data) != wire.Pong.answering(ping):
            raise ProbeFailed(f"{record.peer_id} answered a ping with something else than its pong")

    return probe
