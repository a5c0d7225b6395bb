"""Paid-work ledger in memory and on disk: hash chain, signatures, tamper evidence, replay refusal, totals, export.

Crash safety and the CLI run real processes: tests/integration/test_ledger_cli.py."""

from __future__ import annotations

import csv
import io
import json
import shutil
import sqlite3
from functools import lru_cache
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from node.ledger.receipts import Receipt, ReceiptError, ReceiptStamp, sign, work_units
from node.ledger.store import (
    COLUMNS,
    GENESIS,
    ChainChecker,
    ChainError,
    DispatchRef,
    Entry,
    EntryError,
    Event,
    Kind,
    Ledger,
    LedgerError,
    ReplayError,
    Role,
    Status,
    TransitionError,
    countersign,
    decode_row,
    ref_of,
    verify_countersignature,
)  # fmt: skip
from p2p.identity import Identity
from tests.support import FakeClock

DIGEST = "ab" * 32


def make_receipt(worker: Identity, backbone: Identity, i: int, price: int = 2) -> tuple[Receipt, ReceiptStamp]:
    r = Receipt(
        dispatch_id=f"{i:032x}", backbone=str(backbone.peer_id), worker=str(worker.peer_id), model_digest=DIGEST,
        layer=i % 4, expert_ids=(1, 5), n_tokens=2, work_units=work_units(3 + i % 2, 64, 32), bytes_in=1000 + i,
        bytes_out=600, codec="f32", path="direct", issued_at_us=10_000 + i, price=price, request_digest="11" * 32,
        result_digest="22" * 32,
    )  # fmt: skip
    return r, sign(worker, r)


def fill_backbone(path: Path, backbone, w1, w2, clock=None) -> list[Receipt]:
    """7 entries: receipts 0-2 of w1 and 3-4 of w2 accepted, receipt 1 disputed, receipt 3 paid."""
    receipts = [make_receipt(w1 if i < 3 else w2, backbone, i, price=2 if i < 3 else 5) for i in range(5)]
    with Ledger(path, "backbone", backbone, clock=clock or FakeClock(1_700_000_000.0)) as led:
        for r, stamp in receipts:
            led.append_receipt(r, stamp)
        led.append_batch([Event.disputed(ref_of(receipts[1][0]), "spot check mismatch"), Event.paid(ref_of(receipts[3][0]), "batch 7")])
    return [r for r, _ in receipts]


def fill_worker(path: Path, worker, backbone) -> list[Receipt]:
    """4 entries: receipt 0 issued then countersigned, receipt 1 issued, receipt 2 accepted with its countersignature."""
    rs = [make_receipt(worker, backbone, i) for i in range(3)]
    with Ledger(path, "worker", worker) as led:
        led.append_receipt(*rs[0])
        led.append_receipt(*rs[1])
        led.append(Event.countersigned(ref_of(rs[0][0]), countersign(backbone, *rs[0])))
        led.append_receipt(*rs[2], countersign(backbone, *rs[2]))
    return [r for r, _ in rs]


def test_chain_and_signatures_verify_on_both_sides(tmp_path, parties):
    """A backbone and a worker ledger verify after receipts, countersignatures, a dispute and a payment."""
    backbone, w1, w2 = parties
    fill_backbone(tmp_path / "b.sqlite", backbone, w1, w2)
    fill_worker(tmp_path / "w.sqlite", w1, backbone)
    with Ledger(tmp_path / "b.sqlite") as led:
        report = led.verify()
        assert report.ok and report.entries == 7 and str(report).startswith("ok: 7 entries")
        assert [(e.seq, e.event.kind, e.status) for e in led.entries()][4:] == [
            (5, Kind.ACCEPT, Status.COUNTERSIGNED), (6, Kind.DISPUTE, Status.DISPUTED), (7, Kind.PAY, Status.PAID)]
        entries = list(led.entries())
        assert entries[0].prev_hash == GENESIS and all(b.prev_hash == a.entry_hash for a, b in zip(entries, entries[1:]))
    with Ledger(tmp_path / "w.sqlite") as led:
        assert led.role is Role.WORKER and led.verify().ok
        assert [e.status for e in led.entries()] == [Status.ISSUED, Status.ISSUED, Status.COUNTERSIGNED, Status.COUNTERSIGNED]


