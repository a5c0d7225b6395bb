"""The backbone's remote MoE step: star fan-out of each layer's routed tokens to the hosting workers.

For a layer, every group of the partition that owns at least one selected expert
gets one request, all in flight at once (layer latency = slowest host, not the
sum). Replies are combined in group order (the protocol's combine order), so
with an F32 wire the result equals :func:`experts.moe.grouped_moe` bit for bit.
A host that errs or misses its deadline is benched and the group goes to the
next ready replica, and finally to local compute from the backbone's own copy
of the experts: a token's output never depends on which path answered. Benched
and demoted hosts are only probed, in the background (``routing``'s table), and
:meth:`RemoteMoE.maintain` keeps re-reading the routes, so a departed host costs
at most one deadline and a new one is asked within a refresh interval.

The numpy forward is synchronous; it runs on a worker thread and calls
:meth:`RemoteMoE.hook`, which hands each layer to the asyncio loop that owns the
QUIC endpoint and waits for the combined answer -- or, one sequence decoding, on
the loop's own thread (:mod:`node.backbone.onloop`), with no thread hop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import os
import time
from collections import Counter, deque
from collections.abc import Callable, Coroutine, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import structlog

from experts import codecs
from experts.codecs import Codec
from experts.errors import MoeSwarmError
from experts.moe import ExpertSource, combine
from node.backbone import onloop
from node.backbone.heads import HeadExchange
from node.backbone.hot import HotExperts
from node.backbone.routing import Host, LayerRoute, Router
from node.backbone.signatures import SignatureCollector
from node.backbone.spotcheck import DEFAULT_SPOT_CHECK, Answer, CheckResult, SpotChecker, agree, compare, settle
from node.ledger.deferred import DELAY_S, Pending
from node.ledger.receipts import Receipt, ReceiptError, ReceiptStamp, build_receipt, decode_issued
from node.ledger.sink import LedgerSink
from p2p.connector import Connector
from p2p.dht.discovery import Discovery, DiscoveryError
from p2p.identity import PeerId
from p2p.pathkind import Path
from p2p.quic.endpoint import TransportError, TransportTimeout
from p2p.wire import messages as wire

log = structlog.get_logger("node.backbone.dispatch")
KEEP_RECENT = 100_000


class Taint(Protocol):
    """Told which rows of a dispatch used a host's unchecked sums (:class:`node.backbone.provenance.Provenance`, or a
    batch's split of them among its sequences)."""

    def used(self, peer: str, rows: np.ndarray) -> None: ...


# Slot affinity: (layer, expert range of a group) -> the host that answered it for a session.
Pins = dict[tuple[int, tuple[int, int]], PeerId]


class DispatchFailed(MoeSwarmError):
    """A host could not answer a group; the caller moves on to the next candidate."""


class HostDraining(DispatchFailed):
    """The host refused with DRAINING: it is shutting down, did no work, and takes none until it is back."""


class HostBusy(DispatchFailed):
    """The host refused with OVERLOADED: it is saturated (other backbones), did no work, and may be asked again soon."""


# Refusals that are no dispatch (the worker did no work): what each error code means for the host that sent it.
REFUSALS: dict[wire.ErrorCode, type[DispatchFailed]] = {wire.ErrorCode.DRAINING: HostDraining, wire.ErrorCode.OVERLOADED: HostBusy}


class HostTimedOut(DispatchFailed):
    """No answer within the dispatch's deadline (counted towards demotion: a dead, overloaded or sybil host)."""


@dataclass(frozen=True)
class Dispute:
    """A receipt whose result failed a spot check, or that its worker did not sign: unpaid, with the evidence."""

    receipt: Receipt
    max_abs_diff: float
    min_cosine: float
    caught: bool = True  # False: an earlier, unchecked receipt of a worker caught later (suspect, so unpaid too)
    at: float = field(default_factory=time.monotonic)
    reason: str = "spot check"  # or why its batch signature failed (never signed: the ledgers hold no entry for it)


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
    worker_ms: float = 0.0  # the worker's own time for it (decode, compute, encode), from its reply
    probe: bool = False  # sent in the background to a benched or demoted host; the group was computed locally
    timed_out: bool = False
    at: float = field(default_factory=time.monotonic)


