"""The paid-work ledger file: SQLite storage for the hash-chained entries of :mod:`node.ledger.entries`.

What "acknowledged" promises. Appends come in batches (a group commit: one transaction for
everything the writer has queued, :mod:`node.ledger.sink`), and the owner re-signs the head
after every batch. The database runs in WAL mode with ``synchronous=FULL``: the COMMIT returns
once the batch's WAL frames are fsynced. The signed head is then written to the head record
beside the file and fdatasynced (:mod:`node.ledger.headfile`); only then does
:meth:`Ledger.append_batch` return and its entries count as acknowledged. So an acknowledged
entry survives a crash or power cut of this machine, and if it is lost anyway (a damaged,
truncated or deleted WAL, a file restored from an older copy) :meth:`Ledger.verify` says how
many acknowledged entries are gone instead of checking the shorter chain that is left.

Opening a ledger to append to it recovers from such a loss: the intact prefix SQLite kept
stays, the lost head is recorded as evidence in the ``loss`` table (``verify`` keeps naming
it) and logged as ``ledger.loss_recovered``, and the record moves to the chain's real end.
"""

from __future__ import annotations

import csv
import gzip
import json
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import IO

import structlog

from node.ledger import headfile
from node.ledger.checkpoint import CLOCK_SKEW_US, DISPUTE_WINDOW_S, Checkpoint, DayTotals, Span, archive_digest, day_of, merge_totals, settled_prefix
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
from node.ledger.witness import BAD, UNKNOWN, SignedHead, Verdict, judge
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
# Tables a ledger gains when first needed (the format stays 1: older files simply lack them)
_CHECKPOINT_TABLE = "CREATE TABLE IF NOT EXISTS checkpoint (id INTEGER PRIMARY KEY CHECK (id = 1), body TEXT NOT NULL)"
_WITNESS_TABLES = (
    "CREATE TABLE IF NOT EXISTS witness (peer TEXT PRIMARY KEY, head TEXT NOT NULL, at_us INTEGER NOT NULL)",
    "CREATE TABLE IF NOT EXISTS witness_conflict (held TEXT NOT NULL, got TEXT NOT NULL, verdict TEXT NOT NULL, at_us INTEGER NOT NULL)",
)
# A head this ledger acknowledged and then lost (see headfile), kept when the writer recovered from it
_LOSS_TABLE = "CREATE TABLE IF NOT EXISTS loss (held TEXT NOT NULL, found_seq INTEGER NOT NULL, at_us INTEGER NOT NULL)"
_SELECT = f"SELECT {', '.join(COLUMNS)} FROM entries"
_SPANS = (  # per dispatch: its first and last entry, the status after the last and when that was recorded
    "SELECT s.first, s.last, x.status, x.created_at_us FROM (SELECT MIN(seq) AS first, MAX(seq) AS last FROM entries"
    " GROUP BY dispatch_id, worker, backbone) s JOIN entries x ON x.seq = s.last ORDER BY s.first"
)
_INSERT = f"INSERT INTO entries ({', '.join(COLUMNS)}) VALUES ({', '.join('?' * len(COLUMNS))})"


@dataclass(frozen=True)
class CompactReport:
    through_seq: int  # entries 1..through_seq now live in archive files (0: none)
    archived: int  # entries this run moved
    kept: int  # entries left in the ledger
    archive: Path | None  # the file this run wrote
    bytes_before: int
    bytes_after: int


def _record(row: Iterable[object]) -> dict[str, object]:
    """A stored row as JSON-ready values: hashes and signatures in hex."""
    return {c: v.hex() if isinstance(v, bytes) else v for c, v in zip(COLUMNS, row)}


