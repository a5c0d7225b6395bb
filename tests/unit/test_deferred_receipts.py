"""Batch signatures of receipts, and the batching both sides do meanwhile, without sockets (hand-moved clock)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from node.backbone.signatures import _variants
from node.ledger.deferred import Batch, PendingReceipts, UnsignedReceipts, judge
from node.ledger.entries import EntryError, Event
from node.ledger.receipts import (
    MAX_EVIDENCE,
    BatchProof,
    Receipt,
    ReceiptError,
    ReceiptStamp,
    batch_message,
    evidence_ok,
    leaf_hash,
    merkle_path,
    merkle_root,
    root_from_path,
    sign_batch,
    verify,
    work_units,
)
from p2p.identity import Identity
from p2p.wire.messages import MAX_RECEIPT_BATCH

WORKER, BACKBONE = Identity.generate(), Identity.generate()


def receipt(i: int, worker: Identity = WORKER, backbone: Identity = BACKBONE, path: str = "direct") -> Receipt:
    return Receipt(
        dispatch_id=f"{i:032x}", backbone=str(backbone.peer_id), worker=str(worker.peer_id), model_digest="ab" * 32, layer=1,
        expert_ids=(2,), n_tokens=1, work_units=work_units(1, 64, 32), bytes_in=100, bytes_out=90, codec="f32", path=path,
        issued_at_us=1000 + i, price=2, request_digest="11" * 32, result_digest="22" * 32,
    )  # fmt: skip


@settings(max_examples=60, deadline=None)
@given(leaves=st.lists(st.binary(min_size=32, max_size=32), min_size=1, max_size=70), data=st.data())
def test_every_leaf_leads_to_the_root_by_its_path_and_no_other_leaf_does(leaves, data):
    """RFC 9162 Merkle paths: each leaf and its path give the root; another leaf at that place does not."""
    i = data.draw(st.integers(0, len(leaves) - 1))
    path = merkle_path(leaves, i)
    assert root_from_path(leaves[i], i, len(leaves), path) == merkle_root(leaves)
    assert root_from_path(bytes(a ^ 1 for a in leaves[i]), i, len(leaves), path) != merkle_root(leaves)


def test_a_batch_signature_is_each_receipts_evidence_alone():
    """One signature over 37 receipts: each receipt verifies from its own stamp (signature, position, path); a
    changed receipt, another receipt's stamp, or a stamp re-numbered does not; evidence sizes are bounded."""
    receipts = [receipt(i) for i in range(37)]
    signature, stamps = sign_batch(WORKER, receipts)
    for r, s in zip(receipts, stamps):
        verify(r, s)
        assert evidence_ok(s.signature) and len(s.signature) <= MAX_EVIDENCE
    with pytest.raises(ReceiptError, match="not signed"):
        verify(dataclasses.replace(receipts[3], price=3), stamps[3])
    with pytest.raises(ReceiptError):
        verify(receipts[3], ReceiptStamp(receipts[3].issued_at_us, stamps[4].signature))
    proof = BatchProof.decode(stamps[5].signature)
    with pytest.raises(ReceiptError, match="not signed"):
        verify(receipts[5], ReceiptStamp(receipts[5].issued_at_us, dataclasses.replace(proof, index=6).encode()))
    with pytest.raises(ReceiptError, match="Merkle path"):
        BatchProof.decode(stamps[5].signature + bytes(32))
    with pytest.raises(ReceiptError, match="naming itself"):
        sign_batch(BACKBONE, receipts)
    with pytest.raises(ReceiptError, match="1..256"):
        sign_batch(WORKER, [receipt(i) for i in range(MAX_RECEIPT_BATCH + 1)])
    assert not evidence_ok(bytes(65)) and not evidence_ok("x" * 64) and evidence_ok(bytes(64))


def test_a_ledger_event_keeps_batch_evidence_and_refuses_other_lengths():
    """An issue event stores a batch stamp as the worker signature; bytes of no valid shape are an EntryError."""
    r = receipt(1)
    _, (stamp,) = sign_batch(WORKER, [r])
    assert Event.issued(r, stamp).stamp == stamp
    with pytest.raises(EntryError, match="worker_sig"):
        Event.issued(r, ReceiptStamp(r.issued_at_us, bytes(70)))


def test_worker_keeps_unsigned_receipts_per_backbone_within_bounds():
    """Receipts leave when signed, in the order asked, only for the backbone they name; past the per-peer and the
    total caps the oldest are forgotten (counted), so a flood of identities cannot grow the book."""
    book = UnsignedReceipts(per_peer=3, total=5)
    others = [Identity.generate() for _ in range(3)]
    for i in range(4):
        book.add(receipt(i))
    assert len(book) == 3 and book.forgotten == 1
    assert book.take(str(others[0].peer_id), [receipt(1).dispatch_id]) == []
    assert book.take(str(BACKBONE.peer_id), [receipt(3).dispatch_id, receipt(0).dispatch_id, receipt(2).dispatch_id]) == [receipt(3), receipt(2)]
    assert len(book) == 1
    for j, other in enumerate(others):
        book.add(receipt(10 + j, backbone=other))
        book.add(receipt(20 + j, backbone=other))
    assert len(book) == 5 and book.forgotten == 3  # BACKBONE's last receipt, then the oldest of the first other
    assert book.take(str(BACKBONE.peer_id), [receipt(1).dispatch_id]) == []


