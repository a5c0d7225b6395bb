"""Discovery over real libp2p hosts on 127.0.0.1: a bootstrap node, three workers, a lookup node and a
NAT-bound (client-mode) worker with twelve slices, each node in its own trio thread of this process."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import hashlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio

from p2p.dht.kademlia import LibP2PDiscovery
from p2p.dht.records import HostedSlice, HostRecord, ModelShape, RelayAddress, issue, sign, value_key
from p2p.identity import Identity, PeerId
from tests.support import async_poll, run_bounded

ROOT = Path(__file__).resolve().parents[2]
MODEL = hashlib.sha256(b"dht-test-model").hexdigest()
BIG_MODEL = hashlib.sha256(b"dht-test-model-with-many-layers").hexdigest()
BIG_LAYERS = 12  # more than the 10 provider announcements a libp2p server accepts per 10 s
FOUND_WITHIN = 15.0
REFRESHING_TTL = 4  # seconds; w2 re-signs every 2 s


run = partial(run_bounded, timeout=45.0)


def peers(records: list[HostRecord]) -> set[PeerId]:
    return {r.peer_id for r in records}


@dataclass
class Swarm:
    boot: LibP2PDiscovery
    workers: list[LibP2PDiscovery]
    lookup: LibP2PDiscovery
    big: LibP2PDiscovery  # client mode
    slices: dict[PeerId, list[HostedSlice]]
    big_announce: cf.Future[None]

    @property
    def servers(self) -> list[LibP2PDiscovery]:
        return [self.boot, *self.workers, self.lookup]


def worker_slices(boot: PeerId) -> list[list[HostedSlice]]:
    relay = RelayAddress("ws://127.0.0.1:7100/relay", boot)
    return [
        [HostedSlice(MODEL, 0, ((0, 8),), "127.0.0.1:7001"), HostedSlice(MODEL, 1, ((0, 8),), "127.0.0.1:7001")],
        [HostedSlice(MODEL, 0, ((8, 16),), relay=relay, capacity=2), HostedSlice(MODEL, 1, ((8, 16),), relay=relay)],
        [
            HostedSlice(MODEL, 1, ((16, 24),), "[::1]:7003", relay, capacity=8, price=5),
            HostedSlice(MODEL, 2, ((0, 32), (40, 64)), "[::1]:7003", relay),
        ],
    ]


@pytest.fixture(scope="module")
def swarm() -> Iterator[Swarm]:
    """Start the nodes, announce the workers' slices, and start the big worker's (paced, ~11 s) announcement."""

    async def start() -> Swarm:
        boot = LibP2PDiscovery(Identity.generate())
        await boot.start()
        join = boot.multiaddrs
        workers = [
            LibP2PDiscovery(Identity.generate(), bootstrap=join, ttl=REFRESHING_TTL if i == 1 else 600)
            for i in range(3)
        ]
        lookup = LibP2PDiscovery(Identity.generate(), bootstrap=join)
        big = LibP2PDiscovery(Identity.generate(), bootstrap=join, client_mode=True)
        for node in [*workers, lookup, big]:
            await node.start()
        slices = dict(zip([w.peer_id for w in workers], worker_slices(boot.peer_id)))
        for worker in workers:
            await worker.announce(slices[worker.peer_id])
        big_slices = [HostedSlice(BIG_MODEL, layer, ((0, 4),), "127.0.0.1:7004") for layer in range(BIG_LAYERS)]
        slices[big.peer_id] = big_slices
        announce = pool.submit(run, big.announce(big_slices))
        return Swarm(boot, workers, lookup, big, slices, announce)

    async def stop(nodes: list[LibP2PDiscovery]) -> None:
        await asyncio.gather(*(node.close() for node in nodes))

    with cf.ThreadPoolExecutor(1) as pool:
        net = run(start())
        try:
            yield net
        finally:
            net.big_announce.exception(timeout=60)
            run(stop([*net.servers, net.big]))


def test_announced_slices_are_found_by_model_and_layer(swarm: Swarm):
    """Every worker's slices are found by (model, layer), with the signed content they announced."""
    w1, w2, w3 = (w.peer_id for w in swarm.workers)
    expected = {0: {w1, w2}, 1: {w1, w2, w3}, 2: {w3}}

    async def check() -> None:
        for layer, want in expected.items():
            probe = partial(swarm.lookup.lookup, MODEL, layer)
            found = await async_poll(probe, lambda r, want=want: peers(r) == want, FOUND_WITHIN)
            assert peers(found) == want, f"layer {layer}"
            for record in found:
                assert record.hosted in swarm.slices[record.peer_id]
                assert record.is_live(time.time())
        from_a_worker = await swarm.workers[2].lookup(MODEL, 0)
        assert peers(from_a_worker) == expected[0]
        assert await swarm.lookup.lookup(MODEL, 3) == []

    run(check())


