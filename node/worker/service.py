"""A worker: serves dispatches for the experts it hosts, batching concurrent requests per layer.

Requests for the same layer that arrive while a compute call is running are
folded into the next call (one ``partial_sum`` over the union of their tokens).
The expert kernel is batch invariant (its start-up self-test proves it on this machine), so a
backbone gets the same bits whether its tokens were computed alone or beside others'.
Compute runs on one background thread so the event loop keeps serving QUIC.

A reply leaves unsigned, carrying only the receipt's issue time; its receipt waits
(:class:`node.ledger.deferred.UnsignedReceipts`) until the backbone asks for the batch
signature (``wire.ReceiptSignRequest``): one Ed25519 signature over many dispatches, off
the reply's path. A receipt enters the worker's ledger, and counts as earned, when it is signed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import structlog

from experts import codecs
from experts.codecs import Codec
from experts.errors import CodecError
from experts.moe import ExpertSource
from experts.rows import split_rows
from node.ledger.deferred import UnsignedReceipts
from node.ledger.entries import Role
from node.ledger.receipts import Receipt, ReceiptStamp, build_receipt, encode_issued, leaf_hash, sign_batch, work_units
from node.ledger.sink import LedgerSink
from node.ledger.witness import UNKNOWN, SignedHead
from node.worker.slice_server import SliceServer
from p2p.identity import Identity, PeerId
from p2p.lograte_edge import ThrottledLog
from p2p.pathkind import Path
from p2p.wire import messages as wire

log = structlog.get_logger("node.worker.service")
# Batches up to this much work (expert-token FLOPs, see receipts.work_units) are computed on the event loop: a
# few tokens of a small model take ~0.1 ms there, while the round trip through the pool thread costs ~1 ms under
# load. Larger batches go to the pool so the loop keeps serving other requests meanwhile -- unless the batch is
# all the worker has in flight (one backbone decoding): then the loop has nothing to serve meanwhile, and the hop
# to the pool and back (two thread wake-ups) is pure latency on the reply's path.
INLINE_WORK = 4_000_000
MAX_IN_FLIGHT = 256  # dispatches accepted and not yet answered, all peers (docs/architecture.md, "Limits")
MAX_IN_FLIGHT_PER_PEER = 32  # ... from one peer
SIGN_GRACE_S = 2.0  # a draining worker waits this long for its backbones to ask for their receipts' signatures


class NotHosted(wire.ProtocolError):
    error_code = wire.ErrorCode.NOT_HOSTED


class UnknownModel(wire.ProtocolError):
    error_code = wire.ErrorCode.UNKNOWN_MODEL


class ComputeFailed(wire.ProtocolError):
    error_code = wire.ErrorCode.INTERNAL


class NonFiniteSums(ComputeFailed):
    """The partial sums overflowed to NaN/infinity (finite but extreme inputs, e.g. 3e38): never signed, never sent."""


class Draining(wire.ProtocolError):
    error_code = wire.ErrorCode.DRAINING


class Overloaded(wire.ProtocolError):
    error_code = wire.ErrorCode.OVERLOADED


@dataclass
class _Job:
    x: np.ndarray
    ids: np.ndarray
    weights: np.ndarray
    held: np.ndarray
    done: asyncio.Future = field(repr=False)


@dataclass
class WorkerStats:
    dispatches: int = 0
    errors: int = 0
    batches: int = 0
    tokens: int = 0
    credits: int = 0  # work units x price, as the signed receipts say (see node.ledger.receipts)
    signed: int = 0  # receipts signed (in batches)
    by_peer: dict[str, int] = field(default_factory=dict)


class Worker:
    """Dispatch handler over the hosted experts (an :class:`experts.moe.ExpertSource`); plug ``handle`` into a QUIC endpoint."""

    def __init__(self, identity: Identity, store: ExpertSource, *, price: int = 0, path_of=None, ledger: LedgerSink | None = None, inline_work: int = INLINE_WORK, inline_alone: bool = True, delay: float = 0.0, max_in_flight: int = MAX_IN_FLIGHT, max_in_flight_per_peer: int = MAX_IN_FLIGHT_PER_PEER, slices: SliceServer | None = None) -> None:
        self.identity = identity
        self.slices = slices  # None: --no-serve-slices
        self.delay = delay  # test only: seconds every dispatch waits before it computes (to hold dispatches in flight)
        self.inline_work = inline_work
        self.inline_alone = inline_alone  # compute a batch on the loop when it is all that is in flight
        self.store = store
        self.model_digest = store.model.digest
        self._model_id = wire.model_id_of(bytes.fromhex(self.model_digest))
        self.price = price
        self.path_of = path_of or (lambda peer: Path.DIRECT)
        self.ledger = ledger
        self.stats = WorkerStats()
        self._peer_log = ThrottledLog(log)  # malformed dispatches anyone can send: a few lines, then a count
        self._pending: dict[int, list[_Job]] = {}
        self._running: set[int] = set()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="experts")
        self.refusing = False  # draining: new dispatch requests get ErrorCode.DRAINING
        self.in_flight = 0  # dispatch requests accepted and not yet answered
        self.max_in_flight, self.max_in_flight_per_peer = max_in_flight, max_in_flight_per_peer
        self._in_flight_by: dict[PeerId, int] = {}
        self._idle = asyncio.Event()
        self._idle.set()
        self.unsigned = UnsignedReceipts()
        self._all_signed = asyncio.Event()
        self._all_signed.set()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def refuse_new(self) -> None:
        """From now on answer dispatch requests with DRAINING (pings still get their pong)."""
        self.refusing = True

    async def idle(self) -> None:
        """Return once no dispatch is in flight (their replies handed to the endpoint) and the backbones asked for the
        signatures of the receipts answered (or ``SIGN_GRACE_S`` passed: unsigned receipts are not paid)."""
        await self._idle.wait()
        try:
            await asyncio.wait_for(self._all_signed.wait(), SIGN_GRACE_S)
        except TimeoutError:
            log.warning("receipt.unsigned_at_close", receipts=len(self.unsigned))

    async def handle(self, peer: PeerId, data: bytes) -> bytes:
        """One request message in, one reply message out; bad input gets an ErrorReply, never an exception."""
        t0 = time.perf_counter()
        dispatch_id = wire.peek_dispatch_id(data)
        try:
            msg = wire.decode(data)
            if isinstance(msg, wire.Ping):
                return wire.Pong.answering(msg).encode()
            if isinstance(msg, wire.LedgerHead):
                return (await self._ledger_head(peer, msg)).encode()
            if isinstance(msg, wire.ReceiptSignRequest):
                return self._sign(peer, msg).encode()
            if isinstance(msg, (wire.SliceInfoRequest, wire.PieceRequest)):
                return (await self._slice(peer, msg)).encode()
            if not isinstance(msg, wire.DispatchRequest):
                raise wire.InvalidField("type", f"a worker answers DispatchRequest, Ping, LedgerHead, ReceiptSignRequest, SliceInfoRequest and PieceRequest, not {type(msg).__name__}")
            if self.refusing:
                raise Draining("type", "this worker is shutting down and withdrew its records; ask another replica")
            self._admit(peer)
            self.in_flight += 1
            self._in_flight_by[peer] = self._in_flight_by.get(peer, 0) + 1
            self._idle.clear()
            try:
                reply = await self._dispatch(peer, msg, data, t0)
            finally:
                self.in_flight -= 1
                if (left := self._in_flight_by.pop(peer) - 1) > 0:
                    self._in_flight_by[peer] = left
                if not self.in_flight:
                    self._idle.set()
        except (wire.ProtocolError, CodecError) as exc:
            self.stats.errors += 1
            self._peer_log.warning("dispatch.refused", peer=str(peer), error=str(exc), bytes_in=len(data))
            if isinstance(exc, CodecError):
                exc = wire.BadCodec("hidden", str(exc))
            return wire.error_reply_for(exc, dispatch_id).encode()
        return reply

    async def _slice(self, peer: PeerId, msg: wire.SliceInfoRequest | wire.PieceRequest) -> wire.SliceInfo | wire.Piece:
        if self.slices is None:
            raise NotHosted("type", "this worker does not serve slices (--no-serve-slices)")
        if self.refusing:
            raise Draining("type", "this worker is shutting down; fetch from another holder")
        return self.slices.info(msg) if isinstance(msg, wire.SliceInfoRequest) else await self.slices.piece(peer, msg)

    async def _ledger_head(self, peer: PeerId, msg: wire.LedgerHead) -> wire.LedgerHead:
        """Keep the backbone's signed head; answer with ours and our entry hash at the seq it last witnessed."""
        if self.ledger is None:
            raise wire.InvalidField("type", "this worker keeps no ledger")
        if msg.role is not wire.Role.BACKBONE:
            raise wire.InvalidField("role", "a worker swaps ledger heads with backbones")
        self.ledger.witness(SignedHead(Role.BACKBONE, str(peer), msg.seq, msg.entry_hash, msg.signature))
        ours = await asyncio.to_thread(self.ledger.head)
        answer = await asyncio.to_thread(self.ledger.hash_at, msg.ask_seq) if msg.ask_seq else UNKNOWN
        log.debug("ledger.head_exchanged", peer=str(peer), their_seq=msg.seq, our_seq=ours.seq)
        return wire.LedgerHead(wire.Role.WORKER, ours.seq, ours.entry_hash, ours.signature, msg.ask_seq, answer)

    def _admit(self, peer: PeerId) -> None:
        """Refuse (OVERLOADED) a dispatch past the in-flight caps: the backbone tries another replica or computes
        locally. One peer cannot occupy every compute slot, and a peer with nothing in flight is admitted even past
        the global cap, so a flood from many identities cannot starve the others (the transport's budget still
        bounds what all of them hold)."""
        mine = self._in_flight_by.get(peer, 0)
        if self.in_flight >= self.max_in_flight and mine:
            raise Overloaded("type", f"{self.in_flight} dispatches in flight (limit {self.max_in_flight}); retry later or ask another replica")
        if mine >= self.max_in_flight_per_peer:
            raise Overloaded("type", f"{self.max_in_flight_per_peer} of your dispatches are in flight here (the per-peer limit)")

    async def _dispatch(self, peer: PeerId, req: wire.DispatchRequest, data: bytes, t0: float) -> bytes:
        if req.model_id != self._model_id:
            raise UnknownModel("model_id", f"this worker serves model {self.model_digest[:16]}..., not {req.model_id.hex()[:16]}...")
        if req.layer not in self.store.layers:
            raise NotHosted("layer", f"layer {req.layer} is not hosted here (layers {self.store.layers.start}-{self.store.layers.stop - 1})")
        ids = np.asarray(req.expert_ids, dtype=np.int32).reshape(req.n_tokens, req.top_k)
        held = ids >= 0
        if not held.any():
            raise wire.InvalidField("expert_ids", "no slot is addressed to this worker")
        outside = held & ~((ids >= self.store.experts.start) & (ids < self.store.experts.stop))
        if outside.any():
            raise NotHosted("expert_ids", f"expert {int(ids[outside][0])} is not hosted here (experts {self.store.experts})")
        cfg = self.store.model.cfg
        codec = Codec(int(req.codec))
        x = codecs.decode(codec, req.hidden, req.n_tokens, cfg.n_embd)
        if not np.isfinite(x).all():
            raise wire.InvalidField("hidden", "hidden states hold NaN or infinity")
        w = np.asarray(req.router_weights, dtype=np.float32).reshape(req.n_tokens, req.top_k)
        if self.delay:
            log.info("dispatch.delayed", peer=str(peer), dispatch_id=req.dispatch_id.hex(), seconds=self.delay)
            await asyncio.sleep(self.delay)
        sums = await self._compute(req.layer, x, ids, w, held)
        payload = codecs.encode(codec, sums)
        on_wire = sums if codec is Codec.F32 else codecs.decode(codec, payload, req.n_tokens, cfg.n_embd)  # F16 overflows past 65504
        if not np.isfinite(on_wire).all():
            raise NonFiniteSums("partial", "the partial sums of this input overflow to NaN or infinity; refusing to sign them")
        compute_us = int((time.perf_counter() - t0) * 1e6)
        issued_at_us = time.time_ns() // 1000
        reply = wire.DispatchReply(req.dispatch_id, codec, req.n_tokens, payload, compute_us, encode_issued(issued_at_us))
        receipt = build_receipt(
            data,
            req,
            reply,
            backbone=str(peer),
            worker=str(self.identity.peer_id),
            model_digest=self.model_digest,
            n_embd=cfg.n_embd,
            n_ff_exp=cfg.n_ff_exp,
            path=self.path_of(peer),
            price=self.price,
            issued_at_us=issued_at_us,
        )
        self.unsigned.add(receipt)  # signed when the backbone asks for its batch's signature
        self._all_signed.clear()
        self.stats.dispatches += 1
        self.stats.tokens += req.n_tokens
        self.stats.by_peer[str(peer)] = self.stats.by_peer.get(str(peer), 0) + 1
        # The reply is on the wire before the next loop iteration (the endpoint sends it in this task step), so the
        # log event waits until after it.
        asyncio.get_running_loop().call_soon(self._served, receipt, compute_us)
        return reply.encode()

    @staticmethod
    def _served(receipt: Receipt, compute_us: int) -> None:
        log.debug("dispatch.served", compute_us=compute_us, **dataclasses.asdict(receipt))  # one event, the receipt's fields

    def _sign(self, peer: PeerId, msg: wire.ReceiptSignRequest) -> wire.ReceiptBatch:
        """One signature over the receipts of these dispatches that await it; they enter the ledger now (earned)."""
        receipts = self.unsigned.take(str(peer), (d.hex() for d in msg.dispatch_ids))
        if not len(self.unsigned):
            self._all_signed.set()
        if not receipts:
            raise wire.InvalidField("dispatch_ids", f"none of these {len(msg.dispatch_ids)} dispatches awaits a signature here (never answered, signed already, or forgotten)")
        signature, stamps = sign_batch(self.identity, receipts)
        self.stats.signed += len(receipts)
        self.stats.credits += sum(r.credits for r in receipts)
        asyncio.get_running_loop().call_soon(self._record, receipts, stamps)
        log.debug("receipt.batch_signed", peer=str(peer), dispatches=len(receipts), asked=len(msg.dispatch_ids))
        return wire.ReceiptBatch(tuple(bytes.fromhex(r.dispatch_id) for r in receipts), tuple(leaf_hash(r) for r in receipts), signature)

    def _record(self, receipts: list[Receipt], stamps: list[ReceiptStamp]) -> None:
        if self.ledger:
            for receipt, stamp in zip(receipts, stamps, strict=True):
                self.ledger.receipt(receipt, stamp)

    async def _compute(self, layer: int, x, ids, w, held) -> np.ndarray:
        loop = asyncio.get_running_loop()
        job = _Job(x, ids, w, held, loop.create_future())
        self._pending.setdefault(layer, []).append(job)
        if layer not in self._running:
            self._running.add(layer)
            asyncio.ensure_future(self._drain(layer))
        return await job.done

    async def _drain(self, layer: int) -> None:
        """Run batches for *layer* until no request waits; requests arriving meanwhile join the next batch."""
        loop = asyncio.get_running_loop()
        try:
            while self._pending.get(layer):
                jobs = self._pending.pop(layer)
                x = np.concatenate([j.x for j in jobs])
                args = (layer, x, np.concatenate([j.ids for j in jobs]), np.concatenate([j.weights for j in jobs]), np.concatenate([j.held for j in jobs]))
                try:
                    alone = self.inline_alone and len(jobs) == self.in_flight
                    if alone or work_units(int(args[4].sum()), x.shape[1], self.store.model.cfg.n_ff_exp) <= self.inline_work:
                        sums, _ = self.store.partial_sum(*args)  # cheaper than the hop to the pool thread and back
                    else:
                        sums, _ = await loop.run_in_executor(self._pool, self.store.partial_sum, *args)
                except Exception as exc:  # a compute failure fails these requests, not the worker
                    for j in jobs:
                        if not j.done.done():
                            j.done.set_exception(ComputeFailed("compute", f"{type(exc).__name__}: {exc}"))
                    log.error("dispatch.compute_failed", layer=layer, error=repr(exc))
                    continue
                self.stats.batches += 1
                for j, rows in zip(jobs, split_rows(sums, [j.x.shape[0] for j in jobs]), strict=True):
                    if not j.done.done():
                        j.done.set_result(rows)
        finally:
            self._running.discard(layer)

