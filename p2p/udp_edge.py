"""Hooks into a running ``p2p.quic.Endpoint`` for NAT traversal, without changing its module.

Reachability probes and punch packets must leave from, and arrive at, the QUIC socket itself: the NAT mapping they
learn or open is that socket's. ``EndpointTap`` therefore takes over the socket's receive callback and hands on to
the endpoint every datagram that is not ours (ours start with ``natwire.FRAME_MARK``, which no QUIC packet can),
and sends our frames on the same socket. A direct path after a punch needs a *new* QUIC connection on that socket
(an aioquic client drops packets from any address but the one it dialled, so the relayed connection cannot
migrate), made the one requests use while the relayed one stays open as a warm spare: when the direct connection
dies, the endpoint's own failover moves requests back to it.

``Endpoint`` has public calls for none of this, so this module is the one place that uses its private members
(listed in ``_ENDPOINT_INTERNALS`` and checked when a tap is made, so a change in ``p2p.quic`` fails loudly here
and not mid-punch). Proposed upstream API, if ``p2p.quic`` wants it: ``sendto(data, addr)``,
``set_datagram_filter(fn)``, ``connect(..., new_path=True)``, ``paths(peer)``, ``prefer_path(peer, addr)``,
``close_path(peer, addr)``.

``RelayTap`` does the same for a relay link: frames whose first byte is ``FRAME_MARK`` go to us, everything else
on to whoever consumed the link's packets before (``relay.client.RelayPath``, which feeds them to QUIC).
"""

from __future__ import annotations

import asyncio
import ipaddress
from collections.abc import Callable
from typing import Any, Protocol

import structlog

from p2p.identity import PeerId
from p2p.natwire import FRAME_MARK, Address
from p2p import quic
from p2p.quic import ConnectionLost, Endpoint, ErrorCode, TransportTimeout

log = structlog.get_logger("p2p.udp_edge")

FrameHandler = Callable[[bytes, Address], None]
_ENDPOINT_INTERNALS = ("_transport", "_conns", "_by_peer", "_dialing", "_dial", "_pump", "_closed")
_CONN_INTERNALS = ("quic", "ready", "peer", "failure", "addr")


def _check_internals(endpoint: Endpoint) -> None:
    conn_type = getattr(quic, "_Conn", None)
    names = set(getattr(conn_type, "__dataclass_fields__", ())) | set(dir(conn_type))
    missing = [name for name in _ENDPOINT_INTERNALS if not hasattr(endpoint, name)]
    missing += [f"_Conn.{name}" for name in _CONN_INTERNALS if name not in names]
    if missing:
        raise TypeError(f"p2p.quic no longer has {missing}; update p2p.udp_edge")


