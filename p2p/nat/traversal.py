"""A node's NAT traversal in one object: reachability on its QUIC socket, punching relayed peers, the path in use.

Every swarm node (bootstrap, relay, worker, backbone) taps its QUIC endpoint's UDP socket once
(``p2p.nat.udp_edge``; a second tap would steal the first one's frames) and runs ``ReachabilityService`` there:
it answers other nodes' probes (that is what makes a public node a helper) and, when asked,
``check()``s this node's own reachability against the ``helpers``. A node that also talks
through a relay ``attach_relay``s it: the path manager (``p2p.nat.holepunch_edge``) then answers
punch requests with this node's verdict and, if ``initiate`` (the backbone), tries to punch every
peer it reaches through the relay. Requests keep addressing the peer; once a punch succeeds the
endpoint prefers the direct connection and falls back to the relayed one (kept open) when the
direct path dies.
"""

from __future__ import annotations

from p2p.identity import Identity, PeerId
from p2p.nat.holepunch import HolePunch
from p2p.nat.holepunch_edge import PathManager
from p2p.nat.reachability import NatKind, Reachability, ReachabilityConfig, Verdict
from p2p.nat.reachability_edge import PeerList, ReachabilityService
from p2p.nat.udp_edge import EndpointTap, RelayLink
from p2p.pathkind import Path
from p2p.quic.endpoint import Endpoint


def path_of(endpoint: Endpoint, peer: PeerId) -> Path:
    """DIRECT when the connection requests to *peer* use has an IP address, else RELAY."""
    return Path.of_address(endpoint.connections().get(peer))


def announced_address(verdict: Verdict, configured: str | None) -> str | None:
    """The direct QUIC address a node announces given its verdict: none unless PUBLIC (strangers reach it only
    then); ``configured`` (``--advertise``, or a concrete listen address) if given, else the observed address."""
    if verdict.kind is not NatKind.PUBLIC:
        return None
    if configured is not None:
        return configured
    if not verdict.addresses:
        return None
    host, port = verdict.addresses[0]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class NatTraversal:
    def __init__(
        self,
        endpoint: Endpoint,
        identity: Identity,
        *,
        helpers: PeerList,
        config: ReachabilityConfig = ReachabilityConfig(),
        recheck: float = 300.0,
    ) -> None:
        self.endpoint = endpoint
        self.identity = identity
        self.tap = EndpointTap(endpoint)
        # `recheck`: seconds between full checks in the background (the mapping is refreshed at most every 20 s)
        core = Reachability(identity, config)
        self.reach = ReachabilityService(self.tap, core, peers=helpers, recheck=recheck, refresh=min(20.0, recheck))
        self.manager: PathManager | None = None
        self._closed = False

    @property
    def verdict(self) -> Verdict:
        return self.reach.verdict

    async def check(self) -> Verdict:
        """Ask the helpers now (``reach.start()`` keeps checking in the background)."""
        return await self.reach.check()

    def attach_relay(self, relay: RelayLink, *, initiate: bool) -> PathManager:
        """Punch through ``relay`` (one relay link per socket: later calls return the first manager)."""
        if self.manager is None:
            punch = HolePunch(self.identity)
            self.manager = PathManager(self.tap, relay, punch, verdict=lambda: self.verdict, auto=initiate)
        return self.manager

    def path(self, peer: PeerId) -> Path:
        return path_of(self.endpoint, peer)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.manager is not None:
            await self.manager.close()
        await self.reach.close()
        self.tap.detach()
