"""How to reach host H: its direct QUIC address, or through its relay, punched to a direct path when possible.

The dispatcher only says *whom* to ask (peer id, the direct address and relay from the peer's record) and gets
the reply bytes and the path they came on. Everything about reaching the peer lives here: one relay client per
relay URL (kept for the session), the hole punch started at a relayed peer's first request, and the path
actually used (``Path.DIRECT`` for a dialled address or a punched connection, ``Path.RELAY`` otherwise).

``relay.client`` builds on :mod:`p2p` (not the other way round), so the composition root hands in a
``RelayRouteFactory`` that makes a ``relay.client.RelayPath`` for a URL; this module only knows its shape.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from p2p.dht.records import RelayAddress
from p2p.identity import PeerId
from p2p.nat.traversal import NatTraversal, path_of
from p2p.nat.udp_edge import RelayLink
from p2p.pathkind import Path
from p2p.quic.endpoint import Endpoint
from p2p.quic.errors import TransportError

Address = tuple[str, int]


class RelayClientLike(RelayLink, Protocol):
    """What the connector needs of ``relay.client.RelayClient``."""

    on_connected: Callable[[], None] | None

    def start(self) -> None: ...

    async def wait_connected(self, timeout: float) -> None: ...

    async def close(self) -> None: ...


class RelayRoute(Protocol):
    """What the connector needs of ``relay.client.RelayPath``: the client and virtual addresses through it."""

    @property
    def client(self) -> RelayClientLike: ...  # read-only here, so a route holding a concrete RelayClient matches

    def address(self, peer: PeerId) -> Address: ...

    def detach(self) -> None: ...


# (relay URL, the relay's expected peer id) -> a route through a new client of that relay, not yet started
RelayRouteFactory = Callable[[str, PeerId], RelayRoute]


class Unreachable(TransportError):
    """The host cannot be reached: it has no direct address and its relay is unavailable (or none is configured)."""


@dataclass(frozen=True)
class Reply:
    data: bytes
    path: Path  # what this side's connection to the peer used


class Connector:
    """Requests to hosts over ``endpoint``, by whichever path reaches them."""

    def __init__(self, endpoint: Endpoint, *, relay_route: RelayRouteFactory | None = None, nat: NatTraversal | None = None) -> None:
        self.endpoint = endpoint
        self._relay_route = relay_route
        self._nat = nat  # punches relayed peers to direct paths (None: stay on the relay)
        self._routes: dict[str, RelayRoute] = {}  # relay URL -> our route through it
        # Called with a relay's URL each time our link to it is (re)established: requests that failed while it was
        # down failed on our side, and whoever keeps score of the hosts behind that relay should know.
        self.relay_listeners: list[Callable[[str], None]] = []

    @property
    def peer_id(self) -> PeerId:
        return self.endpoint.peer_id

    async def request(self, peer: PeerId, direct: Address | None, relay: RelayAddress | None, data: bytes, *, timeout: float) -> Reply:
        """Send ``data`` to ``peer`` and return its reply; raises a ``TransportError`` (``Unreachable`` included)."""
        if direct is not None:
            return Reply(await self.endpoint.request(direct, peer, data, timeout=timeout), Path.DIRECT)
        if relay is None:
            raise Unreachable(f"{peer} announces neither a direct address nor a relay")
        addr = await self._relayed_address(peer, relay, timeout)
        raw = await self.endpoint.request(addr, peer, data, timeout=timeout)
        return Reply(raw, path_of(self.endpoint, peer))  # relayed, or a punched direct path took over

    async def _relayed_address(self, peer: PeerId, relay: RelayAddress, timeout: float) -> Address:
        route = self._routes.get(relay.url)
        if route is None:
            if self._relay_route is None:
                raise Unreachable(f"{peer} is reachable only through relay {relay.url}, and this node has no relay support")
            route = self._routes[relay.url] = self._relay_route(relay.url, relay.peer_id)
            route.client.on_connected = functools.partial(self._relay_connected, relay.url)
            if self._nat is not None:  # punch peers behind the first relay to direct paths (one path manager per socket)
                self._nat.attach_relay(route.client, initiate=True)
            route.client.start()
        try:
            await route.client.wait_connected(timeout)
        except TimeoutError as exc:  # relay.client.RelayUnavailable
            raise Unreachable(f"relay {relay.url} unreachable: {exc}") from None
        if self._nat is not None and self._nat.manager is not None:
            # Punch now, beside this relayed request (coordination goes over the relay link, not the QUIC
            # connection), rather than at the path manager's next look at relayed peers; a no-op while a punch
            # runs, after a success, or during the peer's backoff.
            self._nat.manager.upgrade(peer)
        return route.address(peer)

    def _relay_connected(self, url: str) -> None:
        for listener in self.relay_listeners:
            listener(url)

    async def close(self) -> None:
        """Stop punching and close every relay client this connector opened."""
        if self._nat is not None:
            await self._nat.close()
            self._nat = None
        for route in self._routes.values():
            route.detach()
            await route.client.close()
        self._routes.clear()