def is_ip(host: str) -> bool:
    """Whether ``host`` is an IP literal; a relay's virtual address ("relay:<peer>") is not."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


class _Demux(asyncio.DatagramProtocol):
    def __init__(self, tap: EndpointTap) -> None:
        self._tap = tap

    def datagram_received(self, data: bytes, addr: Any) -> None:
        self._tap.datagram_received(data, (addr[0], addr[1]))

    def error_received(self, exc: Exception) -> None:
        log.debug("udp_edge.socket_error", error=str(exc))


class EndpointTap:
    """Our frames in and out of one endpoint's UDP socket, and per-path control of its connections."""

    def __init__(self, endpoint: Endpoint) -> None:
        _check_internals(endpoint)
        if endpoint._transport is None:
            raise ValueError("bind the endpoint (Endpoint.bind) before tapping it")
        self.endpoint = endpoint
        self._transport = endpoint._transport
        self._original = self._transport.get_protocol()
        self._handlers: dict[bytes, FrameHandler] = {}
        self._transport.set_protocol(_Demux(self))

    def on_frames(self, magic: bytes, handler: FrameHandler) -> None:
        """Deliver datagrams starting with ``magic`` (3 bytes, ``FRAME_MARK`` first) to ``handler(data, addr)``."""
        if len(magic) != 3 or magic[0] != FRAME_MARK:
            raise ValueError(f"magic {magic!r} must be 3 bytes starting with {FRAME_MARK:#04x}")
        self._handlers[magic] = handler

    def detach(self) -> None:
        """Give the socket back to the endpoint alone."""
        self._transport.set_protocol(self._original)
        self._handlers.clear()

    def datagram_received(self, data: bytes, addr: Address) -> None:
        if data[:1] != bytes([FRAME_MARK]):
            self.endpoint.datagram_received(data, addr)
            return
        handler = self._handlers.get(bytes(data[:3]))
        if handler is None:
            return
        try:
            handler(data, addr)
        except Exception:  # one bad frame must not take down the socket's callback; the log keeps the traceback
            log.exception("udp_edge.handler_failed", addr=addr)

    def sendto(self, data: bytes, addr: Address) -> None:
        """Send one datagram from the QUIC socket (IP addresses only: a name would block on DNS)."""
        if not self.endpoint._closed and is_ip(addr[0]):
            self._transport.sendto(data, addr)

    # --- connections ----------------------------------------------------------------------------------------

    def _live(self, peer: PeerId | None = None) -> list[Any]:
        """Verified connections that are not closing (of ``peer``, or all)."""
        return [
            c
            for c in self.endpoint._conns
            if c.peer is not None and c.failure is None and c.addr and (peer is None or c.peer == peer)
        ]

    def paths(self, peer: PeerId) -> list[Address]:
        """The addresses of ``peer``'s verified, open connections (direct ones are IPs, relayed ones are not)."""
        return [c.addr for c in self._live(peer)]

    def primary(self, peer: PeerId) -> Address | None:
        """Where requests to ``peer`` go now."""
        return self.endpoint.connections().get(peer)

    def relayed_peers(self) -> list[PeerId]:
        """Peers whose requests go through a relay."""
        return [peer for peer, addr in self.endpoint.connections().items() if addr and not is_ip(addr[0])]

    def remote_ips(self) -> set[str]:
        """Every IP this socket holds a connection with (its NAT admits datagrams from them)."""
        return {c.addr[0] for c in self._live() if is_ip(c.addr[0])}

    async def dial(self, peer: PeerId, addr: Address, *, timeout: float) -> None:
        """A new verified connection to ``peer`` at ``addr``, even if one on another path exists."""
        endpoint = self.endpoint
        if endpoint._closed:
            raise ConnectionLost(peer, addr, "local endpoint closed")
        if addr in self.paths(peer):
            return
        conn = endpoint._dialing.get((peer, addr)) or endpoint._dial(addr, peer)
        try:
            async with asyncio.timeout(timeout):
                await asyncio.shield(conn.ready)
        except TimeoutError:
            self._close(conn, "direct dial timed out")
            raise TransportTimeout(f"no handshake with {peer} at {addr} within {timeout} s") from None

    def prefer(self, peer: PeerId, addr: Address) -> bool:
        """Make the connection to ``peer`` at ``addr`` the one its requests use; False if there is none."""
        conn = next((c for c in self._live(peer) if c.addr == addr), None)
        if conn is None:
            return False
        self.endpoint._by_peer[peer] = conn
        return True

    def close_path(self, peer: PeerId, addr: Address, reason: str) -> bool:
        """Close the connection to ``peer`` at ``addr`` (requests move to another one); False if there is none."""
        conn = next((c for c in self._live(peer) if c.addr == addr), None)
        if conn is None:
            return False
        self._close(conn, reason)
        return True

    def _close(self, conn: Any, reason: str) -> None:
        if conn.failure is None:
            conn.quic.close(error_code=ErrorCode.NO_ERROR, reason_phrase=reason[:200])
            self.endpoint._pump(conn)


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
