"""Reachability and hole punching over real sockets on loopback: a relay, QUIC endpoints, and the NAT-traversal edges.

Loopback has no NAT, so these tests check the machinery (frames on the QUIC socket next to QUIC, relay coordination,
a new direct connection beside the relayed one, failover both ways), not NAT behaviour: that is tests/testbed.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Any

import pytest
import structlog

from p2p.identity import Identity, PeerId
from p2p.nat.holepunch import HolePunch, PunchConfig
from p2p.nat.holepunch_edge import PathManager
from p2p.nat.paths import Backoff, PathState
from p2p.nat.reachability import NatKind, Outcome, Reachability, Verdict
from p2p.nat.reachability_edge import ReachabilityService
from p2p.nat.udp_edge import EndpointTap
from p2p.quic.endpoint import Endpoint
from relay.client import Backoff as RelayBackoff
from relay.client import RelayClient, attach
from relay.server import RelayServer

pytestmark = pytest.mark.timeout(60)


def run(coro: Awaitable[Any], timeout: float = 40.0) -> Any:
    async def bounded() -> Any:
        async with asyncio.timeout(timeout):
            return await coro

    return asyncio.run(bounded())


async def echo(peer: PeerId, data: bytes) -> bytes:
    return str(peer).encode() + b"|" + data


async def until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.02)


@dataclass
class Node:
    endpoint: Endpoint
    tap: EndpointTap
    manager: PathManager
    vaddr: Callable[[PeerId], tuple[str, int]]
    verdict: Verdict

    @property
    def peer(self) -> PeerId:
        return self.endpoint.peer_id


@asynccontextmanager
async def two_nodes(
    kinds: tuple[NatKind, NatKind] = (NatKind.NAT, NatKind.NAT),
    advertise: Callable[[Endpoint], tuple[str, int]] = lambda e: e.local_addr,
    **punch: Any,
) -> AsyncIterator[tuple[Node, Node]]:
    """Two endpoints on 127.0.0.1 that reach each other through a relay, each running a PathManager (auto off)."""
    async with AsyncExitStack() as stack:
        relay = RelayServer(Identity.generate())
        await relay.start("127.0.0.1", 0)
        stack.push_async_callback(relay.close)
        nodes = []
        for kind in kinds:
            identity = Identity.generate()
            endpoint = await Endpoint.bind(identity, "127.0.0.1", 0, handler=echo, idle_timeout=5)
            stack.push_async_callback(endpoint.close)
            link = RelayClient(identity, relay.url, backoff=RelayBackoff(first=0.05, cap=0.5))
            path = attach(endpoint, link)
            link.start()
            stack.push_async_callback(link.close)
            await link.wait_connected(10)
            tap = EndpointTap(endpoint)
            verdict = Verdict(kind, (advertise(endpoint),), "loopback test")
            core = HolePunch(identity, PunchConfig(**punch), backoff=Backoff(first=30))
            manager = PathManager(tap, link, core, verdict=lambda v=verdict: v, auto=False, tick=0.1)
            stack.push_async_callback(manager.close)
            nodes.append(Node(endpoint, tap, manager, path.address, verdict))
        yield nodes[0], nodes[1]


async def relayed(a: Node, b: Node) -> None:
    """Open the relayed QUIC connection from a to b with one request."""
    assert await a.endpoint.request(a.vaddr(b.peer), b.peer, b"hi", timeout=10) == str(a.peer).encode() + b"|hi"
    assert a.endpoint.connections() == {b.peer: a.vaddr(b.peer)}


def test_punch_moves_requests_to_a_direct_connection_and_keeps_the_relayed_one():
    """After the punch both sides send requests over a new direct connection; the relayed one stays as a spare."""

    async def scenario() -> None:
        async with two_nodes() as (a, b):
            await relayed(a, b)
            with structlog.testing.capture_logs() as logs:
                a.manager.upgrade(b.peer)
                assert await a.manager.wait_settled(b.peer, 10) is PathState.DIRECT
                await until(lambda: b.manager.state(a.peer) is PathState.DIRECT)
            assert a.endpoint.connections() == {b.peer: b.endpoint.local_addr}
            assert b.endpoint.connections() == {a.peer: a.endpoint.local_addr}
            assert set(a.tap.paths(b.peer)) == {b.endpoint.local_addr, a.vaddr(b.peer)}
            assert await a.endpoint.request(a.vaddr(b.peer), b.peer, b"x", timeout=5) == str(a.peer).encode() + b"|x"
            assert await b.endpoint.request(b.vaddr(a.peer), a.peer, b"y", timeout=5) == str(b.peer).encode() + b"|y"
            upgraded = [e for e in logs if e["event"] == "path.upgraded"]
            assert {e["peer"] for e in upgraded} == {str(a.peer), str(b.peer)}

    run(scenario())


def test_a_dead_direct_connection_falls_back_to_the_relay_without_retrying():
    """Closing the direct connection downgrades both sides to the relay, requests still work, no punch is retried."""

    async def scenario() -> None:
        async with two_nodes() as (a, b):
            await relayed(a, b)
            a.manager.upgrade(b.peer)
            assert await a.manager.wait_settled(b.peer, 10) is PathState.DIRECT
            await until(lambda: b.manager.state(a.peer) is PathState.DIRECT)
            with structlog.testing.capture_logs() as logs:
                assert b.tap.close_path(a.peer, a.endpoint.local_addr, "test: the path died")
                await until(lambda: a.manager.state(b.peer) is PathState.RELAY)
                await until(lambda: b.manager.state(a.peer) is PathState.RELAY)
            assert a.endpoint.connections() == {b.peer: a.vaddr(b.peer)}
            assert await a.endpoint.request(a.vaddr(b.peer), b.peer, b"z", timeout=5) == str(a.peer).encode() + b"|z"
            down = [e for e in logs if e["event"] == "path.downgraded"]
            assert {e["peer"] for e in down} == {str(a.peer), str(b.peer)} and all(e["retry_in"] > 0 for e in down)
            a.manager.upgrade(b.peer)  # within the backoff: nothing happens (upgrade starts a punch at once, if at all)
            assert a.manager.state(b.peer) is PathState.RELAY

    run(scenario())


def test_punch_to_unreachable_addresses_fails_and_stays_on_the_relay():
    """Both sides advertise a port where nothing listens: punch_failed with a reason, requests keep using the relay."""

    async def scenario() -> None:
        async with two_nodes(advertise=lambda e: ("127.0.0.1", 9), burst=5, grace=0.3) as (a, b):
            await relayed(a, b)
            with structlog.testing.capture_logs() as logs:
                a.manager.upgrade(b.peer)
                assert await a.manager.wait_settled(b.peer, 10) is PathState.RELAY
            failed = [e for e in logs if e["event"] == "path.punch_failed" and e["peer"] == str(b.peer)]
            assert failed and "no punch packet arrived" in failed[0]["reason"]
            assert a.endpoint.connections() == {b.peer: a.vaddr(b.peer)}
            assert await a.endpoint.request(a.vaddr(b.peer), b.peer, b"r", timeout=5) == str(a.peer).encode() + b"|r"

    run(scenario())


def test_symmetric_peer_is_skipped_without_a_punch():
    """The responder is behind a symmetric NAT: it refuses, both log punch_skipped, nothing is dialled."""

    async def scenario() -> None:
        async with two_nodes(kinds=(NatKind.NAT, NatKind.SYMMETRIC)) as (a, b):
            await relayed(a, b)
            with structlog.testing.capture_logs() as logs:
                a.manager.upgrade(b.peer)
                assert await a.manager.wait_settled(b.peer, 10) is PathState.RELAY
                await until(lambda: len({e["peer"] for e in logs if e["event"] == "path.punch_skipped"}) >= 2)
            skipped = {e["peer"] for e in logs if e["event"] == "path.punch_skipped"}
            assert skipped == {str(a.peer), str(b.peer)}
            assert set(a.tap.paths(b.peer)) == {a.vaddr(b.peer)}

    run(scenario())


def test_auto_mode_upgrades_relayed_peers_by_itself():
    """With auto on, a relayed connection becomes direct with no call to upgrade()."""

    async def scenario() -> None:
        async with two_nodes() as (a, b):
            await relayed(a, b)
            a.manager.auto = b.manager.auto = True
            await until(lambda: a.endpoint.connections().get(b.peer) == b.endpoint.local_addr)
            await until(lambda: b.manager.state(a.peer) is PathState.DIRECT)

    run(scenario())


# --- reachability ---------------------------------------------------------------------------------------------------


@asynccontextmanager
async def reachability_swarm(helper_port: int | None = None, **service: Any):
    """Node A on 127.0.0.1 and public peers on 127.0.0.2-4, each running a ReachabilityService.

    The public peers name each other as dial-back helpers, at ``helper_port`` instead of the real one if given.
    """
    async with AsyncExitStack() as stack:
        endpoints = []
        for i in range(4):
            endpoint = await Endpoint.bind(Identity.generate(), f"127.0.0.{i + 1}", 0, handler=echo)
            stack.push_async_callback(endpoint.close)
            endpoints.append(endpoint)
        publics = [(e.peer_id, e.local_addr) for e in endpoints[1:]]
        named = [(p, (a[0], helper_port or a[1])) for p, a in publics]
        services = []
        for i, endpoint in enumerate(endpoints):
            peers = publics if i == 0 else named
            reach = Reachability(endpoint.identity)
            services.append(ReachabilityService(EndpointTap(endpoint), reach, peers=lambda p=peers: p, **service))
            stack.push_async_callback(services[-1].close)
        yield services[0], services[1:]


def test_reachability_on_loopback_is_public_and_quic_still_works():
    """Observers at 127.0.0.2/3 see A at its own address and the helper's probe arrives: PUBLIC; QUIC is untouched."""

    async def scenario() -> None:
        async with reachability_swarm() as (a, others):
            verdict = await a.check()
            assert verdict.kind is NatKind.PUBLIC, verdict.reason
            assert verdict.addresses == (a.tap.endpoint.local_addr,)
            assert len({o.observer_addr[0] for o in a.core.observations()}) >= 2
            peer, addr = others[0].core.peer_id, others[0].tap.endpoint.local_addr
            assert await a.tap.endpoint.request(addr, peer, b"q", timeout=5) == str(a.core.peer_id).encode() + b"|q"

    run(scenario())


def test_a_dial_back_that_never_comes_gives_nat():
    """The servers name helpers at a port where nothing listens: no probe arrives, the mapping is stable, so NAT."""

    async def scenario() -> None:
        async with reachability_swarm(helper_port=9) as (a, _):
            verdict = await a.check()
            assert verdict.kind is NatKind.NAT, verdict.reason
            assert [d.outcome for d in a.core.dial_backs()] == [Outcome.FAILED]

    run(scenario())


def test_started_service_keeps_observing_to_hold_the_mapping():
    """After start(), the service asks an observer again every refresh interval (what keeps a NAT binding open)."""

    async def scenario() -> None:
        async with reachability_swarm(refresh=0.2) as (a, _):
            a.start()
            await until(lambda: a.verdict.kind is NatKind.PUBLIC)
            first = {o.observer: o.at for o in a.core.observations()}
            await until(lambda: any(o.at > first.get(o.observer, 0) for o in a.core.observations()))

    run(scenario())