def inject(targets: list[str], puts: list[tuple[bytes, bytes]]) -> dict[tuple[str, bytes], tuple[bool, bytes | None]]:
    """From a stranger libp2p host, PUT_VALUE each (key, value) straight at each target, then GET it back."""
    from libp2p.kad_dht.kad_dht import DHTMode, KadDHT
    from libp2p.peer.peerinfo import info_from_p2p_addr
    from multiaddr import Multiaddr

    async def main() -> dict[tuple[str, bytes], tuple[bool, bytes | None]]:
        host = stranger_host("noise")
        dht = KadDHT(host, DHTMode.CLIENT)
        results = {}
        async with host.run([Multiaddr("/ip4/127.0.0.1/tcp/0")]):
            try:
                for addr in targets:
                    info = info_from_p2p_addr(Multiaddr(addr))
                    await host.connect(info)
                    for key, value in puts:
                        stored = await dht.value_store._store_at_peer(info.peer_id, key, value)
                        held = await dht.value_store._get_from_peer(info.peer_id, key)
                        results[(addr, key)] = (stored, held)
            finally:
                await host.close()
        return results

    return trio.run(main)


def stranger_host(security: str) -> Any:
    """A libp2p host outside our code, offering only Noise or only plaintext."""
    from libp2p import new_host
    from libp2p.crypto.ed25519 import create_new_key_pair
    from libp2p.crypto.x25519 import create_new_key_pair as create_x25519_key_pair
    from libp2p.network.config import ConnectionConfig
    from libp2p.security.insecure.transport import PLAINTEXT_PROTOCOL_ID, InsecureTransport
    from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
    from libp2p.security.noise.transport import Transport as NoiseTransport

    key_pair = create_new_key_pair()
    if security == "noise":
        sec = {NOISE_PROTOCOL_ID: NoiseTransport(key_pair, noise_privkey=create_x25519_key_pair().private_key)}
    else:
        sec = {PLAINTEXT_PROTOCOL_ID: InsecureTransport(key_pair)}
    return new_host(key_pair=key_pair, sec_opt=sec, connection_config=ConnectionConfig(max_connections_per_peer=1))


def test_forged_and_expired_records_are_refused_by_every_node(swarm: Swarm):
    """PUT_VALUEs with a bad signature, past expiry or in a foreign namespace are refused by every node."""
    w1 = swarm.workers[0]
    genuine = HostedSlice(MODEL, 0, ((0, 8),), "127.0.0.1:7001")
    now = time.time()
    # A record for w1's key and slot, pointing elsewhere, signed by someone else.
    impostor = Identity.generate()
    lure = HostRecord(w1.peer_id, HostedSlice(MODEL, 0, ((0, 64),), "127.0.0.1:6666"), int(now), int(now) + 600, 2**63)
    forged = lure.body() + impostor.sign(b"moeswarm/host-record/v1\n" + lure.body())
    # A correctly signed record whose time is over.
    latecomer = Identity.generate()
    stale = HostRecord(latecomer.peer_id, genuine, int(now) - 1200, int(now) - 600, 1)
    expired = sign(latecomer, stale)
    valid = HostedSlice(MODEL, 5, ((0, 1),), "127.0.0.1:7009")
    control, control_value = issue(Identity.generate(), valid, now=now, ttl=600, seq=1)
    puts = [
        (value_key(w1.peer_id, MODEL, 0).encode(), forged),
        (stale.key.encode(), expired),
        (b"/other-namespace/x", control_value),
        (control.key.encode(), control_value),
    ]
    results = inject([node.multiaddrs[0] for node in swarm.servers], puts)
    for node in swarm.servers:
        addr = node.multiaddrs[0]
        forged_stored, forged_held = results[(addr, puts[0][0])]
        assert not forged_stored and forged_held != forged, f"{node.peer_id.short()} took the forged record"
        assert results[(addr, puts[1][0])] == (False, None), f"{node.peer_id.short()} took the expired record"
        assert results[(addr, puts[2][0])] == (False, None), f"{node.peer_id.short()} took a foreign namespace"
        assert results[(addr, puts[3][0])] == (True, control_value), f"{node.peer_id.short()} refused a valid record"

    found = run(swarm.lookup.lookup(MODEL, 0))
    assert [r.hosted.quic_addr for r in found if r.peer_id == w1.peer_id] == ["127.0.0.1:7001"]
    assert latecomer.peer_id not in peers(found)


