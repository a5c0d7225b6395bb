"""The backbone's remote MoE step: star fan-out of each layer's routed tokens to the hosting workers.

For a layer, every group of the partition that owns at least one selected expert
gets one request, all in flight at once (layer latency = slowest host, not the
sum). Replies are combined in group order (the protocol's combine order), so
with an F32 wire the result equals :func:`experts.moe.grouped_moe` bit for bit.
A host that errs or times out is benched and the group goes to the next replica,
and finally to local compute from the backbone's own copy of the experts: a
token's output never depends on which path answered.

The numpy forward is synchronous; it runs on a worker thread and calls
:meth:`RemoteMoE.hook`, which hands each layer to the asyncio loop that owns the
QUIC endpoint and waits for the combined answer.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np
import structlog

from experts import codecs
from experts.codecs import Codec
from experts.errors import MoeSwarmError
from experts.moe import ExpertSource, combine
from node.backbone.hot import HotExperts
from node.backbone.routing import Host, Router
from node.backbone.spotcheck import SpotChecker, compare
from node.ledger.receipts import (
    Receipt,
    ReceiptError,
    ReceiptStamp,
    build_receipt,
    verify,
    verify_on_either_path,
)
from node.ledger.sink import LedgerSink
from p2p import wire
from p2p.connector import Connector
from p2p.discovery import Discovery
from p2p.identity import PeerId
from p2p.pathkind import Path
from p2p.quic import TransportError

log = structlog.get_logger("node.backbone.dispatch")
KEEP_RECENT = 100_000


# Slot affinity: (layer, expert range of a group) -> the host that answered it for a session.
Pins = dict[tuple[int, tuple[int, int]], PeerId]


class DispatchFailed(MoeSwarmError):
    """A host could not answer a group; the caller moves on to the next candidate."""


class HostDraining(DispatchFailed):
    """The host refused with DRAINING: it is shutting down, did no work, and takes none until it is back."""


@dataclass(frozen=True)
class Dispute:
    """A receipt whose result failed a spot check: unpaid, with the evidence."""

    receipt: Receipt
    max_abs_diff: float
    min_cosine: float
    caught: bool = True  # False: an earlier, unchecked receipt of a worker caught later (suspect, so unpaid too)
    at: float = field(default_factory=time.monotonic)


@dataclass
class DispatchRecord:
    layer: int
    peer: str
    path: Path
    n_tokens: int
    bytes_out: int
    bytes_back: int
    latency_ms: float
    ok: bool
    worker_ms: float = 0.0  # the worker's own time for it (decode, compute, encode, sign), from its reply
    at: float = field(default_factory=time.monotonic)


def _p50(xs: list[float]) -> float:
    return round(float(np.median(xs)), 3)


@dataclass
class DispatchStats:
    # Bounded: a long-running gateway keeps the recent window (the ledger keeps everything).
    records: deque[DispatchRecord] = field(default_factory=lambda: deque(maxlen=KEEP_RECENT))
    local_groups: int = 0
    tokens_forwarded: int = 0  # token-layer visits of the forward (denominator for bytes per token per layer)
    # (remote hosts asked, wall ms) per layer dispatch: a star fan-out should take ~ its slowest round trip, not the sum
    layers: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=KEEP_RECENT))

    def summary(self) -> dict:
        ok = [r for r in self.records if r.ok]
        lat = np.array([r.latency_ms for r in ok]) if ok else np.zeros(1)
        per_peer: dict[str, int] = {}
        per_layer: dict[int, set[str]] = {}
        paths: dict[str, dict[str, int]] = {}
        for r in ok:
            per_peer[r.peer] = per_peer.get(r.peer, 0) + 1
            per_layer.setdefault(r.layer, set()).add(r.peer)
            by_path = paths.setdefault(r.peer, {})
            by_path[r.path] = by_path.get(r.path, 0) + 1
        visits = max(self.tokens_forwarded, 1)
        return {
            "dispatches": len(ok),
            "failed_dispatches": len(self.records) - len(ok),
            "local_groups": self.local_groups,
            "per_peer": per_peer,
            "hosts_per_layer": {layer: len(peers) for layer, peers in sorted(per_layer.items())},
            "paths": paths,
            "first_path": {peer: next(r.path for r in ok if r.peer == peer) for peer in per_peer},
            "bytes_per_token_per_layer": {
                "out": round(sum(r.bytes_out for r in ok) / visits, 1),
                "back": round(sum(r.bytes_back for r in ok) / visits, 1),
            },
            "rtt_ms": {"p50": round(float(np.percentile(lat, 50)), 3), "p99": round(float(np.percentile(lat, 99)), 3)},
            "worker_ms_p50": _p50([r.worker_ms for r in ok]) if ok else 0.0,
            "rtt_ms_by_peer": {peer: _p50([r.latency_ms for r in ok if r.peer == peer]) for peer in per_peer},
            "layer_ms": self.layer_summary(),
        }

    def layer_summary(self) -> dict:
        """Median wall time of a layer's dispatch, overall and by how many remote hosts it fanned out to."""
        by_fanout: dict[int, list[float]] = {}
        for fanout, ms in self.layers:
            by_fanout.setdefault(fanout, []).append(ms)
        return {"p50": _p50([ms for _, ms in self.layers]) if self.layers else None, "by_fanout": {n: {"p50": _p50(xs), "n": len(xs)} for n, xs in sorted(by_fanout.items())}}


