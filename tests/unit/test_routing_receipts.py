"""Replica choice (RTT, load, backoff) and work receipts (signed, tamper-evident), without sockets."""

from __future__ import annotations

import dataclasses

import pytest

from node.backbone.routing import Router
from node.ledger.receipts import Receipt, ReceiptError, ReceiptStamp, sign, verify, work_units
from p2p.dht.records import HostedSlice, HostRecord
from p2p.identity import Identity

DIGEST = "ab" * 32


def record(ident: Identity, ranges, port: int) -> HostRecord:
    return HostRecord(ident.peer_id, HostedSlice(DIGEST, 0, tuple(ranges), quic_addr=f"127.0.0.1:{port}"), 1000, 2000, 1)


def test_partition_follows_announced_ranges_and_gaps_stay_local():
    """Groups are the announced ranges plus gaps; each group lists every host covering it."""
    a, b, c = Identity.generate(), Identity.generate(), Identity.generate()
    router = Router(n_expert=16)
    route = router.update(0, [record(a, [(0, 8)], 1), record(b, [(0, 8)], 2), record(c, [(12, 16)], 3)])
    assert route.partition.bounds == ((0, 8), (8, 12), (12, 16))
    assert {h.peer_id for h in route.hosts[0]} == {a.peer_id, b.peer_id}
    assert route.hosts[1] == []  # 8-11: nobody hosts them -> computed locally
    assert [h.peer_id for h in route.hosts[2]] == [c.peer_id]


def test_replicas_ranked_by_rtt_then_load_and_failures_benched():
    """The faster replica goes first; queued requests inflate its score; a failure benches it with backoff."""
    a, b = Identity.generate(), Identity.generate()
    router = Router(n_expert=8)
    router.update(0, [record(a, [(0, 8)], 1), record(b, [(0, 8)], 2)])
    for peer, rtt in ((a.peer_id, 5.0), (b.peer_id, 20.0)):
        router.started(peer)
        router.succeeded(peer, rtt)
    assert [h.peer_id for h in router.candidates(0, 0, now=0)] == [a.peer_id, b.peer_id]
    for _ in range(4):
        router.started(a.peer_id)  # 4 in flight: 5 ms * 5 > 20 ms
    assert router.candidates(0, 0, now=0)[0].peer_id == b.peer_id
    for _ in range(4):
        router.succeeded(a.peer_id, 5.0)
    router.started(a.peer_id)
    assert router.failed(a.peer_id, now=100.0) == 1.0
    router.started(a.peer_id)
    assert router.failed(a.peer_id, now=100.0) == 2.0
    assert [h.peer_id for h in router.candidates(0, 0, now=101.0)] == [b.peer_id, a.peer_id]
    assert router.candidates(0, 0, now=103.0)[0].peer_id == a.peer_id


def make_receipt(worker: Identity, backbone: Identity) -> Receipt:
    return Receipt(
        dispatch_id="00" * 16, backbone=str(backbone.peer_id), worker=str(worker.peer_id), model_digest=DIGEST, layer=3,
        expert_ids=(1, 5), n_tokens=2, work_units=work_units(3, 64, 32), bytes_in=1000, bytes_out=600, codec="f32",
        path="direct", issued_at_us=123, price=2, request_digest="11" * 32, result_digest="22" * 32,
    )


def test_receipt_signature_covers_every_field():
    """A stamped receipt verifies; changing any field, or the signer, breaks it."""
    worker, backbone = Identity.generate(), Identity.generate()
    r = make_receipt(worker, backbone)
    stamp = sign(worker, r)
    verify(r, stamp)
    assert r.credits == r.work_units * 2 and r.work_units == 3 * 6 * 64 * 32
    for f in dataclasses.fields(Receipt):
        value = getattr(r, f.name)
        changed = value + 1 if isinstance(value, int) else (value + (9,) if isinstance(value, tuple) else value[:-1] + ("0" if value[-1] != "0" else "1"))
        with pytest.raises(ReceiptError):
            verify(dataclasses.replace(r, **{f.name: changed}), stamp)
    with pytest.raises(ReceiptError, match="naming itself"):
        sign(backbone, r)
    with pytest.raises(ReceiptError, match="not signed"):
        verify(r, ReceiptStamp(r.issued_at_us, bytes(64)))


def test_price_decides_among_similar_rtt_and_max_price_filters():
    """Within 25% of the best expected wait the cheaper host wins; a much faster host beats a cheaper slow one."""
    fast_pricey, similar_cheap, slow_cheapest = Identity.generate(), Identity.generate(), Identity.generate()
    recs = []
    for ident, port, price in ((fast_pricey, 1, 9), (similar_cheap, 2, 3), (slow_cheapest, 3, 1)):
        r = record(ident, [(0, 8)], port)
        recs.append(HostRecord(r.peer_id, dataclasses.replace(r.hosted, price=price), 1000, 2000, 1))
    router = Router(n_expert=8)
    router.update(0, recs)
    for ident, rtt in ((fast_pricey, 10.0), (similar_cheap, 12.0), (slow_cheapest, 40.0)):
        router.started(ident.peer_id)
        router.succeeded(ident.peer_id, rtt)
    assert [h.peer_id for h in router.candidates(0, 0, 0)] == [similar_cheap.peer_id, fast_pricey.peer_id, slow_cheapest.peer_id]
    capped = Router(n_expert=8, max_price=5)
    capped.update(0, recs)
    assert {h.peer_id for h in capped.candidates(0, 0, 0)} == {similar_cheap.peer_id, slow_cheapest.peer_id}


def test_scarcity_price_rule():
    """A sole host asks double its base; the premium fades as replicas join; never below base."""
    from node.worker.pricing import scarcity_price

    assert [scarcity_price(10, n) for n in (0, 1, 2, 4, 10)] == [20, 20, 15, 13, 11]
    assert scarcity_price(0, 1) == 0
