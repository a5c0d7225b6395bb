"""The paid-work ledger: an append-only, hash-chained log of work receipts in SQLite.

Theory of operation. Each side of a dispatch keeps its own ledger: the backbone of
the work it bought, the worker of the work it sold. An entry is one *event* about one
dispatch -- the receipt itself, or a later status change -- chained to the entry
before it: ``entry_hash = sha256(prev_hash || canonical bytes)``. A status change
(a countersignature learned later, a payment, a dispute after a spot check) is a new
entry naming the dispatch, never an update, so the log stays append-only and an
edited, removed or reordered row breaks the chain exactly there. After every batch
the owner signs the head (last seq and hash): rewriting the chain with recomputed
hashes, or cutting entries off its tail, then needs the owner's key.

A receipt's life, one row of :data:`TRANSITIONS` per legal step::

    (new) --issue--> ISSUED --countersign--> COUNTERSIGNED --pay--> PAID
      |                 |                      ^   |
      +------accept-----)----------------------+   +--dispute--> DISPUTED
                        +--dispute--> DISPUTED

The worker issues (signs) a receipt; the backbone accepts it by countersigning
receipt body and worker signature together (:func:`countersign`). Entries, the table,
countersignatures and :class:`ChainChecker` are pure; :class:`Ledger` is the SQLite
adapter (WAL, ``synchronous=FULL``: an append that returned survives a crash).
"""

from __future__ import annotations

import csv
import hashlib
import json
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, fields
from enum import StrEnum
from functools import cached_property
from pathlib import Path
from typing import IO, NamedTuple, get_type_hints

import structlog

from experts.errors import MoeSwarmError
from p2p.identity import Identity, IdentityError, PeerId

from .receipts import Receipt, ReceiptError, ReceiptStamp, verify

log = structlog.get_logger("moeswarm.ledger")

FILENAME = "ledger.sqlite"  # inside a node's data directory ($MOESWARM_HOME/<role>/)
GENESIS = b"\0" * 32  # prev_hash of entry 1
ENTRY_CONTEXT = b"moeswarm/ledger-entry/v1\0"
COUNTERSIGN_CONTEXT = b"moeswarm/countersign/v1\0"
HEAD_CONTEXT = b"moeswarm/ledger-head/v1\0"
APPLICATION_ID = 0x6D736C67  # "mslg" in the SQLite header: tells a ledger from any other database
FORMAT_VERSION = 1
MAX_INT = 2**63 - 1  # SQLite INTEGER
MAX_TEXT = 256  # peer ids are ~52 characters, digests 64
MAX_NOTE = 1024
SIG_LEN = 64


class LedgerError(MoeSwarmError):
    """The ledger file is missing, not a ledger, someone else's, or opened read-only for a write."""


class EntryError(LedgerError):
    """An entry is malformed or breaks the ledger's rules (chain, signature, status transition)."""


class ChainError(EntryError):
    """Verification found a bad entry; ``seq`` is its position in the chain."""

    def __init__(self, seq: int, problem: str) -> None:
        super().__init__(f"entry {seq}: {problem}")
        self.seq, self.problem = seq, problem


class TransitionError(EntryError):
    """A status change that the receipt lifecycle does not allow (see TRANSITIONS)."""


class ReplayError(TransitionError):
    """A receipt for a dispatch that this ledger already holds."""


class Role(StrEnum):
    BACKBONE = "backbone"
    WORKER = "worker"


class Kind(StrEnum):
    ISSUE = "issue"  # a receipt signed by its worker, countersignature not (yet) known
    ACCEPT = "accept"  # a receipt with the backbone's countersignature
    COUNTERSIGN = "countersign"  # the countersignature of an issued receipt, learned later
    PAY = "pay"
    DISPUTE = "dispute"


class Status(StrEnum):
    ISSUED = "issued"
    COUNTERSIGNED = "countersigned"
    PAID = "paid"
    DISPUTED = "disputed"


