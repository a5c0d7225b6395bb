"""What a ``p2p.quic.endpoint.Endpoint`` tells its subscribers: a verified connection (a path to a peer) opened or closed.

Typed, frozen records so that path keeping (``p2p.nat.holepunch_edge.PathManager``) and tests react to connections
instead of polling ``Endpoint.paths``. Subscribers are plain callbacks (``Endpoint.subscribe``), called on the
endpoint's loop as the change happens: they must be quick and must not raise.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from p2p.identity import PeerId
from p2p.quic.errors import Address


@dataclass(frozen=True)
class PathOpened:
    """A connection to ``peer`` at ``addr`` passed authentication: it is among ``Endpoint.paths(peer)`` now."""

    peer: PeerId
    addr: Address | None


@dataclass(frozen=True)
class PathClosed:
    """A verified connection to ``peer`` at ``addr`` started closing: it left ``Endpoint.paths(peer)``, its pending
    requests failed, and later ones use another path (if any)."""

    peer: PeerId
    addr: Address | None
    reason: str


EndpointEvent = PathOpened | PathClosed
Subscriber = Callable[[EndpointEvent], None]
