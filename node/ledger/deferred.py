"""Receipts signed after the reply, in batches: what each side holds meanwhile, and when a batch is due (sans-IO).

Theory of operation. A worker answers a dispatch at once and keeps its receipt unsigned
(:class:`UnsignedReceipts`); the backbone uses the sums at once and keeps its own rebuild of
the receipt pending (:class:`PendingReceipts`). A worker's pending receipts fall due as one
batch when ``size`` of them wait or the oldest has waited ``delay`` seconds (and all of them
at session close); the backbone then asks the worker to sign that batch (``wire.ReceiptSignRequest``),
and :func:`judge` checks the one signature that comes back (``wire.ReceiptBatch``) against
the receipts the backbone rebuilt. A batch not signed by its ``deadline``, or whose signature
does not verify, convicts the worker as a failed spot check does (the caller bans it, disputes
its receipts and rolls back the tokens that used its sums). Neither side records a receipt in
its ledger before the batch signature exists: the worker when it signs, the backbone when the
signature verifies, with the batch proof as the receipt's evidence. A receipt's life here::

    answered --due--> requested --signed, leaf matches--> recorded (paid, or disputed if caught meanwhile)
                          |
                          +--past deadline / bad signature / other receipt signed--> convicted (never recorded)

The clock is injected (``now`` arguments): tests move it by hand.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from node.ledger.receipts import Receipt, ReceiptError, ReceiptStamp, batch_stamp, leaf_hash, verify_batch
from p2p.wire.messages import MAX_RECEIPT_BATCH

DELAY_S = 0.05  # the longest a backbone's receipt waits before its batch is asked for
BATCH = 64  # receipts of one worker that make a batch due at once
MAX_UNSIGNED_PER_PEER = 4096  # a worker keeps at most this many unsigned receipts per backbone (oldest forgotten)
MAX_UNSIGNED = 65536  # ... and in all (~45 MB): a flood of identities cannot grow it further

H = TypeVar("H")  # what the backbone needs to reach the worker again (its routing Host)


class UnsignedReceipts:
    """A worker's receipts answered and not yet signed, per backbone, bounded (the oldest are forgotten: unpaid)."""

    def __init__(self, per_peer: int = MAX_UNSIGNED_PER_PEER, total: int = MAX_UNSIGNED) -> None:
        self.per_peer, self.total = per_peer, total
        self._by_peer: OrderedDict[str, OrderedDict[str, Receipt]] = OrderedDict()  # least recently added first
        self._count = 0
        self.forgotten = 0

    def __len__(self) -> int:
        return self._count

    def add(self, receipt: Receipt) -> None:
        held = self._by_peer.setdefault(receipt.backbone, OrderedDict())
        self._by_peer.move_to_end(receipt.backbone)
        held[receipt.dispatch_id] = receipt
        self._count += 1
        if len(held) > self.per_peer:
            self._forget(receipt.backbone)
        while self._count > self.total:
            self._forget(next(iter(self._by_peer)))

    def _forget(self, peer: str) -> None:
        held = self._by_peer[peer]
        held.popitem(last=False)
        self._count -= 1
        self.forgotten += 1
        if not held:
            del self._by_peer[peer]

    def take(self, backbone: str, dispatch_ids: Iterable[str]) -> list[Receipt]:
        """The receipts of these dispatches of *backbone* that await a signature, in the order asked; they leave."""
        held = self._by_peer.get(backbone)
        if held is None:
            return []
        out = [r for did in dispatch_ids if (r := held.pop(did, None)) is not None]
        self._count -= len(out)
        if not held:
            del self._by_peer[backbone]
        return out


@dataclass(eq=False)
class Pending(Generic[H]):
    """A backbone's rebuilt receipt waiting for its worker's batch signature."""

    receipt: Receipt
    host: H
    added: float
    dispute: str | None = None  # the worker was caught meanwhile: once signed, recorded as disputed (never paid)


@dataclass(frozen=True, eq=False)
class Batch(Generic[H]):
    """Receipts of one worker asked to be signed together; a verdict is due by *deadline*."""

    worker: str
    items: tuple[Pending[H], ...]
    deadline: float


