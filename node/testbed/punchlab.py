"""A punching lab in the testbed: public reachability servers, a relay, and fresh NAT-bound peers per attempt.

Shared by the testbed tests (tests/testbed/test_punch.py) and `moeswarm bench paths`. Each attempt builds fresh
endpoints (fresh sockets, so fresh NAT mappings) for the two peers: each checks its reachability, they open a QUIC
connection through the relay, then the initiator punches.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Coroutine
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from p2p.identity import Identity, PeerId
from p2p.nat.holepunch_edge import PathManager
from p2p.nat.paths import PathState
from p2p.nat.reachability import NatKind, ReachabilityConfig
from p2p.nat.reachability_edge import ReachabilityService
from p2p.nat.traversal import NatTraversal
from p2p.quic.endpoint import Endpoint
from relay.client import Backoff, RelayClient, attach
from relay.server import RelayServer

from .netns import Testbed, in_netns

QUIC_PORT = 4433
RELAY_PORT = 8080
PUBLIC = ("pub-bootstrap", "pub-relay", "pub-worker", "backbone")
CONFIG = ReachabilityConfig(probe_wait=1.0)


async def echo(peer: PeerId, data: bytes) -> bytes:
    return data


class NetnsLoop:
    """An asyncio event loop on a thread inside one namespace: sockets it opens live there."""

    def __init__(self, tb: Testbed, role: str) -> None:
        self.role = role
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=in_netns, args=(tb.netns(role), self.loop.run_forever), daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 60.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


@dataclass
class NatNode:
    """One peer under test: endpoint, NAT traversal (reachability + path manager) and relay link, one UDP socket."""

    endpoint: Endpoint
    nat: NatTraversal
    link: RelayClient
    relay_address: Any

    @property
    def peer(self) -> PeerId:
        return self.endpoint.peer_id

    @property
    def reach(self) -> ReachabilityService:
        return self.nat.reach

    @property
    def manager(self) -> PathManager:
        assert self.nat.manager is not None
        return self.nat.manager

    async def close(self) -> None:
        await self.nat.close()
        await self.link.close()
        await self.endpoint.close()


async def make_node(relay_url: str, publics: list[tuple[PeerId, tuple[str, int]]]) -> NatNode:
    identity = Identity.generate()
    endpoint = await Endpoint.bind(identity, "0.0.0.0", 0, handler=echo, idle_timeout=10)
    nat = NatTraversal(endpoint, identity, helpers=lambda: publics, config=CONFIG)
    link = RelayClient(identity, relay_url, backoff=Backoff(first=0.05, cap=0.5))
    path = attach(endpoint, link)
    link.start()
    await link.wait_connected(10)
    nat.attach_relay(link, initiate=False)
    return NatNode(endpoint, nat, link, path.address)


@contextmanager
def punch_lab(rtt_ms: float = 0.0):
    """The testbed with a relay and four public reachability servers; yields (testbed, loops, relay url, publics)."""
    with Testbed(rtt_ms=rtt_ms, routers=("cone", "symmetric", "cone")) as tb:
        loops = {role: NetnsLoop(tb, role) for role in (*PUBLIC, "worker-a", "worker-b", "worker-c")}
        servers: list[tuple[Endpoint, NatTraversal]] = []
        relay = RelayServer(Identity.generate())
        try:
            loops["pub-relay"].run(relay.start("0.0.0.0", RELAY_PORT))
            identities = {role: Identity.generate() for role in PUBLIC}
            publics = [(identities[r].peer_id, (tb.addr(r), QUIC_PORT)) for r in PUBLIC]

            async def serve(identity: Identity) -> tuple[Endpoint, NatTraversal]:
                endpoint = await Endpoint.bind(identity, "0.0.0.0", QUIC_PORT, handler=echo)
                return endpoint, NatTraversal(endpoint, identity, helpers=lambda: publics, config=CONFIG)

            servers = [loops[r].run(serve(identities[r])) for r in PUBLIC]
            yield tb, loops, f"ws://{tb.addr('pub-relay')}:{RELAY_PORT}/relay", publics
        finally:
            for role, (endpoint, service) in zip(PUBLIC, servers):
                loops[role].run(service.close())
                loops[role].run(endpoint.close())
            loops["pub-relay"].run(relay.close())
            for loop in loops.values():
                loop.stop()


def attempt(swarm, initiator_role: str, responder_role: str) -> tuple[NatKind, NatKind, PathState, bool, float]:
    """Fresh nodes in both roles: check reachability, connect through the relay, punch.
    Returns (kinds, final path state, direct request ok, seconds from the punch start to a settled path)."""
    tb, loops, url, publics = swarm
    li, lr = loops[initiator_role], loops[responder_role]
    a, b = li.run(make_node(url, publics)), lr.run(make_node(url, publics))
    try:
        ka = asyncio.run_coroutine_threadsafe(a.reach.check(), li.loop)
        kb = asyncio.run_coroutine_threadsafe(b.reach.check(), lr.loop)
        kind_a, kind_b = ka.result(30).kind, kb.result(30).kind
        li.run(a.endpoint.request(a.relay_address(b.peer), b.peer, b"relayed", timeout=10))

        async def punch() -> tuple[PathState, bool, float]:
            t0 = time.monotonic()
            a.manager.upgrade(b.peer)
            state = await a.manager.wait_settled(b.peer, 20)
            took = time.monotonic() - t0
            if state is not PathState.DIRECT:
                return state, False, took
            direct = a.endpoint.connections()[b.peer]
            ok = await a.endpoint.request(a.relay_address(b.peer), b.peer, b"direct", timeout=10) == b"direct"
            return state, ok and direct in b.reach.verdict.addresses, took

        state, ok, took = li.run(punch())
        return kind_a, kind_b, state, ok, took
    finally:
        li.run(a.close())
        lr.run(b.close())
