"""The Kademlia walk's termination, without sockets: `_Node._walk` over stub peers that answer or stay silent."""

from __future__ import annotations

import hashlib
from types import SimpleNamespace

import trio
from libp2p.peer.id import ID

from p2p.dht.kademlia import WALK_WIDTH, _Node
from p2p.dht.libp2p_glue import libp2p_api

PEERS = [ID(b"\x00" + hashlib.sha256(b"peer %d" % i).digest()) for i in range(60)]

def _stub_node(seeds: list[ID]) -> SimpleNamespace:
    """What `_walk` reads of a node: its routing table's closest peers, its own id, a peerstore that has not
    identified anyone yet (so every peer may speak KAD) and the RPC limiter."""
    me = ID(b"\x00" + hashlib.sha256(b"me").digest())
    peerstore = SimpleNamespace(get_protocols=lambda peer: [])
    return SimpleNamespace(
        dht=SimpleNamespace(routing_table=SimpleNamespace(find_local_closest_peers=lambda key, n: seeds[:n])),
        host=SimpleNamespace(get_id=lambda: me, get_peerstore=lambda: peerstore),
        rpcs=trio.CapacityLimiter(8),
    )


def test_a_walk_ends_only_when_the_closest_peers_that_answer_have_been_asked():
    """10 of the 20 peers closest to the key are gone (they answer nothing, like libp2p's empty reply on an error).
    Counting them as asked ended the walk with only 10 live peers of the closest 20 asked; the entries sit at the
    closest live ones, so all of those 20 must be asked."""
    key = hashlib.sha256(b"a provider key").digest()
    by_distance = libp2p_api().sort_by_distance(key, PEERS)
    gone = set(by_distance[:10])
    asked: list[ID] = []

    async def ask(peer: ID) -> list[ID]:
        asked.append(peer)
        return [] if peer in gone else PEERS  # everyone alive knows everyone

    rounds, n_asked = trio.run(_Node._walk, _stub_node(by_distance[-WALK_WIDTH:]), key, ask)
    closest_live = [p for p in by_distance if p not in gone][:WALK_WIDTH]
    assert set(closest_live) <= set(asked), f"{len(set(closest_live) - set(asked))} of the {WALK_WIDTH} closest live peers not asked"
    assert n_asked == len(asked) == len(set(asked)) and rounds >= 1  # each peer asked once
    assert len(asked) < len(PEERS)  # and the walk still ends before asking everyone


def test_a_walk_in_a_swarm_without_departures_asks_the_closest_peers_and_stops():
    key = hashlib.sha256(b"another key").digest()
    by_distance = libp2p_api().sort_by_distance(key, PEERS)
    asked: list[ID] = []

    async def ask(peer: ID) -> list[ID]:
        asked.append(peer)
        return PEERS

    trio.run(_Node._walk, _stub_node(by_distance[-WALK_WIDTH:]), key, ask)
    assert set(by_distance[:WALK_WIDTH]) <= set(asked)
    assert len(asked) <= 2 * WALK_WIDTH