RECEIPT_KINDS = frozenset({Kind.ISSUE, Kind.ACCEPT})  # entries that carry the receipt itself
COUNTERSIGNED_KINDS = frozenset({Kind.ACCEPT, Kind.COUNTERSIGN})  # entries that carry a countersignature

TRANSITIONS: dict[tuple[Status | None, Kind], Status] = {
    # (status before, kind of the new entry) -> status after; None = dispatch not recorded yet
    (None, Kind.ISSUE): Status.ISSUED,
    (None, Kind.ACCEPT): Status.COUNTERSIGNED,
    (Status.ISSUED, Kind.COUNTERSIGN): Status.COUNTERSIGNED,
    (Status.ISSUED, Kind.DISPUTE): Status.DISPUTED,
    (Status.COUNTERSIGNED, Kind.PAY): Status.PAID,
    (Status.COUNTERSIGNED, Kind.DISPUTE): Status.DISPUTED,
}


def next_status(before: Status | None, kind: Kind, ref: DispatchRef) -> Status:
    after = TRANSITIONS.get((before, kind))
    if after is not None:
        return after
    if kind in RECEIPT_KINDS:
        raise ReplayError(f"dispatch {ref.dispatch_id} of worker {ref.worker} is already recorded ({before})")
    raise TransitionError(f"cannot {kind} dispatch {ref.dispatch_id}: it is {before or 'not recorded'}")


class DispatchRef(NamedTuple):
    """What names one dispatch across ledgers (with the kind, the unique key of an entry)."""

    dispatch_id: str
    worker: str
    backbone: str


def countersigned_bytes(receipt: Receipt, stamp: ReceiptStamp) -> bytes:
    return COUNTERSIGN_CONTEXT + receipt.body() + stamp.signature


def countersign(identity: Identity, receipt: Receipt, stamp: ReceiptStamp) -> bytes:
    """The backbone's signature over the receipt and the worker's signature; verify the stamp first."""
    if receipt.backbone != str(identity.peer_id):
        raise ReceiptError("a backbone countersigns only receipts naming itself as the backbone")
    return identity.sign(countersigned_bytes(receipt, stamp))


def verify_countersignature(receipt: Receipt, stamp: ReceiptStamp, countersig: bytes) -> None:
    """Raise ReceiptError unless the backbone named in *receipt* countersigned exactly this receipt and stamp."""
    try:
        backbone = PeerId.from_string(receipt.backbone)
    except IdentityError as exc:
        raise ReceiptError(f"receipt {receipt.dispatch_id} names no valid backbone: {exc}") from None
    if not backbone.verify(countersigned_bytes(receipt, stamp), countersig):
        raise ReceiptError(f"receipt {receipt.dispatch_id} is not countersigned by backbone {receipt.backbone}")


_RECEIPT_TYPES = get_type_hints(Receipt)
RECEIPT_COLUMNS = tuple(f.name for f in fields(Receipt) if f.name not in DispatchRef._fields)
COLUMNS = (
    "seq", "prev_hash", "entry_hash", "kind", "status", "role", "created_at_us", *DispatchRef._fields,
    *RECEIPT_COLUMNS, "worker_sig", "countersig", "note",
)  # fmt: skip


def _check_int(name: str, value: object) -> int:
    if type(value) is not int or not 0 <= value <= MAX_INT:
        raise EntryError(f"{name} must be an integer in 0..2^63-1, got {value!r:.40}")
    return value


def _check_text(name: str, value: object, limit: int = MAX_TEXT, *, empty: bool = False) -> str:
    if type(value) is not str or len(value) > limit or (not value and not empty):
        raise EntryError(f"{name} must be {'a' if empty else 'a non-empty'} text of at most {limit} characters, got {value!r:.40}")
    return value


def _check_sig(name: str, value: object) -> bytes:
    if type(value) is not bytes or len(value) != SIG_LEN:
        raise EntryError(f"{name} must be a {SIG_LEN}-byte signature, got {value!r:.40}")
    return value


def _ids_text(ids: tuple[int, ...]) -> str:
    return json.dumps(list(ids), separators=(",", ":"))


