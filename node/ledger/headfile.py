"""The ledger's head record: the last acknowledged head, signed by the owner and fsynced beside the database.

Why a second file. SQLite in WAL mode keeps the newest commits only in ``ledger.sqlite-wal``
until a checkpoint copies them into the main file. If that WAL is damaged, truncated or
deleted after a crash, SQLite silently stops at the last frame whose checksum holds and the
file that is left is a perfectly valid, shorter ledger: its chain and its signed head (the
``head`` row is part of the lost commits too) check out. The same goes for a ledger file
restored from the owner's own older copy. Only something written *outside* the database
remembers how far the ledger once got, so after every commit the owner's signed head is also
written here and fdatasync'ed; an entry is acknowledged once both are on disk. ``verify``
then compares the chain's end with this record (:func:`witness.judge`, the same check a
counterparty applies to a head it witnessed) and names how many acknowledged entries are gone.

The file is two fixed-size slots written alternately, each with a generation number and a
digest, so a write torn by a crash leaves the other slot (one commit older) readable: the
record never claims more than the database holds because it is written only after the
commit it names. What it cannot catch: an owner who also rolls this file back. That is what
the counterparties' witnessed heads are for (:mod:`node.ledger.witness`).
"""

from __future__ import annotations

import hashlib
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from node.ledger.entries import EntryError, LedgerError
from node.ledger.witness import BAD, SignedHead, judge

SUFFIX = ".head"  # ledger.sqlite -> ledger.sqlite.head
MAGIC = b"MSLH\x01"
SLOT = 512  # a signed head encodes to ~300 bytes
_FIXED = struct.Struct(">5sQH")  # magic, generation, payload length
DIGEST = 32


class HeadRecordError(LedgerError):
    """The head record exists but neither slot holds a readable head signed by the ledger's owner."""


def record_path(ledger: Path) -> Path:
    return ledger.with_name(ledger.name + SUFFIX)


@dataclass(frozen=True)
class Loss:
    """The ledger ends short of (or away from) the head it last acknowledged."""

    held: SignedHead  # the last acknowledged head, from the record
    found_seq: int  # where the chain in the file ends

    @property
    def missing(self) -> int:
        return max(self.held.seq - self.found_seq, 0)

    def __str__(self) -> str:
        if self.missing:
            what = f"entries {self.found_seq + 1}-{self.held.seq} are gone: the file ends at entry {self.found_seq}"
        else:
            what = "not the entry acknowledged there: the chain was rewritten after a loss"
        return (f"{what}, and its head record (fsynced at every commit) names entry {self.held.seq}; the WAL was damaged or"
                " lost, or the file restored from an older copy (`ledger reconcile` with a counterparty's ledger lists the receipts)")  # fmt: skip


def compare(held: SignedHead, found: SignedHead, answer: bytes) -> Loss | None:
    """A Loss if the chain ending in *found* lost or rewrote the acknowledged head *held*; *answer*: the chain's hash at held.seq."""
    return Loss(held, found.seq) if judge(held, found, answer) in BAD else None


def _slot(generation: int, head: SignedHead) -> bytes:
    payload = head.encode().encode()
    body = _FIXED.pack(MAGIC, generation, len(payload)) + payload
    if len(body) + DIGEST > SLOT:
        raise EntryError(f"a ledger head of {len(payload)} bytes does not fit a {SLOT}-byte head record slot")
    return (body + hashlib.sha256(body).digest()).ljust(SLOT, b"\0")


def _parse(raw: bytes) -> tuple[int, SignedHead] | None:
    """(generation, head) of one slot; None for an empty, torn or foreign one."""
    if len(raw) < _FIXED.size:
        return None
    magic, generation, n = _FIXED.unpack_from(raw)
    end = _FIXED.size + n
    if magic != MAGIC or end + DIGEST > len(raw) or hashlib.sha256(raw[:end]).digest() != raw[end : end + DIGEST]:
        return None
    try:
        return generation, SignedHead.decode(raw[_FIXED.size : end].decode())
    except (EntryError, UnicodeDecodeError):
        return None


def read(path: Path) -> tuple[int, SignedHead] | None:
    """The newest readable slot of the head record at *path*: None if there is no such file.

    HeadRecordError if the file exists but holds no readable slot, or one not signed by its owner.
    """
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise HeadRecordError(f"cannot read the head record {path}: {exc}") from None
    slots = [s for s in (_parse(data[:SLOT]), _parse(data[SLOT : 2 * SLOT])) if s is not None]
    if not slots:
        raise HeadRecordError(f"the head record {path} is damaged: neither slot is readable")
    generation, head = max(slots, key=lambda s: s[0])
    try:
        head.check()
    except EntryError as exc:
        raise HeadRecordError(f"the head record {path} is not signed by its owner ({exc})") from None
    return generation, head


class HeadRecord:
    """The writer's handle on the record: :meth:`write` puts a head in the older slot and fdatasyncs.

    Opened by the (single) process that appends to the ledger; not thread-safe on its own (the
    Ledger calls it under its lock).
    """

    def __init__(self, path: Path, generation: int) -> None:
        self.path, self.generation = path, generation
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)

    @classmethod
    def create(cls, path: Path, head: SignedHead) -> HeadRecord:
        """A new record holding *head* in both slots (a torn first write must still leave one readable)."""
        record = cls(path, 0)
        os.pwrite(record._fd, _slot(0, head) + _slot(1, head), 0)
        os.fsync(record._fd)
        sync_dir(path.parent)
        record.generation = 1
        return record

    def write(self, head: SignedHead) -> None:
        self.generation += 1
        os.pwrite(self._fd, _slot(self.generation, head), (self.generation % 2) * SLOT)
        os.fdatasync(self._fd)

    def close(self) -> None:
        os.close(self._fd)


def sync_dir(directory: Path) -> None:
    """fsync a directory so a file just created in it survives a crash."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
