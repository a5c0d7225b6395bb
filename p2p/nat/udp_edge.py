"""Our NAT-traversal frames on a QUIC endpoint's socket and on relay links, and per-path control of connections.

Reachability probes and punch packets must leave from, and arrive at, the QUIC socket itself: the NAT mapping they
learn or open is that socket's. ``EndpointTap`` therefore filters the socket's datagrams: ours start with
``natwire.FRAME_MARK``, which no QUIC packet can, and go to the handler registered for their magic; the endpoint
gets everything else. A direct path after a punch needs a *new* QUIC connection on that socket (an aioquic client
drops packets from any address but the one it dialled, so the relayed connection cannot migrate), made the one
requests use while the relayed one stays open as a warm spare: when the direct connection dies, the endpoint's own
failover moves requests back to it.

Uses only ``Endpoint``'s public calls: ``set_datagram_filter``, ``sendto``, ``connections``, ``paths``,
``dial_path``, ``prefer_path``, ``close_path`` and ``subscribe`` / ``unsubscribe``.

``RelayTap`` does the same for a relay link: frames whose first byte is ``FRAME_MARK`` go to us, everything else
on to whoever consumed the link's packets before (``relay.client.RelayPath``, which feeds them to QUIC).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import structlog

from p2p.identity import PeerId
from p2p.nat.envelope import FRAME_MARK, Address
from p2p.quic.endpoint import Endpoint, is_ip
from p2p.quic.events import Subscriber

__all__ = ["EndpointTap", "FrameHandler", "RelayLink", "RelayTap", "is_ip"]

log = structlog.get_logger("p2p.nat.udp_edge")

FrameHandler = Callable[[bytes, Address], None]


class EndpointTap:
    """Our frames in and out of one endpoint's UDP socket, and per-path control of its connections."""

    def __init__(self, endpoint: Endpoint) -> None:
        """Install the tap as ``endpoint``'s datagram filter (the endpoint must be bound; one tap per endpoint)."""
        self.endpoint = endpoint
        self._handlers: dict[bytes, FrameHandler] = {}
        endpoint.set_datagram_filter(self._filter)

    def on_frames(self, magic: bytes, handler: FrameHandler) -> None:
        """Deliver datagrams starting with ``magic`` (3 bytes, ``FRAME_MARK`` first) to ``handler(data, addr)``."""
        if len(magic) != 3 or magic[0] != FRAME_MARK:
            raise ValueError(f"magic {magic!r} must be 3 bytes starting with {FRAME_MARK:#04x}")
        self._handlers[magic] = handler

    def detach(self) -> None:
        """Give the socket back to the endpoint alone."""
        self.endpoint.set_datagram_filter(None)
        self._handlers.clear()

    def _filter(self, data: bytes, addr: Address) -> bool:
        """Take our frames (dropping those nobody handles); leave every other datagram to QUIC."""
        if data[:1] != bytes([FRAME_MARK]):
            return False
        handler = self._handlers.get(bytes(data[:3]))
        if handler is not None:
            try:
                handler(data, addr)
            except Exception:  # one bad frame must not take down the socket's callback; the log keeps the traceback
                log.exception("udp_edge.handler_failed", addr=addr)
        return True

    def sendto(self, data: bytes, addr: Address) -> None:
        """Send one datagram from the QUIC socket (IP addresses only: a name would block on DNS)."""
        self.endpoint.sendto(data, addr)

    # --- connections ----------------------------------------------------------------------------------------

    def paths(self, peer: PeerId) -> list[Address]:
        """The addresses of ``peer``'s verified, open connections (direct ones are IPs, relayed ones are not)."""
        return self.endpoint.paths(peer)

    def relayed_peers(self) -> list[PeerId]:
        """Peers whose requests go through a relay."""
        return [peer for peer, addr in self.endpoint.connections().items() if addr and not is_ip(addr[0])]

    def remote_ips(self) -> set[str]:
        """Every IP this socket holds a connection with (its NAT admits datagrams from them)."""
        return {addr[0] for addr in self.endpoint.paths() if is_ip(addr[0])}

    async def dial(self, peer: PeerId, addr: Address, *, timeout: float) -> None:
        """A new verified connection to ``peer`` at ``addr``, even if one on another path exists."""
        await self.endpoint.dial_path(peer, addr, timeout=timeout)

    def prefer(self, peer: PeerId, addr: Address) -> bool:
        """Make the connection to ``peer`` at ``addr`` the one its requests use; False if there is none."""
        return self.endpoint.prefer_path(peer, addr)

    def close_path(self, peer: PeerId, addr: Address, reason: str) -> bool:
        """Close the connection to ``peer`` at ``addr`` (requests move to another one); False if there is none."""
        return self.endpoint.close_path(peer, addr, reason)

    def subscribe(self, fn: Subscriber) -> None:
        """Call ``fn`` as the endpoint's connections open and close (``p2p.quic.events``)."""
        self.endpoint.subscribe(fn)

    def unsubscribe(self, fn: Subscriber) -> None:
        self.endpoint.unsubscribe(fn)


class RelayLink(Protocol):
    """What we need of a relay client (``relay.client.RelayClient`` is one)."""

    on_packet: Callable[[PeerId, bytes], None] | None

    def send(self, dst: PeerId, data: bytes) -> bool: ...


class RelayTap:
    """Our frames out of (and into) a relay link; its other packets go on to their previous consumer."""

    def __init__(self, link: RelayLink, on_frame: Callable[[PeerId, bytes], None]) -> None:
        self.link = link
        self._on_frame = on_frame
        self._next = link.on_packet
        link.on_packet = self._on_packet

    def send(self, peer: PeerId, data: bytes) -> bool:
        return self.link.send(peer, data)

    def detach(self) -> None:
        self.link.on_packet = self._next

    def _on_packet(self, src: PeerId, data: bytes) -> None:
        if data[:1] == bytes([FRAME_MARK]):
            self._on_frame(src, data)
        elif self._next is not None:
            self._next(src, data)
