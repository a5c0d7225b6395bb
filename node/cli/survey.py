"""Looking a swarm up from the command line: read its coverage map from the DHT (the bootstrap is checked first, by `p2p.dht.kademlia.check_bootstrap`).

Shared by `moeswarm join` (what to host) and `moeswarm status` (what is hosted). The lookups go through a
short-lived DHT client with a throwaway identity: it serves nobody and leaves no record.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Sequence

from experts.errors import UsageError
from node.status.coverage import Coverage, build_coverage
from p2p.dht.discovery import DiscoveryError
from p2p.dht.kademlia import LibP2PDiscovery
from p2p.dht.records import HostRecord, ModelShape
from p2p.identity import Identity


def local_address_towards(host: str) -> str:
    """This machine's address on the route to *host*: a connected UDP socket's own address (no packet is sent)."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((host.strip("[]"), 9))
            return str(s.getsockname()[0])
    except OSError as exc:
        raise UsageError(f"no route from this machine to the bootstrap host {host} ({exc.strerror or exc}); check the network, or give --listen HOST:PORT with this machine's address") from None


def coverage_of(shape: ModelShape, found: Sequence[list[HostRecord]]) -> Coverage:
    """The coverage map from one lookup's records per MoE layer of *shape* (in order)."""
    return build_coverage(shape.digest, shape.n_layer, shape.n_expert, dict(zip(shape.moe_layers, found, strict=True)), time.time(), layers=shape.moe_layers)


async def survey(shape: ModelShape, bootstrap: Sequence[str], dht_listen: str) -> Coverage:
    """The swarm's coverage of the model of *shape*: one DHT lookup per MoE layer from a throwaway client."""
    try:
        async with LibP2PDiscovery(Identity.generate(), listen=dht_listen, bootstrap=bootstrap, client_mode=True) as dht:
            found = await asyncio.gather(*(dht.lookup(shape.digest, layer) for layer in shape.moe_layers))
    except DiscoveryError as exc:
        raise UsageError(f"could not join the DHT through {', '.join(bootstrap)}: {exc}; check the peer id in the address (the part after /p2p/)") from None
    return coverage_of(shape, found)
