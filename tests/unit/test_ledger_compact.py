"""Ledger compaction and reconciliation: the settled prefix, the signed checkpoint, edits still caught, totals kept.

The command line runs in real processes: tests/integration/test_ledger_cli.py."""

from __future__ import annotations

import gzip
import hashlib
import json
import shutil
import sqlite3

import pytest

from node.ledger.checkpoint import CLOCK_SKEW_US, Checkpoint, Span, settled_prefix
from node.ledger.receipts import Receipt, sign
from node.ledger.reconcile import reconcile
from node.ledger.store import EntryError, Event, Ledger, ReplayError, Status, ref_of
from tests.support import FakeClock
from tests.unit.test_ledger import make_receipt

DAY = 86400.0
T0 = 1_700_000_000.0
C, P, D, ISS = Status.COUNTERSIGNED, Status.PAID, Status.DISPUTED, Status.ISSUED


def at(receipt_and_stamp, when: float):
    """The receipt re-issued (and re-signed by *worker*) at *when*, unix seconds."""
    r, _ = receipt_and_stamp
    return r.__class__(**{**r.__dict__, "issued_at_us": int(when * 1e6)})


@pytest.mark.parametrize(
    "spans, expect",
    [
        ([], 0),
        ([Span(1, 1, C, 0), Span(2, 3, P, 0)], 3),  # all old: everything goes
        ([Span(1, 1, C, 0), Span(2, 2, C, 10 * DAY * 1e6)], 1),  # the second changed recently
        ([Span(1, 4, D, 0), Span(2, 2, C, 0), Span(3, 3, C, 10 * DAY * 1e6)], 0),  # 1's dispute is after the fresh 3
        ([Span(1, 1, P, 10 * DAY * 1e6), Span(2, 2, ISS, 0)], 2),  # paid and disputed are final however recent
        ([Span(1, 1, ISS, 10 * DAY * 1e6)], 0),
    ],
)
def test_settled_prefix_cuts_only_where_every_dispatch_begun_is_settled_and_ended(spans, expect):
    """The prefix ends before the first open dispatch and never splits a dispatch's entries."""
    assert settled_prefix(spans, now_us=int(10 * DAY * 1e6), window_s=7 * DAY) == expect


def test_settled_prefix_starts_after_an_earlier_checkpoint():
    """With nothing new settled the answer is the earlier checkpoint's seq."""
    assert settled_prefix([Span(6, 6, ISS, 10**15)], now_us=10**15, start=5) == 5
    assert settled_prefix([Span(6, 7, P, 10**15)], now_us=10**15, start=5) == 7


def filled(path, backbone, w1, w2, clock):
    """7 old entries (5 receipts, a dispute, a payment) at T0, then 2 receipts 10 days later."""
    receipts = [make_receipt(w1 if i < 3 else w2, backbone, i, price=2 if i < 3 else 5) for i in range(7)]
    led = Ledger(path, "backbone", backbone, clock=clock)
    for r, stamp in receipts[:5]:
        led.append_receipt(r, stamp)
    led.append_batch([Event.disputed(ref_of(receipts[1][0]), "spot check mismatch"), Event.paid(ref_of(receipts[3][0]), "batch 7")])
    clock.advance(10 * DAY)
    for raw in receipts[5:]:
        r = at(raw, clock.now)
        led.append_receipt(r, sign(w2, r))
    return led


def test_compaction_archives_the_settled_prefix_and_keeps_the_chain_verifiable(tmp_path, parties):
    """7 settled entries go to a gzipped archive under a signed checkpoint; verify and totals still hold."""
    backbone, w1, w2 = parties
    clock = FakeClock(T0)
    with filled(tmp_path / "ledger.sqlite", backbone, w1, w2, clock) as led:
        before = (led.totals(), led.day_totals())
        report = led.compact(window_s=7 * DAY)
        assert (report.through_seq, report.archived, report.kept) == (7, 7, 2)
        assert [e.seq for e in led.entries()] == [8, 9]
        check = led.verify()
        assert check.ok and (check.entries, check.archived) == (2, 7), check
        assert "entries 1-7 archived" in str(check)
        assert (led.totals(), led.day_totals()) == before  # archived days are in the checkpoint's totals
        cp = led.checkpoint()
    data = report.archive.read_bytes()
    assert cp is not None and cp.archive_digest == hashlib.sha256(data).hexdigest()
    lines = [json.loads(x) for x in gzip.decompress(data).splitlines()]
    assert lines[0]["previous_checkpoint"] is None and [x["seq"] for x in lines[1:]] == list(range(1, 8))
    assert lines[-1]["entry_hash"] == cp.through_hash.hex()


def edit(src, dst, sql, *args):
    shutil.copy(src, dst)
    con = sqlite3.connect(dst)
    con.execute(sql, args)
    con.commit()
    con.close()
    return dst


