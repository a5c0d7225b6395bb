"""Churn-proof routing without sockets: benched hosts only probed, demotion, RTT-derived deadlines, route refresh."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from experts.embedded import EMBEDDED_MODEL
from experts.gguf_model import GGUFModel
from experts.slices import ExpertStore
from node.backbone import routing
from node.backbone.dispatch import RemoteMoE
from node.backbone.routing import DEADLINE_FLOOR_S, DEADLINE_K, DEADLINE_MARGIN_S, DEMOTE_AFTER, Router
from node.cli import options
from p2p.dht.discovery import InMemoryBoard, InMemoryDiscovery
from p2p.dht.records import HostedSlice, HostRecord, RelayAddress
from p2p.identity import Identity
from tests.support import async_until

DIGEST = "ab" * 32


def record(ident: Identity, ranges, port: int) -> HostRecord:
    return HostRecord(ident.peer_id, HostedSlice(DIGEST, 0, tuple(ranges), quic_addr=f"127.0.0.1:{port}"), 1000, 2000, 1)


def answered(router: Router, peer, rtt_ms: float = 5.0, compute_ms: float = 2.0, n_tokens: int = 1) -> None:
    router.started(peer)
    router.succeeded(peer, rtt_ms, compute_ms, n_tokens)


def timed_out(router: Router, peer, now: float) -> float:
    router.started(peer)
    return router.failed(peer, now, timed_out=True)


def peers(hosts) -> list:
    return [h.peer_id for h in hosts]


def test_a_benched_sole_host_is_never_asked_only_probed_once_per_bench():
    """The only host of a group fails: the plan asks nobody (local compute), probes it once its bench ends, one probe
    at a time, and an answer to the probe makes it the host asked again."""
    a = Identity.generate()
    router = Router(n_expert=8)
    route = router.update(0, [record(a, [(0, 8)], 1)])
    assert peers(router.plan(route, 0, now=0.0).ask) == [a.peer_id]
    router.started(a.peer_id)
    assert router.failed(a.peer_id, now=10.0) == 1.0
    assert router.plan(route, 0, now=10.5) == routing.Plan((), ())  # benched: neither asked nor probed yet
    due = router.plan(route, 0, now=11.0)
    assert due.ask == () and peers(due.probe) == [a.peer_id]
    assert router.plan(route, 0, now=11.1).probe == ()  # its probe is still in flight
    answered(router, a.peer_id)
    assert peers(router.plan(route, 0, now=11.2).ask) == [a.peer_id] and router.health[a.peer_id].state(11.2) == "ready"


def test_a_failed_probe_doubles_the_wait_and_a_replica_takes_the_work():
    """While one replica is benched the other is asked; each failed probe pushes the next one out (1 s, 2 s, 4 s)."""
    a, b = Identity.generate(), Identity.generate()
    router = Router(n_expert=8)
    route = router.update(0, [record(a, [(0, 8)], 1), record(b, [(0, 8)], 2)])
    answered(router, a.peer_id, rtt_ms=1.0)
    answered(router, b.peer_id, rtt_ms=30.0)
    router.started(a.peer_id)
    waits = [router.failed(a.peer_id, now=0.0)]
    for now in (1.0, 3.0):
        plan = router.plan(route, 0, now)
        assert peers(plan.ask) == [b.peer_id] and peers(plan.probe) == [a.peer_id]
        router.started(a.peer_id)
        waits.append(router.failed(a.peer_id, now))
    assert waits == [1.0, 2.0, 4.0] and router.plan(route, 0, now=6.9).probe == ()


def test_consecutive_timeouts_demote_a_host_for_long_probe_intervals():
    """DEMOTE_AFTER timeouts in a row demote a host (an error in between restarts the count); a demoted host is probed
    every 30 s; if it answers it is asked again, but its next single timeout demotes it again, probed every 60 s."""
    a = Identity.generate()
    router = Router(n_expert=8)
    route = router.update(0, [record(a, [(0, 8)], 1)])
    timed_out(router, a.peer_id, now=0.0)
    router.started(a.peer_id)
    router.failed(a.peer_id, now=1.0)  # a refused connection, not a timeout
    now = 3.0
    for _ in range(DEMOTE_AFTER - 1):
        timed_out(router, a.peer_id, now)
        now += 10.0
    assert router.health[a.peer_id].state(now) == "benched"
    assert timed_out(router, a.peer_id, now) == 30.0
    assert router.health[a.peer_id].state(now) == "demoted"
    assert router.plan(route, 0, now + 29.0) == routing.Plan((), ())
    assert peers(router.plan(route, 0, now + 30.0).probe) == [a.peer_id]
    assert timed_out(router, a.peer_id, now + 30.0) == 30.0  # still demoted, same interval
    answered(router, a.peer_id)  # a probe came back: it is trusted again ...
    assert peers(router.plan(route, 0, now + 61.0).ask) == [a.peer_id]
    assert timed_out(router, a.peer_id, now + 61.0) == 60.0  # ... until its first timeout
    assert router.health[a.peer_id].state(now + 61.0) == "demoted" and router.health[a.peer_id].demotions == 2


def test_our_relay_link_back_ends_the_benches_and_demotions_of_the_hosts_behind_it():
    """Hosts reached only through relay R that failed while our link to R was down are probed at the next dispatch
    once that link is back (not asked before a probe answers); a direct host, a host behind another relay and a
    banned host keep their state."""
    relayed, demoted, elsewhere, direct, banned = (Identity.generate() for _ in range(5))

    def via(ident: Identity, url: str) -> HostRecord:
        return HostRecord(ident.peer_id, HostedSlice(DIGEST, 0, ((0, 8),), relay=RelayAddress(url, Identity.generate().peer_id)), 1000, 2000, 1)

    router = Router(n_expert=8)
    route = router.update(0, [via(relayed, "wss://r/relay"), via(demoted, "wss://r/relay"), via(elsewhere, "wss://q/relay"), via(banned, "wss://r/relay"), record(direct, [(0, 8)], 1)])
    for ident in (relayed, elsewhere, direct, banned):
        router.started(ident.peer_id)
        router.failed(ident.peer_id, now=0.0)
    for _ in range(DEMOTE_AFTER):
        timed_out(router, demoted.peer_id, now=0.0)
    router.ban(banned.peer_id, now=0.0, seconds=100.0)
    assert router.health[demoted.peer_id].state(0.0) == "demoted" and router.plan(route, 0, now=0.5) == routing.Plan((), ())
    assert router.relay_restored("wss://r/relay", now=0.5) == sorted([relayed.peer_id, demoted.peer_id], key=str)
    plan = router.plan(route, 0, now=0.5)
    assert plan.ask == () and set(peers(plan.probe)) == {relayed.peer_id, demoted.peer_id}
    assert router.health[demoted.peer_id].state(0.5) == "benched"
    assert router.relay_restored("wss://q/relay", now=0.6) == [elsewhere.peer_id]
    assert router.health[direct.peer_id].benched_until == 1.0 and router.health[banned.peer_id].state(0.6) == "banned"


def test_deadline_follows_the_measured_round_trip_within_floor_and_cap():
    """An unmeasured host gets the configured timeout; a measured one K x (RTT + tokens x compute) + margin, at least
    the floor, at most the configured timeout."""
    fast, slow = Identity.generate(), Identity.generate()
    router = Router(n_expert=8)
    router.update(0, [record(fast, [(0, 8)], 1), record(slow, [(0, 8)], 2)])
    assert router.deadline(fast.peer_id, 1, cap=5.0) == 5.0
    answered(router, fast.peer_id, rtt_ms=4.0, compute_ms=2.0, n_tokens=1)
    assert router.deadline(fast.peer_id, 1, cap=5.0) == DEADLINE_FLOOR_S
    answered(router, slow.peer_id, rtt_ms=100.0, compute_ms=400.0, n_tokens=2)  # 200 ms per token
    assert router.deadline(slow.peer_id, 1, cap=5.0) == pytest.approx(DEADLINE_K * 0.3 + DEADLINE_MARGIN_S)
    assert router.deadline(slow.peer_id, 50, cap=5.0) == 5.0


def test_a_refresh_adds_the_replacement_while_a_dispatch_keeps_its_own_route():
    """After the sole host failed, a refresh listing a replacement makes the plan ask it at once; the route a dispatch
    captured before the refresh is still planned as it was (its groups and tokens were split by it)."""
    old, new = Identity.generate(), Identity.generate()
    router = Router(n_expert=8)
    before = router.update(0, [record(old, [(0, 8)], 1)])
    router.started(old.peer_id)
    router.failed(old.peer_id, now=0.0, timed_out=True)
    after = router.update(0, [record(old, [(0, 4)], 1), record(new, [(4, 8)], 2)])
    assert after.partition.bounds == ((0, 4), (4, 8)) and router.routes[0] is after
    assert peers(router.plan(after, 1, now=0.1).ask) == [new.peer_id]
    assert router.plan(before, 0, now=0.1).ask == ()  # the old split: its only host is benched -> local
    assert after.peers() - before.peers() == {new.peer_id}


def test_the_cli_default_is_the_routing_default():
    """`--route-refresh`'s default (spelled out so option parsing stays light) is routing.ROUTE_REFRESH_S."""
    assert options.ROUTE_REFRESH_S == routing.ROUTE_REFRESH_S


