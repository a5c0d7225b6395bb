"""Collecting workers' batch signatures in the background (the asyncio adapter over :mod:`node.ledger.deferred`).

A dispatch's sums are used as soon as they arrive; its receipt waits here. When a worker's
batch falls due, one ``RECEIPT_SIGN_REQUEST`` round trip runs beside the decoding (retried on
transport errors until the batch's deadline), and :func:`node.ledger.deferred.judge` checks the
answer. The verdict goes back to the dispatcher through two callbacks: ``signed`` for each
receipt the signature covers (now it may be paid), ``unsigned`` for the receipts it does not
(the dispatcher convicts the worker). :meth:`SignatureCollector.settle` asks for everything
pending at once and waits for every verdict: the end of a sequence and the session's close
call it, so no output is final and no session ends before its receipts are judged.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable, Iterator

import structlog

from node.backbone.routing import Host
from node.ledger.deferred import BATCH, DELAY_S, Batch, Pending, PendingReceipts, judge
from node.ledger.receipts import Receipt, ReceiptStamp
from p2p.connector import Connector
from p2p.pathkind import Path
from p2p.quic.endpoint import TransportError
from p2p.wire import messages as wire

log = structlog.get_logger("node.backbone.signatures")
RETRY_S = 0.2  # pause between attempts after a transport error, within the batch's deadline

Signed = Callable[[Pending[Host], ReceiptStamp], None]
Unsigned = Callable[[Host, tuple[Pending[Host], ...], str, bool], None]  # ..., reason, whether the worker was reached
Repriced = Callable[[Host, int], Awaitable[int | None]]  # (host, layer) -> the price its fresh record asks, if another


class SignatureCollector:
    def __init__(self, connector: Connector, *, signed: Signed, unsigned: Unsigned, repriced: Repriced, deadline: float, delay: float = DELAY_S, size: int = BATCH, clock: Callable[[], float] = time.monotonic) -> None:
        self.connector, self.clock = connector, clock
        self._signed, self._unsigned, self._repriced = signed, unsigned, repriced
        self.pending: PendingReceipts[Host] = PendingReceipts(delay, size, deadline)
        self._timer: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task] = set()
        self.batches = 0  # batch signatures verified

    def add(self, host: Host, receipt: Receipt, dispute: str | None = None) -> None:
        """Keep *receipt* until its worker signs it (never waits)."""
        if self.pending.add(receipt, host, self.clock(), dispute):
            self._ask()
        elif self._timer is None:
            self._arm()

    def convict(self, worker: str, reason: str) -> list[Receipt]:
        return self.pending.convict(worker, reason)

    def _arm(self) -> None:
        due = self.pending.next_due()
        if due is not None:
            self._timer = asyncio.get_running_loop().call_later(max(due - self.clock(), 0.0), self._fire)

    def _fire(self) -> None:
        self._timer = None
        self._ask()

    def _ask(self, *, flush: bool = False) -> None:
        for batch in self.pending.due(self.clock(), flush=flush):
            task = asyncio.ensure_future(self._collect(batch))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            task.add_done_callback(_report)
        if self._timer is None:
            self._arm()

    async def settle(self) -> None:
        """Ask for every pending receipt's signature now and return once each has its verdict."""
        self._ask(flush=True)
        if asked := set(self._tasks):  # later batches (other sequences decoding on) are not waited for
            await asyncio.gather(*asked, return_exceptions=True)

    async def close(self) -> None:
        await self.settle()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    async def _collect(self, batch: Batch[Host]) -> None:
        host = batch.items[0].host
        try:
            reply, problem, reached = await self._request(host, batch)
            signed: tuple[tuple[Pending[Host], ReceiptStamp], ...]
            if reply is not None:
                verdict = judge(batch, reply.dispatch_ids, reply.leaves, reply.signature, _variants)
                if verdict.unsigned and (price := await self._repriced(host, verdict.unsigned[0].receipt.layer)) is not None:
                    verdict = judge(batch, reply.dispatch_ids, reply.leaves, reply.signature, lambda r: _variants(dataclasses.replace(r, price=price)))
                signed, unsigned, problem = verdict.signed, verdict.unsigned, verdict.problem or ""
            else:
                signed, unsigned = (), batch.items
            if unsigned:
                log.warning("receipt.unsigned", peer=batch.worker, dispatches=len(unsigned), batch=len(batch.items), reason=problem)
                self._unsigned(host, unsigned, problem, reached)
            if signed:
                self.batches += 1
                log.debug("receipt.batch_verified", peer=batch.worker, dispatches=len(signed))
            for item, stamp in signed:
                self._signed(item, stamp)
        finally:
            self.pending.done(batch)

    async def _request(self, host: Host, batch: Batch[Host]) -> tuple[wire.ReceiptBatch | None, str, bool]:
        """The worker's answer by the batch's deadline, or None and why not; and whether the worker answered at all.

        Silence (timeouts, a lost connection, a relay down) cannot be told apart from a broken path: the caller
        benches such a worker rather than banning it; an answer that is not a valid signature is the worker's own."""
        req = wire.ReceiptSignRequest(tuple(bytes.fromhex(p.receipt.dispatch_id) for p in batch.items)).encode()
        problem = "no answer"
        while (left := batch.deadline - self.clock()) > 0:
            try:
                raw = await self.connector.request(host.peer_id, host.addr, host.relay, req, timeout=left)
            except TransportError as exc:
                problem = f"{type(exc).__name__}: {exc}"
                await asyncio.sleep(min(RETRY_S, max(batch.deadline - self.clock(), 0.0)))
                continue
            try:
                msg = wire.decode(raw.data)
            except wire.ProtocolError as exc:
                return None, f"malformed answer: {exc}", True
            if isinstance(msg, wire.ReceiptBatch):
                return msg, "", True
            return None, f"worker error {msg.code.name}: {msg.message}" if isinstance(msg, wire.ErrorReply) else f"answered {type(msg).__name__}", True
        return None, f"no batch signature within {self.pending.deadline:.2f} s ({problem})", False


def _report(task: asyncio.Task) -> None:
    if not task.cancelled() and (exc := task.exception()) is not None:
        log.error("receipt.collect_failed", error=repr(exc))  # a bug: its receipts stay unjudged (unpaid)


def _variants(receipt: Receipt) -> Iterator[Receipt]:
    """The receipts an honest worker may have signed for our rebuild: the same, or on the other path (the instant a
    punched path takes over from the relay, or dies back to it, each side may still see the other one)."""
    yield receipt
    yield dataclasses.replace(receipt, path=Path(receipt.path).other.value)
