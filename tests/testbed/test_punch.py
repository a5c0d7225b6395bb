"""Reachability and hole punching through real NATs (network namespaces, iptables MASQUERADE; root only).

Topology (node/testbed): four public hosts, worker-a and worker-c behind cone routers, worker-b behind a symmetric
router. pub-relay runs the WebSocket relay; every public host runs a reachability server on its QUIC socket. Each
attempt builds fresh endpoints (fresh sockets, so fresh NAT mappings) for the two peers under test: each checks its
reachability, they open a QUIC connection through the relay, then the initiator punches. Set
MOESWARM_PUNCH_ATTEMPTS to run more attempts per pair (the report's counts use 20) and MOESWARM_PUNCH_RTT_MS to add
WAN latency (RTT between any two hosts across the WAN).
"""

from __future__ import annotations

import os

import pytest

from node.testbed.punchlab import attempt, make_node, punch_lab
from p2p.nat.paths import PathState
from p2p.nat.reachability import NatKind

from .conftest import why_no_testbed

pytestmark = [pytest.mark.skipif(why_no_testbed() is not None, reason=why_no_testbed() or ""), pytest.mark.timeout(600)]

ATTEMPTS = int(os.environ.get("MOESWARM_PUNCH_ATTEMPTS", "5"))
RTT_MS = float(os.environ.get("MOESWARM_PUNCH_RTT_MS", "0"))


@pytest.fixture(scope="module")
def swarm():
    with punch_lab(RTT_MS) as lab:
        yield lab


def run_attempts(swarm, initiator: str, responder: str) -> list[tuple[NatKind, NatKind, PathState, bool]]:
    results = [attempt(swarm, initiator, responder)[:4] for _ in range(ATTEMPTS)]
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
        for kind_a, kind_b, state, ok in [attempt(swarm, initiator, responder)[:4] for _ in range(2)]:
            assert NatKind.SYMMETRIC in (kind_a, kind_b)
            assert state is PathState.RELAY and not ok