def test_maintain_picks_up_a_host_announced_later():
    """RemoteMoE.maintain re-reads the DHT in the background: a host announced after the first lookup joins the routes."""
    model = GGUFModel(EMBEDDED_MODEL)
    layer = model.moe_layers[0]

    async def main():
        board = InMemoryBoard()
        first, later, me = Identity.generate(), Identity.generate(), Identity.generate()
        n = model.cfg.n_expert
        await InMemoryDiscovery(first, board).announce([HostedSlice(model.digest, layer, ((0, n // 2),), quic_addr="127.0.0.1:1")])
        cfg = model.cfg
        moe = RemoteMoE(SimpleNamespace(relay_listeners=[]), InMemoryDiscovery(me, board), model.digest, cfg.n_embd, cfg.n_ff_exp, n, ExpertStore(model), loop=asyncio.get_running_loop())  # type: ignore[arg-type]  # never dispatches
        await moe.refresh([layer])
        assert moe.router.routes[layer].peers() == {first.peer_id}
        task = asyncio.create_task(moe.maintain([layer], interval=0.05))
        await InMemoryDiscovery(later, board).announce([HostedSlice(model.digest, layer, ((n // 2, n),), quic_addr="127.0.0.1:2")])
        await async_until(lambda: later.peer_id in moe.router.routes[layer].peers(), timeout=10, what="the later host in the routes")
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        route = moe.router.routes[layer]
        return [peers(g) for g in route.hosts], first.peer_id, later.peer_id

    hosts, first, later = asyncio.run(main())
    assert hosts == [[first], [later]]


def test_hedge_after_is_a_multiple_of_the_predicted_round_trip():
    """A measured host is hedged after HEDGE_K x its predicted round trip (at least the floor); an unmeasured one never."""
    a = Identity.generate()
    router = Router(n_expert=8)
    router.update(0, [record(a, [(0, 8)], 1)])
    assert router.hedge_after(a.peer_id, 4) is None
    answered(router, a.peer_id, rtt_ms=10.0, compute_ms=8.0, n_tokens=4)  # 2 ms per token
    assert router.hedge_after(a.peer_id, 4) == pytest.approx(routing.HEDGE_K * 0.018)
    router.health[a.peer_id].rtt_ms = router.health[a.peer_id].compute_ms_per_token = 0.0
    assert router.hedge_after(a.peer_id, 1) == routing.HEDGE_FLOOR_S


def test_a_pinged_host_never_dispatched_to_gets_the_floor_deadline_not_the_cap():
    """A host the vetting ping measured (5 ms) and that never answered a dispatch: with the compute prior of a
    backbone holding the experts, a short dispatch waits DEADLINE_FLOOR_S, a long prefill up to the cap; without the
    prior (remote experts only) or without a ping, the cap. A measured dispatch then replaces the ping's RTT."""
    a = Identity.generate()
    router = Router(n_expert=8)
    router.update(0, [record(a, [(0, 8)], 1)])
    assert router.deadline(a.peer_id, 4, cap=30.0) == 30.0  # never pinged, never measured
    router.pinged(a.peer_id, 5.0)
    assert router.deadline(a.peer_id, 4, cap=30.0) == 30.0  # no prior: a remote-experts-only backbone waits
    router.unmeasured_compute_ms = routing.UNMEASURED_COMPUTE_MS
    assert router.deadline(a.peer_id, 4, cap=30.0) == DEADLINE_FLOOR_S
    assert router.deadline(a.peer_id, 5000, cap=30.0) == 30.0  # a long prefill keeps the cap
    answered(router, a.peer_id, rtt_ms=100.0, compute_ms=400.0, n_tokens=4)
    router.pinged(a.peer_id, 1.0)  # a later ping does not overwrite what dispatches measured
    assert router.health[a.peer_id].rtt_ms == 100.0
    assert router.deadline(a.peer_id, 4, cap=30.0) == pytest.approx(DEADLINE_K * (0.1 + 0.4) + DEADLINE_MARGIN_S)


def test_a_busy_answer_to_a_probe_leaves_the_host_probed_again_not_stuck():
    """A benched host whose probe is refused OVERLOADED (full, not broken) is probed again once its bench allows,
    and an OVERLOADED refusal while ready counts no failure and only ranks it after its replica for BUSY_S."""
    a, b = Identity.generate(), Identity.generate()
    router = Router(n_expert=8)
    route = router.update(0, [record(a, [(0, 8)], 1), record(b, [(0, 8)], 2)])
    answered(router, a.peer_id, rtt_ms=1.0)
    answered(router, b.peer_id, rtt_ms=30.0)
    router.started(a.peer_id)
    router.busy(a.peer_id, now=0.0)
    assert router.health[a.peer_id].failures == 0
    assert peers(router.plan(route, 0, now=0.1).ask) == [b.peer_id, a.peer_id]  # after its replica while busy
    assert peers(router.plan(route, 0, now=routing.BUSY_S).ask) == [a.peer_id, b.peer_id]  # first again after it
    router.started(a.peer_id)
    router.failed(a.peer_id, now=10.0)
    assert peers(router.plan(route, 0, now=11.0).probe) == [a.peer_id]
    router.started(a.peer_id)
    router.busy(a.peer_id, now=11.0)  # the probe's answer: OVERLOADED
    assert peers(router.plan(route, 0, now=11.0 + routing.BUSY_S).probe) == [a.peer_id]
