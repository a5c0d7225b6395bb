"""Reachability and hole punching through real NATs (network namespaces, iptables MASQUERADE; root only).

Topology (node/testbed): four public hosts, worker-a and worker-c behind cone routers, worker-b behind a symmetric
router. pub-relay runs the WebSocket relay; every public host runs a reachability server on its QUIC socket. Each
attempt builds fresh endpoints (fresh sockets, so fresh NAT mappings) for the two peers under test: each checks its
reachability, they open a QUIC connection through the relay, then the initiator punches. Set
MOESWARM_PUNCH_ATTEMPTS to run more attempts per pair (the report's counts use 20) and MOESWARM_PUNCH_RTT_MS to add
WAN latency (RTT between any two hosts across the WAN).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import threading
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

import pytest

from node.testbed import Testbed, in_netns
from p2p.holepunch import HolePunch
from p2p.holepunch_edge import PathManager
from p2p.identity import Identity, PeerId
from p2p.paths import PathState
from p2p.quic import Endpoint
from p2p.reachability import NatKind, Reachability, ReachabilityConfig
from p2p.reachability_edge import ReachabilityService
from p2p.udp_edge import EndpointTap
from relay.client import Backoff, RelayClient, attach
from relay.server import RelayServer


def _why_skip() -> str | None:
    if os.geteuid() != 0:
        return "the testbed needs root (network namespaces, iptables); CI runs as root"
    for tool in ("ip", "iptables", "iptables-restore"):
        if shutil.which(tool) is None:
            return f"the testbed needs `{tool}` (apt-get install -y iproute2 iptables)"
    return None


pytestmark = [pytest.mark.skipif(_why_skip() is not None, reason=_why_skip() or ""), pytest.mark.timeout(600)]

ATTEMPTS = int(os.environ.get("MOESWARM_PUNCH_ATTEMPTS", "5"))
RTT_MS = float(os.environ.get("MOESWARM_PUNCH_RTT_MS", "0"))
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
    """One peer under test: endpoint, reachability, relay link and path manager, all on one UDP socket."""

    endpoint: Endpoint
    reach: ReachabilityService
    link: RelayClient
    manager: PathManager
    relay_address: Any

    @property
    def peer(self) -> PeerId:
        return self.endpoint.peer_id

    async def close(self) -> None:
        await self.manager.close()
        await self.reach.close()
        await self.link.close()
        await self.endpoint.close()


async def make_node(relay_url: str, publics: list[tuple[PeerId, tuple[str, int]]]) -> NatNode:
    identity = Identity.generate()
    endpoint = await Endpoint.bind(identity, "0.0.0.0", 0, handler=echo, idle_timeout=10)
    tap = EndpointTap(endpoint)
    reach = ReachabilityService(tap, Reachability(identity, CONFIG), peers=lambda: publics)
    link = RelayClient(identity, relay_url, backoff=Backoff(first=0.05, cap=0.5))
    path = attach(endpoint, link)
    link.start()
    await link.wait_connected(10)
    manager = PathManager(tap, link, HolePunch(identity), verdict=lambda: reach.verdict, auto=False)
    return NatNode(endpoint, reach, link, manager, path.address)


@pytest.fixture(scope="module")
def swarm():
    """The testbed with a relay and four public reachability servers; yields (testbed, loops, relay url, publics)."""
    with Testbed(rtt_ms=RTT_MS, routers=("cone", "symmetric", "cone")) as tb:
        loops = {role: NetnsLoop(tb, role) for role in (*PUBLIC, "worker-a", "worker-b", "worker-c")}
        servers: list[tuple[Endpoint, ReachabilityService]] = []
        relay = RelayServer(Identity.generate())
        try:
            loops["pub-relay"].run(relay.start("0.0.0.0", RELAY_PORT))
            identities = {role: Identity.generate() for role in PUBLIC}
            publics = [(identities[r].peer_id, (tb.addr(r), QUIC_PORT)) for r in PUBLIC]

            async def serve(identity: Identity) -> tuple[Endpoint, ReachabilityService]:
                endpoint = await Endpoint.bind(identity, "0.0.0.0", QUIC_PORT, handler=echo)
                reach = Reachability(identity, CONFIG)
                return endpoint, ReachabilityService(EndpointTap(endpoint), reach, peers=lambda: publics)

            servers = [loops[r].run(serve(identities[r])) for r in PUBLIC]
            yield tb, loops, f"ws://{tb.addr('pub-relay')}:{RELAY_PORT}/relay", publics
        finally:
            for role, (endpoint, service) in zip(PUBLIC, servers):
                loops[role].run(service.close())
                loops[role].run(endpoint.close())
            loops["pub-relay"].run(relay.close())
            for loop in loops.values():
                loop.stop()


def attempt(swarm, initiator_role: str, responder_role: str) -> tuple[NatKind, NatKind, PathState, bool]:
    """Fresh nodes in both roles: check reachability, connect through the relay, punch. (kinds, state, request ok)."""
    tb, loops, url, publics = swarm
    li, lr = loops[initiator_role], loops[responder_role]
    a, b = li.run(make_node(url, publics)), lr.run(make_node(url, publics))
    try:
        ka = asyncio.run_coroutine_threadsafe(a.reach.check(), li.loop)
        kb = asyncio.run_coroutine_threadsafe(b.reach.check(), lr.loop)
        kind_a, kind_b = ka.result(30).kind, kb.result(30).kind
        li.run(a.endpoint.request(a.relay_address(b.peer), b.peer, b"relayed", timeout=10))

        async def punch() -> tuple[PathState, bool]:
            a.manager.upgrade(b.peer)
            state = await a.manager.wait_settled(b.peer, 20)
            if state is not PathState.DIRECT:
                return state, False
            direct = a.endpoint.connections()[b.peer]
            ok = await a.endpoint.request(a.relay_address(b.peer), b.peer, b"direct", timeout=10) == b"direct"
            return state, ok and direct in b.reach.verdict.addresses

        state, ok = li.run(punch())
        return kind_a, kind_b, state, ok
    finally:
        li.run(a.close())
        lr.run(b.close())


def run_attempts(swarm, initiator: str, responder: str) -> list[tuple[NatKind, NatKind, PathState, bool]]:
    results = [attempt(swarm, initiator, responder) for _ in range(ATTEMPTS)]
    direct = sum(state is PathState.DIRECT and ok for _, _, state, ok in results)
    print(f"\n{initiator} -> {responder}: {direct}/{len(results)} direct, kinds {sorted({r[:2] for r in results})}")
    return results


def test_reachability_verdicts_match_the_routers(swarm):
    """worker-a (cone) is NAT, worker-b (symmetric) is SYMMETRIC, a host on the WAN is PUBLIC."""
    tb, loops, url, publics = swarm
    verdicts = {}
    for role in ("worker-a", "worker-b", "pub-worker"):
        node = loops[role].run(make_node(url, publics))
        try:
            verdicts[role] = loops[role].run(node.reach.check())
        finally:
            loops[role].run(node.close())
    assert verdicts["worker-a"].kind is NatKind.NAT, verdicts["worker-a"].reason
    assert verdicts["worker-a"].addresses[0][0] == tb.addr("router-a")
    assert verdicts["worker-b"].kind is NatKind.SYMMETRIC, verdicts["worker-b"].reason
    assert verdicts["pub-worker"].kind is NatKind.PUBLIC, verdicts["pub-worker"].reason


def test_punch_cone_to_public_goes_direct(swarm):
    """worker-a behind a cone NAT punches to a public peer: every attempt ends with a direct QUIC connection."""
    results = run_attempts(swarm, "worker-a", "pub-worker")
    assert all(r == (NatKind.NAT, NatKind.PUBLIC, PathState.DIRECT, True) for r in results), results


def test_punch_cone_to_cone_goes_direct(swarm):
    """worker-a and worker-c, behind two cone NATs, punch through both: every attempt ends direct."""
    results = run_attempts(swarm, "worker-a", "worker-c")
    assert all(r == (NatKind.NAT, NatKind.NAT, PathState.DIRECT, True) for r in results), results


def test_punch_with_the_symmetric_nat_is_skipped(swarm):
    """With worker-b (symmetric) on either side no punch is tried: both stay on the relay."""
    for initiator, responder in (("worker-a", "worker-b"), ("worker-b", "worker-a")):
        for kind_a, kind_b, state, ok in [attempt(swarm, initiator, responder) for _ in range(2)]:
            assert NatKind.SYMMETRIC in (kind_a, kind_b)
            assert state is PathState.RELAY and not ok
