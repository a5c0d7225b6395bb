"""A backbone session: endpoint + DHT client + reachability + the remote MoE dispatcher, set up and torn down together."""


from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from contextlib import asynccontextmanager

import structlog

from experts.gguf_model import GGUFModel
from experts.hosting import open_experts
from experts.kernels import Kernel
from node.backbone.dispatch import RemoteMoE
from node.backbone.hot import HotExperts
from node.backbone.options import BackboneOptions
from node.backbone.routing import UNMEASURED_COMPUTE_MS, Router
from node.ledger.sink import LedgerSink
from node.outbound import connector_on
from node.status.server import model_shape
from node.verdicts import require_verified
from p2p.dht.discovery import CachedDiscovery
from p2p.dht.kademlia import LibP2PDiscovery
from p2p.dht.vetting import VettedDiscovery, ping_probe
from p2p.identity import Identity
from p2p.quic.endpoint import Endpoint

log = structlog.get_logger("node.backbone.session")


@asynccontextmanager
async def backbone_session(identity: Identity, model: GGUFModel, bootstrap: Sequence[str], kernel: Kernel, options: BackboneOptions | None = None, dht: LibP2PDiscovery | None = None):
    """A ready RemoteMoE for *model*: endpoint, DHT client, cached lookups, connector, local fallback experts.

    Its routes are re-read from the DHT every ``options.route_refresh`` seconds while the session lasts
    (``RemoteMoE.maintain``), so a worker that joins later is used, and its background probes end with the session.

    *kernel* computes the fallback (and hot, and spot-checked) experts; give the backbone's dense forward the same
    one, so that a group computed here has the same bits as one computed by a worker with this kernel.
    *dht*: a started DHT node of the caller's to use (a stage's, which also announces on it), else a client of its own.
    ``options.hold_experts`` False: the backbone computes no routed expert itself (a model whose experts do not fit
    it): no local fallback, no hot experts, and spot checks re-ask another replica instead of re-computing locally.
    """
    o = options or BackboneOptions()
    require_verified(model.digest, o.codec)  # a lossy wire only after its gate passed on this machine
    async with contextlib.AsyncExitStack() as stack:
        endpoint = await Endpoint.bind(identity, o.listen[0], o.listen[1], handler=None, max_datagram_size=o.max_datagram)
        stack.push_async_callback(endpoint.close)
        if dht is None:
            dht = LibP2PDiscovery(identity, listen=o.dht_listen, bootstrap=bootstrap, client_mode=True, models=[model_shape(model)])
            stack.push_async_callback(dht.close)
            await dht.start()
        if o.ledger_path:
            ledger = LedgerSink(o.ledger_path, "backbone", identity)
            stack.callback(ledger.close)
        else:
            ledger = None
        connector = await stack.enter_async_context(connector_on(identity, endpoint, dht, o.relay))
        cfg = model.cfg
        # Only hosts that answered a ping or served us (p2p.dht.vetting): a DHT answer may be full of sybils' records.
        # The router learns from pings before the first dispatch (a new host's first deadline from its ping, not the
        # full --timeout), and hosts that served us need no ping: so the router exists before the discovery.
        router = Router(cfg.n_expert, max_price=o.max_price)
        discovery = VettedDiscovery(CachedDiscovery(dht, ttl=30.0), ping_probe(connector), served=router.served, pinged=router.pinged)
        moe = RemoteMoE(connector, discovery, model.digest, cfg.n_embd, cfg.n_ff_exp, cfg.n_expert, open_experts(model, kernel)[0] if o.hold_experts else None, loop=asyncio.get_running_loop(), codec=o.codec, timeout=o.timeout, spot_check=o.spot_check, spot_seed=o.spot_seed, ledger=ledger, hot=_hot_experts(model, o.local_experts, o.local_memory), hedge=o.hedge, router=router)
        if o.hold_experts:  # a missed first deadline costs a local compute, not an error (routing's docstring)
            moe.router.unmeasured_compute_ms = UNMEASURED_COMPUTE_MS
        stack.push_async_callback(moe.close)  # probes and hedges, and the last ledger-head swap: before the connector closes
        maintaining = asyncio.create_task(moe.maintain(model.moe_layers, o.route_refresh))
        maintaining.add_done_callback(_report_crash)
        stack.push_async_callback(_cancel, maintaining)
        yield moe


async def _cancel(task: asyncio.Task) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def _report_crash(task: asyncio.Task) -> None:
    """The route refresh died of an error it does not expect (it survives DiscoveryError): routes stay as they were,
    dispatch goes on (local compute covers hosts that leave), and the operator sees why."""
    if not task.cancelled() and task.exception() is not None:
        log.error("routes.maintain_crashed", error=repr(task.exception()))


def _hot_experts(model: GGUFModel, n: int, memory: int | None) -> HotExperts | None:
    cfg = model.cfg
    if memory is not None:
        return HotExperts.for_memory(cfg.n_layer, cfg.n_expert, cfg.n_embd, cfg.n_ff_exp, memory)
    return HotExperts(cfg.n_layer, cfg.n_expert, n) if n else None


async def wait_for_hosts(moe: RemoteMoE, layers: Sequence[int], n_hosts: int, deadline_s: float) -> None:
    """Poll the DHT until every layer lists *n_hosts* hosts (workers announce asynchronously).

    Announced hosts count, vetted or not: one the backbone cannot reach is computed around (as before the vetting),
    not waited on; which hosts get dispatches is decided by the routes ``refresh`` builds from vetted lookups."""
    deadline = time.monotonic() + deadline_s
    discovery = moe.discovery
    assert isinstance(discovery, VettedDiscovery)  # backbone_session's
    while True:
        counts = []
        for layer in layers:
            counts.append(len(await discovery.announced(moe.model_digest, layer)))  # the DHT, unvetted: refresh() vets
        if min(counts) >= n_hosts:
            await moe.refresh(layers)
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"the DHT lists {counts} hosts per layer after {deadline_s:.0f} s; expected {n_hosts}")
        await asyncio.sleep(0.5)

