"""A stage process: load layers A..B, serve passes over QUIC until SIGINT/SIGTERM, then close.

The experts of the stage's MoE layers are computed here (``experts="all"``: the file holds them) or dispatched to
workers exactly as a backbone dispatches them (``experts="remote"``: :func:`node.backbone.session.backbone_session`'s
RemoteMoE, its DHT lookups and routing, with a local fallback when the file holds the experts). The client is told
the stage's address (the ready file says it); announcing a signed stage record on the DHT is later work (issue 26).
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
from p2p.dht.kademlia import check_bootstrap
from p2p.identity import Identity
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
    wait_hosts: int = 1  # experts="remote": hosts every MoE layer of the stage needs before it serves
    max_datagram: int = 1200
    max_sessions: int = 64
    backbone: BackboneOptions = BackboneOptions()  # experts="remote": how the workers are reached

    def __post_init__(self) -> None:
        if self.experts not in EXPERTS:
            raise UsageError(f"--experts is one of {', '.join(EXPERTS)}, not {self.experts!r}")
        if self.experts == "remote" and not self.bootstrap:
            raise UsageError("--experts remote finds its workers on the DHT: give --bootstrap")


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
        if opts.experts == "all":
            moe_ffn = local_experts(model, kernel, opts.layers)
        else:
            moe = await stack.enter_async_context(backbone_session(identity, model, opts.bootstrap, kernel, opts.backbone))
            await wait_for_hosts(moe, [i for i in opts.layers if model.cfg.is_moe(i)], opts.wait_hosts, 60)
            moe_ffn = moe.hook
        service = StageService(runner, moe_ffn)
        stack.callback(service.close)
        endpoint = await Endpoint.bind(identity, *opts.listen, handler=service.handle, max_datagram_size=opts.max_datagram)
        stack.push_async_callback(endpoint.close)
        host, port = endpoint.local_addr
        span = f"{opts.layers.start}-{opts.layers.stop - 1}"
        log.info("stage.ready", peer=str(identity.peer_id), quic=f"{host}:{port}", layers=span, experts=opts.experts, model=model.path.name)
        write_ready(ready_file, {"role": "stage", "peer_id": str(identity.peer_id), "quic_addr": f"{host}:{port}", "layers": span, "model_digest": model.digest, "experts": opts.experts})
        await until_stopped()
        log.info("stage.stopping", peer=str(identity.peer_id), passes=service.passes, rows=service.rows, errors=service.errors)
