"""Appending to the ledger off the dispatch path: a writer process, one transaction per group of receipts.

A synchronous SQLite commit costs milliseconds (the disk's fsync), and the Python around it
(countersignature, chain hashing, the head's signature) holds the GIL; a dispatch must wait
for neither. Nodes hand receipts to :class:`LedgerSink`, which pickles them onto the pipe of
its writer process (:mod:`node.ledger.writer`); the writer commits whatever has queued up as
one batch, and reports back. ``acknowledged`` counts the receipts committed so far: those
survive a crash (see :mod:`node.ledger.store` for what acknowledged promises). Receipts
already on the pipe when the node dies are still committed, since the writer runs until its
pipe ends; only a SIGKILL of the writer itself (or the machine going down) drops the few
not yet committed. Reads (:meth:`head`, :meth:`hash_at`, :meth:`witnessed`) go through a
read-only connection of the node's own.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import structlog

from node.ledger.receipts import Receipt, ReceiptStamp
from node.ledger.store import Ledger, LedgerError
from node.ledger.witness import UNKNOWN, SignedHead
from node.ledger.writer import receive, send
from p2p.identity import Identity

log = structlog.get_logger("moeswarm.ledger")


class LedgerSink:
    def __init__(self, path: str | Path, role: str, identity: Identity) -> None:
        self.path = Path(path)
        self.acknowledged = 0  # receipts and disputes committed (the writer's count)
        self._refused = 0  # ... that the writer could not record (see ledger.append_failed)
        self._lost = 0  # ... that never reached the writer (it had died)
        self._send_lock = threading.Lock()
        self._proc = subprocess.Popen([sys.executable, "-m", "node.ledger.writer"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._fd = self._proc.stdin.fileno()
        try:
            send(self._fd, ("open", str(self.path), role, identity.seed))
            while (reply := self._next()) is not None and reply[0] == "log":  # opening logs (ledger.created, ...)
                self._log(reply)
        except BaseException:
            self._proc.kill()
            self._proc.wait()
            raise
        if reply is None or reply[0] != "ready":
            self._proc.wait()
            if reply is not None and reply[0] == "error":
                raise reply[1]
            raise LedgerError(f"the ledger writer for {self.path} exited before opening it (exit {self._proc.returncode})")
        self._ledger = Ledger(self.path)  # read-only: the writer created the file if it was missing
        self._reader = threading.Thread(target=self._read_replies, name="ledger-acks", daemon=True)
        self._reader.start()

    def receipt(self, receipt: Receipt, stamp: ReceiptStamp) -> None:
        """Record a verified receipt (countersigned on the backbone, issued on the worker)."""
        self._send(("receipt", receipt, stamp))

    def dispute(self, receipt: Receipt, reason: str) -> None:
        """Record that an already-recorded receipt is disputed (unpaid)."""
        self._send(("dispute", receipt, reason))

    def witness(self, head: SignedHead, answer: bytes = UNKNOWN) -> None:
        """Keep a counterparty's signed head (checked and judged by the writer; see node.ledger.witness)."""
        self._send(("witness", head, answer))

    def head(self) -> SignedHead:
        """This node's signed ledger head (a short read under the ledger's lock: call it off the event loop)."""
        return self._ledger.head()

    def hash_at(self, seq: int) -> bytes:
        return self._ledger.hash_at(seq)

    def witnessed(self, peer: str) -> SignedHead | None:
        return self._ledger.witnessed(peer)

    @property
    def failed(self) -> int:
        return self._refused + self._lost

    def close(self) -> None:
        """Commit everything queued, then stop the writer."""
        try:
            self._send(("stop",))
        finally:
            assert self._proc.stdin is not None
            self._proc.stdin.close()
            self._reader.join()
            self._proc.wait()
            self._ledger.close()

    def _send(self, message: tuple) -> None:
        with self._send_lock:
            try:
                send(self._fd, message)
            except (BrokenPipeError, ValueError):  # the writer died (or the sink is closed): the item is lost
                if message[0] != "stop":
                    self._lost += 1
                    if self._lost == 1:  # once: every later item would say the same
                        log.error("ledger.writer_gone", path=str(self.path), kind=message[0], exit=self._proc.poll())

    def _next(self) -> tuple | None:
        assert self._proc.stdout is not None
        return receive(self._proc.stdout)

    @staticmethod
    def _log(message: tuple) -> None:
        _, level, event, fields = message
        getattr(log, level, log.info)(event, **fields)

    def _read_replies(self) -> None:
        """Acknowledgements and the writer's log events, until it exits (blocked in read, the GIL released)."""
        while (message := self._next()) is not None:
            if message[0] == "acked":
                self.acknowledged, self._refused = message[1], message[2]
            elif message[0] == "log":
                self._log(message)
        assert self._proc.stdout is not None
        self._proc.stdout.close()