def test_plaintext_peers_cannot_connect(swarm: Swarm):
    """A host offering only /plaintext/2.0.0 cannot connect to our nodes; a Noise host can."""
    from libp2p.peer.peerinfo import info_from_p2p_addr
    from multiaddr import Multiaddr

    def connects(security: str) -> bool:
        async def main() -> bool:
            host = stranger_host(security)
            async with host.run([Multiaddr("/ip4/127.0.0.1/tcp/0")]):
                try:
                    with trio.fail_after(10):
                        await host.connect(info_from_p2p_addr(Multiaddr(swarm.boot.multiaddrs[0])))
                    return True
                except Exception:  # any dial failure means: not connected
                    return False
                finally:
                    await host.close()

        return trio.run(main)

    assert not connects("plaintext")
    assert connects("noise")


def test_withdrawn_worker_disappears_from_lookups(swarm: Swarm):
    """After withdraw(), lookups stop returning the worker at once (its tombstones replace its records)."""
    w1, w2, w3 = (w.peer_id for w in swarm.workers)

    async def check() -> None:
        before = await async_poll(partial(swarm.lookup.lookup, MODEL, 2), lambda r: peers(r) == {w3}, FOUND_WITHIN)
        assert peers(before) == {w3}
        await swarm.workers[2].withdraw()
        assert await swarm.lookup.lookup(MODEL, 2) == []
        assert peers(await swarm.lookup.lookup(MODEL, 1)) == {w1, w2}
        assert w3 not in peers(await swarm.boot.lookup(MODEL, 1))

    run(check())


def test_more_than_ten_slices_from_one_worker_are_all_found(swarm: Swarm):
    """A client-mode worker announcing 12 slices is found for every one (provider announcements are paced)."""
    swarm.big_announce.result(timeout=40)

    async def layers_found() -> set[int]:
        found = await asyncio.gather(*(swarm.lookup.lookup(BIG_MODEL, layer) for layer in range(BIG_LAYERS)))
        return {layer for layer, records in enumerate(found) if peers(records) == {swarm.big.peer_id}}

    assert run(async_poll(layers_found, lambda got: len(got) == BIG_LAYERS, FOUND_WITHIN)) == set(range(BIG_LAYERS))


def test_a_node_told_the_model_neither_stores_nor_returns_records_outside_its_shape():
    """A bootstrap told a 32-expert model refuses a record for its experts 0-65534, so no lookup finds it; a lookup
    node told another model's shape drops that model's out-of-shape record, which a node without the shape returns."""
    stored_by_boot = ModelShape(MODEL, n_layer=3, n_expert=32)
    known_to_looker = ModelShape(BIG_MODEL, n_layer=8, n_expert=32)

    async def check() -> tuple[set[PeerId], set[PeerId], set[PeerId], set[PeerId]]:
        async with LibP2PDiscovery(Identity.generate(), models=[stored_by_boot]) as boot:
            join = boot.multiaddrs
            async with (
                LibP2PDiscovery(Identity.generate(), bootstrap=join, client_mode=True) as honest,
                LibP2PDiscovery(Identity.generate(), bootstrap=join, client_mode=True) as greedy,
                LibP2PDiscovery(Identity.generate(), bootstrap=join, client_mode=True) as plain,
                LibP2PDiscovery(Identity.generate(), bootstrap=join, client_mode=True, models=[known_to_looker]) as knows,
            ):
                await honest.announce([HostedSlice(MODEL, 1, ((0, 32),), "127.0.0.1:7001"), HostedSlice(BIG_MODEL, 5, ((0, 64),), "127.0.0.1:7001")])
                await greedy.announce([HostedSlice(MODEL, 1, ((0, 65535),), "127.0.0.1:7002")])
                want = {honest.peer_id}
                model_a = await async_poll(partial(plain.lookup, MODEL, 1), lambda r: peers(r) == want, FOUND_WITHIN)
                big_plain = await async_poll(partial(plain.lookup, BIG_MODEL, 5), lambda r: peers(r) == want, FOUND_WITHIN)
                return peers(model_a), peers(await knows.lookup(MODEL, 1)), peers(big_plain), peers(await knows.lookup(BIG_MODEL, 5))

    model_a, model_a_knows, big_plain, big_knows = run(check())
    assert model_a == model_a_knows == big_plain and len(model_a) == 1  # the greedy record was never stored
    assert big_knows == set()