class RemoteMoE:
    """Dispatches a model's MoE layers to workers found through *discovery*."""

    def __init__(
        self,
        connector: Connector,
        discovery: Discovery,
        model_digest: str,
        n_embd: int,
        n_ff_exp: int,
        n_expert: int,
        fallback: ExpertSource,
        *,
        loop: asyncio.AbstractEventLoop,
        codec: Codec = Codec.F32,
        timeout: float = 5.0,
        spot_check: float = 0.0,
        spot_seed: int | None = None,
        ledger: LedgerSink | None = None,
        hot: HotExperts | None = None,
        max_price: int | None = None,
    ) -> None:
        """Everything the dispatcher needs, complete: *codec* must already be allowed for the model (the
        composition root checks the verdict store), *loop* owns *connector*'s endpoint (:meth:`hook` is
        called from the forward's thread and hands each layer to it)."""
        self.connector = connector
        self.discovery = discovery
        self.model_digest = model_digest
        self._model_id = wire.model_id_of(bytes.fromhex(model_digest))
        self.n_embd, self.n_ff_exp = n_embd, n_ff_exp
        self.fallback = fallback
        self.codec = codec
        self.timeout = timeout
        self.router = Router(n_expert, max_price=max_price)
        self.stats = DispatchStats()
        self.receipts: deque[Receipt] = deque(maxlen=KEEP_RECENT)  # recent; the ledger holds them all
        self.disputes: deque[Dispute] = deque(maxlen=KEEP_RECENT)
        self.checker = SpotChecker(spot_check, spot_seed)
        self.ledger = ledger  # every verified receipt, and every dispute, is appended (off the hot path)
        self.hot = hot  # experts the backbone computes itself (EPLB-style), or None
        self.loop = loop

    async def refresh(self, layers: Sequence[int]) -> None:
        """Look up every layer's hosts (through the discovery cache) and rebuild the routes."""
        for layer in layers:
            self.router.update(layer, await self.discovery.lookup(self.model_digest, layer))

    def hook(self, layer: int, x: np.ndarray, ids: np.ndarray, w: np.ndarray, pins: Pins | None = None) -> Future:
        """The ``moe_ffn`` for :class:`experts.forward.Backbone`, called off the loop thread.

        Returns a Future at once, so the forward computes the shared expert during the round trip.
        """
        return asyncio.run_coroutine_threadsafe(self.dispatch_layer(layer, x, ids, w, pins), self.loop)

    async def dispatch_layer(self, layer: int, x: np.ndarray, ids: np.ndarray, w: np.ndarray, pins: Pins | None = None) -> np.ndarray:
        """*pins*, if given, steers each group to the host pinned for it (while that host is ready) and records the host that answered."""
        self.stats.tokens_forwarded += x.shape[0]
        t0 = time.perf_counter()
        if layer not in self.router.routes:
            await self.refresh(range(layer, layer + 1))
        part = self.router.routes[layer].partition
        is_hot = self.hot.hot(layer)[ids] if self.hot else np.zeros(ids.shape, dtype=bool)
        groups = [part.held_mask(g, ids) & ~is_hot for g in range(len(part.bounds))]
        jobs, present = [], []
        for g, held in enumerate(groups):
            rows = held.any(axis=1)
            present.append(rows)
            if rows.any():
                jobs.append((g, rows, self._group(layer, g, x[rows], np.where(held, ids, -1)[rows], w[rows], held[rows], pins)))
        if is_hot.any():  # the backbone's own hot experts: computed here while the round trips are in flight
            rows = is_hot.any(axis=1)
            present.append(rows)
            jobs.append((len(groups), rows, self._local(layer, x[rows], ids[rows], w[rows], is_hot[rows])))
        remote = len(jobs) - int(is_hot.any())
        # Start the slowest round trip first: the layer ends with its slowest answer, which must not queue behind the
        # other sends (tasks run in creation order until their first await, i.e. until their request is on the wire).
        now = time.monotonic()
        expected = [self.router.expected_ms(layer, g, now) if g < len(groups) else 0.0 for g, _, _ in jobs]
        tasks = {j: asyncio.ensure_future(jobs[j][2]) for j in sorted(range(len(jobs)), key=lambda j: -expected[j])}
        results = await asyncio.gather(*(tasks[j] for j in range(len(jobs))))
        self.stats.layers.append((remote, (time.perf_counter() - t0) * 1e3))
        partials = [(np.zeros_like(x), rows) for rows in present]
        for (g, rows, _), sums in zip(jobs, results):
            partials[g][0][rows] = sums
        if self.hot:
            self.hot.observe(layer, ids)
        return combine(partials)

    async def _local(self, layer: int, x, ids, w, held) -> np.ndarray:
        loop = asyncio.get_running_loop()
        sums, _ = await loop.run_in_executor(None, self.fallback.partial_sum, layer, x, ids, w, held)
        return sums

    async def _group(self, layer: int, group: int, x, ids, w, held, pins: Pins | None) -> np.ndarray:
        key = (layer, self.router.routes[layer].partition.bounds[group])
        for host in self.router.candidates(layer, group, time.monotonic(), prefer=pins.get(key) if pins else None):
            try:
                sums = await self._send(host, layer, x, ids, w, held)
                if pins is not None:
                    pins[key] = host.peer_id
                return sums
            except HostDraining as exc:
                self.router.leaving(host.peer_id, time.monotonic())
                log.debug("dispatch.redirected", peer=str(host.peer_id), layer=layer, reason=str(exc))
            except DispatchFailed as exc:
                backoff = self.router.failed(host.peer_id, time.monotonic())
                log.warning("dispatch.failed", peer=str(host.peer_id), layer=layer, reason=str(exc), benched_s=backoff)
        self.stats.local_groups += 1
        log.debug("dispatch.local", layer=layer, group=list(self.router.routes[layer].partition.bounds[group]), n_tokens=x.shape[0])
        return await self._local(layer, x, ids, w, held)

    async def _send(self, host: Host, layer: int, x, ids, w, held) -> np.ndarray:
        n, k = ids.shape
        req = wire.DispatchRequest(
            dispatch_id=os.urandom(16),
            model_id=self._model_id,
            layer=layer,
            codec=self.codec,
            n_tokens=n,
            top_k=k,
            expert_ids=tuple(int(e) for e in ids.ravel()),
            router_weights=tuple(float(v) for v in w.ravel()),
            hidden=codecs.encode(self.codec, x),
        )
        data = req.encode()
        self.router.started(host.peer_id)
        t0 = time.perf_counter()
        ok, reply_len, path, refused, worker_ms = False, 0, host.path, False, 0.0
        try:
            try:
                reply = await self.connector.request(host.peer_id, host.addr, host.relay, data, timeout=self.timeout)
            except TransportError as exc:
                raise DispatchFailed(f"{type(exc).__name__}: {exc}") from None
            raw, path = reply.data, reply.path
            reply_len = len(raw)
            try:
                msg = wire.decode(raw)
            except wire.ProtocolError as exc:
                raise DispatchFailed(f"malformed reply: {exc}") from None
            if isinstance(msg, wire.ErrorReply):
                refused = msg.code is wire.ErrorCode.DRAINING
                raise (HostDraining if refused else DispatchFailed)(f"worker error {msg.code.name}: {msg.message}")
            if not isinstance(msg, wire.DispatchReply) or msg.dispatch_id != req.dispatch_id or msg.n_tokens != n:
                raise DispatchFailed("reply does not answer this dispatch")
            try:
                sums = codecs.decode(self.codec, msg.partial, n, self.n_embd)
            except codecs.CodecError as exc:
                raise DispatchFailed(f"bad partial sums: {exc}") from None
            if not np.isfinite(sums).all():
                raise DispatchFailed("partial sums are not finite")
            receipt, stamp = await self._check_receipt(host, req, data, msg, path)
            ok, worker_ms = True, msg.compute_us / 1e3
        finally:
            latency = (time.perf_counter() - t0) * 1e3
            if not refused:  # a draining host's refusal is no dispatch: it did no work, the group goes elsewhere
                self.stats.records.append(DispatchRecord(layer, str(host.peer_id), path, n, len(data), reply_len, latency, ok, worker_ms))
            log.debug("dispatch.done", peer=str(host.peer_id), path=path, layer=layer, n_tokens=n, bytes_out=len(data), bytes_back=reply_len, latency_ms=round(latency, 3), ok=ok)
        compute_ms = msg.compute_us / 1e3
        self.router.succeeded(host.peer_id, max(latency - compute_ms, 0.0))
        if self.checker.should_check():
            want = await self._spot_check(host, layer, x, ids, w, held, sums, receipt, stamp)
            if want is not None:
                return want
        self.receipts.append(receipt)
        log.debug("receipt.accepted", **dataclasses.asdict(receipt))  # the ledger entry's fields, as one event
        if self.ledger:
            self.ledger.receipt(receipt, stamp)
        return sums

    async def _spot_check(self, host: Host, layer: int, x, ids, w, held, sums, receipt: Receipt, stamp: ReceiptStamp) -> np.ndarray | None:
        """Re-compute this dispatch locally; on a mismatch dispute the receipt, ban the host, return the right answer."""
        self.checker.checked += 1
        want = codecs.roundtrip(self.codec, await self._local(layer, codecs.roundtrip(self.codec, x), ids, w, held))
        result = compare(self.codec, sums, want, same_kernel=host.kernel == str(self.fallback.identity))
        if result.ok:
            return None
        self.checker.caught += 1
        ban = self.checker.ban_for(str(host.peer_id))
        self.router.ban(host.peer_id, time.monotonic(), ban)
        dispute = Dispute(receipt, result.max_abs_diff, result.min_cosine)
        earlier = [r for r in self.receipts if r.worker == receipt.worker]
        self.receipts = deque((r for r in self.receipts if r.worker != receipt.worker), maxlen=KEEP_RECENT)
        self.disputes += [dispute] + [Dispute(r, float("nan"), float("nan"), caught=False) for r in earlier]
        if self.ledger:
            self.ledger.receipt(receipt, stamp)
            self.ledger.dispute(receipt, f"spot check: max|diff| {result.max_abs_diff:.3g}, min cosine {result.min_cosine:.6f}")
            for r in earlier:
                self.ledger.dispute(r, f"worker caught returning wrong sums in dispatch {receipt.dispatch_id}")
        log.warning("receipt.disputed", peer=str(host.peer_id), dispatch_id=receipt.dispatch_id, layer=layer, max_abs_diff=result.max_abs_diff, min_cosine=result.min_cosine, banned_s=ban)
        return want

    async def _check_receipt(self, host: Host, req: wire.DispatchRequest, data: bytes, msg: wire.DispatchReply, path: Path) -> tuple[Receipt, ReceiptStamp]:
        """Rebuild the receipt the worker signed and check its signature.

        The price comes from the worker's DHT record; a worker that re-priced since our cached
        lookup signs its new price, so on a mismatch the record is fetched again once. The path
        is what each side sees of its own connection (see ``verify_on_either_path``).
        """
        try:
            stamp = ReceiptStamp.decode(msg.receipt)
        except ReceiptError as exc:
            raise DispatchFailed(f"receipt rejected: {exc}") from None
        receipt = build_receipt(
            data,
            req,
            msg,
            backbone=str(self.connector.peer_id),
            worker=str(host.peer_id),
            model_digest=self.model_digest,
            n_embd=self.n_embd,
            n_ff_exp=self.n_ff_exp,
            path=path,
            price=host.price,
            issued_at_us=stamp.issued_at_us,
        )
        try:
            return verify_on_either_path(receipt, stamp), stamp
        except ReceiptError as exc:
            first_error = exc
        records = await self.discovery.lookup(self.model_digest, req.layer, fresh=True)
        fresh = [r for r in records if r.peer_id == host.peer_id]
        if fresh and fresh[0].hosted.price != host.price:
            self.router.update(req.layer, records)
            repriced = dataclasses.replace(receipt, price=fresh[0].hosted.price)
            try:
                verify(repriced, stamp)
                return repriced, stamp
            except ReceiptError:
                pass
        raise DispatchFailed(f"receipt rejected: {first_error}")
