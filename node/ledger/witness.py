"""Witnessed ledger heads, pure: each side keeps the other's latest signed head, so a rollback shows.

A ledger proves to its owner's counterparties only that nobody else edited it: its owner
can restore last week's copy (or lose WAL frames in a crash) and the older file verifies.
So a backbone and each worker it pays swap signed heads now and then (``LEDGER_HEAD`` on the
wire, :mod:`node.backbone.heads`), and each stores the other's in its own ledger. A head is a
commitment: a chain that once ended in (seq N, hash H) must, as long as it grows, keep entry N
with hash H. A later head with a lower seq, another hash at the same seq, or (asked for
directly) another hash at N is a rollback or rewrite — flagged at once, and kept as evidence
that ``moeswarm ledger reconcile`` shows next to the receipts missing from the other side.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import StrEnum

from node.ledger.entries import EntryError, Role, head_bytes
from p2p.identity import IdentityError, PeerId

UNKNOWN = bytes(32)  # "that entry is archived (or never existed): cannot say"


@dataclass(frozen=True)
class SignedHead:
    role: Role
    owner: str
    seq: int
    entry_hash: bytes
    signature: bytes

    def check(self) -> None:
        """EntryError unless *owner* signed this head of its *role* ledger."""
        try:
            ok = PeerId.from_string(self.owner).verify(head_bytes(self.role, self.owner, self.seq, self.entry_hash), self.signature)
        except IdentityError:
            ok = False
        if not ok:
            raise EntryError(f"the ledger head (entry {self.seq}) is not signed by {self.owner}")

    def encode(self) -> str:
        return json.dumps([self.role.value, self.owner, self.seq, self.entry_hash.hex(), self.signature.hex()], separators=(",", ":"))

    @classmethod
    def decode(cls, text: str) -> SignedHead:
        try:
            role, owner, seq, h, sig = json.loads(text)
            return cls(Role(role), str(owner), int(seq), bytes.fromhex(h), bytes.fromhex(sig))
        except (ValueError, TypeError) as exc:
            raise EntryError(f"a witnessed ledger head is malformed ({exc})") from None


class Verdict(StrEnum):
    NEW = "new"  # the first head of this peer
    ADVANCED = "advanced"  # grew, consistent with what we held as far as we can tell
    SAME = "same"
    ROLLED_BACK = "rolled_back"  # fewer entries than it once signed, or the entry we witnessed is gone or changed
    FORKED = "forked"  # two different chains signed at the same seq


def judge(held: SignedHead | None, new: SignedHead, answer: bytes = UNKNOWN) -> Verdict:
    """Compare a peer's new head with the one *held*; *answer* is the peer's entry hash at ``held.seq`` if it gave one."""
    if held is None:
        return Verdict.NEW
    if new.seq < held.seq:
        return Verdict.ROLLED_BACK
    if new.seq == held.seq:
        return Verdict.SAME if new.entry_hash == held.entry_hash else Verdict.FORKED
    if answer != UNKNOWN and answer != held.entry_hash:
        return Verdict.ROLLED_BACK
    return Verdict.ADVANCED


BAD = frozenset({Verdict.ROLLED_BACK, Verdict.FORKED})
