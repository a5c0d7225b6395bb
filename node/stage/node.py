"""A stage process: load layers A..B, serve passes over QUIC until SIGINT/SIGTERM, then close.

The experts of the stage's MoE layers are computed here (``experts="all"``: the file holds them) or dispatched to
workers exactly as a backbone dispatches them (``experts="remote"``: :func:`node.backbone.session.backbone_session`'s
RemoteMoE, its DHT lookups and routing, with a local fallback when the file holds the experts).

With ``--bootstrap`` the stage joins the DHT as a server and announces its signed stage record
(:mod:`p2p.dht.stage_records`: model digest, layers, QUIC address, capacity, price, kernel) once it serves; the DHT's
upkeep re-signs it before it expires, as it does the workers' records, and the stage withdraws it (a tombstone) when it
stops. A client with ``--stages auto`` finds it there; the ready file says the same for launchers and tests.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import structlog

from experts.errors import UsageError
from experts.forward import MoeFfn, local_moe
from experts.gguf_model import GGUFModel
from experts.hosting import open_experts
from experts.kernels import Kernel
from experts.moe import ungrouped_moe
from experts.stage_forward import StageRunner
from node.backbone.options import BackboneOptions
from node.backbone.session import backbone_session, wait_for_hosts
from node.runtime import until_stopped, write_ready
from node.status.server import model_shape
from p2p.dht.discovery import DiscoveryError
from p2p.dht.kademlia import LibP2PDiscovery, check_bootstrap
from p2p.dht.stage_records import HostedStage
from p2p.identity import Identity
from p2p.nat.helpers import helper_address
from p2p.quic.endpoint import Endpoint

from .service import StageService

log = structlog.get_logger("node.stage.node")
EXPERTS = ("all", "remote")


@dataclass(frozen=True)
class StageOptions:
    model: Path
    layers: range
    listen: tuple[str, int] = ("127.0.0.1", 0)
    experts: str = "all"  # EXPERTS: computed here, or dispatched to workers found on the DHT
    bootstrap: Sequence[str] = ()
    bootstrap_wait: float = 30.0
    dht_listen: str = "127.0.0.1:0"
    advertise: str | None = None  # the QUIC HOST:PORT to announce, when not the bound address (a wildcard, a port forward)
    price: int = 0  # per pass-token, announced in the stage record
    wait_hosts: int = 1  # experts="remote": hosts every MoE layer of the stage needs before it serves
    max_datagram: int = 1200
    max_sessions: int = 64
    backbone: BackboneOptions = BackboneOptions()  # experts="remote": how the workers are reached

    def __post_init__(self) -> None:
        if self.experts not in EXPERTS:
            raise UsageError(f"--experts is one of {', '.join(EXPERTS)}, not {self.experts!r}")
        if self.experts == "remote" and not self.bootstrap:
            raise UsageError("--experts remote finds its workers on the DHT: give --bootstrap")
        if self.price < 0:
            raise UsageError(f"--price is a non-negative amount, not {self.price}")


def local_experts(model: GGUFModel, kernel: Kernel, layers: range) -> MoeFfn:
    """The stage's layers' experts computed here, as a single local process computes them (slot order)."""
    source, _ = open_experts(model, kernel, layers)
    return local_moe(lambda i, x, e, w: ungrouped_moe(source, i, x, e, w))


async def run_stage(identity: Identity, opts: StageOptions, kernel: Kernel, ready_file: str | None) -> None:
    model = GGUFModel(opts.model)
    if opts.bootstrap:
        await check_bootstrap(opts.bootstrap, opts.bootstrap_wait)  # before anything loads
    runner = StageRunner(model, opts.layers, kernel, max_sessions=opts.max_sessions)
    async with contextlib.AsyncExitStack() as stack:
        dht = None
        if opts.bootstrap:  # a server node: a stage is reachable at its QUIC address, so it can host records too
            dht = LibP2PDiscovery(identity, listen=opts.dht_listen, bootstrap=opts.bootstrap, models=[model_shape(model)])
            stack.push_async_callback(dht.close)
            await dht.start()
        if opts.experts == "all":
            moe_ffn = local_experts(model, kernel, opts.layers)
        else:
            moe = await stack.enter_async_context(backbone_session(identity, model, opts.bootstrap, kernel, opts.backbone, dht=dht))
            await wait_for_hosts(moe, [i for i in opts.layers if model.cfg.is_moe(i)], opts.wait_hosts, 60)
            moe_ffn = moe.hook
        service = StageService(runner, moe_ffn)
        stack.callback(service.close)
        endpoint = await Endpoint.bind(identity, *opts.listen, handler=service.handle, max_datagram_size=opts.max_datagram)
        stack.push_async_callback(endpoint.close)
        host, port = endpoint.local_addr
        quic_addr = opts.advertise or helper_address(host, port)
        span = f"{opts.layers.start}-{opts.layers.stop - 1}"
        if dht is not None:
            if quic_addr is None:
                raise UsageError(f"the stage listens on {host}:{port}, which no peer can dial: give --advertise HOST:PORT (the address the swarm should use)")
            await dht.announce_stage(HostedStage(model.digest, opts.layers, quic_addr, capacity=opts.max_sessions, price=opts.price, kernel=str(kernel.identity)))
            stack.push_async_callback(_withdraw, dht)
        log.info("stage.ready", peer=str(identity.peer_id), quic=quic_addr or f"{host}:{port}", layers=span, experts=opts.experts, model=model.path.name, announced=dht is not None)
        write_ready(ready_file, {"role": "stage", "peer_id": str(identity.peer_id), "quic_addr": quic_addr or f"{host}:{port}", "layers": span, "model_digest": model.digest, "experts": opts.experts, "dht_addrs": dht.multiaddrs if dht else []})
        await until_stopped()
        log.info("stage.stopping", peer=str(identity.peer_id), passes=service.passes, rows=service.rows, errors=service.errors)


async def _withdraw(dht: LibP2PDiscovery) -> None:
    """Tombstone our stage record on the way out, so clients stop choosing us before the record would expire."""
    try:
        await dht.announce_stage(None)
    except DiscoveryError as exc:
        log.warning("stage.withdraw_failed", error=str(exc))  # the record expires on its own within its TTL
