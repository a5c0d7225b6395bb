"""Lookup-side vetting (p2p/dht/vetting.py): only hosts that answered a ping or served are used, incumbents first (sans-IO)."""

from __future__ import annotations

import asyncio
import hashlib

import pytest

from p2p.dht.discovery import InMemoryBoard, InMemoryDiscovery
from p2p.dht.records import HostedSlice, HostRecord, issue
from p2p.dht.vetting import HostVetting, VettedDiscovery, host_group
from p2p.identity import Identity, PeerId
from p2p.quic.errors import TransportTimeout
from tests.support import FakeClock

MODEL = hashlib.sha256(b"model-v").hexdigest()
NOW = 1_800_000_000.0
SALT = b"fixed salt......"


def record(identity: Identity, addr: str | None = "127.0.0.1:4433") -> HostRecord:
    return issue(identity, HostedSlice(MODEL, 1, ((0, 8),), quic_addr=addr), now=NOW, ttl=600, seq=1)[0]


def never_served(peer: PeerId) -> int:
    return 0


@pytest.mark.parametrize(
    ("addr", "group"),
    [
        ("203.0.113.9:4433", "203.0.113.0/24"),
        ("[2001:db8:7::1]:4433", "2001:db8:7::/48"),
        ("127.0.0.1:5001", "lo/5001"),
        ("Worker.Example:4433", "name/worker.example"),
    ],
)
def test_host_group_is_the_network_of_the_quic_address_and_loopback_counts_per_port(addr, group):
    """A host's network is its QUIC address's /24 or /48; on loopback each port is its own network."""
    assert host_group(HostedSlice(MODEL, 1, ((0, 8),), quic_addr=addr), Identity.generate().peer_id) == group


def test_unverified_hosts_are_probed_not_used_and_join_once_they_answered():
    """A fresh record is only a probe candidate; after its ping answered it is in the answer, after a failure not."""
    vetting = HostVetting(salt=SALT)
    good, bad = record(Identity.generate(), "127.0.0.1:5001"), record(Identity.generate(), "127.0.0.1:5002")
    first = vetting.select([good, bad], never_served, NOW)
    assert first.accepted == [] and {r.peer_id for r in first.to_probe} == {good.peer_id, bad.peer_id}
    vetting.probed(good.peer_id, True, NOW)
    vetting.probed(bad.peer_id, False, NOW)
    after = vetting.select([good, bad], never_served, NOW + 1)
    assert (after.accepted, after.to_probe) == ([good], [])  # bad waits out its backoff before a second ping


def test_a_failed_host_is_pinged_again_after_a_doubling_backoff():
    """A host whose ping failed is a probe candidate again only after 30 s, then after 60 s more."""
    vetting = HostVetting(salt=SALT)
    bad = record(Identity.generate())
    vetting.probed(bad.peer_id, False, NOW)
    assert vetting.select([bad], never_served, NOW + 29).to_probe == []
    assert vetting.select([bad], never_served, NOW + 30).to_probe == [bad]
    vetting.probed(bad.peer_id, False, NOW + 30)
    assert vetting.select([bad], never_served, NOW + 89).to_probe == []
    assert vetting.select([bad], never_served, NOW + 90).to_probe == [bad]


def test_a_verified_host_that_never_served_is_pinged_again_after_reverify_after():
    """Verification lapses after reverify_after unless the host served; a host that served needs no ping."""
    vetting = HostVetting(reverify_after=100.0, salt=SALT)
    idle, busy = record(Identity.generate(), "127.0.0.1:5001"), record(Identity.generate(), "127.0.0.1:5002")
    for r in (idle, busy):
        vetting.probed(r.peer_id, True, NOW)
    served = {busy.peer_id: 3}.get
    later = vetting.select([idle, busy], lambda p: served(p, 0), NOW + 100)
    assert (later.accepted, later.to_probe) == ([busy], [idle])


