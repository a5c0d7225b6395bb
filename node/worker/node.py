"""A worker node: its slice, QUIC endpoint, DHT records, reachability and optional relay, from start to stop.

``WorkerNode`` enters each resource into one ``AsyncExitStack`` as it sets it up, so teardown runs in exactly the
reverse order (background tasks, DHT records, reachability, relay, endpoint, DHT node, compute pool, ledger), also
when start-up fails half way. Its lifecycle is the table in :mod:`node.worker.lifecycle`; on SIGTERM/SIGINT it
drains: withdraw the records, refuse new dispatches, finish those in flight within ``drain_timeout`` seconds.
"""


from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Self, TypeVar

import structlog

from experts.errors import MoeSwarmError
from experts.gguf_model import ExpertRange, GGUFModel
from experts.hosting import open_experts
from experts.kernels import make_kernel
from experts.moe import Progress
from experts.slices import check_slice
from node.ledger.sink import LedgerSink
from node.runtime import until_stopped, write_ready
from node.status.coverage import Phase
from node.status.server import NodeStatus, model_shape, serve_status
from node.worker.lifecycle import Lifecycle, State
from node.worker.pricing import scarcity_price
from node.worker.service import MAX_IN_FLIGHT, MAX_IN_FLIGHT_PER_PEER, Worker
from node.worker.slice_server import SliceLimits, SliceServer
from p2p.dht.kademlia import BOOTSTRAP_WAIT, LibP2PDiscovery, check_bootstrap, parse_listen
from p2p.dht.records import HostedSlice, RelayAddress
from p2p.identity import Identity
from p2p.nat.helpers import NodeReachability, helper_address
from p2p.nat.reachability import Verdict
from p2p.nat.traversal import announced_address
from p2p.ports import check_free
from p2p.quic.budget import ServeLimits
from p2p.quic.endpoint import Endpoint
from p2p.wire import messages as wire
from relay.client import RelaySettings, attach

log = structlog.get_logger("node.worker.node")


@dataclass(frozen=True)
class WorkerOptions:
    model: Path
    layers: range | None
    experts: ExpertRange | None
    listen: tuple[str, int]
    dht_listen: str
    bootstrap: Sequence[str]
    bootstrap_wait: float = BOOTSTRAP_WAIT  # seconds to retry an unreachable bootstrap, before anything loads
    memory_budget: int | None = None  # refuse to start unless the hosted experts fit (see experts.hosting)
    kernel: str = "ggml"  # experts.kernels.KERNELS name; self-tested before anything is announced
    threads: int = 1
    price: int = 0
    capacity: int = 0
    advertise: str | None = None  # host:port others should dial (default: the bound address)
    model_digest: str | None = None  # for a slice: the model it must belong to
    max_datagram: int = 1200  # QUIC datagram size this end sends (1200 is safe on any path; loopback takes 16384)
    reprice_s: float = 60.0
    relay: str | None = None  # ws(s)://HOST:PORT/relay: also reachable through this relay; check reachability
    relay_only: bool = False  # announce the relay address only, skip the check, answer no punch (relay path only)
    relay_settings: RelaySettings = RelaySettings()  # whom to trust for wss://, how often to ping the relay
    recheck_s: float = 300.0  # with a relay: seconds between reachability re-checks (a change is re-announced)
    drain_timeout: float = 10.0  # on SIGTERM: seconds to finish the dispatches in flight before closing
    dispatch_delay: float = 0.0  # test only: seconds every dispatch waits before computing (holds it in flight)
    serve_limits: ServeLimits = ServeLimits()  # what peers may make the QUIC endpoint hold (p2p.quic.budget)
    max_in_flight: int = MAX_IN_FLIGHT  # dispatches accepted and not yet answered, all peers; then OVERLOADED
    max_in_flight_per_peer: int = MAX_IN_FLIGHT_PER_PEER
    summary_s: float = 60.0  # seconds between "worker.summary" lines (none for a quiet interval)
    serve_slices: bool = True  # serve the hosted experts' bytes to peers fetching a slice (and say so in the records)
    slice_limits: SliceLimits = SliceLimits()


T = TypeVar("T")
PhaseProgress = Callable[[str, int, int], None]
"""Hears (phase, steps done, steps in all) while a worker loads: "self-testing the kernel", "loading experts"."""


class LoadCancelled(MoeSwarmError):
    """Raised on the warming thread to stop it; nobody awaits it any more by then."""


WITHDRAW_TIMEOUT_S = 10.0  # past it shutdown goes on; the records then expire on their own