def test_countersignature_binds_receipt_stamp_and_backbone(parties):
    """The countersignature verifies only for the same receipt, worker signature and backbone key."""
    backbone, worker, other = parties
    r, stamp = make_receipt(worker, backbone, 1)
    cs = countersign(backbone, r, stamp)
    verify_countersignature(r, stamp, cs)
    with pytest.raises(ReceiptError, match="not countersigned"):
        verify_countersignature(Receipt(**{**r.__dict__, "price": 3}), stamp, cs)
    with pytest.raises(ReceiptError, match="not countersigned"):
        verify_countersignature(r, ReceiptStamp(stamp.issued_at_us, bytes(64)), cs)
    with pytest.raises(ReceiptError, match="not countersigned"):
        verify_countersignature(r, stamp, other.sign(b"x"))
    with pytest.raises(ReceiptError, match="naming itself"):
        countersign(other, r, stamp)


def tampered_copies(src: Path, tmp: Path, seq: int, table: str = "entries", key: str = "seq"):
    """Yield (column, copy) with one column of one row changed: a new value, then a value of another SQLite type."""
    con = sqlite3.connect(src)
    row = con.execute(f"SELECT * FROM {table} WHERE {key} = ?", (seq,)).fetchone()
    names = [d[0] for d in con.execute(f"SELECT * FROM {table}").description]
    con.close()
    for name, value in zip(names, row):
        if name == "id":
            continue
        for new in (changed(value), retyped(value)):
            dst = tmp / f"{table}-{seq}-{name}-{type(new).__name__}.sqlite"
            shutil.copy(src, dst)
            con = sqlite3.connect(dst)
            con.execute("PRAGMA synchronous=OFF")  # a throwaway copy
            con.execute(f"UPDATE {table} SET {name} = ? WHERE rowid = (SELECT rowid FROM {table} WHERE {key} = ?)", (new, seq))
            con.commit()
            stored = con.execute(f"SELECT {name} FROM {table} ORDER BY rowid LIMIT 1 OFFSET ?", (seq - 1 if table == "entries" else 0,)).fetchone()[0]
            con.close()
            assert stored != value or type(stored) is not type(value), f"tampering {name} changed nothing"
            yield name, dst


def changed(value):
    if value is None:
        return 0
    if isinstance(value, int):
        return value + 1000
    if isinstance(value, str):
        return ("1" if value[:1] == "0" else "0") + value[1:]  # the first character: no clash with another row's key
    return value[:-1] + bytes([value[-1] ^ 1])


def retyped(value):
    if value is None:
        return b""
    if isinstance(value, int):
        return f"x{value}"
    if isinstance(value, str):
        return value.encode()
    return value.hex()


def test_editing_any_column_of_any_entry_names_that_entry(tmp_path, parties):
    """Every column of a receipt, a dispute and a countersign entry, edited in the file, fails verify at that seq."""
    backbone, w1, w2 = parties
    fill_backbone(tmp_path / "b.sqlite", backbone, w1, w2)
    fill_worker(tmp_path / "w.sqlite", w1, backbone)
    checked = 0
    for src, seq in ((tmp_path / "b.sqlite", 3), (tmp_path / "b.sqlite", 6), (tmp_path / "b.sqlite", 7), (tmp_path / "w.sqlite", 3)):
        for name, copy in tampered_copies(src, tmp_path, seq):
            with Ledger(copy) as led:
                report = led.verify()
            assert not report.ok and report.bad_seq == seq, (src.name, seq, name, report)
            checked += 1
    assert checked == 4 * 2 * len(COLUMNS)


def test_editing_the_signed_head_fails_verify(tmp_path, parties):
    """Changing the head's seq, hash, signature, role or owner is caught (at open or by verify)."""
    backbone, w1, w2 = parties
    fill_backbone(tmp_path / "b.sqlite", backbone, w1, w2)
    for name, copy in tampered_copies(tmp_path / "b.sqlite", tmp_path, 1, table="head", key="id"):
        try:
            with Ledger(copy) as led:
                assert not led.verify().ok, name
        except LedgerError as exc:
            assert name in ("role", "owner"), exc  # a head naming no valid role or owner is refused when opening


