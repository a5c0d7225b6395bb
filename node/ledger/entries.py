"""Ledger entries, pure: events about receipts, their hash chain, the legal status changes, and the checker.

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
countersignatures and :class:`ChainChecker` live here, free of I/O; :class:`node.ledger.Ledger`
is the SQLite adapter that stores them.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from enum import StrEnum
from functools import cached_property
from typing import Any, NamedTuple, get_type_hints

from experts.errors import UsageError
from node.ledger.receipts import MAX_EVIDENCE, Receipt, ReceiptError, ReceiptStamp, evidence_ok, verify
from p2p.identity import Identity, IdentityError, PeerId

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


class LedgerError(UsageError):
    """The ledger file is missing, not a ledger, someone else's, or opened read-only for a write."""


class LedgerCorrupt(LedgerError):
    """The SQLite file itself is damaged below the rows (a bad page): reads fail before any entry can be checked."""


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


RECEIPT_TYPES = get_type_hints(Receipt)
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
    for name, kind in RECEIPT_TYPES.items():
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
            if not evidence_ok(self.worker_sig):  # a signature alone, or a batch's with the receipt's Merkle path
                raise EntryError(f"worker_sig must be a {SIG_LEN}-byte signature or batch evidence of at most {MAX_EVIDENCE} bytes, got {self.worker_sig!r:.40}")
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

    def values(self) -> dict[str, Any]:
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
    v: dict[str, Any] = dict(zip(COLUMNS, row))  # checked value by value below
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
        receipt = Receipt(**{name: v[name] for name in RECEIPT_TYPES} | {"expert_ids": parsed})
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
        assert event.receipt is not None, "a receipt entry holds its receipt (decode_row and Event check it)"
        verify(event.receipt, event.stamp)
    if event.kind is Kind.ACCEPT:
        assert event.receipt is not None and event.countersig is not None, "an accept entry holds a countersigned receipt"
        verify_countersignature(event.receipt, event.stamp, event.countersig)
    elif event.kind is Kind.COUNTERSIGN:
        assert original is not None and original.receipt is not None, "a countersign entry follows its receipt"
        assert event.countersig is not None, "a countersign entry holds its countersignature"
        verify_countersignature(original.receipt, original.stamp, event.countersig)


@dataclass(frozen=True)
class VerifyReport:
    role: str
    owner: str
    entries: int  # entries that checked out before the first bad one (all of them when ok)
    bad_seq: int | None = None
    problem: str | None = None
    archived: int = 0  # entries 1..archived were compacted into the signed checkpoint the chain starts from
    missing: int = 0  # acknowledged entries (by the head record beside the file) that the file no longer holds
    notes: tuple[str, ...] = ()  # what an ok ledger's reader should still know (losses recovered from, no head record)

    @property
    def ok(self) -> bool:
        return self.problem is None

    def __str__(self) -> str:
        if self.ok:
            kept = f"; entries 1-{self.archived} archived under its signed checkpoint" if self.archived else ""
            notes = "".join(f"; {n}" for n in self.notes)
            return f"ok: {self.entries} entries of the {self.role} ledger of {self.owner}{kept}; chain, head and every signature check out{notes}"
        if self.missing:
            return f"lost {self.missing} acknowledged entries: {self.problem}"
        return f"entry {self.bad_seq}: {self.problem}"


class ChainChecker:
    """Walks stored rows in order; raises ChainError at the first that breaks chain, rules or a signature.

    *receipt_at* fetches an already checked receipt entry by its seq (for COUNTERSIGN entries),
    so the walk holds one small state per dispatch instead of every receipt.
    """

    def __init__(self, role: Role, owner: str, receipt_at: Callable[[int], Event], *, after: tuple[int, bytes] = (0, GENESIS)) -> None:
        """*after*: the seq and hash the first row links to (a compacted ledger's checkpoint; else the genesis)."""
        self.role, self.owner, self.receipt_at = role, owner, receipt_at
        self.seq, self.hash = after
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