class WorkerNode:
    """One worker process: ``async with WorkerNode(...) as node`` loads, serves and announces; ``drain()`` stops
    it gracefully; leaving the block closes every resource in reverse order of set-up."""

    def __init__(self, identity: Identity, opts: WorkerOptions, ledger_path: Path | None = None, progress: PhaseProgress | None = None) -> None:
        self.identity = identity
        self.opts = opts
        self.ledger_path = ledger_path
        self.progress = progress  # hears the load's steps, phase by phase (the CLI draws bars on a terminal)
        self.lifecycle = Lifecycle()
        self.reachability = "unchecked"
        self._stack = AsyncExitStack()
        self._tasks: set[asyncio.Task] = set()
        self._withdrawn = False

    async def __aenter__(self) -> Self:
        try:
            await self._start()
        except BaseException:
            await self._close()
            raise
        self.lifecycle.move(State.SERVING)
        log.info("worker.ready", peer=str(self.identity.peer_id), quic=self.addr, relay=self.opts.relay, dht=self.dht.multiaddrs[:1], reachability=self.reachability, layers=f"{self.store.layers.start}-{self.store.layers.stop - 1}", experts=str(self.store.experts), mode=self.plan.mode, resident_mb=round(self.plan.resident_bytes / 2**20, 1), kernel=str(self.store.identity), threads=self.opts.threads)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._close()

    async def _start(self) -> None:
        opts, identity, stack = self.opts, self.identity, self._stack
        self.model = model = GGUFModel(opts.model)
        # A taken port or a wrong or dead bootstrap fails now, not after loading (the DHT node exists only later).
        check_free("UDP", *opts.listen, "QUIC")
        check_free("TCP", *parse_listen(opts.dht_listen), "the DHT")
        await check_bootstrap(opts.bootstrap, opts.bootstrap_wait)
        log.info("worker.loading", model=model.path.name, layers=_span(opts.layers), experts=str(opts.experts) if opts.experts else "all", kernel=opts.kernel)
        kernel = await self._in_thread("self-testing the kernel", lambda progress: make_kernel(opts.kernel, opts.threads, progress=progress))  # KernelError: refuse to serve
        store, self.plan = open_experts(model, kernel, opts.layers, opts.experts, memory_budget=opts.memory_budget)  # refuses what does not fit, before reading it
        self.store = store
        if model.is_slice:
            await self._in_thread("checking the slice", lambda progress: check_slice(model, opts.model_digest, progress))
        await self._in_thread("loading experts", store.warm)  # announce only once dispatches are served at full speed
        self.ledger = LedgerSink(self.ledger_path, "worker", identity) if self.ledger_path else None
        if self.ledger:
            stack.callback(self.ledger.close)
        slices = SliceServer(model, store.layers, range(store.experts.start, store.experts.stop), opts.slice_limits) if opts.serve_slices else None
        self.worker = worker = Worker(identity, store, price=opts.price, ledger=self.ledger, delay=opts.dispatch_delay, max_in_flight=opts.max_in_flight, max_in_flight_per_peer=opts.max_in_flight_per_peer, slices=slices)
        stack.callback(worker.close)
        # A worker behind a relay may be NAT-bound: it joins the DHT as a client (nobody may be able to dial it, so
        # it must not host records), also when its check finds it public.
        self.dht = dht = LibP2PDiscovery(identity, listen=opts.dht_listen, bootstrap=opts.bootstrap, client_mode=bool(opts.relay), models=[model_shape(model)])
        stack.push_async_callback(dht.close)
        self.endpoint = endpoint = await Endpoint.bind(identity, opts.listen[0], opts.listen[1], handler=worker.handle, max_datagram_size=opts.max_datagram, max_message=min(wire.MAX_MESSAGE, opts.serve_limits.max_bytes_per_conn), serve_limits=opts.serve_limits)
        stack.push_async_callback(endpoint.close)
        port = endpoint.local_addr[1]
        self.configured = opts.advertise or helper_address(opts.listen[0], port)  # a direct address we were told, if any
        self.addr = None if opts.relay else opts.advertise or f"{opts.listen[0]}:{port}"  # with a relay: decided by the check
        self.ranges = ((store.experts.start, store.experts.stop),)
        self.relay_addr = relay_path = None
        if opts.relay:
            relay_path = attach(endpoint, opts.relay_settings.client(identity, opts.relay))
            stack.push_async_callback(relay_path.client.close)
            stack.callback(relay_path.detach)
            relay_path.client.start()
            await relay_path.client.wait_connected(30)
            assert relay_path.client.relay_peer is not None  # wait_connected returned: the relay said who it is
            self.relay_addr = RelayAddress(opts.relay, relay_path.client.relay_peer)
        self.reach = reach = NodeReachability(endpoint, dht, recheck=opts.recheck_s)  # answers probes on the QUIC socket in every mode
        stack.push_async_callback(reach.close)
        if relay_path:
            reach.nat.attach_relay(relay_path.client, initiate=False)  # answers backbones' punches with our verdict
            worker.path_of = reach.nat.path
        await dht.start()
        stack.push_async_callback(self._withdraw)
        stack.callback(self._cancel_tasks)
        reach.start()
        if opts.relay and not opts.relay_only:
            verdict = await reach.check()
            self.addr = announced_address(verdict, self.configured)
            self.reachability = verdict.kind.name.lower()
            reach.nat.reach.on_change = self._on_change
        elif opts.relay_only:
            self.reachability = "relay-only"  # else "unchecked": public by configuration
        await reach.announce(self.addr if opts.relay else self.configured)  # public nodes help others check theirs
        worker.price = scarcity_price(opts.price, await self.replicas()) if opts.price else 0
        await dht.announce(self.slices(worker.price))
        if opts.price:
            self._spawn(self._reprice())
        self._spawn(self._summarize())

    async def _in_thread(self, phase: str, work: Callable[[Progress], T]) -> T:
        """Run ``work(progress)`` on a thread that stops at its next progress step once this task is cancelled
        (Ctrl-C while loading): a thread cannot be interrupted, and ``asyncio.run`` waits for it before exiting."""
        log.info("worker.load_phase", phase=phase)
        cancelled = threading.Event()
        reached: list[int | None] = [0, None]  # the last step the thread reported: (done, total)

        def step(done: int, total: int) -> None:
            if cancelled.is_set():
                raise LoadCancelled(f"{phase} was cancelled")
            reached[:] = [done, total]
            if self.progress:
                self.progress(phase, done, total)

        try:
            return await asyncio.to_thread(work, step)
        except asyncio.CancelledError:
            # Logged here, not in the thread: a cancel that comes before the executor picked the work up means the
            # work never runs (its future is cancelled first), so the thread would never say anything.
            cancelled.set()
            log.info("worker.load_cancelled", phase=phase, done=reached[0], total=reached[1])
            raise

    def ready_info(self) -> dict:
        """What the ready file publishes: how launchers and tests reach this worker."""
        return {"role": "worker", "peer_id": str(self.identity.peer_id), "quic_addr": self.addr, "relay": self.opts.relay, "reachability": self.reachability, "dht_addrs": self.dht.multiaddrs, "load": self.plan.mode, "resident_bytes": self.plan.resident_bytes, "kernel": str(self.store.identity), "price": self.worker.price, "ledger": str(self.ledger_path) if self.ledger_path else None}

    @property
    def moe_layers(self) -> list[int]:
        """The hosted layers that have experts: dense layers have nothing to announce."""
        return [layer for layer in self.store.layers if self.model.cfg.is_moe(layer)]

    def slices(self, price: int) -> list[HostedSlice]:
        return [HostedSlice(self.model.digest, layer, self.ranges, quic_addr=self.addr, relay=self.relay_addr, capacity=self.opts.capacity, price=price, kernel=str(self.store.identity), serves_slices=self.opts.serve_slices) for layer in self.moe_layers]

    async def replicas(self) -> int:
        """Live hosts (this one included) of our slice's scarcest layer."""
        counts = []
        for layer in self.moe_layers:
            hosts = await self.dht.lookup(self.model.digest, layer)
            counts.append(1 + sum(1 for r in hosts if r.peer_id != self.identity.peer_id and r.hosted.expert_ranges == self.ranges))
        return min(counts)

    async def _reprice(self) -> None:
        """Re-announce when the scarcity price changes (docs/swarm.md: pricing)."""
        while True:
            await asyncio.sleep(self.opts.reprice_s)
            price = scarcity_price(self.opts.price, await self.replicas())
            if price != self.worker.price:
                self.worker.price = price
                await self.dht.announce(self.slices(price))
                log.info("worker.repriced", price=price)

    async def _summarize(self) -> None:
        """Every ``summary_s``: one line of what the last interval served and earned (nothing if it served nothing)."""
        stats = self.worker.stats
        seen = (stats.dispatches, stats.tokens, stats.errors, stats.credits)
        while True:
            await asyncio.sleep(self.opts.summary_s)
            now = (stats.dispatches, stats.tokens, stats.errors, stats.credits)
            if now[:3] != seen[:3]:
                d = [a - b for a, b in zip(now, seen)]
                log.info("worker.summary", seconds=self.opts.summary_s, dispatches=d[0], tokens=d[1], refused=d[2], credits=d[3], credits_total=now[3], peers=len(stats.by_peer))
            seen = now

    async def _readvertise(self, verdict: Verdict) -> None:
        """A re-check changed the verdict: announce the direct address it implies (or withdraw ours)."""
        new = announced_address(verdict, self.configured)
        if new == self.addr:
            return
        log.info("worker.readvertised", quic=new, before=self.addr, reachability=verdict.kind.name.lower(), reason=verdict.reason)
        self.addr = new
        try:
            await self.dht.announce(self.slices(self.worker.price))
            await self.reach.announce(new)
        except Exception as exc:  # the records keep their refresh loop; the next change or restart retries
            log.warning("worker.readvertise_failed", error=repr(exc))

    def _on_change(self, verdict: Verdict) -> None:
        self._spawn(self._readvertise(verdict))

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _cancel_tasks(self) -> None:
        for task in list(self._tasks):
            task.cancel()

    async def _withdraw(self) -> None:
        """Tombstone our records (once: the drain does it first, teardown only if no drain did)."""
        if self._withdrawn:
            return
        self._withdrawn = True
        try:
            await asyncio.wait_for(self.dht.withdraw(), WITHDRAW_TIMEOUT_S)
            log.info("worker.withdrawn", peer=str(self.identity.peer_id))
        except Exception as exc:  # shutdown goes on; records then expire on their own
            log.warning("worker.withdraw_failed", error=repr(exc))

    async def drain(self) -> None:
        """Stop gracefully: withdraw the records, refuse new dispatches, finish those in flight (within the deadline).

        Records go first, so backbones stop finding us while we still serve; requests that arrive after that (from
        a backbone's cached lookup) get ``ErrorCode.DRAINING`` and go to another replica. "Finished" means the
        reply was handed to QUIC: the endpoint has no flush yet, so a reply larger than the congestion window at
        close could still be cut (decode replies are a few KB).
        """
        self.lifecycle.move(State.DRAINING)
        log.info("worker.draining", peer=str(self.identity.peer_id), in_flight=self.worker.in_flight, deadline_s=self.opts.drain_timeout)
        self._cancel_tasks()
        await self._withdraw()
        self.worker.refuse_new()
        try:
            await asyncio.wait_for(self.worker.idle(), self.opts.drain_timeout)
            log.info("worker.drained", peer=str(self.identity.peer_id), served=self.worker.stats.dispatches)
        except TimeoutError:
            log.warning("worker.drain_timeout", peer=str(self.identity.peer_id), in_flight=self.worker.in_flight, deadline_s=self.opts.drain_timeout)

    async def _close(self) -> None:
        await self._stack.aclose()
        self.lifecycle.move(State.CLOSED)
        log.info("worker.closed", peer=str(self.identity.peer_id))


