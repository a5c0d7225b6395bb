"""Ledger compaction, pure: which prefix of the chain is settled, and the signed checkpoint that replaces it.

A busy worker's ledger grows by gigabytes a day, yet most entries are done with: their
dispatch was paid, disputed, or nobody touched it within the dispute window. Compaction
moves a *prefix* of the chain (entries 1..K) to an archive file and leaves in the ledger a
:class:`Checkpoint` signed by the owner: the seq and hash of entry K, the per-day and
per-peer totals of what was archived, and the archive file's digest. Verification then
starts at entry K's hash instead of the genesis hash, so every kept entry is still checked
link by link and an edit of any of them still breaks the chain there.

Only a prefix can go (the chain is a list), and only one where every dispatch is settled
and lies wholly inside it: a later status change must find its receipt. A receipt whose
dispatch was archived can no longer be told from a replay by its dispatch id, so the
ledger refuses receipts issued before the checkpoint's cutoff (plus clock skew) instead.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from typing import NamedTuple

from node.ledger.entries import ChainError, EntryError, Role, Status
from p2p.identity import Identity, IdentityError, PeerId

CHECKPOINT_CONTEXT = b"moeswarm/ledger-checkpoint/v1\0"
DISPUTE_WINDOW_S = 7 * 86400  # default: a receipt neither paid nor disputed for a week is final as it stands
CLOCK_SKEW_US = 10 * 60 * 1_000_000  # worker and backbone clocks may differ by this much
FINAL = frozenset({Status.PAID, Status.DISPUTED})


def day_of(us: int) -> str:
    """The UTC calendar day of a ledger time (microseconds since the epoch), as YYYY-MM-DD."""
    return datetime.fromtimestamp(us / 1e6, tz=timezone.utc).strftime("%Y-%m-%d")


@dataclass(frozen=True)
class DayTotals:
    """Receipts of one counterparty recorded on one UTC day; disputed ones earn nothing."""

    day: str
    peer_id: str
    dispatches: int = 0
    work_units: int = 0  # undisputed
    credits: int = 0  # undisputed work_units * price
    disputed: int = 0

    def __add__(self, other: DayTotals) -> DayTotals:
        assert (self.day, self.peer_id) == (other.day, other.peer_id), "only totals of the same day and peer add up"
        return replace(self, **{k: getattr(self, k) + getattr(other, k) for k in ("dispatches", "work_units", "credits", "disputed")})


def merge_totals(*groups: Iterable[DayTotals]) -> tuple[DayTotals, ...]:
    """Sum totals of the same (day, peer); sorted by day, then peer."""
    acc: dict[tuple[str, str], DayTotals] = {}
    for group in groups:
        for t in group:
            key = (t.day, t.peer_id)
            acc[key] = acc[key] + t if key in acc else t
    return tuple(acc[k] for k in sorted(acc))


@dataclass(frozen=True)
class Checkpoint:
    """Stands for entries 1..``through_seq``, which now live in an archive file; signed by the ledger's owner."""

    role: Role
    owner: str
    through_seq: int
    through_hash: bytes  # entry_hash of entry through_seq: entry through_seq + 1 links to it
    cutoff_us: int  # created_at_us of the newest archived entry
    archive_digest: str  # sha256 (hex) of the archive file holding the entries after the previous checkpoint
    totals: tuple[DayTotals, ...] = ()  # of every archived entry, this checkpoint's and the earlier ones'
    signature: bytes = field(default=b"", compare=False)

    def body(self) -> bytes:
        d = asdict(self)
        del d["signature"]
        d["role"], d["through_hash"] = self.role.value, self.through_hash.hex()
        return CHECKPOINT_CONTEXT + json.dumps(d, sort_keys=True, separators=(",", ":")).encode()

    def signed(self, identity: Identity) -> Checkpoint:
        if str(identity.peer_id) != self.owner:
            raise EntryError(f"a checkpoint is signed by the ledger's owner {self.owner}, not {identity.peer_id}")
        return replace(self, signature=identity.sign(self.body()))

    def check(self, role: Role, owner: str) -> None:
        """ChainError (at entry 0: before the kept chain) unless this is the owner's signed checkpoint of this ledger."""
        if (self.role, self.owner) != (role, owner):
            raise ChainError(0, f"the checkpoint belongs to the {self.role} ledger of {self.owner}")
        try:
            ok = PeerId.from_string(owner).verify(self.body(), self.signature)
        except IdentityError:
            ok = False
        if not ok:
            raise ChainError(0, "the checkpoint is not signed by the ledger's owner (edited)")

    def encode(self) -> str:
        d = asdict(self)
        d["role"], d["through_hash"], d["signature"] = self.role.value, self.through_hash.hex(), self.signature.hex()
        return json.dumps(d, sort_keys=True, separators=(",", ":"))

    @classmethod
    def decode(cls, text: str) -> Checkpoint:
        """EntryError for anything but a checkpoint this module encoded (its signature is checked by :meth:`check`)."""
        try:
            d = json.loads(text)
            return cls(
                Role(d["role"]), str(d["owner"]), int(d["through_seq"]), bytes.fromhex(d["through_hash"]), int(d["cutoff_us"]),
                str(d["archive_digest"]), tuple(DayTotals(**t) for t in d["totals"]), bytes.fromhex(d["signature"]),
            )  # fmt: skip
        except (ValueError, KeyError, TypeError) as exc:
            raise EntryError(f"the ledger's checkpoint is malformed ({type(exc).__name__}: {exc})") from None


class Span(NamedTuple):
    """One dispatch's entries: first and last seq, the status after the last, and when that was recorded."""

    first: int
    last: int
    status: Status
    changed_us: int


def settled_prefix(spans: Iterable[Span], now_us: int, window_s: float = DISPUTE_WINDOW_S, start: int = 0) -> int:
    """The largest K such that entries up to K may be archived; *spans* (sorted by ``first``) start after *start*.

    Returns *start* when nothing more may go.

    Every dispatch with an entry at or before K must lie wholly at or before K and be settled:
    paid, disputed, or unchanged for *window_s* seconds.
    """
    horizon = now_us - int(window_s * 1e6)
    best = reach = start
    for span in spans:
        if reach < span.first:
            best = reach  # every dispatch begun so far has ended: a clean cut
        if span.status not in FINAL and span.changed_us > horizon:
            return best  # this dispatch may still change: nothing from its first entry on can go
        reach = max(reach, span.last)
    return reach


def archive_digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
