"""How a client node (a backbone, a slice fetcher) reaches workers: one connector over its endpoint, with relay routes
and hole punching, set up and torn down together.

A worker's record gives a direct QUIC address, or only a relay (it is NAT-bound). :class:`p2p.connector.Connector`
picks the path per request; what it needs from this composition root is the relay client factory (``relay/`` builds
on ``p2p/``, not the other way round) and the node's NAT traversal, which finds its own verdict in the background
(the DHT lists the reachability helpers) so that punches to relayed workers can upgrade them to direct paths.
Backbones and fetchers build this the same way, so both reach NAT-bound workers alike.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from p2p.connector import Connector
from p2p.identity import Identity
from p2p.nat.helpers import HelperBoard, NodeReachability
from p2p.quic.endpoint import Endpoint
from relay.client import RelaySettings, attach


@asynccontextmanager
async def connector_on(identity: Identity, endpoint: Endpoint, board: HelperBoard, relay: RelaySettings) -> AsyncIterator[Connector]:
    """A connector on *endpoint* whose relay links trust and keep alive as *relay* says; *board* (a started DHT
    client) lists the helpers of the reachability check, which runs in the background: requests start on the relay
    anyway, and punches wait for no verdict they do not need."""
    reach = NodeReachability(endpoint, board)  # answers probes; our own verdict gives the addresses punches need
    reach.start()
    checking = asyncio.create_task(reach.check())
    connector = Connector(endpoint, relay_route=lambda url, relay_peer: attach(endpoint, relay.client(identity, url, expected_relay=relay_peer)), nat=reach.nat)
    try:
        yield connector
    finally:
        await connector.close()
        checking.cancel()
        await asyncio.gather(checking, return_exceptions=True)
        await reach.close()