def _check_receipt(r: Receipt) -> None:
    for name, kind in _RECEIPT_TYPES.items():
        value = getattr(r, name)
        if kind is int:
            _check_int(name, value)
        elif kind is str:
            _check_text(name, value)
        elif type(value) is not tuple or len(value) > 4096:
            raise EntryError(f"{name} must be a tuple of at most 4096 expert ids, got {value!r:.40}")
        else:
            for e in value:
                _check_int(name, e)


@dataclass(frozen=True)
class Event:
    """What a caller records about a dispatch; the ledger chains it into an :class:`Entry`."""

    kind: Kind
    ref: DispatchRef
    receipt: Receipt | None = None
    worker_sig: bytes | None = None
    countersig: bytes | None = None
    note: str = ""  # why a dispute, which payment

    def __post_init__(self) -> None:
        if not isinstance(self.kind, Kind):
            raise EntryError(f"unknown entry kind {self.kind!r}")
        for name, value in zip(DispatchRef._fields, self.ref):
            _check_text(name, value)
        if self.kind in RECEIPT_KINDS:
            if self.receipt is None or self.worker_sig is None:
                raise EntryError(f"a {self.kind} entry carries the receipt and the worker's signature")
            _check_receipt(self.receipt)
            _check_sig("worker_sig", self.worker_sig)
            if self.ref != ref_of(self.receipt):
                raise EntryError("the entry's dispatch reference differs from its receipt's")
        elif self.receipt is not None or self.worker_sig is not None:
            raise EntryError(f"a {self.kind} entry refers to its receipt by dispatch id and holds no copy")
        if self.kind in COUNTERSIGNED_KINDS:
            _check_sig("countersig", self.countersig)
        elif self.countersig is not None:
            raise EntryError(f"a {self.kind} entry carries no countersignature")
        _check_text("note", self.note, MAX_NOTE, empty=True)

    @classmethod
    def issued(cls, receipt: Receipt, stamp: ReceiptStamp) -> Event:
        return cls(Kind.ISSUE, ref_of(receipt), receipt, stamp.signature)

    @classmethod
    def accepted(cls, receipt: Receipt, stamp: ReceiptStamp, countersig: bytes) -> Event:
        return cls(Kind.ACCEPT, ref_of(receipt), receipt, stamp.signature, countersig)

    @classmethod
    def countersigned(cls, ref: DispatchRef, countersig: bytes) -> Event:
        return cls(Kind.COUNTERSIGN, ref, countersig=countersig)

    @classmethod
    def paid(cls, ref: DispatchRef, note: str = "") -> Event:
        return cls(Kind.PAY, ref, note=note)

    @classmethod
    def disputed(cls, ref: DispatchRef, reason: str) -> Event:
        return cls(Kind.DISPUTE, ref, note=reason)

    @property
    def stamp(self) -> ReceiptStamp:
        assert self.receipt is not None and self.worker_sig is not None, "only receipt entries carry a stamp"
        return ReceiptStamp(self.receipt.issued_at_us, self.worker_sig)


def ref_of(receipt: Receipt) -> DispatchRef:
    return DispatchRef(receipt.dispatch_id, receipt.worker, receipt.backbone)


