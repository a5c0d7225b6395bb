"""Swapping signed ledger heads with the workers a backbone pays (see node.ledger.witness for why).

After a successful dispatch to a worker not swapped with for ``interval`` seconds, one
``LEDGER_HEAD`` round trip runs in the background: the backbone sends its own head and the
seq of the worker's head it holds; the worker keeps the backbone's head and answers with its
own plus its entry hash at that seq. Closing the session swaps once more with every worker
used since, so even a short generation leaves each side holding the other's final head.
A worker that answers with an error (no ledger) or not at all costs nothing but a log line.
"""

from __future__ import annotations

import asyncio
import time

import structlog

from node.backbone.routing import Host
from node.ledger.entries import Role
from node.ledger.sink import LedgerSink
from node.ledger.witness import UNKNOWN, SignedHead
from p2p.connector import Connector
from p2p.identity import PeerId
from p2p.quic.endpoint import TransportError
from p2p.wire import messages as wire

log = structlog.get_logger("node.backbone.heads")
INTERVAL_S = 60.0
CLOSE_TIMEOUT_S = 3.0


class HeadExchange:
    def __init__(self, sink: LedgerSink, connector: Connector, *, interval: float = INTERVAL_S, timeout: float = 5.0, clock=time.monotonic) -> None:
        self.sink, self.connector, self.interval, self.timeout, self.clock = sink, connector, interval, timeout, clock
        self._last: dict[PeerId, float] = {}
        self._used: dict[PeerId, Host] = {}  # dispatched to since its last swap
        self._tasks: set[asyncio.Task] = set()

    def after_dispatch(self, host: Host) -> None:
        """Note a paid dispatch to *host*; start a swap if it is due (never waits)."""
        self._used[host.peer_id] = host
        last = self._last.get(host.peer_id)
        if last is None or self.clock() - last >= self.interval:
            self._start(host)

    def _start(self, host: Host) -> None:
        self._last[host.peer_id] = self.clock()
        self._used.pop(host.peer_id, None)
        task = asyncio.ensure_future(self.exchange(host))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def exchange(self, host: Host) -> None:
        peer = str(host.peer_id)
        ours = await asyncio.to_thread(self.sink.head)
        held = await asyncio.to_thread(self.sink.witnessed, peer)
        ask = (held.seq, held.entry_hash) if held else (0, UNKNOWN)
        req = wire.LedgerHead(wire.Role.BACKBONE, ours.seq, ours.entry_hash, ours.signature, *ask)
        try:
            reply = await self.connector.request(host.peer_id, host.addr, host.relay, req.encode(), timeout=self.timeout)
            msg = wire.decode(reply.data)
        except (TransportError, wire.ProtocolError) as exc:
            log.debug("ledger.head_exchange_failed", peer=peer, error=f"{type(exc).__name__}: {exc}")
            return
        if not isinstance(msg, wire.LedgerHead) or msg.role is not wire.Role.WORKER:
            log.debug("ledger.head_exchange_refused", peer=peer, reply=type(msg).__name__, error=getattr(msg, "message", ""))
            return
        answer = msg.ask_hash if held and msg.ask_seq == held.seq else UNKNOWN
        self.sink.witness(SignedHead(Role.WORKER, peer, msg.seq, msg.entry_hash, msg.signature), answer)

    async def close(self) -> None:
        """One last swap with every worker dispatched to since its previous one; bounded in time."""
        for host in list(self._used.values()):
            self._start(host)
        if self._tasks:
            _, pending = await asyncio.wait(set(self._tasks), timeout=CLOSE_TIMEOUT_S)
            for t in pending:
                t.cancel()