def _write_durably(path: Path, data: bytes) -> None:
    """Write, fsync and rename into place: the archive exists in full before the ledger forgets its entries."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    headfile.sync_dir(path.parent)


class Ledger:
    """One node's ledger file. With *identity* it is created if missing and appended to; without, only read.

    Rows are walked in insertion (rowid) order, so a renumbered or swapped row shows at its place.
    One process appends at a time; others (the CLI) may read meanwhile. :meth:`verify` holds this
    object's lock for the whole walk: a running node verifies through a second, read-only Ledger.
    """

    def __init__(self, path: str | Path, role: str | None = None, identity: Identity | None = None, *, clock: Callable[[], float] = time.time) -> None:
        self.path, self.identity, self.clock = Path(path), identity, clock
        self._lock = threading.Lock()
        self._record: headfile.HeadRecord | None = None
        self.recovered: headfile.Loss | None = None  # the loss this writer found and recovered from on opening
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
                self._open_record()
        except BaseException:
            self._db.close()
            raise

    def _open_record(self) -> None:
        """Open the head record for appending: create it, or recover from a loss it reveals (module docstring)."""
        path, now = headfile.record_path(self.path), self._head()
        try:
            got = headfile.read(path)
        except headfile.HeadRecordError as exc:  # nothing to compare with: start a new record, and say so
            log.warning("ledger.head_record_replaced", path=str(path), error=str(exc))
            got = None
        if got is None:
            self._record = headfile.HeadRecord.create(path, now)
            return
        generation, held = got
        if (held.role, held.owner) != (self.role, self.owner):
            raise LedgerError(f"the head record {path} belongs to the {held.role} ledger of {held.owner}, not to {self.path}")
        self._record = headfile.HeadRecord(path, generation)
        loss = headfile.compare(held, now, self._hash_at(held.seq) if held.seq <= now.seq else UNKNOWN)
        if loss is not None:
            with self._transaction():
                self._db.execute(_LOSS_TABLE)
                self._db.execute("INSERT INTO loss VALUES (?, ?, ?)", (held.encode(), now.seq, int(self.clock() * 1e6)))
            self.recovered = loss
            log.warning("ledger.loss_recovered", path=str(self.path), missing=loss.missing, acknowledged_seq=held.seq, kept_seq=now.seq, problem=str(loss))
        if held != now:
            self._record.write(now)

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
        if self._record is not None:
            self._record.close()

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
        with self._lock:
            with self._transaction():
                out, head = self._insert(identity, events, check_signatures)
            assert self._record is not None, "every writer opens the head record"
            self._record.write(head)  # after the COMMIT: from now on the batch is acknowledged
        for e in out:
            if e.event.kind is Kind.DISPUTE:
                ref = e.event.ref
                log.info("ledger.dispute_recorded", dispatch_id=ref.dispatch_id, worker=ref.worker, backbone=ref.backbone, reason=e.event.note)
        return out

    def _insert(self, identity: Identity, events: list[Event], check_signatures: bool) -> tuple[list[Entry], SignedHead]:
        """Chain *events* after the head and re-sign it (inside the caller's transaction); the entries and the new head."""
        out: list[Entry] = []
        seq, prev = self._db.execute("SELECT seq, hash FROM head WHERE id = 1").fetchone()
        now_us = int(self.clock() * 1e6)
        checkpoint = self._checkpoint()
        for ev in events:
            if checkpoint and ev.receipt and ev.receipt.issued_at_us <= checkpoint.cutoff_us + CLOCK_SKEW_US:
                raise ReplayError(
                    f"receipt {ev.ref.dispatch_id} was issued before this ledger's checkpoint (entries up to"
                    f" {checkpoint.through_seq} are archived): a dispatch that old cannot be told from a replay"
                )
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
        return out, SignedHead(self.role, self.owner, seq, prev, sig)

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

    def checkpoint(self) -> Checkpoint | None:
        """A compacted ledger's checkpoint, standing for the archived entries (:meth:`verify` checks its signature)."""
        with self._reading():
            return self._checkpoint()

    def _has(self, table: str) -> bool:
        return self._db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (table,)).fetchone() is not None

    def _checkpoint(self) -> Checkpoint | None:
        if not self._has("checkpoint"):
            return None
        row = self._db.execute("SELECT body FROM checkpoint WHERE id = 1").fetchone()
        return Checkpoint.decode(row[0]) if row else None

    def _check_chain(self) -> int:
        """Walk checkpoint, kept chain, signatures and signed head (inside a transaction); the first archived-out seq.

        Raises ChainError naming the first bad entry (0: the checkpoint itself).
        """
        try:
            checkpoint = self._checkpoint()
        except EntryError as exc:
            raise ChainError(0, str(exc)) from None
        after = (checkpoint.through_seq, checkpoint.through_hash) if checkpoint else (0, GENESIS)
        if checkpoint:
            checkpoint.check(self.role, self.owner)
        checker = ChainChecker(self.role, self.owner, self._event_at, after=after)
        self._checker = checker  # where a failure happened, for the report
        head = self._db.execute("SELECT role, owner, seq, hash, signature FROM head WHERE id = 1").fetchone()
        for row in self._db.execute(f"{_SELECT} ORDER BY rowid"):
            checker.feed(row)
        if head is None or (head[0], head[1]) != (self.role.value, self.owner):
            raise ChainError(checker.seq, "the ledger head names another role or owner")
        checker.finish(*head[2:])
        return after[0]

    def verify(self) -> VerifyReport:
        """Walk the whole chain and every signature in one snapshot, then hold the chain's end against the head
        record beside the file: the report names the first bad entry, or how many acknowledged entries are gone."""
        self._checker = ChainChecker(self.role, self.owner, self._event_at)
        notes: list[str] = []
        loss, record_problem = None, None
        try:  # before the snapshot: a writer records a head only once it is committed
            record = headfile.read(headfile.record_path(self.path))
        except headfile.HeadRecordError as exc:
            record, record_problem = None, str(exc)
        try:
            with self._lock, self._transaction("DEFERRED"):
                archived = self._check_chain()
                if record is not None:
                    loss = headfile.compare(record[1], self._head(), self._hash_at(record[1].seq))
                notes += self._losses()
        except sqlite3.DatabaseError as exc:  # bytes edited in the file itself, below the rows
            bad = ChainError(self._checker.seq + 1, f"unreadable: {exc}")
        except ChainError as exc:
            bad = exc
        else:
            if loss is None and record_problem is None:
                if record is None:
                    notes.append(f"no head record ({headfile.record_path(self.path).name}) beside it, so a loss of acknowledged entries would not show")
                return VerifyReport(self.role.value, self.owner, self._checker.seq - archived, archived=archived, notes=tuple(notes))
            if loss is not None:
                bad = ChainError(loss.found_seq + 1 if loss.missing else loss.held.seq, str(loss))
            else:
                bad = ChainError(self._checker.seq, f"{record_problem}")
        missing = loss.missing if loss else 0
        log.warning("ledger.verify_failed", path=str(self.path), seq=bad.seq, problem=bad.problem, missing=missing)
        return VerifyReport(self.role.value, self.owner, self._checker.seq, bad.seq, bad.problem, missing=missing)

    def _losses(self) -> list[str]:
        """The losses a writer recovered from (see _open_record), as verify reports them."""
        if not self._has("loss"):
            return []
        out = []
        for held, found, at_us in self._db.execute("SELECT held, found_seq, at_us FROM loss ORDER BY rowid").fetchall():
            loss = headfile.Loss(SignedHead.decode(held), found)
            when = datetime.fromtimestamp(at_us / 1e6, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
            what = f"{loss.missing} acknowledged entries (entries {found + 1}-{loss.held.seq})" if loss.missing else f"a rewrite of acknowledged entry {loss.held.seq}"
            out.append(f"recovered on {when} from the loss of {what}: the chain goes on from entry {found}")
        return out

    def compact(self, *, window_s: float = DISPUTE_WINDOW_S, archive_dir: Path | None = None) -> CompactReport:
        """Move the settled prefix of the chain to a gzipped JSONL archive and replace it by a signed checkpoint.

        The whole chain is verified first (a broken entry must not vanish into an archive under the
        owner's signature); the archive is on disk, fsynced, before the entries leave the ledger.
        See :mod:`node.ledger.checkpoint` for what may go.
        """
        identity = self._writer()
        archive_dir = archive_dir or self.path.parent / "archive"
        before = self._file_bytes()
        with self._lock, self._transaction():
            try:
                start = self._check_chain()
            except ChainError as exc:
                raise EntryError(f"{self.path} does not verify ({exc}); compaction would archive the damage") from None
            old = self._checkpoint()
            spans = (Span(a, b, Status(st), us) for a, b, st, us in self._db.execute(_SPANS).fetchall())
            through = settled_prefix(spans, int(self.clock() * 1e6), window_s, start)
            kept = self._db.execute("SELECT COUNT(*) FROM entries WHERE seq > ?", (through,)).fetchone()[0]
            if through == start:
                return CompactReport(start, 0, kept, None, before, before)
            rows = self._db.execute(f"{_SELECT} WHERE seq <= ? ORDER BY seq", (through,)).fetchall()
            header = {"archive": "moeswarm ledger", "role": self.role.value, "owner": self.owner, "previous_checkpoint": old.encode() if old else None}
            lines = [json.dumps(header, separators=(",", ":"))] + [json.dumps(_record(r), separators=(",", ":")) for r in rows]
            data = gzip.compress(("\n".join(lines) + "\n").encode(), mtime=0)
            path = archive_dir / f"{self.path.stem}-{start + 1}-{through}.jsonl.gz"
            _write_durably(path, data)
            last = dict(zip(COLUMNS, rows[-1]))
            checkpoint = Checkpoint(
                self.role, self.owner, through, last["entry_hash"], max(dict(zip(COLUMNS, r))["created_at_us"] for r in rows),
                archive_digest(data), merge_totals(old.totals if old else (), self._day_totals(" AND r.seq <= ?", [through])),
            ).signed(identity)  # fmt: skip
            self._db.execute(_CHECKPOINT_TABLE)
            self._db.execute("INSERT OR REPLACE INTO checkpoint VALUES (1, ?)", (checkpoint.encode(),))
            self._db.execute("DELETE FROM entries WHERE seq <= ?", (through,))
        try:  # give the freed pages back now; without this they are reused by later appends
            self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            self._db.execute("VACUUM")
        except sqlite3.OperationalError as exc:  # another process (the running node) holds the file open
            log.info("ledger.vacuum_deferred", path=str(self.path), reason=str(exc))
        log.info("ledger.compacted", path=str(self.path), through_seq=through, archived=len(rows), kept=kept, archive=str(path))
        return CompactReport(through, len(rows), kept, path, before, self._file_bytes())

    def _file_bytes(self) -> int:
        return sum(p.stat().st_size for p in (self.path, self.path.with_name(self.path.name + "-wal")) if p.exists())

    # -- witnessed heads (node.ledger.witness)

    def head(self) -> SignedHead:
        """This ledger's head as its owner signed it: what the counterparties keep."""
        with self._reading():
            return self._head()

    def _head(self) -> SignedHead:
        role, owner, seq, h, sig = self._db.execute("SELECT role, owner, seq, hash, signature FROM head WHERE id = 1").fetchone()
        return SignedHead(Role(role), owner, seq, h, sig)

    def hash_at(self, seq: int) -> bytes:
        """The hash of entry *seq* (the checkpoint's for its last archived entry); witness.UNKNOWN if not in the chain."""
        with self._reading():
            return self._hash_at(seq)

    def _hash_at(self, seq: int) -> bytes:
        row = self._db.execute("SELECT entry_hash FROM entries WHERE seq = ?", (seq,)).fetchone()
        if row is not None:
            return row[0]
        checkpoint = self._checkpoint()
        return checkpoint.through_hash if checkpoint and checkpoint.through_seq == seq else UNKNOWN

    def witnessed(self, peer: str) -> SignedHead | None:
        """The latest head *peer* signed that this ledger holds."""
        with self._reading():
            row = self._db.execute("SELECT head FROM witness WHERE peer = ?", (peer,)).fetchone() if self._has("witness") else None
        return SignedHead.decode(row[0]) if row else None

    def witness(self, got: SignedHead, answer: bytes = UNKNOWN) -> Verdict:
        """Keep a counterparty's signed head; a rollback or fork keeps the old one and records both as evidence.

        *answer*: the peer's own entry hash at the seq of the head held before (see witness.judge).
        """
        got.check()
        held = self.witnessed(got.owner)
        verdict = judge(held, got, answer)
        now_us = int(self.clock() * 1e6)
        with self._lock, self._transaction():
            for stmt in _WITNESS_TABLES:
                self._db.execute(stmt)
            if verdict in BAD:
                assert held is not None, "judge finds a rollback only against a held head"
                self._db.execute("INSERT INTO witness_conflict VALUES (?, ?, ?, ?)", (held.encode(), got.encode(), verdict.value, now_us))
            elif verdict is not Verdict.SAME:
                self._db.execute("INSERT OR REPLACE INTO witness VALUES (?, ?, ?)", (got.owner, got.encode(), now_us))
        if verdict in BAD:
            assert held is not None
            log.warning("ledger.rollback_detected", peer=got.owner, role=got.role.value, verdict=verdict.value, held_seq=held.seq, now_seq=got.seq)
        return verdict

    def conflicts(self) -> list[tuple[SignedHead, SignedHead, str]]:
        """Evidence of counterparties' rollbacks: (head held, head got, verdict), oldest first."""
        with self._reading():
            rows = self._db.execute("SELECT held, got, verdict FROM witness_conflict ORDER BY rowid").fetchall() if self._has("witness_conflict") else []
        return [(SignedHead.decode(a), SignedHead.decode(b), v) for a, b, v in rows]

    def _day_totals(self, where: str = "", args: Sequence[object] = ()) -> tuple[DayTotals, ...]:
        """Receipts in the kept chain per UTC day and counterparty; *where* narrows ``entries r``."""
        col = "worker" if self.role is Role.BACKBONE else "backbone"
        query = (
            "SELECT day, peer, COUNT(*), SUM(CASE WHEN bad THEN 0 ELSE units END), SUM(CASE WHEN bad THEN 0 ELSE units * price END),"
            f" SUM(bad) FROM (SELECT strftime('%Y-%m-%d', r.created_at_us / 1000000, 'unixepoch') AS day, r.{col} AS peer,"
            " r.work_units AS units, r.price AS price, EXISTS (SELECT 1 FROM entries d WHERE d.dispatch_id = r.dispatch_id"
            " AND d.worker = r.worker AND d.backbone = r.backbone AND d.kind = 'dispute') AS bad"
            f" FROM entries r WHERE r.kind IN ('issue', 'accept'){where}) GROUP BY day, peer ORDER BY day, peer"
        )
        return tuple(DayTotals(*row) for row in self._db.execute(query, list(args)))

    def day_totals(self, peer: str | None = None, since: float | None = None) -> tuple[DayTotals, ...]:
        """Per UTC day and counterparty, the receipts recorded at or after *since* (unix seconds).

        Archived entries are known only by their checkpoint's day totals: a day counts whole when it
        is *since*'s day or later.
        """
        where = ""
        args: list[object] = []
        if peer is not None:
            where += f" AND r.{'worker' if self.role is Role.BACKBONE else 'backbone'} = ?"
            args.append(peer)
        if since is not None:
            where += " AND r.created_at_us >= ?"
            args.append(int(since * 1e6))
        with self._reading():
            kept, checkpoint = self._day_totals(where, args), self._checkpoint()
        first_day = day_of(int(since * 1e6)) if since is not None else ""
        archived = [t for t in checkpoint.totals if peer in (None, t.peer_id) and t.day >= first_day] if checkpoint else []
        return merge_totals(archived, kept)

    def totals(self, peer: str | None = None, since: float | None = None) -> list[PeerTotals]:
        """Per counterparty, the receipts recorded at or after *since* (see :meth:`day_totals`); disputed ones earn nothing."""
        acc: dict[str, list[int]] = {}
        for t in self.day_totals(peer, since):
            a = acc.setdefault(t.peer_id, [0, 0, 0, 0])
            for i, v in enumerate((t.dispatches, t.work_units, t.credits, t.disputed)):
                a[i] += v
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
            rec = _record(row)
            if writer:
                writer.writerow(rec)
            else:
                out.write(json.dumps(rec, separators=(",", ":")) + "\n")
            n += 1
        return n