@dataclass(frozen=True)
class Entry:
    """One chained event: its position, link, writer role, resulting status and time."""

    seq: int
    prev_hash: bytes
    role: Role
    status: Status
    created_at_us: int
    event: Event

    def values(self) -> dict[str, object]:
        """Every column but entry_hash, as Python values (None where an entry of this kind has no value)."""
        ev, r = self.event, self.event.receipt
        out: dict[str, object] = {
            "seq": self.seq, "prev_hash": self.prev_hash, "kind": ev.kind.value, "status": self.status.value,
            "role": self.role.value, "created_at_us": self.created_at_us, **ev.ref._asdict(),
        }  # fmt: skip
        out.update({name: getattr(r, name) if r else None for name in RECEIPT_COLUMNS})
        out.update(worker_sig=ev.worker_sig, countersig=ev.countersig, note=ev.note)
        return out

    def canonical(self) -> bytes:
        """The hashed bytes: every column but the two hashes, as sorted compact JSON after a context string."""
        v = self.values()
        del v["prev_hash"]  # hashed in front of these bytes
        for k in ("worker_sig", "countersig"):
            v[k] = v[k].hex() if v[k] is not None else None
        if v["expert_ids"] is not None:
            v["expert_ids"] = list(v["expert_ids"])
        return ENTRY_CONTEXT + json.dumps(v, sort_keys=True, separators=(",", ":")).encode()

    @cached_property
    def entry_hash(self) -> bytes:
        return hashlib.sha256(self.prev_hash + self.canonical()).digest()

    def row(self) -> tuple:
        v = self.values()
        v["entry_hash"] = self.entry_hash
        if v["expert_ids"] is not None:
            v["expert_ids"] = _ids_text(v["expert_ids"])
        return tuple(v[c] for c in COLUMNS)


def decode_row(row: Sequence[object]) -> tuple[Entry, bytes]:
    """A stored row -> (entry, stored entry_hash); EntryError unless every value has its one canonical form."""
    if len(row) != len(COLUMNS):
        raise EntryError(f"a ledger row has {len(COLUMNS)} columns, got {len(row)}")
    v = dict(zip(COLUMNS, row))
    for name in ("prev_hash", "entry_hash"):
        if type(v[name]) is not bytes or len(v[name]) != 32:
            raise EntryError(f"{name} must be 32 bytes, got {v[name]!r:.40}")
    try:
        kind, status, role = Kind(v["kind"]), Status(v["status"]), Role(v["role"])
    except ValueError as exc:
        raise EntryError(f"unknown kind, status or role: {exc}") from None
    receipt = None
    if kind in RECEIPT_KINDS:
        ids = v["expert_ids"]
        try:
            parsed = tuple(json.loads(ids)) if type(ids) is str else None
        except (ValueError, TypeError):
            parsed = None
        if parsed is None or _ids_text(parsed) != ids:
            raise EntryError(f"expert_ids must be a compact JSON list of integers, got {ids!r:.40}")
        receipt = Receipt(**{name: v[name] for name in _RECEIPT_TYPES} | {"expert_ids": parsed})
    else:
        extra = [name for name in RECEIPT_COLUMNS if v[name] is not None]
        if extra:
            raise EntryError(f"a {kind} entry holds no receipt, but {extra[0]} is set")
    ref = DispatchRef(*(v[name] for name in DispatchRef._fields))
    event = Event(kind, ref, receipt, v["worker_sig"], v["countersig"], v["note"])
    entry = Entry(_check_int("seq", v["seq"]), v["prev_hash"], role, status, _check_int("created_at_us", v["created_at_us"]), event)
    return entry, v["entry_hash"]


def head_bytes(role: Role, owner: str, seq: int, entry_hash: bytes) -> bytes:
    return HEAD_CONTEXT + json.dumps([role.value, owner, seq, entry_hash.hex()], separators=(",", ":")).encode()


def check_rules(event: Event, role: Role, owner: str, before: Status | None) -> Status:
    """The status *event* leads to from *before*, if the owner may record it (signatures apart)."""
    party = event.ref.backbone if role is Role.BACKBONE else event.ref.worker
    if party != owner:
        raise EntryError(f"dispatch {event.ref.dispatch_id} names {role} {party}, but this ledger belongs to {owner}")
    return next_status(before, event.kind, event.ref)


def verify_signatures(event: Event, original: Event | None) -> None:
    """Worker signature and countersignature; *original* is the receipt entry a COUNTERSIGN refers to."""
    if event.kind in RECEIPT_KINDS:
        verify(event.receipt, event.stamp)
    if event.kind is Kind.ACCEPT:
        verify_countersignature(event.receipt, event.stamp, event.countersig)
    elif event.kind is Kind.COUNTERSIGN:
        assert original is not None and original.receipt is not None, "a countersign entry follows its receipt"
        verify_countersignature(original.receipt, original.stamp, event.countersig)


