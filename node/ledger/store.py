"""The paid-work ledger file: SQLite storage for the hash-chained entries of :mod:`node.ledger.entries`.

WAL with ``synchronous=FULL``: an append that returned survives a crash. Appends come in
batches, one transaction each, and the owner re-signs the head after every batch; reads
verify the chain and the head (see the entries module for the theory of operation).
"""

from __future__ import annotations

import csv
import json
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import structlog

from node.ledger.entries import (  # noqa: F401  (re-exported: the ledger's public names)
    APPLICATION_ID,
    COLUMNS,
    FORMAT_VERSION,
    GENESIS,
    RECEIPT_COLUMNS,
    RECEIPT_KINDS,
    RECEIPT_TYPES,
    ChainChecker,
    ChainError,
    DispatchRef,
    Entry,
    EntryError,
    Event,
    Kind,
    LedgerCorrupt,
    LedgerError,
    ReplayError,
    Role,
    Status,
    TransitionError,
    VerifyReport,
    check_rules,
    countersign,
    decode_row,
    head_bytes,
    ref_of,
    verify_countersignature,
    verify_signatures,
)  # fmt: skip
from node.ledger.receipts import Receipt, ReceiptStamp, verify
from p2p.identity import Identity

log = structlog.get_logger("moeswarm.ledger")


FILENAME = "ledger.sqlite"  # inside a node's data directory ($MOESWARM_HOME/<role>/)


@dataclass(frozen=True)
class PeerTotals:
    peer_id: str
    role: str  # the peer's role: workers in a backbone ledger, backbones in a worker ledger
    dispatches: int
    work_units: int  # undisputed
    credits: int  # undisputed work_units * price
    disputed: int


_SCHEMA = f"""
CREATE TABLE entries (
    seq INTEGER NOT NULL UNIQUE, prev_hash BLOB NOT NULL, entry_hash BLOB NOT NULL,
    kind TEXT NOT NULL, status TEXT NOT NULL, role TEXT NOT NULL, created_at_us INTEGER NOT NULL,
    dispatch_id TEXT NOT NULL, worker TEXT NOT NULL, backbone TEXT NOT NULL,
    {", ".join(f"{n} {'INTEGER' if RECEIPT_TYPES[n] is int else 'TEXT'}" for n in RECEIPT_COLUMNS)},
    worker_sig BLOB, countersig BLOB, note TEXT NOT NULL,
    UNIQUE (dispatch_id, worker, backbone, kind)
);
CREATE TABLE head (
    id INTEGER PRIMARY KEY CHECK (id = 1), role TEXT NOT NULL, owner TEXT NOT NULL,
    seq INTEGER NOT NULL, hash BLOB NOT NULL, signature BLOB NOT NULL
);
"""
_SELECT = f"SELECT {', '.join(COLUMNS)} FROM entries"
_INSERT = f"INSERT INTO entries ({', '.join(COLUMNS)}) VALUES ({', '.join('?' * len(COLUMNS))})"


