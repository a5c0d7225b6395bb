"""Finding reachability helpers: the public nodes that answer ``p2p.nat.reachability`` probes, as the DHT lists them.

Why the DHT, with a record of its own (``records.HelperRecord``). A node needs at least three helpers at different
IPs: two observers (one mapping seen from two IPs tells cone from symmetric) and a third that the dial-back server
names, which the node has never sent to. Bootstrap nodes, relays and public workers each bind a QUIC (UDP) socket
that answers probes and announce it under the well-known helper slot; the record is signed by the helper (its
frames are signed by the same key, so a wrong address in a record only costs an unanswered probe, never a false
verdict), expires on its own (a dead helper drops out within a TTL) and is withdrawn on a clean shutdown. Every
node that answers dial-backs needs the list too, to pick the third peer, so the same directory serves both sides.

DHT work stays off the hot path: ``HelperDirectory`` refreshes a cached list in the background (often while it
knows fewer than ``enough`` helpers, rarely after) and ``peers()`` only reads the cache.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from typing import Protocol

import structlog

from p2p.dht.records import HelperRecord
from p2p.identity import Identity, PeerId
from p2p.nat.envelope import Address
from p2p.nat.reachability import ReachabilityConfig, Verdict
from p2p.nat.traversal import NatTraversal
from p2p.nat.udp_edge import is_ip
from p2p.quic.endpoint import Endpoint

log = structlog.get_logger("p2p.nat.helpers")

ENOUGH = 3  # two observers and a dial-back helper, at three IPs


class HelperSource(Protocol):
    async def lookup_helpers(self) -> list[HelperRecord]: ...


def helper_peers(records: Iterable[HelperRecord], me: PeerId, now: float) -> list[tuple[PeerId, Address]]:
    """The helpers we may ask, from raw records: live, not us, at an IP literal (no DNS on the probe path); one per
    peer (the newest); newest first, so a helper that just restarted is asked before one that may be gone."""
    newest: dict[PeerId, HelperRecord] = {}
    for record in records:
        held = newest.get(record.peer_id)
        if held is None or (record.seq, record.expires_at) > (held.seq, held.expires_at):
            newest[record.peer_id] = record
    live = [r for r in newest.values() if r.peer_id != me and r.is_live(now) and is_ip(r.address()[0])]
    return [(r.peer_id, r.address()) for r in sorted(live, key=lambda r: r.issued_at, reverse=True)]


def distinct_ips(peers: Sequence[tuple[PeerId, Address]]) -> int:
    return len({addr[0] for _, addr in peers})


class HelperDirectory:
    """The helpers ``source`` (e.g. ``LibP2PDiscovery``) lists, kept fresh in the background (every ``fast``
    seconds while fewer than ``enough`` IPs are known, for at most ``fast_for`` seconds; else every ``slow``);
    ``peers()`` is what ``ReachabilityService(peers=...)`` wants. ``extra`` helpers (known otherwise) are always
    included."""

    def __init__(
        self,
        source: HelperSource,
        me: PeerId,
        *,
        extra: Sequence[tuple[PeerId, Address]] = (),
        enough: int = ENOUGH,
        fast: float = 2.0,
        fast_for: float = 60.0,
        slow: float = 60.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._source = source
        self._me = me
        self._extra = list(extra)
        self._enough, self._fast, self._fast_for, self._slow = enough, fast, fast_for, slow
        self._clock = clock  # unix seconds, as in the records
        self._known: list[tuple[PeerId, Address]] = []
        self._loop = asyncio.get_running_loop()
        self._updated = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def peers(self) -> list[tuple[PeerId, Address]]:
        known = {peer for peer, _ in self._known}
        return [*self._known, *((p, a) for p, a in self._extra if p not in known and p != self._me)]

    def start(self) -> None:
        if self._task is None:
            self._task = self._loop.create_task(self._refresh_forever())

    async def refresh(self) -> list[tuple[PeerId, Address]]:
        """Look the helpers up now."""
        peers = helper_peers(await self._source.lookup_helpers(), self._me, self._clock())
        if {p for p, _ in peers} != {p for p, _ in self._known}:
            log.debug("helpers.updated", helpers=[f"{a[0]}:{a[1]}" for _, a in peers])
        self._known = peers
        self._updated.set()
        return self.peers()

    async def wait_enough(self, timeout: float) -> list[tuple[PeerId, Address]]:
        """The helpers once ``enough`` distinct IPs are known, or whatever is known after ``timeout`` seconds."""
        self.start()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                while distinct_ips(self.peers()) < self._enough:
                    self._updated.clear()
                    await self._updated.wait()
        return self.peers()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _refresh_forever(self) -> None:
        started = self._loop.time()
        while True:
            try:
                await self.refresh()
            except Exception as exc:  # a failed lookup keeps the cached list; logged, retried soon
                log.warning("helpers.lookup_failed", error=repr(exc))
            few = distinct_ips(self.peers()) < self._enough
            eager = few and self._loop.time() - started < self._fast_for  # a small swarm must not poll forever
            await asyncio.sleep(self._fast if eager else self._slow)


class HelperBoard(HelperSource, Protocol):
    async def announce_helper(self, quic_addr: str | None) -> None: ...


def helper_address(host: str, port: int) -> str | None:
    """The address to announce for a socket bound at (host, port): None for a wildcard or a name (others could
    not send to it)."""
    if not is_ip(host) or ipaddress.ip_address(host).is_unspecified:
        return None
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class NodeReachability:
    """NAT traversal on ``endpoint`` with the helpers ``board`` (the DHT) lists, and this node's own helper
    record: ``announce(addr)`` once the node knows it is publicly reachable at ``addr``; ``close()`` withdraws it."""

    def __init__(
        self, endpoint: Endpoint, board: HelperBoard, *, config: ReachabilityConfig = ReachabilityConfig(), recheck: float = 300.0
    ) -> None:
        self.board = board
        self.directory = HelperDirectory(board, endpoint.peer_id)
        self.nat = NatTraversal(endpoint, endpoint.identity, helpers=self.directory.peers, config=config, recheck=recheck)
        self.announced: str | None = None

    def start(self) -> None:
        """Start following the helper list (once the board is running)."""
        self.directory.start()

    async def check(self, *, wait_helpers: float = 15.0) -> Verdict:
        """Our verdict, once enough helpers are known (or ``wait_helpers`` seconds passed); then keep it fresh."""
        await self.directory.wait_enough(wait_helpers)
        verdict = await self.nat.check()
        self.nat.reach.start()
        return verdict

    async def announce(self, quic_addr: str | None) -> None:
        """Announce this node as a helper at ``quic_addr``; None withdraws an earlier announcement (no longer public)."""
        if quic_addr != self.announced:
            await self.board.announce_helper(quic_addr)
            self.announced = quic_addr

    async def close(self) -> None:
        if self.announced is not None:
            try:
                await asyncio.wait_for(self.board.announce_helper(None), 10)
            except Exception as exc:  # shutdown goes on; the record expires on its own
                log.warning("helpers.withdraw_failed", error=repr(exc))
            self.announced = None
        await self.nat.close()
        await self.directory.close()


@contextlib.asynccontextmanager
async def serve_helper(identity: Identity, board: HelperBoard, host: str, port: int) -> AsyncIterator[str | None]:
    """Answer reachability probes on a UDP (QUIC) socket at (host, port) and announce it as a helper in the DHT;
    yields the announced address (None for a wildcard host: nobody could be told where to send)."""
    endpoint = await Endpoint.bind(identity, host, port, handler=None)
    reach = NodeReachability(endpoint, board)
    try:
        reach.start()
        quic = helper_address(host, endpoint.local_addr[1])
        if quic is None:
            log.warning("helpers.not_announced", host=host, reason="a wildcard or a name: listen on this node's public IP")
        await reach.announce(quic)
        yield quic
    finally:
        await reach.close()
        await endpoint.close()
