"""The head record beside a ledger: torn writes fall back a slot, damage and rewrites are named, never a crash."""

from __future__ import annotations

import sqlite3

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from node.ledger import headfile
from node.ledger.entries import Role, head_bytes
from node.ledger.store import Ledger
from p2p.identity import Identity
from tests.unit.test_ledger import make_receipt

OWNER = Identity.generate()
WORKER = Identity.generate()


def fill(path, n: int) -> Ledger:
    led = Ledger(path, "backbone", OWNER)
    for i in range(n):
        led.append_receipt(*make_receipt(WORKER, OWNER, i))
    return led


def test_the_record_follows_every_commit_and_a_torn_slot_falls_back_one_commit(tmp_path):
    """After each commit the record names the head; garbling the newest slot (a torn write) leaves the one before."""
    path = tmp_path / "l.sqlite"
    with fill(path, 3) as led:
        head = led.head()
    generation, held = headfile.read(headfile.record_path(path))
    assert held == head and held.seq == 3
    record = headfile.record_path(path)
    data = bytearray(record.read_bytes())
    newest = (generation % 2) * headfile.SLOT
    data[newest + 40] ^= 0xFF
    record.write_bytes(bytes(data))
    assert headfile.read(record)[1].seq == 2  # the commit before: never more than the database holds
    assert Ledger(path).verify().ok


def test_a_record_with_no_readable_slot_fails_verify_and_a_writer_starts_a_new_one(tmp_path):
    """Both slots garbled: verify exits not ok naming the record; opening to append replaces it (logged) and verify passes."""
    path = tmp_path / "l.sqlite"
    fill(path, 2).close()
    headfile.record_path(path).write_bytes(b"\x00garbage" * 200)
    report = Ledger(path).verify()
    assert not report.ok and "head record" in str(report) and "damaged" in str(report)
    fill(path, 0).close()
    assert Ledger(path).verify().ok


def test_a_chain_rewritten_after_a_loss_is_caught_even_when_it_grew_back(tmp_path):
    """The file loses its last 2 entries, then a writer that knew nothing of the record (it was moved away) appends 2
    others: the same length, but another hash at the acknowledged seq, and verify names that entry."""
    path = tmp_path / "l.sqlite"
    fill(path, 4).close()
    record = headfile.record_path(path)
    acknowledged = record.read_bytes()  # names entry 4
    con = sqlite3.connect(path)
    (h,) = con.execute("SELECT entry_hash FROM entries WHERE seq = 2").fetchone()
    con.execute("DELETE FROM entries WHERE seq > 2")
    con.execute("UPDATE head SET seq = 2, hash = ?, signature = ?", (h, OWNER.sign(head_bytes(Role.BACKBONE, str(OWNER.peer_id), 2, h))))
    con.commit()
    con.close()
    record.unlink()
    with fill(path, 0) as led:
        for i in (10, 11):
            led.append_receipt(*make_receipt(WORKER, OWNER, i))
    assert Ledger(path).verify().ok  # by its own new record, all is well
    record.write_bytes(acknowledged)
    report = Ledger(path).verify()
    assert not report.ok and str(report).startswith("entry 4: not the entry acknowledged there"), report


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=3 * headfile.SLOT))
def test_any_record_bytes_read_as_a_head_or_one_error(tmp_path_factory, data):
    """Whatever the file holds, reading it returns a signed head or raises HeadRecordError, never anything else."""
    record = tmp_path_factory.mktemp("r") / "l.sqlite.head"
    record.write_bytes(data)
    try:
        got = headfile.read(record)
    except headfile.HeadRecordError:
        return
    assert got is not None


def test_a_record_of_another_ledger_is_refused_with_one_line(tmp_path):
    """A head record copied from another node's ledger: opening to append says whose it is instead of trusting it."""
    a, b = tmp_path / "a.sqlite", tmp_path / "b.sqlite"
    fill(a, 1).close()
    Ledger(b, "backbone", WORKER).close()
    headfile.record_path(b).write_bytes(headfile.record_path(a).read_bytes())
    with pytest.raises(headfile.LedgerError, match="belongs to the backbone ledger of"):
        Ledger(b, "backbone", WORKER)
