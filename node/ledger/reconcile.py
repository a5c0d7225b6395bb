"""Cross-checking two ledgers of one trade, pure: a backbone's (work bought) against a worker's (work sold).

A ledger's chain and signed head stop anyone but its owner from editing it; they cannot stop
the owner from rolling the whole file back to an older copy, and a damaged WAL can lose
acknowledged entries while what is left still verifies. The counterparty's ledger is the
anchor: every receipt one side holds should be in the other's, with the same body. A
receipt in the backbone's ledger carries the worker's signature, so one missing from the
worker's ledger proves that ledger lost an entry its owner signed.

Receipts issued before either ledger's checkpoint (plus clock skew) are left out: one side may
have archived them (see :mod:`node.ledger.checkpoint`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from node.ledger.receipts import Receipt


@dataclass(frozen=True)
class Differing:
    dispatch_id: str
    fields: tuple[str, ...]  # receipt fields whose values differ between the two ledgers


@dataclass(frozen=True)
class Reconciliation:
    backbone: str
    worker: str
    compared: int  # dispatches between these two peers found in either ledger
    missing_at_worker: tuple[str, ...]  # dispatch ids in the backbone's ledger only (the worker signed them)
    missing_at_backbone: tuple[str, ...]  # dispatch ids in the worker's ledger only
    differing: tuple[Differing, ...]

    @property
    def ok(self) -> bool:
        return not (self.missing_at_worker or self.missing_at_backbone or self.differing)


def reconcile(backbone: str, worker: str, bought: Iterable[Receipt], sold: Iterable[Receipt], *, after_us: int = 0) -> Reconciliation:
    """Compare the receipts of dispatches from *backbone* to *worker* in each ledger (issued after *after_us*)."""

    def between(receipts: Iterable[Receipt]) -> dict[str, Receipt]:
        return {r.dispatch_id: r for r in receipts if (r.backbone, r.worker) == (backbone, worker) and r.issued_at_us > after_us}

    b, w = between(bought), between(sold)
    differing = []
    for did in sorted(b.keys() & w.keys()):
        if b[did] != w[did]:
            names = tuple(f for f in Receipt.__dataclass_fields__ if getattr(b[did], f) != getattr(w[did], f))
            differing.append(Differing(did, names))
    return Reconciliation(
        backbone, worker, len(b.keys() | w.keys()), tuple(sorted(b.keys() - w.keys())), tuple(sorted(w.keys() - b.keys())), tuple(differing)
    )
