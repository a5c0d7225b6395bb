"""Appending to the ledger off the dispatch path: one writer thread, one transaction per batch.

A synchronous SQLite commit costs milliseconds (the disk's fsync); a dispatch must not
wait for it. Nodes hand receipts to :class:`LedgerSink`, whose thread owns the SQLite
connection and commits whatever has queued up as one batch. ``acknowledged`` counts the
receipts committed so far: those survive a crash (WAL, synchronous=FULL); the few
still queued at a SIGKILL are lost, and nothing else is.
"""

from __future__ import annotations

import queue
import threading
from pathlib import Path

import structlog

from node.ledger.receipts import Receipt, ReceiptStamp
from node.ledger.store import Event, Ledger, LedgerError, ref_of
from node.ledger.witness import UNKNOWN, SignedHead
from p2p.identity import Identity

log = structlog.get_logger("node.ledger.store")
_STOP = object()
MAX_BATCH = 256


class LedgerSink:
    def __init__(self, path: str | Path, role: str, identity: Identity) -> None:
        self.path = Path(path)
        self.acknowledged = 0
        self.failed = 0
        self._queue: queue.Queue = queue.Queue()
        self._opened = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(role, identity), name="ledger", daemon=True)
        self._thread.start()
        self._opened.wait()
        if self._error is not None:
            raise self._error

    def receipt(self, receipt: Receipt, stamp: ReceiptStamp) -> None:
        """Record a verified receipt (countersigned on the backbone, issued on the worker)."""
        self._queue.put(("receipt", receipt, stamp))

    def dispute(self, receipt: Receipt, reason: str) -> None:
        """Record that an already-recorded receipt is disputed (unpaid)."""
        self._queue.put(("dispute", receipt, reason))

    def witness(self, head: SignedHead, answer: bytes = UNKNOWN) -> None:
        """Keep a counterparty's signed head (checked and judged on the writer thread; see node.ledger.witness)."""
        self._queue.put(("witness", head, answer))

    def head(self) -> SignedHead:
        """This node's signed ledger head (a short read under the ledger's lock: call it off the event loop)."""
        return self._ledger.head()

    def hash_at(self, seq: int) -> bytes:
        return self._ledger.hash_at(seq)

    def witnessed(self, peer: str) -> SignedHead | None:
        return self._ledger.witnessed(peer)

    def close(self) -> None:
        """Commit everything queued, then stop the writer."""
        self._queue.put(_STOP)
        self._thread.join()

    def _run(self, role: str, identity: Identity) -> None:
        try:
            ledger = Ledger(self.path, role, identity)
        except BaseException as exc:  # reported to the constructor's caller
            self._error = exc
            self._opened.set()
            return
        self._ledger = ledger
        self._opened.set()
        try:
            stopping = False
            while not stopping:
                items = [self._queue.get()]
                while len(items) < MAX_BATCH:
                    try:
                        items.append(self._queue.get_nowait())
                    except queue.Empty:
                        break
                if _STOP in items:
                    stopping = True
                    items = [i for i in items if i is not _STOP]
                if items:
                    self._commit(ledger, items)
        finally:
            ledger.close()

    def _commit(self, ledger: Ledger, items: list) -> None:
        for _, head, answer in (i for i in items if i[0] == "witness"):
            try:
                ledger.witness(head, answer)
            except LedgerError as exc:  # a forged or garbled head from a peer: its problem, logged
                log.warning("ledger.witness_refused", peer=head.owner, error=str(exc))
        items = [i for i in items if i[0] != "witness"]
        if not items:
            return
        events = [self._event(ledger, item) for item in items]
        try:
            ledger.append_batch(events, check_signatures=False)
        except LedgerError:
            for event in events:  # isolate the bad one: the rest must still be recorded
                try:
                    ledger.append_batch([event], check_signatures=False)
                except LedgerError as exc:
                    self.failed += 1
                    log.error("ledger.append_failed", error=str(exc), path=str(self.path))
                    continue
                self.acknowledged += 1
            return
        self.acknowledged += len(events)
        log.debug("ledger.appended", entries=len(events), acknowledged=self.acknowledged)

    @staticmethod
    def _event(ledger: Ledger, item) -> Event:
        kind, receipt, extra = item
        if kind == "receipt":
            return ledger.receipt_event(receipt, extra, verified=True)
        return Event.disputed(ref_of(receipt), extra)