def raw_rows(path: Path) -> list[tuple]:
    con = sqlite3.connect(path)
    rows = con.execute(f"SELECT {', '.join(COLUMNS)} FROM entries ORDER BY rowid").fetchall()
    con.close()
    return rows


def test_deleted_reordered_and_truncated_entries_are_detected(tmp_path, parties):
    """A deleted middle row, two swapped rows and a cut-off tail each fail verify at the right seq."""
    backbone, w1, w2 = parties
    src = tmp_path / "b.sqlite"
    fill_backbone(src, backbone, w1, w2)
    rows = raw_rows(src)
    cases = {
        "delete": (["DELETE FROM entries WHERE seq = 4"], 4, "missing"),
        "swap": (["DELETE FROM entries WHERE seq IN (3, 4)", ("rowid3", rows[3]), ("rowid4", rows[2])], 3, "stored seq is 4"),
        "truncate": (["DELETE FROM entries WHERE seq = 7"], 7, "missing"),
    }
    for case, (steps, bad, problem) in cases.items():
        dst = tmp_path / f"{case}.sqlite"
        shutil.copy(src, dst)
        con = sqlite3.connect(dst)
        for step in steps:
            if isinstance(step, str):
                con.execute(step)
            else:
                con.execute(f"INSERT INTO entries (rowid, {', '.join(COLUMNS)}) VALUES ({step[0][-1]}, {', '.join('?' * len(COLUMNS))})", step[1])
        con.commit()
        con.close()
        with Ledger(dst) as led:
            report = led.verify()
        assert (report.ok, report.bad_seq) == (False, bad) and problem in report.problem, (case, report)


def test_chain_rewritten_with_recomputed_hashes_is_caught_by_the_signed_head(tmp_path, parties):
    """Turning a dispute into a payment and recomputing every hash still fails: the head signature doesn't match."""
    backbone, w1, w2 = parties
    src = tmp_path / "b.sqlite"
    fill_backbone(src, backbone, w1, w2)
    con = sqlite3.connect(src)
    rows = raw_rows(src)
    prev = GENESIS
    for row in rows:
        entry, _ = decode_row(row)
        if entry.event.kind is Kind.DISPUTE:
            entry = Entry(entry.seq, prev, entry.role, Status.PAID, entry.created_at_us, Event.paid(entry.event.ref))
        entry = Entry(entry.seq, prev, entry.role, entry.status, entry.created_at_us, entry.event)
        con.execute("DELETE FROM entries WHERE seq = ?", (entry.seq,))
        con.execute(f"INSERT INTO entries ({', '.join(COLUMNS)}) VALUES ({', '.join('?' * len(COLUMNS))})", entry.row())
        prev = entry.entry_hash
    con.commit()
    con.close()
    with Ledger(src) as led:
        report = led.verify()
    assert not report.ok and "head" in report.problem and "rewritten" in report.problem


def test_replayed_receipt_is_refused_and_batches_are_all_or_nothing(tmp_path, parties):
    """The same dispatch twice is refused, by the API and by the table's unique key; a bad batch stores nothing."""
    backbone, w1, w2 = parties
    path = tmp_path / "b.sqlite"
    fill_backbone(path, backbone, w1, w2)
    again = make_receipt(w1, backbone, 0)
    fresh = make_receipt(w1, backbone, 99)
    with Ledger(path, "backbone", backbone) as led:
        with pytest.raises(ReplayError, match="already recorded"):
            led.append_receipt(*again)
        with pytest.raises(ReplayError):
            led.append_batch([led.receipt_event(*fresh), led.receipt_event(*fresh)])
        assert len(led) == 7 and led.status(ref_of(fresh[0])) is None and led.verify().ok
        other_backbone = make_receipt(w1, Identity.generate(), 99)
        with pytest.raises(EntryError, match="belongs to"):
            led.append(Event.accepted(*other_backbone, bytes(64)))
    con = sqlite3.connect(path)
    with pytest.raises(sqlite3.IntegrityError, match="UNIQUE"):
        con.execute(f"INSERT INTO entries ({', '.join(COLUMNS)}) SELECT 99, {', '.join(COLUMNS[1:])} FROM entries WHERE seq = 1")
    con.close()