def test_newly_verified_hosts_never_displace_hosts_that_served_or_were_verified_first():
    """With per_group 2, two incumbents of a network keep their places against a third verified later."""
    vetting = HostVetting(per_group=2, salt=SALT)
    a, b, c = (record(Identity.generate(), f"203.0.113.{i}:4433") for i in (1, 2, 3))
    vetting.probed(a.peer_id, True, NOW)
    vetting.probed(b.peer_id, True, NOW + 1)
    vetting.probed(c.peer_id, True, NOW + 2)
    assert {r.peer_id for r in vetting.select([c, b, a], never_served, NOW + 3).accepted} == {a.peer_id, b.peer_id}
    served = {c.peer_id: 5}.get  # c served: it goes first, the later verified of a and b yields
    chosen = vetting.select([c, b, a], lambda p: served(p, 0), NOW + 3).accepted
    assert {r.peer_id for r in chosen} == {a.peer_id, c.peer_id}


def test_probes_are_bounded_and_spread_over_networks_first():
    """Of 80 unverified sybils on one /24 and one honest host elsewhere, the honest host is among the few pinged."""
    vetting = HostVetting(per_group=4, max_probes=6, salt=SALT)
    sybils = [record(Identity.generate(), f"203.0.113.{i % 250}:4433") for i in range(80)]
    honest = record(Identity.generate(), "198.51.100.7:4433")
    probes = vetting.select([*sybils, honest], never_served, NOW).to_probe
    assert len(probes) == 5 and honest in probes  # 4 of the /24 (its share) and the honest host
    assert vetting.select(sybils, never_served, NOW).accepted == []


def test_the_answer_holds_at_most_max_hosts_and_then_probes_nobody():
    """With max_hosts verified hosts answered, no further host is pinged."""
    vetting = HostVetting(max_hosts=2, salt=SALT)
    hosts = [record(Identity.generate(), f"127.0.0.1:{5000 + i}") for i in range(3)]
    for r in hosts[:2]:
        vetting.probed(r.peer_id, True, NOW)
    chosen = vetting.select(hosts, never_served, NOW)
    assert (len(chosen.accepted), chosen.to_probe) == (2, [])


def test_vetted_discovery_answers_the_hosts_whose_ping_answered():
    """Over an in-memory DHT, VettedDiscovery pings both hosts, answers only the one whose probe returned, and reports
    that one's round trip (the router's first deadline for it)."""
    board, clock = InMemoryBoard(), FakeClock(NOW)
    live, dead = Identity.generate(), Identity.generate()
    pinged: list[PeerId] = []
    rtts: list[tuple[PeerId, float]] = []

    async def probe(r: HostRecord) -> None:
        pinged.append(r.peer_id)
        if r.peer_id == dead.peer_id:
            raise TransportTimeout("no pong")

    async def main():
        await InMemoryDiscovery(live, board, clock=clock).announce([HostedSlice(MODEL, 1, ((0, 8),), quic_addr="127.0.0.1:5001")])
        await InMemoryDiscovery(dead, board, clock=clock).announce([HostedSlice(MODEL, 1, ((8, 16),), quic_addr="127.0.0.1:5002")])
        vetted = VettedDiscovery(InMemoryDiscovery(Identity.generate(), board, clock=clock), probe, clock=clock, pinged=lambda peer, rtt_ms: rtts.append((peer, rtt_ms)))
        first = await vetted.lookup(MODEL, 1)
        second = await vetted.lookup(MODEL, 1)
        return first, second

    first, second = asyncio.run(main())
    assert [r.peer_id for r in first] == [r.peer_id for r in second] == [live.peer_id]
    assert sorted(pinged) == sorted([live.peer_id, dead.peer_id])  # the second lookup pinged nobody
    assert [peer for peer, _ in rtts] == [live.peer_id] and rtts[0][1] >= 0  # the router learns the answered ping's RTT


def test_vetted_discovery_bounds_a_probe_that_never_returns():
    """A probe hanging past probe_timeout counts as failed; the lookup returns without that host."""
    board = InMemoryBoard()
    clock = FakeClock(NOW)
    hung = Identity.generate()

    async def probe(r: HostRecord) -> None:
        await asyncio.sleep(3600)

    async def main():
        await InMemoryDiscovery(hung, board, clock=clock).announce([HostedSlice(MODEL, 1, ((0, 8),), quic_addr="127.0.0.1:5001")])
        vetted = VettedDiscovery(InMemoryDiscovery(Identity.generate(), board, clock=clock), probe, probe_timeout=0.05, clock=clock)
        return await asyncio.wait_for(vetted.lookup(MODEL, 1), 10)

    assert asyncio.run(main()) == []