def test_client_mode_worker_stays_out_of_routing_tables(swarm: Swarm):
    """Servers keep each other in their routing tables but never the client-mode worker that talked to them."""
    swarm.big_announce.result(timeout=40)
    tables = {node.peer_id: run(node.routing_peers()) for node in swarm.servers}
    assert str(swarm.workers[0].peer_id) in tables[swarm.boot.peer_id]
    for owner, table in tables.items():
        assert str(swarm.big.peer_id) not in table, f"client-mode peer in {owner.short()}'s routing table"


def test_records_are_refreshed_before_they_expire(swarm: Swarm):
    """A worker with a 4 s TTL stays findable past its first record's expiry, with a newer signed record."""
    w2 = swarm.workers[1].peer_id

    async def w2_record() -> HostRecord | None:
        return next((r for r in await swarm.lookup.lookup(MODEL, 0) if r.peer_id == w2), None)

    async def check() -> None:
        first = await w2_record()
        assert first is not None
        # Not a synchronisation: the behaviour under test is what a lookup finds once this real-clock TTL has run out.
        await asyncio.sleep(max(0.0, first.expires_at + 0.5 - time.time()))
        later = await async_poll(w2_record, lambda r: r is not None, 5.0)
        assert later is not None and later.seq > first.seq and later.expires_at > first.expires_at

    run(check())


def test_libp2p_is_loaded_only_by_a_running_node_and_leaves_aioquic_alone(swarm: Swarm):
    """Importing p2p.dht.kademlia loads no libp2p; once nodes run, aioquic's get_frame is still aioquic's own."""
    from aioquic.quic.stream import QuicStreamSender

    assert QuicStreamSender.get_frame.__module__ == "aioquic.quic.stream"
    probe = "import sys, p2p.dht.kademlia; assert 'libp2p' not in sys.modules, 'libp2p imported'; print('ok')"
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "ok", done.stderr


def tcp_ports_in_use() -> set[int]:
    """Local and remote ports of the TCP sockets this process holds open (Linux /proc)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # closed meanwhile
        if link.startswith("socket:["):
            inodes.add(link[len("socket:[") : -1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[9] in inodes:
                ports |= {int(fields[1].rsplit(":", 1)[1], 16), int(fields[2].rsplit(":", 1)[1], 16)}
    return ports


def test_closed_nodes_leave_no_socket_open():
    """close() really closes a node's connections: no socket to or from it stays open (e.g. in CLOSE_WAIT)."""

    async def pair() -> int:
        first = LibP2PDiscovery(Identity.generate())
        await first.start()
        second = LibP2PDiscovery(Identity.generate(), bootstrap=first.multiaddrs)
        await second.start()
        port = int(first.multiaddrs[0].split("/")[4])
        assert port in tcp_ports_in_use()
        await second.close()
        await first.close()
        return port

    port = run(pair())
    assert port not in tcp_ports_in_use()


def test_a_kad_stream_reaching_a_closed_node_spawns_nothing():
    """An inbound KAD stream can reach ``add_peer`` after our nursery has closed, while the host is still closing: a
    peer whose identify has not answered must then be left alone, not handed to that nursery (trio's "Nursery is
    closed to new arrivals" ended the node's thread, logged as ``dht.node_crashed``, at every few closes)."""
    from libp2p.peer.id import ID

    async def closed() -> LibP2PDiscovery:
        d = LibP2PDiscovery(Identity.generate())
        await d.start()
        await d.close()
        return d

    node = run(closed())._node
    stranger = ID.from_base58(str(Identity.generate().peer_id))
    assert trio.run(partial(node.dht.add_peer, stranger, skip_server_mode_check=True)) is False