def test_status_changes_follow_the_transition_table(tmp_path, parties):
    """Paying a disputed receipt, disputing an unknown one, or countersigning twice is refused; a forged countersignature too."""
    backbone, w1, w2 = parties
    rs = fill_backbone(tmp_path / "b.sqlite", backbone, w1, w2)
    with Ledger(tmp_path / "b.sqlite", "backbone", backbone) as led:
        with pytest.raises(TransitionError, match="cannot pay .* disputed"):
            led.append(Event.paid(ref_of(rs[1])))
        with pytest.raises(TransitionError, match="not recorded"):
            led.append(Event.disputed(DispatchRef("ff" * 16, rs[0].worker, rs[0].backbone), "x"))
        with pytest.raises(TransitionError, match="countersigned"):
            led.append(Event.countersigned(ref_of(rs[0]), bytes(64)))
        with pytest.raises(TransitionError, match="paid"):
            led.append(Event.disputed(ref_of(rs[3]), "found wrong after payment"))
    rw = fill_worker(tmp_path / "w.sqlite", w1, backbone)
    with Ledger(tmp_path / "w.sqlite", "worker", w1) as led:
        with pytest.raises(ReceiptError, match="not countersigned"):
            led.append(Event.countersigned(ref_of(rw[1]), w2.sign(b"forged")))
        assert led.status(ref_of(rw[1])) is Status.ISSUED and led.verify().ok


def test_disputed_receipts_earn_nothing_and_totals_filter(tmp_path, parties):
    """Totals per worker count a dispute as disputed with no credit; --peer and --since narrow them."""
    backbone, w1, w2 = parties
    clock = FakeClock(1000.0)
    path = tmp_path / "b.sqlite"
    rs = fill_backbone(path, backbone, w1, w2, clock)
    wu = [r.work_units for r in rs]
    with Ledger(path) as led:
        by_peer = {t.peer_id: t for t in led.totals()}
        t1, t2 = by_peer[str(w1.peer_id)], by_peer[str(w2.peer_id)]
        assert (t1.role, t1.dispatches, t1.disputed, t1.work_units, t1.credits) == ("worker", 3, 1, wu[0] + wu[2], 2 * (wu[0] + wu[2]))
        assert (t2.dispatches, t2.disputed, t2.credits) == (2, 0, 5 * (wu[3] + wu[4]))
        assert led.totals(peer=str(w2.peer_id)) == [t2]
        assert led.totals(since=1000.5) == []
    clock.now = 2000.0
    late = make_receipt(w2, backbone, 50)
    with Ledger(path, "backbone", backbone, clock=clock) as led:
        led.append_receipt(*late)
        assert [(t.peer_id, t.dispatches) for t in led.totals(since=1500)] == [(str(w2.peer_id), 1)]


def test_export_csv_and_jsonl_round_trip_counts(tmp_path, parties):
    """Both exports hold every entry; credits recomputed from them match totals()."""
    backbone, w1, w2 = parties
    path = tmp_path / "b.sqlite"
    fill_backbone(path, backbone, w1, w2)
    with Ledger(path) as led:
        credits = sum(t.credits for t in led.totals())
        outs = {fmt: io.StringIO() for fmt in ("csv", "jsonl")}
        assert [led.export(fmt, out) for fmt, out in outs.items()] == [7, 7]
    from_csv = list(csv.DictReader(io.StringIO(outs["csv"].getvalue())))
    from_jsonl = [json.loads(line) for line in outs["jsonl"].getvalue().splitlines()]
    for recs, num in ((from_csv, int), (from_jsonl, lambda v: v)):
        assert len(recs) == 7 and [int(r["seq"]) for r in recs] == list(range(1, 8))
        disputed = {r["dispatch_id"] for r in recs if r["kind"] == "dispute"}
        got = sum(num(r["work_units"]) * num(r["price"]) for r in recs if r["kind"] == "accept" and r["dispatch_id"] not in disputed)
        assert got == credits and len(disputed) == 1
    assert from_jsonl[0]["entry_hash"] == from_csv[0]["entry_hash"] and len(bytes.fromhex(from_jsonl[0]["entry_hash"])) == 32


