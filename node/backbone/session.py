"""A backbone session: endpoint + DHT client + reachability + the remote MoE dispatcher, set up and torn down together."""


from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import structlog

from experts.codecs import Codec
from experts.errors import UsageError
from experts.gguf_model import GGUFModel
from experts.hosting import open_experts
from experts.kernels import Kernel
from node.backbone.dispatch import RemoteMoE
from node.backbone.hot import HotExperts
from node.backbone.routing import ROUTE_REFRESH_S, UNMEASURED_COMPUTE_MS
from node.backbone.spotcheck import DEFAULT_SPOT_CHECK
from node.ledger.sink import LedgerSink
from node.outbound import connector_on
from node.status.server import model_shape
from node.verdicts import require_verified
from p2p.dht.discovery import CachedDiscovery
from p2p.dht.kademlia import LibP2PDiscovery
from p2p.dht.vetting import VettedDiscovery, ping_probe
from p2p.identity import Identity
from p2p.quic.endpoint import Endpoint
from relay.client import RelaySettings

log = structlog.get_logger("node.backbone.session")


@asynccontextmanager
async def backbone_session(identity: Identity, model: GGUFModel, bootstrap: Sequence[str], *, codec: Codec = Codec.F32, listen: tuple[str, int] = ("127.0.0.1", 0), dht_listen: str = "127.0.0.1:0", timeout: float = 5.0, kernel: Kernel, max_datagram: int = 1200, spot_check: float = DEFAULT_SPOT_CHECK, spot_seed: int | None = None, ledger_path: Path | None = None, max_price: int | None = None, local_experts: int = 0, local_memory: int | None = None, hold_experts: bool = True, relay: RelaySettings = RelaySettings(), route_refresh: float = ROUTE_REFRESH_S, hedge: bool = False):
    """A ready RemoteMoE for *model*: endpoint, DHT client, cached lookups, connector, local fallback experts.

    Its routes are re-read from the DHT every *route_refresh* seconds while the session lasts (``RemoteMoE.maintain``),
    so a worker that joins later is used, and its background probes end with the session. *hedge*: a group whose host
    is late is also sent to the next replica (``RemoteMoE.hedge``).

    *kernel* computes the fallback (and hot, and spot-checked) experts; give the backbone's dense forward the same
    one, so that a group computed here has the same bits as one computed by a worker with this kernel.
    *relay*: how links to the workers' relays (URLs from their records) trust ``wss://`` and keep alive.
    *hold_experts* False: the backbone computes no routed expert itself (a model whose experts do not fit it): no
    local fallback, no hot experts, and spot checks re-ask another replica instead of re-computing locally.
    """
    if not hold_experts and (local_experts or local_memory is not None):
        raise UsageError("a backbone that holds no experts keeps no hot experts local either; drop --local-experts/--local-memory or --remote-experts-only")
    require_verified(model.digest, codec)  # a lossy wire only after its gate passed on this machine
    async with contextlib.AsyncExitStack() as stack:
        endpoint = await Endpoint.bind(identity, listen[0], listen[1], handler=None, max_datagram_size=max_datagram)
        stack.push_async_callback(endpoint.close)
        dht = LibP2PDiscovery(identity, listen=dht_listen, bootstrap=bootstrap, client_mode=True, models=[model_shape(model)])
        stack.push_async_callback(dht.close)
        if ledger_path:
            ledger = LedgerSink(ledger_path, "backbone", identity)
            stack.callback(ledger.close)
        else:
            ledger = None
        await dht.start()
        connector = await stack.enter_async_context(connector_on(identity, endpoint, dht, relay))
        cfg = model.cfg
        # Only hosts that answered a ping or served us (p2p.vetting): a DHT answer may be full of sybils' records.
        discovery = VettedDiscovery(CachedDiscovery(dht, ttl=30.0), ping_probe(connector))
        moe = RemoteMoE(connector, discovery, model.digest, cfg.n_embd, cfg.n_ff_exp, cfg.n_expert, open_experts(model, kernel)[0] if hold_experts else None, loop=asyncio.get_running_loop(), codec=codec, timeout=timeout, spot_check=spot_check, spot_seed=spot_seed, ledger=ledger, hot=_hot_experts(model, local_experts, local_memory), max_price=max_price, hedge=hedge)
        discovery.served = lambda peer: health.dispatches if (health := moe.router.health.get(peer)) else 0
        discovery.pinged = moe.router.pinged  # a new host's first deadline from its ping, not the full --timeout
        if hold_experts:  # a missed first deadline costs a local compute, not an error (routing's docstring)
            moe.router.unmeasured_compute_ms = UNMEASURED_COMPUTE_MS
        stack.push_async_callback(moe.close)  # probes and hedges, and the last ledger-head swap: before the connector closes
        maintaining = asyncio.create_task(moe.maintain(model.moe_layers, route_refresh))
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
    while True:
        counts = []
        for layer in layers:
            counts.append(len(await moe.discovery.announced(moe.model_digest, layer)))  # the DHT, unvetted: refresh() vets
        if min(counts) >= n_hosts:
            await moe.refresh(layers)
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"the DHT lists {counts} hosts per layer after {deadline_s:.0f} s; expected {n_hosts}")
        await asyncio.sleep(0.5)

