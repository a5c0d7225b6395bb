"""A bootstrap node: a DHT server that is also a reachability helper."""


from __future__ import annotations

from collections.abc import Sequence

import structlog

from node.runtime import parse_hostport, until_stopped, write_ready
from p2p.dht import LibP2PDiscovery
from p2p.helpers import serve_helper
from p2p.identity import Identity

log = structlog.get_logger("node.backbone.session")


async def run_bootstrap_node(identity: Identity, listen: str, bootstrap: Sequence[str], ready_file: str | None, quic_listen: tuple[str, int] | None = None) -> None:
    """A DHT server that is also a reachability helper on UDP ``quic_listen`` (default: --listen's host and port)."""
    host, port = quic_listen or parse_hostport(listen)
    async with LibP2PDiscovery(identity, listen=listen, bootstrap=bootstrap) as node, serve_helper(identity, node, host, port) as quic:
        write_ready(ready_file, {"role": "bootstrap", "peer_id": str(identity.peer_id), "dht_addrs": node.multiaddrs, "quic_addr": quic})
        log.info("bootstrap.ready", addrs=node.multiaddrs, quic=quic)
        await until_stopped()