@dataclass(frozen=True)
class VerifyReport:
    role: str
    owner: str
    entries: int  # entries that checked out before the first bad one (all of them when ok)
    bad_seq: int | None = None
    problem: str | None = None

    @property
    def ok(self) -> bool:
        return self.problem is None

    def __str__(self) -> str:
        if self.ok:
            return f"ok: {self.entries} entries of the {self.role} ledger of {self.owner}; chain, head and every signature check out"
        return f"entry {self.bad_seq}: {self.problem}"


class ChainChecker:
    """Walks stored rows in order; raises ChainError at the first that breaks chain, rules or a signature.

    *receipt_at* fetches an already checked receipt entry by its seq (for COUNTERSIGN entries),
    so the walk holds one small state per dispatch instead of every receipt.
    """

    def __init__(self, role: Role, owner: str, receipt_at: Callable[[int], Event]) -> None:
        self.role, self.owner, self.receipt_at = role, owner, receipt_at
        self.seq, self.hash = 0, GENESIS
        self._state: dict[DispatchRef, tuple[Status, int]] = {}  # status now, position of the receipt entry

    def feed(self, row: Sequence[object]) -> Entry:
        try:
            return self._feed(row)
        except (EntryError, ReceiptError) as exc:
            raise ChainError(self.seq + 1, str(exc)) from None

    def _feed(self, row: Sequence[object]) -> Entry:
        entry, stored_hash = decode_row(row)
        expect = self.seq + 1
        if entry.seq != expect:
            raise EntryError(f"stored seq is {entry.seq}: an entry is missing, moved or renumbered here")
        if entry.prev_hash != self.hash:
            raise EntryError(f"prev_hash does not match entry {self.seq}'s hash")
        if entry.entry_hash != stored_hash:
            raise EntryError("contents do not match the entry's hash (edited)")
        if entry.role is not self.role:
            raise EntryError(f"written by a {entry.role}, in a {self.role} ledger")
        ev = entry.event
        before, pos = self._state.get(ev.ref, (None, 0))
        after = check_rules(ev, self.role, self.owner, before)
        if after is not entry.status:
            raise EntryError(f"status {entry.status} should be {after} after {before or 'nothing'} and {ev.kind}")
        verify_signatures(ev, self.receipt_at(pos) if ev.kind is Kind.COUNTERSIGN else None)
        self._state[ev.ref] = (after, expect if ev.kind in RECEIPT_KINDS else pos)
        self.seq, self.hash = expect, stored_hash
        return entry

    def finish(self, head_seq: object, head_hash: object, head_sig: object) -> None:
        """Check the owner's signed head against the walked chain; raise ChainError naming where they part."""
        last = self.seq
        if type(head_seq) is not int or type(head_hash) is not bytes or type(head_sig) is not bytes:
            raise ChainError(last, "the ledger head is malformed")
        try:
            signed = PeerId.from_string(self.owner).verify(head_bytes(self.role, self.owner, head_seq, head_hash), head_sig)
        except IdentityError:
            signed = False
        if not signed:
            raise ChainError(last, "the ledger head is not signed by the ledger's owner")
        if head_seq > last:
            raise ChainError(last + 1, f"missing: the signed head names {head_seq} entries, the chain ends at {last}")
        if head_seq < last:
            raise ChainError(head_seq + 1, f"not covered by the signed head, which ends at entry {head_seq}")
        if head_hash != self.hash:
            raise ChainError(last, "the chain does not end in the signed head's hash (entries rewritten)")


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
    {", ".join(f"{n} {'INTEGER' if _RECEIPT_TYPES[n] is int else 'TEXT'}" for n in RECEIPT_COLUMNS)},
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

    def __len__(self) -> int:
        with self._lock:
            return self._db.execute("SELECT COUNT(*) FROM entries").fetchone()[0]

    def rows(self, chunk: int = 1000) -> Iterator[tuple]:
        """Every stored row as it is, in stored order (chunked: the lock is not held between chunks)."""
        last = 0
        while True:
            with self._lock:
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
        with self._lock:
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