def _p50(xs: list[float]) -> float:
    return round(float(np.median(xs)), 3)


@dataclass
class DispatchStats:
    # Bounded: a long-running gateway keeps the recent window (the ledger keeps everything).
    records: deque[DispatchRecord] = field(default_factory=lambda: deque(maxlen=KEEP_RECENT))
    local_groups: int = 0
    refusals: Counter[str] = field(default_factory=Counter)  # worker refusals that were no dispatch, by code (draining, overloaded)
    tokens_forwarded: int = 0  # token-layer visits of the forward (denominator for bytes per token per layer)
    # (remote hosts asked, wall ms) per layer dispatch: a star fan-out should take ~ its slowest round trip, not the sum
    layers: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=KEEP_RECENT))

    def summary(self) -> dict:
        probes = [r for r in self.records if r.probe]
        asked = [r for r in self.records if not r.probe]
        ok = [r for r in asked if r.ok]
        waited: dict[str, int] = {}  # failed dispatches a layer waited on, per host (the cost churn has on tokens)
        for r in asked:
            if not r.ok:
                waited[r.peer] = waited.get(r.peer, 0) + 1
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
            "failed_dispatches": len(asked) - len(ok),
            "failed_by_peer": waited,
            "timeouts_by_peer": {peer: sum(1 for r in asked if r.timed_out and r.peer == peer) for peer in waited},
            "probes": {"ok": sum(1 for r in probes if r.ok), "failed": sum(1 for r in probes if not r.ok)},
            "local_groups": self.local_groups,
            "refusals": dict(self.refusals),
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