def test_after_compaction_an_edit_of_any_kept_entry_or_of_the_checkpoint_is_caught(tmp_path, parties):
    """Changed kept columns fail verify at their seq; a changed or removed checkpoint fails before the chain."""
    backbone, w1, w2 = parties
    src = tmp_path / "ledger.sqlite"
    with filled(src, backbone, w1, w2, FakeClock(T0)) as led:
        led.compact(window_s=7 * DAY)
    for col, value in (("price", 99), ("result_digest", "33" * 32), ("created_at_us", 1), ("prev_hash", b"\1" * 32), ("worker_sig", b"\2" * 64)):
        for seq in (8, 9):
            copy = edit(src, tmp_path / f"{col}{seq}.sqlite", f"UPDATE entries SET {col} = ? WHERE seq = ?", value, seq)
            with Ledger(copy) as bad:
                report = bad.verify()
            assert not report.ok and report.bad_seq == seq, (col, seq, report)
    body = json.loads(sqlite3.connect(src).execute("SELECT body FROM checkpoint").fetchone()[0])
    body["totals"][0]["credits"] += 1
    forged = edit(src, tmp_path / "forged.sqlite", "UPDATE checkpoint SET body = ?", json.dumps(body))
    gone = edit(src, tmp_path / "gone.sqlite", "DELETE FROM checkpoint")
    garbled = edit(src, tmp_path / "garbled.sqlite", "UPDATE checkpoint SET body = 'x'")
    for copy, seq, problem in ((forged, 0, "not signed"), (gone, 1, "missing"), (garbled, 0, "malformed")):
        with Ledger(copy) as bad:
            report = bad.verify()
        assert not report.ok and report.bad_seq == seq and problem in report.problem, report


def test_after_compaction_old_receipts_are_refused_as_replays_and_new_ones_append(tmp_path, parties):
    """A receipt issued before the checkpoint's cutoff (plus skew) cannot be told from a replay: refused."""
    backbone, w1, w2 = parties
    clock = FakeClock(T0)
    with filled(tmp_path / "ledger.sqlite", backbone, w1, w2, clock) as led:
        led.compact(window_s=7 * DAY)
        cutoff = led.checkpoint().cutoff_us
        old = at(make_receipt(w1, backbone, 100), (cutoff + CLOCK_SKEW_US) / 1e6)
        with pytest.raises(ReplayError, match="checkpoint"):
            led.append_receipt(old, sign(w1, old))
        new = at(make_receipt(w1, backbone, 101), clock.now)
        assert led.append_receipt(new, sign(w1, new)).seq == 10
        assert led.verify().ok


def test_a_second_compaction_chains_on_the_first(tmp_path, parties):
    """Compacting again archives the next settled stretch, and the checkpoint totals accumulate."""
    backbone, w1, w2 = parties
    clock = FakeClock(T0)
    with filled(tmp_path / "ledger.sqlite", backbone, w1, w2, clock) as led:
        totals = led.totals()
        first = led.compact(window_s=7 * DAY)
        assert led.compact(window_s=7 * DAY).archived == 0  # 8 and 9 are recent
        clock.advance(8 * DAY)
        second = led.compact(window_s=7 * DAY)
        assert (second.through_seq, second.archived, second.kept, len(led)) == (9, 2, 0, 0)
        assert led.verify().ok and led.totals() == totals
    assert first.archive != second.archive and second.archive.name.endswith("-8-9.jsonl.gz")
    header = json.loads(gzip.decompress(second.archive.read_bytes()).splitlines()[0])
    assert Checkpoint.decode(header["previous_checkpoint"]).through_seq == 7


def test_a_ledger_that_does_not_verify_is_not_compacted(tmp_path, parties):
    """Compaction walks the chain first: damage is reported, never archived under the owner's signature."""
    backbone, w1, w2 = parties
    with filled(tmp_path / "ledger.sqlite", backbone, w1, w2, FakeClock(T0)):
        pass
    bad = edit(tmp_path / "ledger.sqlite", tmp_path / "bad.sqlite", "UPDATE entries SET price = 7 WHERE seq = 2")
    with Ledger(bad, identity=backbone) as led:
        with pytest.raises(EntryError, match="does not verify"):
            led.compact(window_s=7 * DAY)
        assert len(led) == 9 and led.checkpoint() is None


def test_compaction_keeps_the_file_bounded(tmp_path, parties):
    """Rounds of 400 appends then compaction: the file stops growing with the number of entries ever written."""
    backbone, w1, _ = parties
    clock = FakeClock(T0)
    sizes = []
    with Ledger(tmp_path / "ledger.sqlite", "backbone", backbone, clock=clock) as led:
        for rnd in range(3):
            batch = [at(make_receipt(w1, backbone, rnd * 1000 + i), clock.now) for i in range(400)]
            led.append_batch([led.receipt_event(r, sign(w1, r)) for r in batch])
            clock.advance(8 * DAY)
            sizes.append(led.compact(window_s=7 * DAY).bytes_after)
        assert led.verify().ok and sum(t.dispatches for t in led.totals()) == 1200
    assert max(sizes) <= min(sizes) * 1.5, sizes


def test_reconcile_lists_receipts_missing_on_either_side_and_differing_ones(parties):
    """Pure comparison of the two ledgers' receipts for one backbone/worker pair."""
    backbone, worker, other = parties
    rs = [make_receipt(worker, backbone, i)[0] for i in range(5)]
    foreign = make_receipt(other, backbone, 9)[0]
    changed = Receipt(**{**rs[4].__dict__, "price": 9, "bytes_out": 1})
    b, w = str(backbone.peer_id), str(worker.peer_id)
    result = reconcile(b, w, [rs[0], rs[1], rs[2], rs[4], foreign], [rs[0], rs[2], rs[3], changed])
    assert (result.compared, result.missing_at_worker, result.missing_at_backbone) == (5, (rs[1].dispatch_id,), (rs[3].dispatch_id,))
    assert [(d.dispatch_id, d.fields) for d in result.differing] == [(rs[4].dispatch_id, ("bytes_out", "price"))] and not result.ok
    assert reconcile(b, w, rs, rs).ok
    assert reconcile(b, w, rs[:2], [], after_us=rs[1].issued_at_us).missing_at_worker == ()  # archived: not compared