@dataclass
class PendingReceipts(Generic[H]):
    """The backbone's side: receipts per worker until their batch falls due, and the batches asked for."""

    delay: float = DELAY_S
    size: int = BATCH
    deadline: float = 5.0  # seconds from asking to the verdict
    _waiting: dict[str, list[Pending[H]]] = field(default_factory=dict)
    _asked: set[Batch[H]] = field(default_factory=set)

    def __post_init__(self) -> None:
        if not 1 <= self.size <= MAX_RECEIPT_BATCH:
            raise ValueError(f"a batch holds 1..{MAX_RECEIPT_BATCH} receipts, not {self.size}")

    def __len__(self) -> int:
        """Receipts without a verdict yet (waiting or asked for)."""
        return sum(map(len, self._waiting.values())) + sum(len(b.items) for b in self._asked)

    def add(self, receipt: Receipt, host: H, now: float, dispute: str | None = None) -> bool:
        """Keep *receipt* until it is signed; True when its worker's batch is due at once (``size`` reached)."""
        waiting = self._waiting.setdefault(receipt.worker, [])
        waiting.append(Pending(receipt, host, now, dispute))
        return len(waiting) >= self.size

    def next_due(self) -> float | None:
        """When the oldest waiting receipt falls due (None: nothing waits)."""
        return min((w[0].added + self.delay for w in self._waiting.values() if w), default=None)

    def due(self, now: float, *, flush: bool = False) -> list[Batch[H]]:
        """The batches to ask for now (all of them when *flush*: the session closes, or a sequence ends)."""
        out = []
        for worker, waiting in list(self._waiting.items()):
            while waiting and (flush or len(waiting) >= self.size or waiting[0].added + self.delay <= now):
                items, waiting[:] = tuple(waiting[: self.size]), waiting[self.size :]
                out.append(Batch(worker, items, now + self.deadline))
            if not waiting:
                del self._waiting[worker]
        self._asked.update(out)
        return out

    def done(self, batch: Batch[H]) -> None:
        self._asked.discard(batch)

    def convict(self, worker: str, reason: str) -> list[Receipt]:
        """*worker* was caught: every receipt of it without a verdict is disputed once signed; returns them."""
        hit = [p for p in self._waiting.get(worker, ())] + [p for b in self._asked if b.worker == worker for p in b.items]
        for p in hit:
            p.dispute = p.dispute or reason
        return [p.receipt for p in hit]


@dataclass(frozen=True)
class Verdict(Generic[H]):
    """What a batch signature proved: receipts signed (with their evidence), and those it does not cover."""

    signed: tuple[tuple[Pending[H], ReceiptStamp], ...]
    unsigned: tuple[Pending[H], ...]
    problem: str | None  # why *unsigned* is not empty (None: every receipt of the batch is signed)


def judge(batch: Batch[H], ids: Sequence[bytes], leaves: Sequence[bytes], signature: bytes, variants: Callable[[Receipt], Iterable[Receipt]]) -> Verdict[H]:
    """Check a worker's batch signature over *leaves* (for dispatches *ids*, in order) against our receipts.

    *variants* lists the receipts each side could honestly have built for a dispatch (ours first; the other path,
    a price re-read from the worker's record): the signed leaf must be one of them, and that one is recorded.
    """
    try:
        verify_batch(batch.worker, leaves, signature)
    except ReceiptError as exc:
        return Verdict((), batch.items, str(exc))
    ours = {bytes.fromhex(p.receipt.dispatch_id): p for p in batch.items}
    signed, problems = [], []
    for i, (did, leaf) in enumerate(zip(ids, leaves, strict=True)):
        item = ours.pop(did, None)
        if item is None:
            problems.append(f"it signed dispatch {did.hex()}, which is not in the batch asked for")
            continue
        match = next((r for r in variants(item.receipt) if leaf_hash(r) == leaf), None)
        if match is None:
            ours[did] = item  # signed, but another receipt than the work done: unsigned for this dispatch
            problems.append(f"it signed another receipt for dispatch {did.hex()}")
            continue
        item.receipt = match  # the one the worker signed (the path it saw, its current price)
        signed.append((item, batch_stamp(match, signature, i, leaves)))
    if ours:
        problems.append(f"{len(ours)} of {len(batch.items)} receipts not signed")
    return Verdict(tuple(signed), tuple(ours.values()), "; ".join(problems) or None)
