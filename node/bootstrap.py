"""A bootstrap node: a DHT server that is also a reachability helper."""


from __future__ import annotations

from collections.abc import Callable, Sequence

import structlog

from node.runtime import parse_hostport, until_stopped, write_ready
from node.status.coverage import Phase
from node.status.server import ModelShape, NodeStatus, serve_status
from p2p.dht.kademlia import BOOTSTRAP_WAIT, LibP2PDiscovery, check_bootstrap
from p2p.identity import Identity
from p2p.nat.helpers import serve_helper

log = structlog.get_logger("node.backbone.session")


async def run_bootstrap_node(identity: Identity, listen: str, bootstrap: Sequence[str], ready_file: str | None, quic_listen: tuple[str, int] | None = None, *, http: tuple[str, int] | None = None, model: ModelShape | None = None, on_ready: Callable[[list[str]], None] | None = None, bootstrap_wait: float = BOOTSTRAP_WAIT) -> None:
    """A DHT server that is also a reachability helper on UDP ``quic_listen`` (default: --listen's host and port).

    With ``http``, it serves its status there; told a *model*, the page maps that model's hosts and ``/readyz``
    stays 503 while a layer lacks them (a supervisor can wait on the bootstrap for a whole swarm). ``on_ready``
    gets the DHT multiaddrs once they serve (the CLI prints the one to hand out). Told a model, it also refuses to
    store records naming layers or experts that model does not have."""
    host, port = quic_listen or parse_hostport(listen)
    await check_bootstrap(bootstrap, bootstrap_wait)
    status = NodeStatus("bootstrap", str(identity.peer_id), model=model, needs_swarm=model is not None)
    async with serve_status(http, status), LibP2PDiscovery(identity, listen=listen, bootstrap=bootstrap, models=[model] if model else []) as node, serve_helper(identity, node, host, port) as quic:
        status.discovery = node
        status.info = {"addresses": " ".join(node.multiaddrs)}
        status.phase = Phase.SERVING
        write_ready(ready_file, {"role": "bootstrap", "peer_id": str(identity.peer_id), "dht_addrs": node.multiaddrs, "quic_addr": quic, "http_addr": status.http_addr})
        log.info("bootstrap.ready", addrs=node.multiaddrs, quic=quic)
        if on_ready is not None:
            on_ready(node.multiaddrs)
        await until_stopped()