def test_backbone_asks_for_a_batch_when_full_or_late_and_everything_at_a_flush():
    """A worker's receipts fall due when `size` wait or the oldest waited `delay`; a flush asks for all; each batch
    has its deadline; len counts receipts without a verdict."""
    pending: PendingReceipts[str] = PendingReceipts(delay=0.05, size=3, deadline=2.0)
    other = Identity.generate()
    assert not pending.add(receipt(0), "h", now=10.0)
    assert not pending.add(receipt(1), "h", now=10.01)
    assert pending.next_due() == pytest.approx(10.05)
    assert pending.due(10.04) == []
    assert pending.add(receipt(2), "h", now=10.02)  # full: due at once
    (batch,) = pending.due(10.02)
    assert [p.receipt for p in batch.items] == [receipt(0), receipt(1), receipt(2)] and batch.deadline == pytest.approx(12.02)
    pending.add(receipt(3), "h", now=10.03)
    pending.add(receipt(4, worker=other), "o", now=10.07)
    assert len(pending) == 5 and pending.next_due() == pytest.approx(10.08)
    (late,) = pending.due(10.09)
    assert late.worker == str(WORKER.peer_id) and [p.receipt for p in late.items] == [receipt(3)]
    (rest,) = pending.due(10.09, flush=True)
    assert rest.worker == str(other.peer_id)
    for b in (batch, late, rest):
        pending.done(b)
    assert len(pending) == 0 and pending.next_due() is None


def test_a_convicted_worker_s_receipts_are_disputed_once_signed():
    """Convicting a worker marks its waiting and asked-for receipts (not other workers'), first reason kept."""
    pending: PendingReceipts[str] = PendingReceipts(size=2)
    other = Identity.generate()
    pending.add(receipt(0), "h", 0.0)
    pending.add(receipt(1), "h", 0.0)
    (asked,) = pending.due(0.0)
    pending.add(receipt(2), "h", 0.0, dispute="spot check")
    pending.add(receipt(3, worker=other), "o", 0.0)
    assert {r.dispatch_id for r in pending.convict(str(WORKER.peer_id), "caught")} == {receipt(i).dispatch_id for i in range(3)}
    assert [p.dispute for p in asked.items] == ["caught", "caught"]
    assert [p.dispute for p in pending.due(0.0, flush=True)[0].items] == ["spot check"]


def batch_of(receipts: list[Receipt]) -> Batch[str]:
    pending: PendingReceipts[str] = PendingReceipts(size=len(receipts))
    for r in receipts:
        pending.add(r, "h", 0.0)
    return pending.due(0.0)[0]


def test_judge_accepts_a_good_batch_and_the_other_path_and_names_what_is_unsigned():
    """A batch signature over our receipts signs them all (one on the other path is the one recorded); a forged
    signature signs none; a receipt missing from the batch, or another receipt signed for a dispatch, is unsigned."""
    ours = [receipt(i) for i in range(4)]
    worker_saw = [ours[0], ours[1], dataclasses.replace(ours[2], path="relay"), ours[3]]
    ids = [bytes.fromhex(r.dispatch_id) for r in worker_saw]
    signature, _ = sign_batch(WORKER, worker_saw)
    leaves = [leaf_hash(r) for r in worker_saw]
    verdict = judge(batch_of(ours), ids, leaves, signature, _variants)
    assert verdict.problem is None and not verdict.unsigned
    assert [p.receipt for p, _ in verdict.signed] == worker_saw
    for p, stamp in verdict.signed:
        verify(p.receipt, stamp)

    forged = Identity.generate().sign(batch_message(merkle_root(leaves), len(leaves)))  # the right root, another key
    bad = judge(batch_of(ours), ids, leaves, forged, _variants)
    assert not bad.signed and len(bad.unsigned) == 4 and "not signed by worker" in (bad.problem or "")

    greedy = [ours[0], dataclasses.replace(ours[1], work_units=ours[1].work_units * 2)]  # claims twice the work
    sig, _ = sign_batch(WORKER, greedy)
    partial = judge(batch_of(ours), ids[:2], [leaf_hash(r) for r in greedy], sig, _variants)
    assert [p.receipt for p, _ in partial.signed] == [ours[0]]
    assert {p.receipt.dispatch_id for p in partial.unsigned} == {r.dispatch_id for r in ours[1:]}
    assert "another receipt" in (partial.problem or "") and "3 of 4" in (partial.problem or "")
