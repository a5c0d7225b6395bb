"""The ledger's writer process: group commits of what the node's :class:`node.ledger.sink.LedgerSink` sends it.

Why a process and not a thread. A commit itself waits on the disk with the GIL released, but
everything around it is Python holding the GIL: decoding the receipt, the backbone's
countersignature, the chain's hashing and rule checks, the head's Ed25519 signature, the
SQLite calls between steps. In a thread of the node that work competes with the event loop
and the compute thread exactly while replies are in flight, which is what `bench dispatch`'s
``ledger.cost_pct`` measured. In its own process it competes with nothing in the node; the
node only pickles each item onto a pipe (its stdin) and reads acknowledgements back.

Protocol, one pickled frame each way per message (length-prefixed; both ends are this
checkout, so pickle is safe). Node -> writer: ``("open", path, role, seed)`` first, then
``("receipt", receipt, stamp)``, ``("dispute", receipt, reason)``, ``("witness", head,
answer)``, and ``("stop",)`` or end of file. Writer -> node: ``("ready",)`` or ``("error",
exc)``, then ``("acked", acknowledged, failed)`` after each group commit and ``("log", level,
event, fields)`` for every log event (the node logs them as its own, in its own format).

Everything queued is committed before the process exits: on ``stop``, and on end of file
(the node died, even by SIGKILL). SIGINT and SIGTERM are ignored so that a signal sent to
the node's process group does not drop the queue.
"""

from __future__ import annotations

import os
import pickle
import queue
import signal
import struct
import sys
import threading
from collections.abc import Mapping, MutableMapping
from pathlib import Path
from typing import IO, Any

import structlog
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from node.ledger.store import Event, Ledger, LedgerError, ref_of
from p2p.identity import Identity

MAX_BATCH = 256
READER_GRACE_S = 10.0  # after "stop", how long the writer waits for the node to close the pipe
_LEN = struct.Struct(">I")
_MAX_FRAME = 1 << 20  # a receipt pickles to ~1 KB; a larger length is a broken pipe, not a message


def send(fd: int, message: tuple) -> None:
    """Write one frame to *fd* (a pipe) in full."""
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    view = memoryview(_LEN.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view) :]


def tell(fd: int, message: tuple) -> None:
    """The writer's send: once the node is gone nobody listens, and the queue must still be committed."""
    try:
        send(fd, message)
    except BrokenPipeError:
        pass


def receive(stream: IO[bytes]) -> tuple | None:
    """The next frame from *stream*; None at end of file (or a frame cut short by the other side's death)."""
    head = stream.read(_LEN.size)
    if len(head) < _LEN.size:
        return None
    (n,) = _LEN.unpack(head)
    if n > _MAX_FRAME:
        raise LedgerError(f"ledger writer pipe: a frame of {n} bytes (at most {_MAX_FRAME})")
    data = stream.read(n)
    return pickle.loads(data) if len(data) == n else None


class Writer:
    """Owns the Ledger: batches whatever has queued since the last commit into one transaction."""

    def __init__(self, ledger: Ledger, out: int) -> None:
        self.ledger, self.out = ledger, out
        self.acknowledged = self.failed = 0

    def run(self, items: queue.Queue) -> None:
        stopping = False
        while not stopping:
            batch = [items.get()]
            while len(batch) < MAX_BATCH:
                try:
                    batch.append(items.get_nowait())
                except queue.Empty:
                    break
            stopping = any(m is None or m[0] == "stop" for m in batch)
            self.commit([m for m in batch if m is not None and m[0] != "stop"])

    def commit(self, items: list[tuple]) -> None:
        log = structlog.get_logger("moeswarm.ledger")
        for _, head, answer in (i for i in items if i[0] == "witness"):
            try:
                self.ledger.witness(head, answer)
            except LedgerError as exc:  # a forged or garbled head from a peer: its problem, logged
                log.warning("ledger.witness_refused", peer=head.owner, error=str(exc))
        events = [self._event(i) for i in items if i[0] != "witness"]
        if not events:
            return
        try:
            self.ledger.append_batch(events, check_signatures=False)
            self.acknowledged += len(events)
        except LedgerError:
            for event in events:  # isolate the bad one: the rest must still be recorded
                try:
                    self.ledger.append_batch([event], check_signatures=False)
                except LedgerError as exc:
                    self.failed += 1
                    log.error("ledger.append_failed", error=str(exc), path=str(self.ledger.path))
                    continue
                self.acknowledged += 1
        tell(self.out, ("acked", self.acknowledged, self.failed))

    def _event(self, item: tuple) -> Event:
        kind, receipt, extra = item
        if kind == "receipt":
            return self.ledger.receipt_event(receipt, extra, verified=True)
        return Event.disputed(ref_of(receipt), extra)


def _forward_logs(out: int) -> None:
    """Send every structlog event to the node, which logs it as its own (see the module docstring)."""

    def forward(logger: Any, method: str, event_dict: MutableMapping[str, Any]) -> Mapping[str, Any]:
        event = event_dict.pop("event")
        tell(out, ("log", method, event, event_dict))
        raise structlog.DropEvent

    structlog.configure(processors=[forward], cache_logger_on_first_use=False)


def _read_into(items: queue.Queue, stream: IO[bytes]) -> None:
    """Drain the pipe as fast as the node writes it (so the node's write never waits on a commit); None at its end."""
    try:
        while (message := receive(stream)) is not None:
            items.put(message)
    finally:
        items.put(None)


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    stream, out = sys.stdin.buffer, os.dup(sys.stdout.fileno())
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # a stray print must not land in the protocol
    _forward_logs(out)
    opening = receive(stream)
    if opening is None or opening[0] != "open":
        return
    _, path, role, seed = opening
    try:
        ledger = Ledger(Path(path), role, Identity(Ed25519PrivateKey.from_private_bytes(seed)))
    except (LedgerError, OSError) as exc:
        tell(out, ("error", exc))
        return
    items: queue.Queue = queue.Queue()
    reader = threading.Thread(target=_read_into, args=(items, stream), name="ledger-pipe", daemon=True)
    reader.start()
    tell(out, ("ready",))
    try:
        Writer(ledger, out).run(items)
    finally:
        ledger.close()
    # "stop" is read before the node closes the pipe (LedgerSink.close sends it, then closes): leaving now, with the
    # reader blocked inside stdin's read, makes the interpreter's shutdown abort (it cannot take stdin's lock). Wait
    # for the end of the pipe; a node that never closes it gets an exit without that shutdown (all is committed).
    reader.join(READER_GRACE_S)
    if reader.is_alive():
        os._exit(0)


if __name__ == "__main__":
    main()
