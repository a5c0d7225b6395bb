"""Witnessed ledger heads: the verdict table, forged heads refused, evidence kept, the LEDGER_HEAD frame."""

from __future__ import annotations

import pytest

from node.ledger.store import EntryError, Ledger, Role
from node.ledger.witness import UNKNOWN, SignedHead, Verdict, judge
from p2p.wire import messages as wire
from tests.support import FakeClock
from tests.unit.test_ledger import make_receipt


def head(seq: int, h: bytes = b"\1" * 32) -> SignedHead:
    return SignedHead(Role.WORKER, "w", seq, h, b"s" * 64)


@pytest.mark.parametrize(
    "held, new, answer, verdict",
    [
        (None, head(3), UNKNOWN, Verdict.NEW),
        (head(3), head(3), UNKNOWN, Verdict.SAME),
        (head(3), head(3, b"\2" * 32), UNKNOWN, Verdict.FORKED),
        (head(3), head(2), UNKNOWN, Verdict.ROLLED_BACK),
        (head(3), head(9), UNKNOWN, Verdict.ADVANCED),  # the entry is archived: cannot say
        (head(3), head(9), b"\1" * 32, Verdict.ADVANCED),
        (head(3), head(9), b"\3" * 32, Verdict.ROLLED_BACK),  # grew again, but not from what it signed
    ],
)
def test_judge(held, new, answer, verdict):
    """A head with fewer entries, another hash at the same seq, or another entry at the held seq is a rollback."""
    assert judge(held, new, answer) is verdict


def test_a_ledger_keeps_the_highest_head_and_records_rollbacks_as_evidence(tmp_path, parties):
    """The worker's real signed heads, witnessed in the backbone's ledger: growth is kept, a rollback is evidence."""
    backbone, worker, other = parties
    with Ledger(tmp_path / "w.sqlite", "worker", worker) as wled, Ledger(tmp_path / "b.sqlite", "backbone", backbone, clock=FakeClock(1e9)) as bled:
        heads = []
        for i in range(3):
            wled.append_receipt(*make_receipt(worker, backbone, i))
            heads.append(wled.head())
        assert bled.witness(heads[1]) is Verdict.NEW and bled.witness(heads[1]) is Verdict.SAME
        assert bled.witness(heads[2], wled.hash_at(heads[1].seq)) is Verdict.ADVANCED
        assert bled.witness(heads[0]) is Verdict.ROLLED_BACK
        assert bled.witnessed(str(worker.peer_id)) == heads[2]  # the higher head stays held
        [(held, got, verdict)] = bled.conflicts()
        assert (held, got, verdict) == (heads[2], heads[0], "rolled_back")
        forged = SignedHead(Role.WORKER, str(worker.peer_id), 7, b"\0" * 32, other.sign(b"x"))
        with pytest.raises(EntryError, match="not signed"):
            bled.witness(forged)
        assert wled.hash_at(99) == UNKNOWN and wled.hash_at(1) != UNKNOWN


def test_ledger_head_frame_round_trips_and_refuses_bad_sizes():
    """LEDGER_HEAD encodes to its fixed 145-byte body and back; wrong sizes are field errors."""
    m = wire.LedgerHead(wire.Role.WORKER, 5, b"a" * 32, b"b" * 64, 3, b"c" * 32)
    assert wire.decode(m.encode()) == m and len(m.encode()) == wire.HEADER_LEN + 145
    with pytest.raises(wire.InvalidField, match="signature"):
        wire.LedgerHead(wire.Role.WORKER, 5, b"a" * 32, b"b" * 63)
    with pytest.raises(wire.Truncated):
        wire.decode(m.encode()[:-1])