class Ledger:
    """One node's ledger file. With *identity* it is created if missing and appended to; without, only read.

    Rows are walked in insertion (rowid) order, so a renumbered or swapped row shows at its place.
    One process appends at a time; others (the CLI) may read meanwhile. :meth:`verify` holds this
    object's lock for the whole walk: a running node verifies through a second, read-only Ledger.
    """

    def __init__(self, path: str | Path, role: str | None = None, identity: Identity | None = None, *, clock: Callable[[], float] = time.time) -> None:
        self.path, self.identity, self.clock = Path(path), identity, clock
        self._lock = threading.Lock()
        want = Role(role) if role is not None else None
        exists = self.path.is_file()
        if not exists and (identity is None or self.path.exists()):
            raise LedgerError(f"no ledger at {self.path}")
        if not exists and want is None:
            raise LedgerError("creating a ledger needs its role (backbone or worker)")
        if identity is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            target = str(self.path) if identity else self.path.resolve().as_uri() + "?mode=ro"
            self._db = sqlite3.connect(target, uri=not identity, isolation_level=None, timeout=10, check_same_thread=False)
        except sqlite3.Error as exc:
            raise LedgerError(f"cannot open ledger {self.path}: {exc}") from None
        try:
            if not exists:
                assert want is not None and identity is not None  # checked above: a new ledger needs both
                self._create(want, identity)
            self.role, self.owner = self._header()
            if want is not None and self.role is not want:
                raise LedgerError(f"{self.path} is a {self.role} ledger, not a {want} ledger")
            if identity is not None:
                if str(identity.peer_id) != self.owner:
                    raise LedgerError(f"{self.path} belongs to {self.owner}, not to this node ({identity.peer_id})")
                self._db.execute("PRAGMA journal_mode=WAL")
                self._db.execute("PRAGMA synchronous=FULL")
        except BaseException:
            self._db.close()
            raise

    def _create(self, role: Role, identity: Identity) -> None:
        owner = str(identity.peer_id)
        self._db.execute("PRAGMA journal_mode=WAL")
        with self._transaction():
            self._db.execute(f"PRAGMA application_id={APPLICATION_ID}")
            self._db.execute(f"PRAGMA user_version={FORMAT_VERSION}")
            for stmt in _SCHEMA.split(";"):  # executescript() would commit first
                if stmt.strip():
                    self._db.execute(stmt)
            sig = identity.sign(head_bytes(role, owner, 0, GENESIS))
            self._db.execute("INSERT INTO head VALUES (1, ?, ?, 0, ?, ?)", (role.value, owner, GENESIS, sig))
        log.info("ledger.created", path=str(self.path), role=role.value, owner=owner)

    def _header(self) -> tuple[Role, str]:
        try:
            app, version = (self._db.execute(f"PRAGMA {p}").fetchone()[0] for p in ("application_id", "user_version"))
            if app != APPLICATION_ID:
                raise LedgerError(f"{self.path} is not a moeswarm ledger")
            if version != FORMAT_VERSION:
                raise LedgerError(f"{self.path} has ledger format {version}; this moeswarm reads format {FORMAT_VERSION}")
            row = self._db.execute("SELECT role, owner FROM head WHERE id = 1").fetchone()
        except sqlite3.DatabaseError as exc:
            raise LedgerError(f"{self.path} is not a moeswarm ledger ({exc})") from None
        if row is None or row[0] not in set(Role) or type(row[1]) is not str:
            raise LedgerError(f"{self.path} has no valid ledger head")
        return Role(row[0]), row[1]

    @contextmanager
    def _transaction(self, mode: str = "IMMEDIATE") -> Iterator[None]:
        self._db.execute(f"BEGIN {mode}")
        try:
            yield
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- writing

    def receipt_event(self, receipt: Receipt, stamp: ReceiptStamp, countersig: bytes | None = None, *, verified: bool = False) -> Event:
        """The event recording *receipt*: a backbone countersigns it; a worker passes a countersignature it learned, if any.

        ``verified=True`` skips re-checking a worker signature the caller has just checked with
        :func:`node.receipts.verify`; a countersignature from elsewhere is always checked.
        """
        if not verified:
            verify(receipt, stamp)
        if countersig is None and self.role is Role.BACKBONE:
            countersig = countersign(self._writer(), receipt, stamp)
        elif countersig is not None:
            verify_countersignature(receipt, stamp, countersig)
        return Event.accepted(receipt, stamp, countersig) if countersig is not None else Event.issued(receipt, stamp)

    def append_receipt(self, receipt: Receipt, stamp: ReceiptStamp, countersig: bytes | None = None, *, verified: bool = False) -> Entry:
        return self.append_batch([self.receipt_event(receipt, stamp, countersig, verified=verified)], check_signatures=False)[0]

    def append(self, event: Event) -> Entry:
        return self.append_batch([event])[0]

    def append_batch(self, events: Iterable[Event], *, check_signatures: bool = True) -> list[Entry]:
        """Chain *events* in one transaction (all or none) and re-sign the head; durable once this returns.

        ``check_signatures=False`` is for events whose signatures were just checked or made
        (:meth:`receipt_event`); :meth:`verify` re-checks everything stored.
        """
        identity, events = self._writer(), list(events)
        if not events:
            return []
        out: list[Entry] = []
        with self._lock, self._transaction():
            seq, prev = self._db.execute("SELECT seq, hash FROM head WHERE id = 1").fetchone()
            now_us = int(self.clock() * 1e6)
            for ev in events:
                before, receipt_seq = self._state(ev.ref)
                status = check_rules(ev, self.role, self.owner, before)
                if check_signatures:
                    verify_signatures(ev, self._event_at(receipt_seq) if ev.kind is Kind.COUNTERSIGN else None)
                entry = Entry(seq + 1, prev, self.role, status, now_us, ev)
                try:
                    self._db.execute(_INSERT, entry.row())
                except sqlite3.IntegrityError as exc:
                    raise ReplayError(f"dispatch {ev.ref.dispatch_id} already has a {ev.kind} entry ({exc})") from None
                seq, prev = entry.seq, entry.entry_hash
                out.append(entry)
            sig = identity.sign(head_bytes(self.role, self.owner, seq, prev))
            self._db.execute("UPDATE head SET seq = ?, hash = ?, signature = ? WHERE id = 1", (seq, prev, sig))
        for e in out:
            if e.event.kind is Kind.DISPUTE:
                ref = e.event.ref
                log.info("ledger.dispute_recorded", dispatch_id=ref.dispatch_id, worker=ref.worker, backbone=ref.backbone, reason=e.event.note)
        return out

    def _writer(self) -> Identity:
        if self.identity is None:
            raise LedgerError(f"{self.path} is open read-only (no key given)")
        return self.identity

    def _state(self, ref: DispatchRef) -> tuple[Status | None, int]:
        """A dispatch's current status and the seq of its receipt entry (0 if none)."""
        rows = self._db.execute(
            "SELECT seq, kind, status FROM entries WHERE dispatch_id = ? AND worker = ? AND backbone = ? ORDER BY seq", ref
        ).fetchall()
        if not rows:
            return None, 0
        return Status(rows[-1][2]), next((seq for seq, kind, _ in rows if kind in RECEIPT_KINDS), 0)

    def _event_at(self, seq: int) -> Event:
        row = self._db.execute(f"{_SELECT} WHERE seq = ?", (seq,)).fetchone()
        if row is None:
            raise EntryError(f"the receipt entry {seq} is gone")
        return decode_row(row)[0].event

    # -- reading

    def status(self, ref: DispatchRef) -> Status | None:
        with self._lock:
            return self._state(ref)[0]

    @contextmanager
    def _reading(self) -> Iterator[None]:
        """Under the lock; a damaged file (sqlite's "database disk image is malformed") becomes one LedgerCorrupt
        line that points to `verify`, which names the first entry it cannot read."""
        with self._lock:
            try:
                yield
            except sqlite3.DatabaseError as exc:
                raise LedgerCorrupt(f"{self.path} is damaged ({exc}); `moeswarm ledger verify` names the first unreadable entry") from None

    def __len__(self) -> int:
        with self._reading():
            return self._db.execute("SELECT COUNT(*) FROM entries").fetchone()[0]

    def rows(self, chunk: int = 1000) -> Iterator[tuple]:
        """Every stored row as it is, in stored order (chunked: the lock is not held between chunks)."""
        last = 0
        while True:
            with self._reading():
                got = self._db.execute(f"SELECT rowid, {', '.join(COLUMNS)} FROM entries WHERE rowid > ? ORDER BY rowid LIMIT ?", (last, chunk)).fetchall()
            if not got:
                return
            last = got[-1][0]
            yield from (r[1:] for r in got)

    def entries(self) -> Iterator[Entry]:
        """Every entry in stored order (EntryError at a malformed row; :meth:`verify` checks the chain)."""
        for row in self.rows():
            yield decode_row(row)[0]

    def verify(self) -> VerifyReport:
        """Walk the whole chain and every signature in one snapshot; the report names the first bad entry."""
        checker = ChainChecker(self.role, self.owner, self._event_at)
        try:
            with self._lock, self._transaction("DEFERRED"):
                head = self._db.execute("SELECT role, owner, seq, hash, signature FROM head WHERE id = 1").fetchone()
                for row in self._db.execute(f"{_SELECT} ORDER BY rowid"):
                    checker.feed(row)
                if head is None or (head[0], head[1]) != (self.role.value, self.owner):
                    raise ChainError(checker.seq, "the ledger head names another role or owner")
                checker.finish(*head[2:])
        except sqlite3.DatabaseError as exc:  # bytes edited in the file itself, below the rows
            bad = ChainError(checker.seq + 1, f"unreadable: {exc}")
        except ChainError as exc:
            bad = exc
        else:
            return VerifyReport(self.role.value, self.owner, checker.seq)
        log.warning("ledger.verify_failed", path=str(self.path), seq=bad.seq, problem=bad.problem)
        return VerifyReport(self.role.value, self.owner, checker.seq, bad.seq, bad.problem)

    def totals(self, peer: str | None = None, since: float | None = None) -> list[PeerTotals]:
        """Per counterparty, the receipts recorded at or after *since* (unix seconds); disputed ones earn nothing."""
        col = "worker" if self.role is Role.BACKBONE else "backbone"
        query = (
            f"SELECT r.{col}, r.work_units, r.price, EXISTS (SELECT 1 FROM entries d WHERE d.dispatch_id = r.dispatch_id"
            " AND d.worker = r.worker AND d.backbone = r.backbone AND d.kind = 'dispute')"
            " FROM entries r WHERE r.kind IN ('issue', 'accept')"
        )
        args: list[object] = []
        if peer is not None:
            query += f" AND r.{col} = ?"
            args.append(peer)
        if since is not None:
            query += " AND r.created_at_us >= ?"
            args.append(int(since * 1e6))
        acc: dict[str, list[int]] = {}
        with self._reading():
            for pid, units, price, disputed in self._db.execute(query, args):
                a = acc.setdefault(pid, [0, 0, 0, 0])
                a[0] += 1
                if disputed:
                    a[3] += 1
                else:
                    a[1] += units
                    a[2] += units * price
        other = Role.WORKER if self.role is Role.BACKBONE else Role.BACKBONE
        return [PeerTotals(pid, other.value, *a) for pid, a in sorted(acc.items())]

    def export(self, fmt: str, out: IO[str]) -> int:
        """Write every stored row as it is (signatures and hashes in hex) to *out*; returns the count."""
        if fmt not in ("csv", "jsonl"):
            raise LedgerError(f"export format must be csv or jsonl, not {fmt!r}")
        writer = csv.DictWriter(out, COLUMNS, lineterminator="\n") if fmt == "csv" else None
        if writer:
            writer.writeheader()
        n = 0
        for row in self.rows():
            rec = {c: v.hex() if isinstance(v, bytes) else v for c, v in zip(COLUMNS, row)}
            if writer:
                writer.writerow(rec)
            else:
                out.write(json.dumps(rec, separators=(",", ":")) + "\n")
            n += 1
        return n