def _span(layers: range | None) -> str:
    return f"{layers.start}-{layers.stop - 1}" if layers else "all"


async def run_worker(identity: Identity, opts: WorkerOptions, ready_file: str | None, ledger_path: Path | None = None, *, http: tuple[str, int] | None = None, progress: PhaseProgress | None = None, on_ready: Callable[[WorkerNode], None] | None = None) -> None:
    """Load the slice, serve dispatches, announce until SIGINT/SIGTERM, then drain and close (a second signal
    during the drain ends the process at once: the handlers are gone by then). *progress* hears the load's steps;
    *on_ready* is called once the node serves and is announced."""
    status = NodeStatus("worker", str(identity.peer_id), phase=Phase.LOADING, ledger_path=ledger_path)
    async with serve_status(http, status), WorkerNode(identity, opts, ledger_path, progress) as node:
        status.worker, status.discovery, status.model = node.worker, node.dht, model_shape(node.model)
        status.info = {"addresses": f"quic {node.addr or '-'}" + (f", relay {opts.relay}" if opts.relay else "") + f" ({node.reachability})", "slices": f"layers {node.store.layers.start}-{node.store.layers.stop - 1}, experts {node.store.experts.start}-{node.store.experts.stop - 1}"}
        status.phase = Phase.SERVING
        write_ready(ready_file, {**node.ready_info(), "http_addr": status.http_addr})
        if on_ready:
            on_ready(node)
        await until_stopped()
        status.phase = Phase.DRAINING
        await node.drain()