def _finished(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()  # a DispatchFailed already charged to its host: retrieved, so asyncio does not report it lost


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
        fallback: ExpertSource | None,
        *,
        loop: asyncio.AbstractEventLoop,
        codec: Codec = Codec.F32,
        timeout: float = 5.0,
        spot_check: float = DEFAULT_SPOT_CHECK,
        spot_seed: int | None = None,
        ledger: LedgerSink | None = None,
        hot: HotExperts | None = None,
        hedge: bool = False,
        sign_delay: float = DELAY_S,
        router: Router | None = None,
    ) -> None:
        """Everything the dispatcher needs, complete: *codec* must already be allowed for the model (the
        composition root checks the verdict store), *loop* owns *connector*'s endpoint (:meth:`hook` is
        called from the forward's thread and hands each layer to it). *fallback* None: the backbone holds no
        routed experts (a model too large for it): no local compute, spot checks re-ask another replica. Receipts
        are signed by their workers in batches after the replies (:mod:`node.backbone.signatures`): asked for
        *sign_delay* s after a worker's oldest unsigned receipt, each batch's verdict due within *timeout*."""
        self.connector = connector
        self.discovery = discovery
        self.model_digest = model_digest
        self._model_id = wire.model_id_of(bytes.fromhex(model_digest))
        self.n_embd, self.n_ff_exp = n_embd, n_ff_exp
        self.fallback = fallback
        self.codec = codec
        self.timeout = timeout
        self.router = router if router is not None else Router(n_expert)  # *router*: one the caller built first, e.g. with --max-price
        connector.relay_listeners.append(self._relay_restored)
        self.stats = DispatchStats()
        self.receipts: deque[Receipt] = deque(maxlen=KEEP_RECENT)  # recent; the ledger holds them all
        self.disputes: deque[Dispute] = deque(maxlen=KEEP_RECENT)
        self.checker = SpotChecker(spot_check, spot_seed)
        self.ledger = ledger  # every receipt once its batch signature verified, and every dispute, is appended (off the hot path)
        self.signatures = SignatureCollector(connector, signed=self._signed, unsigned=self._unsigned, repriced=self._repriced, deadline=timeout, delay=sign_delay)
        self.heads = HeadExchange(ledger, connector, timeout=timeout) if ledger else None  # signed heads swapped with workers paid
        self.hot = hot  # experts the backbone computes itself (EPLB-style), or None
        self.loop = loop
        self.hedge = hedge  # ask the next replica too when a group's host is late (Router.hedge_after)
        self._tasks: set[asyncio.Future] = set()  # probes and hedged dispatches that lost, finishing in the background

    async def refresh(self, layers: Sequence[int], *, fresh: bool = False) -> None:
        """Look up every layer's hosts (through the discovery cache unless *fresh*) and rebuild the routes."""
        found = await asyncio.gather(*(self.discovery.lookup(self.model_digest, layer, fresh=fresh) for layer in layers))
        for layer, records in zip(layers, found):
            old = self.router.routes.get(layer)
            new = self.router.update(layer, records)
            if old is not None and old.peers() != new.peers():
                log.info("routes.changed", layer=layer, added=sorted(map(str, new.peers() - old.peers())), removed=sorted(map(str, old.peers() - new.peers())))

    async def maintain(self, layers: Sequence[int], interval: float) -> None:
        """Re-read every layer's hosts from the DHT every *interval* seconds, until cancelled.

        A lookup failure is logged and retried at the next interval; the routes in use stay as they were.
        """
        while True:
            await asyncio.sleep(interval)
            try:
                await self.refresh(layers, fresh=True)
            except DiscoveryError as exc:
                log.warning("routes.refresh_failed", error=str(exc))

    async def close(self) -> None:
        """Cancel the probes and hedged dispatches still in flight (their hosts are not charged for it); collect the
        signatures of every receipt still unsigned; swap ledger heads a last time with the workers paid since the
        previous swap."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.signatures.close()
        if self.heads:
            await self.heads.close()

    async def settle(self) -> None:
        """Return once every receipt so far has its batch signature's verdict (a worker convicted by one is a culprit)."""
        await self.signatures.settle()

    def settle_blocking(self) -> None:
        """:meth:`settle` from the forward (on its thread, or on the loop's inside ``onloop.run_on_loop``, where blocking
        the thread would deadlock): a sequence's last rollback check waits for it (``Provenance``)."""
        if onloop.inside():
            onloop.start(self.settle()).result()
        else:
            asyncio.run_coroutine_threadsafe(self.settle(), self.loop).result()

    def hook(self, layer: int, x: np.ndarray, ids: np.ndarray, w: np.ndarray, pins: Pins | None = None, provenance: Taint | None = None) -> Future:
        """The ``moe_ffn`` for :class:`experts.forward.Backbone`, called off the loop thread or, with no thread hop,
        inside :func:`node.backbone.onloop.run_on_loop` on it.

        Returns a Future at once, so the forward computes the shared expert during the round trip.
        """
        if onloop.inside():
            return onloop.start(self.dispatch_layer(layer, x, ids, w, pins, provenance))
        return asyncio.run_coroutine_threadsafe(self.dispatch_layer(layer, x, ids, w, pins, provenance), self.loop)

    async def dispatch_layer(self, layer: int, x: np.ndarray, ids: np.ndarray, w: np.ndarray, pins: Pins | None = None, provenance: Taint | None = None) -> np.ndarray:
        """*pins*, if given, steers each group to the host pinned for it (while that host is ready) and records the host that answered.
        *provenance*, if given, learns which rows used unchecked remote sums."""
        self.stats.tokens_forwarded += x.shape[0]
        t0 = time.perf_counter()
        if layer not in self.router.routes:
            await self.refresh(range(layer, layer + 1))
        route = self.router.routes[layer]  # this dispatch's split, whatever a refresh puts in its place meanwhile
        part = route.partition
        is_hot = self.hot.hot(layer)[ids] if self.hot else np.zeros(ids.shape, dtype=bool)
        groups = [part.held_mask(g, ids) & ~is_hot for g in range(len(part.bounds))]
        jobs, present = [], []
        for g, held in enumerate(groups):
            rows = held.any(axis=1)
            present.append(rows)
            if rows.any():
                mark = functools.partial(provenance.used, rows=rows) if provenance else None
                jobs.append((g, rows, self._group(layer, route, g, x[rows], np.where(held, ids, -1)[rows], w[rows], held[rows], pins, mark)))
        if is_hot.any():  # the backbone's own hot experts: computed here while the round trips are in flight
            rows = is_hot.any(axis=1)
            present.append(rows)
            jobs.append((len(groups), rows, self._local(layer, x[rows], ids[rows], w[rows], is_hot[rows])))
        remote = len(jobs) - int(is_hot.any())
        # Start the slowest round trip first: the layer ends with its slowest answer, which must not queue behind the
        # other sends (tasks run in creation order until their first await, i.e. until their request is on the wire).
        now = time.monotonic()
        expected = [self.router.expected_ms(route, g, now) if g < len(groups) else 0.0 for g, _, _ in jobs]
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
        if self.fallback is None:
            raise DispatchFailed(f"no host answered for layer {layer}, and this backbone holds no experts to compute them itself")
        loop = asyncio.get_running_loop()
        sums, _ = await loop.run_in_executor(None, self.fallback.partial_sum, layer, x, ids, w, held)
        return sums

    async def _group(self, layer: int, route: LayerRoute, group: int, x, ids, w, held, pins: Pins | None, mark: Callable[[str], None] | None = None) -> np.ndarray:
        """*mark*, if given, is told the peer whose answer was used unchecked (see :mod:`node.backbone.provenance`)."""
        key = (layer, route.partition.bounds[group])
        plan = self.router.plan(route, group, time.monotonic(), prefer=pins.get(key) if pins else None)
        # Benched or demoted hosts are never waited on: asked in the background with the same data while the group
        # is computed here. A backbone that holds no experts has nothing to compute: for it they are the last resort.
        last_resort = plan.probe if self.fallback is None else []
        for host in plan.probe if self.fallback is not None else []:
            self._background(self._probe(host, layer, x, ids, w, held))

        def won(winner: Host, sums: np.ndarray, checked: bool) -> np.ndarray:
            if pins is not None:
                pins[key] = winner.peer_id
            if mark is not None and not checked:
                mark(str(winner.peer_id))
            return sums

        tried: set[PeerId] = set()
        for i, host in enumerate(plan.ask):
            if host.peer_id in tried or self.router.health[host.peer_id].failures:  # failed since the plan was made
                continue
            backup = next((h for h in plan.ask[i + 1 :] if not self.router.health[h.peer_id].failures), None) if self.hedge else None
            try:
                winner, (sums, checked) = await self._ask(host, backup, tried, layer, x, ids, w, held)
            except DispatchFailed:
                continue
            return won(winner, sums, checked)
        for host in last_resort:
            try:
                return won(host, *await self._attempt(host, layer, x, ids, w, held))
            except DispatchFailed:
                continue
        self.stats.local_groups += 1
        log.debug("dispatch.local", layer=layer, group=list(route.partition.bounds[group]), n_tokens=x.shape[0])
        return await self._local(layer, x, ids, w, held)

    async def _ask(self, host: Host, backup: Host | None, tried: set[PeerId], layer: int, x, ids, w, held) -> tuple[Host, tuple[np.ndarray, bool]]:
        """Ask *host*; with a *backup* (hedging) ask it too once *host* is later than ``Router.hedge_after``. The first
        good answer wins; the slower dispatch finishes in the background (its receipt kept, its round trip measured).
        Raises DispatchFailed when every host asked failed (each already charged by ``_failed``)."""
        tried.add(host.peer_id)
        hedge_s = self.router.hedge_after(host.peer_id, x.shape[0]) if backup is not None else None
        if backup is None or hedge_s is None:
            return host, await self._attempt(host, layer, x, ids, w, held)
        tasks = {asyncio.ensure_future(self._attempt(host, layer, x, ids, w, held)): host}
        done, _ = await asyncio.wait(tasks, timeout=hedge_s)
        if not done:
            tried.add(backup.peer_id)
            log.debug("dispatch.hedged", peer=str(host.peer_id), backup=str(backup.peer_id), layer=layer, after_ms=round(hedge_s * 1e3, 3))
            tasks[asyncio.ensure_future(self._attempt(backup, layer, x, ids, w, held))] = backup
        pending = set(tasks)
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                if (exc := t.exception()) is not None and not isinstance(exc, DispatchFailed):
                    raise exc  # a bug, not a host failing
            good = next((t for t in done if t.exception() is None), None)
            if good is not None:
                for task in pending:
                    self._keep(task)
                return tasks[good], good.result()
        raise DispatchFailed(f"{len(tasks)} hosts asked, none answered")

    async def _attempt(self, host: Host, layer: int, x, ids, w, held) -> tuple[np.ndarray, bool]:
        """One dispatch within *host*'s deadline, (sums, verified); a failure is charged to it (``_failed``) and re-raised."""
        try:
            return await self._send(host, layer, x, ids, w, held, timeout=self.router.deadline(host.peer_id, x.shape[0], self.timeout))
        except DispatchFailed as exc:
            self._failed(host, layer, exc, probe=False)
            raise

    async def _probe(self, host: Host, layer: int, x, ids, w, held) -> None:
        """Ask a benched or demoted host for a group already answered locally: an answer makes it ready again."""
        try:
            await self._send(host, layer, x, ids, w, held, timeout=self.timeout, probe=True)
            log.info("dispatch.probe_ok", peer=str(host.peer_id), layer=layer)
        except DispatchFailed as exc:
            self._failed(host, layer, exc, probe=True)

    def _failed(self, host: Host, layer: int, exc: DispatchFailed, *, probe: bool) -> None:
        now = time.monotonic()
        if isinstance(exc, HostDraining):
            self.router.leaving(host.peer_id, now)
            log.debug("dispatch.redirected", peer=str(host.peer_id), layer=layer, reason=str(exc))
            return
        if isinstance(exc, HostBusy):
            self.router.busy(host.peer_id, now)
            log.debug("dispatch.busy", peer=str(host.peer_id), layer=layer, reason=str(exc))
            return
        was_demoted = self.router.health[host.peer_id].demoted
        next_probe_s = self.router.failed(host.peer_id, now, timed_out=isinstance(exc, HostTimedOut))
        health = self.router.health[host.peer_id]
        log.warning("dispatch.probe_failed" if probe else "dispatch.failed", peer=str(host.peer_id), layer=layer, reason=str(exc), benched_s=next_probe_s)
        if health.demoted and not was_demoted:
            log.warning("route.demoted", peer=str(host.peer_id), timeouts=health.timeouts, demotions=health.demotions, next_probe_s=next_probe_s)

    def _relay_restored(self, url: str) -> None:
        if peers := self.router.relay_restored(url, time.monotonic()):
            log.info("route.relay_restored", url=url, probing=[str(p) for p in peers])

    def _background(self, job: Coroutine) -> None:
        self._keep(asyncio.ensure_future(job))

    def _keep(self, task: asyncio.Future) -> None:
        """Let *task* finish in the background (cancelled by :meth:`close`); its failure was charged where it happened."""
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(_finished)

    async def _send(self, host: Host, layer: int, x, ids, w, held, *, timeout: float, probe: bool = False) -> tuple[np.ndarray, bool]:
        """*host*'s answer within *timeout* s, spot-checked if sampled: (sums to use, whether they were verified)."""
        sums, receipt = await self._exchange(host, layer, x, ids, w, held, timeout=timeout, probe=probe)
        if not self.checker.should_check():
            self.signatures.add(host, receipt)
            return sums, False
        return await self._spot_check(host, layer, x, ids, w, held, Answer(sums, host.kernel), receipt)

    async def _exchange(self, host: Host, layer: int, x, ids, w, held, *, timeout: float, probe: bool = False) -> tuple[np.ndarray, Receipt]:
        """One request to *host* and its checked reply, waiting at most *timeout* s: (sums, rebuilt receipt, its
        signature still to come); DispatchFailed otherwise (HostTimedOut, HostDraining)."""
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
        ok, reply_len, path, worker_ms, timed_out = False, 0, host.path, 0.0, False
        refused: str | None = None  # the code of a refusal that was no dispatch
        try:
            try:
                reply = await self.connector.request(host.peer_id, host.addr, host.relay, data, timeout=timeout)
            except TransportTimeout as exc:
                timed_out = True
                raise HostTimedOut(f"no answer within {timeout:.2f} s: {exc}") from None
            except TransportError as exc:
                raise DispatchFailed(f"{type(exc).__name__}: {exc}") from None
            raw, path = reply.data, reply.path
            reply_len = len(raw)
            try:
                msg = wire.decode(raw)
            except wire.ProtocolError as exc:
                raise DispatchFailed(f"malformed reply: {exc}") from None
            if isinstance(msg, wire.ErrorReply):
                refusal = REFUSALS.get(msg.code)
                refused = msg.code.name.lower() if refusal is not None else None
                raise (refusal or DispatchFailed)(f"worker error {msg.code.name}: {msg.message}")
            if not isinstance(msg, wire.DispatchReply) or msg.dispatch_id != req.dispatch_id or msg.n_tokens != n:
                raise DispatchFailed("reply does not answer this dispatch")
            try:
                sums = codecs.decode(self.codec, msg.partial, n, self.n_embd)
            except codecs.CodecError as exc:
                raise DispatchFailed(f"bad partial sums: {exc}") from None
            if not np.isfinite(sums).all():
                raise DispatchFailed("partial sums are not finite")
            receipt = self._rebuild_receipt(host, req, data, msg, path)
            ok, worker_ms = True, msg.compute_us / 1e3
        finally:
            latency = (time.perf_counter() - t0) * 1e3
            if refused:  # a draining or saturated host's refusal is no dispatch: it did no work, the group goes elsewhere
                self.stats.refusals[refused] += 1
            else:
                self.stats.records.append(DispatchRecord(layer, str(host.peer_id), path, n, len(data), reply_len, latency, ok, worker_ms, probe, timed_out))
            log.debug("dispatch.done", peer=str(host.peer_id), path=path, layer=layer, n_tokens=n, bytes_out=len(data), bytes_back=reply_len, latency_ms=round(latency, 3), ok=ok, probe=probe)
        compute_ms = msg.compute_us / 1e3
        self.router.succeeded(host.peer_id, max(latency - compute_ms, 0.0), compute_ms, n)
        return sums, receipt

    def _signed(self, item: Pending[Host], stamp: ReceiptStamp) -> None:
        """A receipt's batch signature verified: now it is recorded, paid unless its worker was caught meanwhile."""
        receipt = item.receipt
        if self.ledger:
            self.ledger.receipt(receipt, stamp)
            if item.dispute:
                self.ledger.dispute(receipt, item.dispute)
        if item.dispute:
            return
        self.receipts.append(receipt)
        log.debug("receipt.accepted", **dataclasses.asdict(receipt))  # the ledger entry's fields, as one event
        if self.heads:
            self.heads.after_dispatch(item.host)

    def _unsigned(self, host: Host, items: tuple[Pending[Host], ...], reason: str, reached: bool) -> None:
        """*host* left receipts unsigned past their deadline, or signed something else: its receipts are disputed
        and the sums rolled back as for a caught cheat. A worker that answered with anything but a valid signature is
        banned; one that never answered (it crashed, its relay restarted, its path broke, or it stays silent on
        purpose) is benched like a failed dispatch instead, the bench doubling per failure: banning it would buy
        nothing (nothing unsigned is paid, its sums are recomputed) and would keep an honest worker out for a minute
        after every network blip.
        Receipts disputed already (their worker convicted while they waited) are no new offence; a reply that was in
        flight at a conviction is (its sums were used after the culprit was named: naming it again rolls them back)."""
        items = tuple(p for p in items if p.dispute is None)
        if not items:
            return
        self.checker.unsigned += 1  # batches whose worker was convicted for them
        disputes = [Dispute(p.receipt, float("nan"), float("nan"), reason=f"unsigned: {reason}") for p in items]
        ban = self._convict(host, disputes, f"worker left dispatch {items[0].receipt.dispatch_id} unsigned: {reason}"[:1000], ban=reached)
        log.warning("receipt.disputed", peer=str(host.peer_id), dispatch_id=items[0].receipt.dispatch_id, layer=items[0].receipt.layer, unsigned=len(items), reason=reason,
                    **({"banned_s": ban} if reached else {"benched_s": ban}))

    async def _repriced(self, host: Host, layer: int) -> int | None:
        """The price *host*'s fresh record asks, if it re-priced since our cached lookup (it signs its new price)."""
        try:
            records = await self.discovery.lookup(self.model_digest, layer, fresh=True)
        except DiscoveryError:
            return None
        fresh = [r for r in records if r.peer_id == host.peer_id]
        if not fresh or fresh[0].hosted.price == host.price:
            return None
        self.router.update(layer, records)
        return fresh[0].hosted.price

    async def _spot_check(self, host: Host, layer: int, x, ids, w, held, got: Answer, receipt: Receipt) -> tuple[np.ndarray, bool]:
        """Re-compute this dispatch: locally if the backbone holds the experts, else on other replicas.

        Returns (sums to use, verified): a caught host's receipt is disputed, it is banned, and the
        right answer is used; with nobody to ask (or no settling third answer) its answer stands, unverified.
        """
        self.checker.checked += 1
        if self.fallback is not None:
            want = codecs.roundtrip(self.codec, await self._local(layer, codecs.roundtrip(self.codec, x), ids, w, held))
            result = compare(self.codec, got.sums, want, same_kernel=host.kernel == str(self.fallback.identity))
            if not result.ok:
                self._catch(host, layer, receipt, result)
                return want, True
            self.signatures.add(host, receipt)
            return got.sums, True
        asked = await self._ask_replicas(host, layer, x, ids, w, held, 1)
        if not asked:
            self._unverifiable(host, layer)
            self.signatures.add(host, receipt)
            return got.sums, False
        (ref, ref_answer, ref_receipt), = asked
        if agree(self.codec, got, ref_answer).ok:
            self.signatures.add(host, receipt)
            self.signatures.add(ref, ref_receipt)
            return got.sums, True
        third = await self._ask_replicas(host, layer, x, ids, w, held, 1, skip={ref.peer_id})
        verdict = settle(self.codec, got, ref_answer, third[0][1]) if third else None
        for other, _, r in third:
            self.signatures.add(other, r)
        if verdict is None or verdict.wrong is None:
            self.checker.unsettled += 1
            log.warning("spotcheck.unsettled", layer=layer, peers=[str(host.peer_id), str(ref.peer_id)], third=bool(third))
            self.signatures.add(host, receipt)
            self.signatures.add(ref, ref_receipt)
            return got.sums, False
        if verdict.wrong == 0:
            self._catch(host, layer, receipt, verdict.evidence)
            self.signatures.add(ref, ref_receipt)
            return ref_answer.sums, True
        self._catch(ref, layer, ref_receipt, verdict.evidence)
        self.signatures.add(host, receipt)
        return got.sums, True

    async def _ask_replicas(self, host: Host, layer: int, x, ids, w, held, n: int, skip: frozenset | set = frozenset()) -> list[tuple[Host, Answer, Receipt]]:
        """The same dispatch on up to *n* other replicas that hold its experts (not *host*, not *skip*), best first."""
        route = self.router.routes[layer]
        lo, hi = int(ids[held].min()), int(ids[held].max())
        group = next(g for g, (a, b) in enumerate(route.partition.bounds) if a <= lo and hi < b)
        out: list[tuple[Host, Answer, Receipt]] = []
        for other in self.router.candidates(layer, group, time.monotonic()):
            if len(out) == n:
                break
            if other.peer_id == host.peer_id or other.peer_id in skip:
                continue
            try:
                sums, r = await self._exchange(other, layer, x, ids, w, held, timeout=self.router.deadline(other.peer_id, x.shape[0], self.timeout))
            except DispatchFailed as exc:
                self._failed(other, layer, exc, probe=False)
                continue
            out.append((other, Answer(sums, other.kernel), r))
        return out

    def _unverifiable(self, host: Host, layer: int) -> None:
        if not self.checker.unverifiable:
            log.warning("spotcheck.unverifiable", peer=str(host.peer_id), layer=layer, reason="no other replica hosts these experts and the backbone holds none: its answers cannot be verified")
        self.checker.unverifiable += 1

    def _catch(self, host: Host, layer: int, receipt: Receipt, result: CheckResult) -> None:
        """*host* answered wrong: convict it; this receipt is recorded disputed once signed (the signed wrong sums are the evidence)."""
        self.checker.caught += 1
        reason = f"spot check: max|diff| {result.max_abs_diff:.3g}, min cosine {result.min_cosine:.6f}"
        ban = self._convict(host, [Dispute(receipt, result.max_abs_diff, result.min_cosine)], f"worker caught returning wrong sums in dispatch {receipt.dispatch_id}")
        self.signatures.add(host, receipt, dispute=reason)
        log.warning("receipt.disputed", peer=str(host.peer_id), dispatch_id=receipt.dispatch_id, layer=layer, max_abs_diff=result.max_abs_diff, min_cosine=result.min_cosine, banned_s=ban)

    def _convict(self, host: Host, disputes: list[Dispute], earlier_reason: str, *, ban: bool = True) -> float:
        """Ban *host* (or with ``ban=False`` only bench it), name it a culprit (sequences that used its unchecked
        sums roll back), and dispute *disputes* and every earlier receipt of it in the session: paid ones in the
        ledger now, unsigned ones once signed. Returns the ban's (or bench's) seconds."""
        worker = str(host.peer_id)
        self.checker.culprits.append(worker)
        if ban:
            seconds = self.checker.ban_for(worker)
            self.router.ban(host.peer_id, time.monotonic(), seconds)
        else:
            seconds = self.router.unreachable(host.peer_id, time.monotonic())
        earlier = [r for r in self.receipts if r.worker == worker]
        self.receipts = deque((r for r in self.receipts if r.worker != worker), maxlen=KEEP_RECENT)
        judged = {d.receipt.dispatch_id for d in disputes} | {d.receipt.dispatch_id for d in self.disputes if d.receipt.worker == worker}
        waiting = [r for r in self.signatures.convict(worker, earlier_reason) if r.dispatch_id not in judged]
        self.disputes += disputes + [Dispute(r, float("nan"), float("nan"), caught=False) for r in earlier + waiting]
        if self.ledger:
            for r in earlier:
                self.ledger.dispute(r, earlier_reason)
        return seconds

    def _rebuild_receipt(self, host: Host, req: wire.DispatchRequest, data: bytes, msg: wire.DispatchReply, path: Path) -> Receipt:
        """The receipt the worker will sign for this dispatch (its issue time from the reply; the price from its
        record, re-read if its batch signature covers another). The path is what our own connection saw."""
        try:
            issued_at_us = decode_issued(msg.receipt)
        except ReceiptError as exc:
            raise DispatchFailed(f"receipt rejected: {exc}") from None
        return build_receipt(
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
            issued_at_us=issued_at_us,
        )