def test_opening_checks_file_role_and_owner(tmp_path, parties):
    """Missing files, non-ledgers, another role or another owner's key are refused with a clear error."""
    backbone, w1, w2 = parties
    path = tmp_path / "b.sqlite"
    fill_backbone(path, backbone, w1, w2)
    with pytest.raises(LedgerError, match="no ledger at"):
        Ledger(tmp_path / "missing.sqlite")
    (tmp_path / "notes.txt").write_text("not a database " * 100)
    with pytest.raises(LedgerError, match="not a moeswarm ledger"):
        Ledger(tmp_path / "notes.txt")
    other = sqlite3.connect(tmp_path / "other.sqlite")
    other.execute("CREATE TABLE t (x)")
    other.close()
    with pytest.raises(LedgerError, match="not a moeswarm ledger"):
        Ledger(tmp_path / "other.sqlite", "backbone", backbone)
    with pytest.raises(LedgerError, match="not a worker ledger"):
        Ledger(path, "worker", backbone)
    with pytest.raises(LedgerError, match="belongs to"):
        Ledger(path, "backbone", w1)
    with Ledger(path) as led, pytest.raises(LedgerError, match="read-only"):
        led.append(Event.paid(ref_of(make_receipt(w1, backbone, 0)[0])))


# -- the sans-IO core, without SQLite


@lru_cache(maxsize=1)
def pure_chain() -> tuple[Role, str, tuple[tuple, ...]]:
    """A worker-side chain built with the pure functions only: issue, issue, countersign, accept, dispute."""
    backbone, worker = Identity.generate(), Identity.generate()
    (r0, s0), (r1, s1), (r2, s2) = (make_receipt(worker, backbone, i) for i in range(3))
    events = [Event.issued(r0, s0), Event.issued(r1, s1), Event.countersigned(ref_of(r0), countersign(backbone, r0, s0)),
              Event.accepted(r2, s2, countersign(backbone, r2, s2)), Event.disputed(ref_of(r1), "never countersigned")]  # fmt: skip
    statuses = [Status.ISSUED, Status.ISSUED, Status.COUNTERSIGNED, Status.COUNTERSIGNED, Status.DISPUTED]
    rows, prev = [], GENESIS
    for seq, (ev, status) in enumerate(zip(events, statuses), 1):
        e = Entry(seq, prev, Role.WORKER, status, 5_000_000 + seq, ev)
        rows.append(e.row())
        prev = e.entry_hash
    return Role.WORKER, str(worker.peer_id), tuple(rows)


def check_chain(rows) -> ChainChecker:
    role, owner, _ = pure_chain()
    by_seq = {}
    checker = ChainChecker(role, owner, lambda seq: by_seq[seq])
    for row in rows:
        entry = checker.feed(row)
        by_seq[entry.seq] = entry.event
    return checker


def test_pure_chain_checks_out():
    """The pure checker accepts a chain built from events without any storage."""
    assert check_chain(pure_chain()[2]).seq == 5


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 4), st.integers(0, len(COLUMNS) - 1), st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1), st.text(max_size=80), st.binary(max_size=80), st.floats()))
def test_any_changed_value_in_any_row_is_detected_there(index, column, value):
    """Replacing one value of one stored row by any other value makes the checker fail at that row."""
    rows = [list(r) for r in pure_chain()[2]]
    original = rows[index][column]
    if type(value) is type(original) and value == original:
        return
    rows[index][column] = value
    with pytest.raises(ChainError) as info:
        check_chain(rows)
    assert info.value.seq == index + 1


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(st.none(), st.integers(), st.text(max_size=40), st.binary(max_size=70)), min_size=len(COLUMNS) - 1, max_size=len(COLUMNS) + 1))
def test_decode_row_never_crashes(row):
    """Arbitrary rows decode or raise EntryError, nothing else."""
    try:
        decode_row(row)
    except EntryError:
        pass
