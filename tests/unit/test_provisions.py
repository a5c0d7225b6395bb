"""Re-providing when a key's neighbourhood moves: the pure policy, and `_Node` sending over a stub routing table."""

from __future__ import annotations

import hashlib
from types import SimpleNamespace

import pytest
import trio
from libp2p.peer.id import ID

from p2p.dht.discovery import Announcer
from p2p.dht.kademlia import WALK_WIDTH, ProvidePacer, _Node
from p2p.dht.provisions import MIN_GAP, REPROVIDE_AFTER, Provisions, View
from p2p.dht.records import HostedSlice
from p2p.identity import Identity

KEY = b"\x12\x20" + hashlib.sha256(b"key").digest()
PEERS = [ID(b"\x00" + hashlib.sha256(b"peer %d" % i).digest()) for i in range(200)]
MODEL = hashlib.sha256(b"model-a").hexdigest()
NOW = 1_800_001_000.0  # mid-epoch: every step overlaps the same epochs


def view(peers: range, table: int | None = None) -> View:
    return View(frozenset(PEERS[i].to_bytes() for i in peers), len(peers) if table is None else table)


@pytest.mark.parametrize(
    "sent, later, age, reason",
    [
        (None, view(range(20)), 0.0, "new"),
        (view(range(20)), view(range(20)), REPROVIDE_AFTER, "age"),
        (view(range(20)), view(range(20)), REPROVIDE_AFTER - 1, None),  # a stable swarm costs nothing
        (view(range(20)), view(range(4, 24)), MIN_GAP, None),  # 4 of 20 new: under a quarter
        (view(range(20)), view(range(5, 25)), MIN_GAP, "closest_changed"),  # 5 of 20 new (joins or deaths)
        (view(range(20)), view(range(5, 25)), MIN_GAP - 1, None),  # but at most once a minute
        (view(range(2)), view(range(2), table=4), MIN_GAP, "table_grew"),  # sent right after joining
        (view(range(20), table=40), view(range(20), table=79), MIN_GAP, None),
        (view(range(2)), view(range(2, 22)), MIN_GAP, "closest_changed"),  # a young node's few peers, then many
    ],
)
def test_when_an_entry_is_due(sent: View | None, later: View, age: float, reason: str | None):
    """New keys go out at once, old ones every 30 min; between, only a moved neighbourhood sends one again."""
    provisions = Provisions()
    if sent is not None:
        provisions.sent(KEY, 0, NOW, sent)
    assert provisions.due(KEY, NOW + age, later) == reason


def test_old_epochs_are_forgotten():
    provisions = Provisions()
    provisions.sent(KEY, 5, NOW, view(range(20)))
    provisions.forget_before(5)
    assert len(provisions) == 1
    provisions.forget_before(6)
    assert len(provisions) == 0 and provisions.due(KEY, NOW, view(range(20))) == "new"


class _Table:
    """The part of libp2p's routing table `_Node` reads: the peers it knows, sorted like the real one."""

    def __init__(self) -> None:
        self.peers: list[ID] = []

    def find_local_closest_peers(self, key: bytes, count: int) -> list[ID]:
        target = int.from_bytes(hashlib.sha256(key).digest(), "big")
        return sorted(self.peers, key=lambda p: int.from_bytes(hashlib.sha256(p.to_bytes()).digest(), "big") ^ target)[:count]

    def size(self) -> int:
        return len(self.peers)


def _stub_node(clock: list[float]) -> SimpleNamespace:
    """A `_Node` without libp2p: a stub routing table and a provider store that records every ADD_PROVIDER round."""
    sent: list[bytes] = []

    async def provide(key: bytes) -> bool:
        sent.append(key)
        return True

    table = _Table()
    node = SimpleNamespace(
        clock=lambda: clock[0],
        provisions=Provisions(),
        pacer=ProvidePacer(budget=1000),
        announcer=Announcer(Identity.generate(), ttl=3600),
        helper=None,
        stage=None,
        dht=SimpleNamespace(routing_table=table, provider_store=SimpleNamespace(provide=provide, providing_keys=set())),
        sent=sent,
        table=table,
    )
    node._view = lambda key: _Node._view(node, key)  # type: ignore[arg-type]
    node._provide = lambda key, epoch, reason: _Node._provide(node, key, epoch, reason)  # type: ignore[arg-type]
    node._provide_due = lambda records: _Node._provide_due(node, records)  # type: ignore[arg-type]
    return node


def test_a_host_provides_again_as_the_swarm_grows_and_after_churn_and_not_while_stable():
    """Announced when its table held 2 peers, a host re-sends its entries once the swarm around the keys grew (the
    200-node runs missed such hosts for the 30 min until their first re-provide) and once half the swarm died, and
    sends nothing while the swarm is stable."""
    clock = [NOW]
    node = _stub_node(clock)
    node.announcer.replace([HostedSlice(MODEL, 0, ((0, 8),), capacity=16, price=1, quic_addr="127.0.0.1:4433")], NOW)
    tables = [PEERS[:2], PEERS[:42], PEERS[:200], PEERS[:200], PEERS[::2], PEERS[::2], PEERS[::2]]

    async def rounds() -> list[int]:
        counts = []
        for step, peers in enumerate(tables):
            clock[0] = NOW + step * MIN_GAP
            node.table.peers = peers
            await _Node._reprovide(node, set())  # type: ignore[arg-type]
            counts.append(len(node.sent))
        return counts

    counts = trio.run(rounds)
    keys = len(set(node.sent))  # one key per epoch the record's lifetime overlaps
    assert keys >= 1 and counts[0] == keys  # new
    assert counts[1] == 2 * keys and counts[2] == 3 * keys  # grew: 2 -> 42 -> 200 peers
    assert counts[3] == counts[2]  # stable
    assert counts[4] == 4 * keys  # half the swarm gone: the closest peers changed
    assert counts[6] == counts[5] == counts[4]  # stable again
    assert len(node.table.find_local_closest_peers(KEY, WALK_WIDTH)) == WALK_WIDTH
