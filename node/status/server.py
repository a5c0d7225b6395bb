"""``--http HOST:PORT``: liveness, readiness, Prometheus metrics and the status page of one node (aiohttp).

``NodeStatus`` is what a node tells this module: its role and phase, and whichever of its parts exist (a DHT
client to look the swarm up in, the backbone's ``RemoteMoE``, the ``Worker``, a ledger file). ``watch`` looks the
model's layers up in the DHT every ``refresh_s`` seconds, so a page or a scrape never waits on the DHT.

- ``GET /healthz``: 200 while the process runs its event loop (liveness).
- ``GET /readyz``: 200 ``ready``, or 503 with the reason (loading, waiting for hosts, a layer lacking hosts, draining).
- ``GET /metrics``: Prometheus text format (:mod:`node.status.metrics`).
- ``GET /status`` and ``/status.json``: the swarm as this node sees it (:mod:`node.status.page`).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import statistics
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from node.ledger.store import Ledger, LedgerError
from node.status import errors
from node.status.coverage import Coverage, Phase, Seen, build_coverage, readiness
from node.status.metrics import LedgerTotals, NodeCollector, exposition, registry_for
from node.status.page import render
from p2p.dht.records import ModelShape
from p2p.ports import binding

log = structlog.get_logger("node.status")
REFRESH_S = 5.0
SEEN_WINDOW = 2000  # newest dispatch records the page's path/RTT per host come from


def model_shape(model: Any) -> ModelShape:
    """The shape of a ``GGUFModel`` (full model or slice: the config keeps the whole model's layer count)."""
    cfg = model.cfg
    return ModelShape(model.digest, cfg.n_layer, cfg.n_expert, cfg.n_dense_lead, cfg.moe_step)


@dataclass
class NodeStatus:
    role: str
    peer_id: str
    phase: Phase = Phase.STARTING
    model: ModelShape | None = None  # whose coverage to look up
    discovery: Any = None  # anything with ``async lookup(model_digest, layer, fresh=)``
    needs_swarm: bool = False  # not ready while a layer lacks hosts (a gateway, a bootstrap told the model)
    remote: Any = None  # the backbone's RemoteMoE
    worker: Any = None  # the worker's Worker
    relay: Any = None  # a relay's RelayServer
    ledger_path: Path | None = None
    info: dict = field(default_factory=dict)  # addresses and slices, shown as they are
    refresh_s: float = REFRESH_S
    coverage: Coverage | None = None
    http_addr: str | None = None
    collector: NodeCollector = field(init=False)
    _last_round: dict[int, list[Any]] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        self.collector = NodeCollector(self)
        self.registry = registry_for(self.collector)

    def not_ready(self) -> str | None:
        return readiness(self.phase, self.coverage, needs_swarm=self.needs_swarm)

    def snapshot(self) -> dict:
        ledger = self.collector.ledger
        earnings = None
        if ledger is not None:
            earnings = f"{ledger.entries} entries, {ledger.work_units} work units, {ledger.credits} credits" + (" earned" if self.role == "worker" else " owed")
        return {
            "role": self.role,
            "peer_id": self.peer_id,
            "phase": self.phase.value,
            "ready": self.not_ready() or True,
            **self.info,
            "earnings": earnings,
            "coverage": self.coverage.to_json() if self.coverage else None,
            "looking_up": self.model is not None and self.discovery is not None,
            "recent_errors": list(errors.RECENT),
        }

    async def refresh(self) -> None:
        """One round of DHT lookups (all layers at once) and ledger totals."""
        if self.ledger_path is not None:
            self.collector.ledger = await asyncio.to_thread(ledger_totals, self.ledger_path)
        if self.model is None or self.discovery is None:
            return
        m = self.model
        found = await asyncio.gather(*(self.discovery.lookup(m.digest, layer, fresh=True) for layer in m.moe_layers))
        now = time.time()
        rounds = {layer: with_last_round(records, self._last_round.get(layer, ()), now) for layer, records in zip(m.moe_layers, found, strict=True)}
        self._last_round = dict(zip(m.moe_layers, found, strict=True))
        self.coverage = build_coverage(m.digest, m.n_layer, m.n_expert, rounds, now, self._seen(), layers=m.moe_layers)

    def _seen(self) -> dict[str, Seen]:
        if self.remote is None:
            return {}
        records = list(self.remote.stats.records)[-SEEN_WINDOW:]
        rtts: dict[str, list[float]] = {}
        paths: dict[str, str] = {}
        for r in records:
            paths[r.peer] = str(r.path)
            if r.ok:
                rtts.setdefault(r.peer, []).append(r.latency_ms)
        return {peer: Seen(path, statistics.median(rtts[peer]) if peer in rtts else None) for peer, path in paths.items()}

    async def watch(self) -> None:
        """Refresh until cancelled; a failed round is logged and retried at the next interval."""
        while True:
            try:
                await self.refresh()
            except Exception as exc:  # the DHT thread closing, a lookup timeout: the page keeps the last map
                log.warning("status.refresh_failed", error=repr(exc))
            await asyncio.sleep(self.refresh_s)


def with_last_round(records: list[Any], last: Any, now: float) -> list[Any]:
    """This round's host records plus the still-live ones the previous round found and this one missed.

    A lookup on a busy node can time out on some of the hosts it asks and return the others: taken as it is,
    one such round flips /readyz to 503 (and the ready gauge to 0) for hosts that are there. So a host gets one
    round's grace: ``last`` is the previous round's raw answer, so a host missing twice in a row is gone, and a
    worker that left disappears at most two refreshes later. A withdrawn or expired record is never carried."""
    peers = {r.peer_id for r in records}
    return [*records, *(r for r in last if r.peer_id not in peers and r.is_live(now))]


def ledger_totals(path: Path) -> LedgerTotals | None:
    """Read-only totals of a ledger file (None before the node wrote its first receipt)."""
    try:
        with Ledger(path) as ledger:
            totals = ledger.totals()
            return LedgerTotals(len(ledger), sum(t.dispatches for t in totals), sum(t.work_units for t in totals), sum(t.credits for t in totals))
    except LedgerError:
        return None


def add_routes(app: web.Application, status: NodeStatus) -> None:
    async def healthz(request: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def readyz(request: web.Request) -> web.Response:
        reason = status.not_ready()
        return web.Response(text="ready\n") if reason is None else web.Response(status=503, text=f"not ready: {reason}\n")

    async def metrics(request: web.Request) -> web.Response:
        if status.ledger_path is not None:
            status.collector.ledger = await asyncio.to_thread(ledger_totals, status.ledger_path)
        return web.Response(body=exposition(status.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def status_json(request: web.Request) -> web.Response:
        return web.json_response(status.snapshot())

    async def status_page(request: web.Request) -> web.Response:
        return web.Response(text=render(status.snapshot(), status.refresh_s), content_type="text/html")

    app.add_routes([web.get("/healthz", healthz), web.get("/readyz", readyz), web.get("/metrics", metrics), web.get("/status.json", status_json), web.get("/status", status_page)])


async def start_app(app: web.Application, host: str, port: int, *, handler_cancellation: bool = False) -> tuple[web.AppRunner, tuple[str, int]]:
    """Serve *app* on host:port (0: any free port) on the running loop; returns the runner and the bound address.

    *handler_cancellation*: a client that disconnects cancels its request's handler (the gateway stops generating).
    """
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        with binding("TCP", host, port, "HTTP"):
            sock.bind((host, port))
    except BaseException:
        sock.close()
        raise
    runner = web.AppRunner(app, access_log=None, handle_signals=False, handler_cancellation=handler_cancellation)
    await runner.setup()
    await web.SockSite(runner, sock, shutdown_timeout=2.0).start()
    return runner, (host, sock.getsockname()[1])


def url_of(host: str, port: int) -> str:
    return f"http://{'[' + host + ']' if ':' in host else host}:{port}"


@contextlib.asynccontextmanager
async def serve_status(http: tuple[str, int] | None, status: NodeStatus) -> AsyncIterator[NodeStatus]:
    """Serve *status* on ``http`` (None: nothing, the node runs without an HTTP port) and keep it refreshed."""
    if http is None:
        yield status
        return
    app = web.Application()
    add_routes(app, status)
    runner, (host, port) = await start_app(app, *http)
    status.http_addr = f"{host}:{port}"
    log.info("status.serving", url=url_of(host, port) + "/status")
    try:
        async with watching(status):
            yield status
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def watching(status: NodeStatus) -> AsyncIterator[None]:
    """Run ``status.watch()`` for the duration of the block."""
    task = asyncio.create_task(status.watch())
    try:
        yield
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
