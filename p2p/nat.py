"""A node's NAT traversal in one object: punch relayed peers to direct paths, and name the path in use.

Bundles the socket tap and the path manager (``p2p.udp_edge``, ``p2p.holepunch_edge``) for an
endpoint that also talks through a relay. The backbone *initiates*: every peer it reaches
through the relay gets a punch attempt when its backoff allows; a worker answers punches.
Requests keep addressing the peer; once a punch succeeds the endpoint prefers the direct
connection and falls back to the relayed one (kept open) when the direct path dies.
"""

from __future__ import annotations

from collections.abc import Callable

from p2p.holepunch import HolePunch
from p2p.holepunch_edge import PathManager
from p2p.identity import Identity, PeerId
from p2p.quic import Endpoint
from p2p.reachability import UNKNOWN, Verdict
from p2p.udp_edge import EndpointTap, RelayLink


def path_of(endpoint: Endpoint, peer: PeerId) -> str:
    """"direct" when the connection requests to *peer* use has an IP address, else "relay"."""
    addr = endpoint.connections().get(peer)
    return "relay" if addr is None or str(addr[0]).startswith("relay:") else "direct"


class NatTraversal:
    def __init__(self, endpoint: Endpoint, identity: Identity, relay: RelayLink, *, initiate: bool, verdict: Callable[[], Verdict] = lambda: UNKNOWN) -> None:
        self.endpoint = endpoint
        self.tap = EndpointTap(endpoint)
        self.manager = PathManager(self.tap, relay, HolePunch(identity), verdict=verdict, auto=initiate)

    def path(self, peer: PeerId) -> str:
        return path_of(self.endpoint, peer)

    async def close(self) -> None:
        await self.manager.close()
        self.tap.detach()
