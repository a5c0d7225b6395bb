"""The QUIC data path: one UDP socket per node, mutually authenticated connections, one request per stream.

An ``Endpoint`` owns one UDP socket that both serves and dials, and drives aioquic's sans-IO ``QuicConnection``s
(datagram in -> events -> datagrams out, one timer per connection). Datagrams go to connections by destination
connection id, not source address, so two peers may dial each other at once and one socket carries every
connection. Verified connections are kept per peer id (``connections()``) and reused by all later requests to that
peer, whichever side dialled; keepalive PINGs hold them open and the idle timeout ends them when the peer vanishes.

The datagram path is pluggable: ``add_route(addr, send)`` hands datagrams for ``addr`` (e.g. a relay's virtual
address) to ``send`` instead of the socket, and ``datagram_received(data, addr)`` injects datagrams that came that
way, so a relay carries the very same QUIC packets. ``send`` must not call ``datagram_received`` synchronously.
(aioquic clients drop packets from any address but the one dialled; servers follow a peer to a new address.)

Paths, for NAT traversal (``p2p.nat.udp_edge``). Probes and punch packets must use this very socket, whose NAT mapping
they learn or open: ``sendto`` sends one, and ``set_datagram_filter`` gets first look at every datagram the socket
receives. One peer may hold several connections (``paths``), e.g. a relayed one and a punched direct one, which
must be a new connection since a client cannot migrate: ``dial_path`` makes it, ``prefer_path`` picks the one
requests use, ``close_path`` ends one and requests fall back to another path.

Authentication. aioquic 1.7.2's TLS can request a client certificate but has no public switch for it
(``tls.Context._request_client_certificate``, "for test purposes only"; aiortc/aioquic#541). ``AuthQuicConnection`` (``p2p.quic.adapter``)
sets it on the server side; both sides present a ``p2p.quic.tls`` certificate and TLS proves each holds its certificate
key (CertificateVerify). aioquic checks no chain (``CERT_NONE``: there is no CA); when it reports the handshake
complete we run ``p2p.quic.tls.verify_certificate`` before reading one stream byte: the client against the peer id it
dialled, the server to learn who called. A failure closes the connection with ``ErrorCode.PEER_AUTH_FAILED`` and
the reason. No session tickets are issued (a resumed session carries no certificate).

Messages. A request is one bidirectional stream: payload, FIN; the reply returns on it, FIN. The stream's end
delimits the message: no framing, no head-of-line blocking between requests (``node/bench/quic.py`` compares a framed
persistent stream). A message above ``max_message`` is refused with STOP_SENDING/RESET_STREAM
(``ErrorCode.MESSAGE_TOO_LARGE``), never buffered, and stream windows stop at ``max_message + 1``. That bookkeeping
is the sans-IO ``p2p.quic.streams.RequestStreams`` (one per verified connection); this module only moves its
commands to aioquic and its results to futures and handler tasks.

Bounded resources (docs/architecture.md, "Limits"). What peers may make a serving endpoint buffer is one
``p2p.quic.budget.ServeBudget`` shared by all its connections (request bytes and streams, per connection and in all;
refusals reset the stream with ``ErrorCode.OVERLOADED``); aioquic's own per-connection stream count is capped to
the same ``max_streams_per_conn``, and its connection credit to one ``max_bytes_per_conn`` window ahead of what the
peer sent (``AuthQuicConnection``). Unverified (half-open) connections are capped too: a first Initial whose packet
does not decrypt is dropped with its connection at once (aioquic would keep it for the idle timeout), and beyond
``max_half_open`` half-open connections a new client must prove its address with a stateless Retry first
(``p2p.quic.gate`` has the table). Below the cap no Retry is sent, so a normal dial costs no extra round trip.

Events. ``subscribe(fn)`` calls ``fn`` with a ``p2p.quic.events.PathOpened`` when a connection passes
authentication and a ``PathClosed`` when a verified one starts closing, so path keeping needs no polling.

aioquic 1.7.2 pitfalls handled (docs/FIELD-NOTES.md): ``max_datagram_size`` is at most 16384 (beyond, a STREAM frame can
overflow aioquic's 2-byte length field and kill the connection) and is set on both configurations; stream ids are
``RequestStreams``' own, in order and never reused, opened by ``send_stream_data`` (``create_stream`` hands out one
id twice); per-stream state is ``RequestStreams``' and dropped when the stream ends (aioquic's reader table never
forgets one); pending requests fail with ``ConnectionLost`` naming the peer as soon as the connection starts
closing (``AuthQuicConnection.closing``), not when aioquic reports its end; our streams send with aioquic's own
``QuicStreamSender.get_frame``, reloaded from its source, since importing libp2p replaces it. Every use of aioquic
internals is in ``p2p.quic.adapter``.

Kept here: the endpoint's behaviour. Its error vocabulary is ``p2p.quic.errors`` (re-exported here), its
per-connection records are ``p2p.quic.conn`` and its events ``p2p.quic.events``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ipaddress
import os
import ssl
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any

import structlog
from aioquic.buffer import Buffer
from aioquic.quic import events
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.packet import QuicPacketType, encode_quic_retry, pull_quic_header
from aioquic.quic.retry import QuicRetryTokenHandler

from p2p.identity import Identity, PeerId
from p2p.ports import binding
from p2p.quic.adapter import AuthQuicConnection
from p2p.quic.budget import ServeBudget, ServeLimits
from p2p.quic.conn import Conn, retrieve, settle
from p2p.quic.errors import Address, ConnectionLost, ErrorCode, MessageTooLarge, PeerAuthError, RemoteError, TransportError, TransportTimeout  # noqa: F401  re-exported: callers import errors from here
from p2p.quic.events import EndpointEvent, PathClosed, PathOpened, Subscriber
from p2p.quic.gate import MAX_HALF_OPEN, Admit, InitialGate
from p2p.quic.streams import (
    AbortStream,
    CallFailed,
    Output,
    ReplyReceived,
    RequestReceived,
    RequestStreams,
    ResetStream,
    SendStream,
    ServeCancelled,
    StreamsEvicted,
    check_request_size,
)
from p2p.quic.tls import PeerCertificateError, make_certificate, verify_certificate

Handler = Callable[[PeerId, bytes], Awaitable[bytes]]
DatagramFilter = Callable[[bytes, Address], bool]  # True: the datagram was consumed, QUIC never sees it

ALPN = "moeswarm/1"
CID_LENGTH = 8
MIN_DATAGRAM = 1200  # QUIC's minimum; safe on any path
MAX_DATAGRAM = 16384  # above this aioquic 1.7.2 can emit STREAM frames > 16383 bytes and break the connection
_MAX_REASON = 200

log = structlog.get_logger("p2p.quic.endpoint")


@functools.lru_cache(maxsize=1024)
def is_ip(host: str) -> bool:
    """Whether ``host`` is an IP literal; a relay's virtual address ("relay:<peer>") is not."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


class _Socket(asyncio.DatagramProtocol):
    def __init__(self, endpoint: Endpoint) -> None:
        self._endpoint = endpoint

    def datagram_received(self, data: bytes, addr: Any) -> None:
        endpoint, addr = self._endpoint, (addr[0], addr[1])
        if endpoint._filter is None or not endpoint._filter(data, addr):
            endpoint.datagram_received(data, addr)

    def error_received(self, exc: Exception) -> None:
        log.debug("quic.socket_error", error=str(exc))


class Endpoint:
    """A node's QUIC endpoint: serves requests with ``handler`` and sends requests to other peers."""

    def __init__(
        self,
        identity: Identity,
        *,
        handler: Handler | None,
        max_message: int,
        max_datagram_size: int,
        idle_timeout: float,
        keepalive: bool,
        stream_timeout: float,
        serve_limits: ServeLimits | None = None,
        max_half_open: int = MAX_HALF_OPEN,
    ) -> None:
        """Use ``await Endpoint.bind(...)``; this constructor opens no socket."""
        if not MIN_DATAGRAM <= max_datagram_size <= MAX_DATAGRAM:
            raise ValueError(f"max_datagram_size {max_datagram_size} is outside {MIN_DATAGRAM}..{MAX_DATAGRAM}")
        if max_message < 1 or idle_timeout <= 0 or stream_timeout <= 0:
            raise ValueError("max_message, idle_timeout and stream_timeout must be positive")
        self.identity = identity
        self.peer_id = identity.peer_id
        self.max_message = max_message
        self.local_addr: Address = ("", 0)
        self._handler = handler
        self._idle_timeout = idle_timeout
        self._stream_timeout = stream_timeout
        self.budget = ServeBudget(serve_limits)
        self._gate = InitialGate(max_half_open)
        self._retry = QuicRetryTokenHandler()
        self._loop = asyncio.get_running_loop()
        host = make_certificate(identity, now=time.time())
        self._configs = {
            is_client: QuicConfiguration(
                alpn_protocols=[ALPN],
                is_client=is_client,
                certificate=host.certificate,
                private_key=host.private_key,
                verify_mode=ssl.CERT_NONE,  # there is no CA: _on_handshake checks the libp2p extension
                max_datagram_size=max_datagram_size,
                max_stream_data=min(QuicConfiguration.max_stream_data, max_message + 1),
                idle_timeout=idle_timeout,
                connection_id_length=CID_LENGTH,
            )
            for is_client in (True, False)
        }
        self._transport: asyncio.DatagramTransport | None = None
        self._conns: set[Conn] = set()
        self._by_cid: dict[bytes, Conn] = {}
        self._by_peer: dict[PeerId, Conn] = {}
        self._dialing: dict[tuple[PeerId, Address], Conn] = {}
        self._routes: dict[Address, Callable[[bytes], None]] = {}
        self._filter: DatagramFilter | None = None
        self._subscribers: list[Subscriber] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False

    @classmethod
    async def bind(
        cls,
        identity: Identity,
        host: str,
        port: int,
        *,
        handler: Handler | None,
        max_message: int = 64 << 20,
        max_datagram_size: int = MIN_DATAGRAM,
        idle_timeout: float = 10.0,
        keepalive: bool = True,
        stream_timeout: float = 60.0,
        serve_limits: ServeLimits | None = None,
        max_half_open: int = MAX_HALF_OPEN,
    ) -> Endpoint:
        """Open the UDP socket at (host, port) (port 0: any free port; see ``local_addr``).

        ``handler(peer_id, request) -> reply`` answers requests; with ``None`` requests to us are refused
        (``ErrorCode.NO_HANDLER``). ``max_datagram_size`` applies to what this end sends, so set it alike on both
        ends: 1200 works on every path, 1452 fits Ethernet without tunnels, 16384 is for loopback. A silent peer is
        declared gone after ``idle_timeout`` seconds; ``keepalive`` PINGs keep quiet connections open meanwhile. A
        request whose stream gets no data for ``stream_timeout`` seconds before it is complete is reset.
        ``serve_limits`` bound what peers may make a serving endpoint hold (``p2p.quic.budget``); past ``max_half_open``
        unverified connections new clients must pass a Retry first.
        """
        endpoint = cls(
            identity,
            handler=handler,
            max_message=max_message,
            max_datagram_size=max_datagram_size,
            idle_timeout=idle_timeout,
            keepalive=keepalive,
            stream_timeout=stream_timeout,
            serve_limits=serve_limits,
            max_half_open=max_half_open,
        )
        with binding("UDP", host, port, "QUIC"):  # a taken port is the operator's to fix: one clear line
            transport, _ = await endpoint._loop.create_datagram_endpoint(
                lambda: _Socket(endpoint), local_addr=(host, port)
            )
        endpoint._transport = transport
        sockname = transport.get_extra_info("sockname")
        endpoint.local_addr = (sockname[0], sockname[1])
        if keepalive:
            endpoint._spawn(endpoint._keep_alive())
        return endpoint

    # --- public API ---------------------------------------------------------------------------------------------

    async def request(self, addr: Address, peer_id: PeerId, payload: bytes, *, timeout: float) -> bytes:
        """Send ``payload`` to ``peer_id`` (dialling ``addr`` unless a connection to the peer exists); its reply.

        Raises ``TransportTimeout``, ``PeerAuthError``, ``ConnectionLost``, ``MessageTooLarge`` or ``RemoteError``.
        """
        check_request_size(payload, self.max_message)
        try:
            async with asyncio.timeout(timeout):
                return await self._call(await self._connection(addr, peer_id), payload)
        except TimeoutError:
            raise TransportTimeout(f"no reply from {peer_id} at {addr} within {timeout} s") from None

    async def connect(self, addr: Address, peer_id: PeerId, *, timeout: float) -> None:
        """Make sure a verified connection to ``peer_id`` exists (dialling ``addr`` if needed)."""
        try:
            async with asyncio.timeout(timeout):
                await self._connection(addr, peer_id)
        except TimeoutError:
            raise TransportTimeout(f"no handshake with {peer_id} at {addr} within {timeout} s") from None

    def connections(self) -> dict[PeerId, Address | None]:
        """The peers we hold a verified connection to, with the address their packets go to."""
        return {peer: conn.addr for peer, conn in self._by_peer.items()}

    def add_route(self, addr: Address, send: Callable[[bytes], None]) -> None:
        """Hand datagrams for ``addr`` to ``send`` (e.g. a relay) instead of the UDP socket."""
        self._routes[addr] = send

    def remove_route(self, addr: Address) -> None:
        self._routes.pop(addr, None)

    def subscribe(self, fn: Subscriber) -> None:
        """Call ``fn(event)`` for every ``PathOpened`` / ``PathClosed`` from now on (``p2p.quic.events``)."""
        self._subscribers.append(fn)

    def unsubscribe(self, fn: Subscriber) -> None:
        """Stop calling ``fn``; a function that is not subscribed is ignored."""
        with contextlib.suppress(ValueError):
            self._subscribers.remove(fn)

    def datagram_received(self, data: bytes, addr: Address) -> None:
        """Feed one datagram from ``addr``: the socket calls this, and so may a relay for datagrams it carried."""
        if self._closed:
            return
        try:
            header = pull_quic_header(Buffer(data=data), host_cid_length=CID_LENGTH)
        except ValueError:
            return
        conn = self._by_cid.get(header.destination_cid)
        fresh = conn is None
        if conn is None:
            if (
                header.packet_type != QuicPacketType.INITIAL
                or len(data) < MIN_DATAGRAM
                or header.version not in self._configs[False].supported_versions
            ):
                return
            conn = self._admit(header, addr)
            if conn is None:
                return
        conn.quic.receive_datagram(data, addr, now=self._loop.time())
        if fresh and conn.quic.nothing_decrypted():  # junk dressed as an Initial: no state for it
            self._forget(conn, quiet=True)
            return
        self._pump(conn)

    def _admit(self, header: Any, addr: Address) -> Conn | None:
        """A connection for a new client's Initial, or None (a Retry sent, or dropped): ``p2p.quic.gate`` decides."""
        now, routable = self._loop.time(), is_ip(addr[0])
        original, token = header.destination_cid, None
        if header.token:  # only ours are valid: we issue no NEW_TOKEN tokens
            token = False
            if routable:
                with contextlib.suppress(ValueError):
                    original = self._retry.validate_token(address=addr, destination_cid=header.destination_cid, token=header.token, now=now)
                    token = True
        verdict = self._gate.admit(token=token, routable=routable, half_open=self._half_open(), now=now)
        if verdict is Admit.ACCEPT:
            return self._accept(original, retry_cid=header.destination_cid if token else None)
        if verdict is Admit.RETRY and self._transport is not None:
            retry_cid = os.urandom(CID_LENGTH)
            token_bytes = self._retry.create_token(address=addr, original_destination_connection_id=original, retry_source_connection_id=retry_cid, now=now)
            retry = encode_quic_retry(version=header.version, source_cid=retry_cid, destination_cid=header.source_cid, original_destination_cid=original, retry_token=token_bytes)
            self._transport.sendto(retry, addr)
        return None

    def _half_open(self) -> int:
        return sum(1 for c in self._conns if c.peer is None and c.failure is None and not c.is_client)

    async def close(self) -> None:
        """Close every connection (pending requests fail with ``ConnectionLost``) and the socket."""
        if self._closed:
            return
        self._closed = True
        for conn in list(self._conns):
            if conn.failure is None:
                conn.quic.close(error_code=ErrorCode.NO_ERROR, reason_phrase="endpoint closing")
                self._transmit(conn)
                reason = "local endpoint closed"
                self._fail(conn, ConnectionLost(conn.peer or conn.expected, conn.addr, reason), reason, 0)
            self._forget(conn)
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._transport is not None:
            self._transport.close()

    # --- paths --------------------------------------------------------------------------------------------------

    def set_datagram_filter(self, fn: DatagramFilter | None) -> None:
        """Show every datagram the socket receives to ``fn(data, addr)`` first; QUIC gets those it returns False
        for. One filter at a time (``None`` removes it); it must not raise. Relayed datagrams bypass it."""
        if self._transport is None:
            raise ValueError("bind the endpoint (Endpoint.bind) before filtering its datagrams")
        if fn is not None and self._filter is not None:
            raise ValueError("this endpoint already has a datagram filter")
        self._filter = fn

    def sendto(self, data: bytes, addr: Address) -> None:
        """Send one datagram from the QUIC socket; dropped once closed or if ``addr`` is not an IP (a name would
        block on DNS; a relay's virtual address is not the socket's)."""
        if not self._closed and self._transport is not None and is_ip(addr[0]):
            self._transport.sendto(data, addr)

    def paths(self, peer_id: PeerId | None = None) -> list[Address]:
        """The addresses of the verified, open connections to ``peer_id`` (or to anyone)."""
        return [addr for conn in self._live(peer_id) if (addr := conn.addr)]

    async def dial_path(self, peer_id: PeerId, addr: Address, *, timeout: float) -> None:
        """Make sure a verified connection to ``peer_id`` at ``addr`` exists, even if the peer has one elsewhere; it
        carries requests once preferred (or if it is the peer's first). One that times out is closed."""
        try:
            async with asyncio.timeout(timeout):
                await self._connection(addr, peer_id, new_path=True)
        except TimeoutError:
            if (conn := self._dialing.get((peer_id, addr))) is not None:
                self._close_conn(conn, "path dial timed out")
            raise TransportTimeout(f"no handshake with {peer_id} at {addr} within {timeout} s") from None

    def prefer_path(self, peer_id: PeerId, addr: Address) -> bool:
        """Send later requests to ``peer_id`` on its connection at ``addr``; False if there is none."""
        if (conn := self._path(peer_id, addr)) is not None:
            self._by_peer[peer_id] = conn
        return conn is not None

    def close_path(self, peer_id: PeerId, addr: Address, reason: str) -> bool:
        """Close the connection to ``peer_id`` at ``addr``: its pending requests fail with ``ConnectionLost``, later
        ones use another path (if any). False if there is no such connection."""
        if (conn := self._path(peer_id, addr)) is not None:
            self._close_conn(conn, reason)
        return conn is not None

    # --- connections --------------------------------------------------------------------------------------------

    async def _connection(self, addr: Address, peer_id: PeerId, *, new_path: bool = False) -> Conn:
        """The peer's connection for requests, or (``new_path``) its connection at ``addr``; dialled if need be."""
        if self._closed:
            raise ConnectionLost(peer_id, addr, "local endpoint closed")
        if peer_id == self.peer_id:
            raise ValueError("an endpoint cannot connect to its own peer id")
        known = self._path(peer_id, addr) if new_path else self._by_peer.get(peer_id)
        conn = known or self._dialing.get((peer_id, addr)) or self._dial(addr, peer_id)
        await asyncio.shield(conn.ready)
        return conn

    def _live(self, peer_id: PeerId | None) -> list[Conn]:
        """Verified connections that are not closing (to ``peer_id``, or all)."""
        return [c for c in self._conns if c.peer is not None and c.failure is None and peer_id in (None, c.peer)]

    def _path(self, peer_id: PeerId, addr: Address) -> Conn | None:
        return next((c for c in self._live(peer_id) if c.addr == addr), None)

    def _close_conn(self, conn: Conn, reason: str) -> None:
        """Close one connection; ``_pump`` sees it closing at once and moves the peer's requests to a spare."""
        if conn.failure is None:
            conn.quic.close(error_code=ErrorCode.NO_ERROR, reason_phrase=reason[:_MAX_REASON])
            self._pump(conn)

    def _new_conn(self, quic: AuthQuicConnection, expected: PeerId | None) -> Conn:
        conn = Conn(quic=quic, ready=self._loop.create_future(), expected=expected)
        conn.ready.add_done_callback(retrieve)
        self._conns.add(conn)
        self._register_cid(conn, quic.host_cid)
        return conn

    def _quic(self, **kwargs: Any) -> AuthQuicConnection:
        limits = self.budget.limits
        return AuthQuicConnection(window_cap=self.max_message + 1, max_streams=limits.max_streams_per_conn, conn_window=limits.max_bytes_per_conn, **kwargs)

    def _dial(self, addr: Address, peer_id: PeerId) -> Conn:
        quic = self._quic(configuration=self._configs[True])
        conn = self._new_conn(quic, peer_id)
        self._dialing[(peer_id, addr)] = conn
        conn.quic.connect(addr, now=self._loop.time())
        self._pump(conn)
        return conn

    def _accept(self, original_cid: bytes, *, retry_cid: bytes | None = None) -> Conn:
        quic = self._quic(
            configuration=self._configs[False],
            original_destination_connection_id=original_cid,
            retry_source_connection_id=retry_cid,
        )
        conn = self._new_conn(quic, None)
        self._register_cid(conn, retry_cid or original_cid)  # where the client's Initial packets are addressed
        return conn

    def _register_cid(self, conn: Conn, cid: bytes) -> None:
        self._by_cid[cid] = conn
        conn.cids.add(cid)

    def _pump(self, conn: Conn) -> None:
        """Handle the connection's pending events, then send what it has to send."""
        while (event := conn.quic.next_event()) is not None:
            self._on_event(conn, event)
        closing = conn.quic.closing()
        if conn.failure is None and closing is not None:
            self._fail(conn, self._closed_by(conn, closing), closing.reason_phrase, closing.error_code)
        self._transmit(conn)

    def _transmit(self, conn: Conn) -> None:
        for data, addr in conn.quic.datagrams_to_send(now=self._loop.time()):
            route = self._routes.get(addr)
            if route is not None:
                route(data)
            elif self._transport is not None and is_ip(addr[0]):  # a name would block the loop on DNS
                self._transport.sendto(data, addr)
        timers = [conn.quic.get_timer(), None if conn.streams is None else conn.streams.get_timer()]
        timer_at = min((t for t in timers if t is not None), default=None)
        if conn.timer is not None and conn.timer_at != timer_at:
            conn.timer.cancel()
            conn.timer = None
        if conn.timer is None and timer_at is not None and not self._closed:
            conn.timer = self._loop.call_at(timer_at, self._on_timer, conn)
        conn.timer_at = timer_at

    def _on_timer(self, conn: Conn) -> None:
        now = max(conn.timer_at or 0.0, self._loop.time())
        conn.timer = conn.timer_at = None
        if (quic_at := conn.quic.get_timer()) is not None and quic_at <= now:
            conn.quic.handle_timer(now=now)
        if conn.streams is not None:
            self._perform(conn, conn.streams.handle_timer(now))
        self._pump(conn)

    def _on_event(self, conn: Conn, event: events.QuicEvent) -> None:
        if isinstance(event, events.StreamDataReceived):
            self._on_stream_data(conn, event)
        elif isinstance(event, (events.StreamReset, events.StopSendingReceived)):
            if conn.streams is not None:
                self._perform(conn, conn.streams.stream_reset(event.stream_id, event.error_code))
        elif isinstance(event, events.HandshakeCompleted):
            self._on_handshake(conn)
        elif isinstance(event, events.ConnectionIdIssued):
            self._register_cid(conn, event.connection_id)
        elif isinstance(event, events.ConnectionIdRetired):
            self._by_cid.pop(event.connection_id, None)
            conn.cids.discard(event.connection_id)
        elif isinstance(event, events.ConnectionTerminated):
            if conn.failure is None:
                self._fail(conn, self._closed_by(conn, event), event.reason_phrase, event.error_code)
            self._forget(conn)

    def _on_handshake(self, conn: Conn) -> None:
        try:
            certificates = conn.quic.peer_certificates()
            if len(certificates) != 1:
                raise PeerCertificateError(f"peer presented {len(certificates)} certificates; exactly 1 is required")
            peer = verify_certificate(certificates[0], now=time.time(), expected=conn.expected)
        except PeerCertificateError as exc:
            log.warning("quic.refused", addr=conn.addr, expected=conn.expected and str(conn.expected), reason=str(exc))
            conn.quic.close(error_code=ErrorCode.PEER_AUTH_FAILED, reason_phrase=str(exc)[:_MAX_REASON])
            error = PeerAuthError(f"peer at {conn.addr} failed authentication: {exc}")
            self._fail(conn, error, str(exc), ErrorCode.PEER_AUTH_FAILED)
            return
        conn.peer = peer
        conn.streams = RequestStreams(
            peer,
            is_client=conn.is_client,
            max_message=self.max_message,
            serving=self._handler is not None,
            stream_timeout=self._stream_timeout,
            budget=self.budget,
        )
        if conn.expected is not None:
            self._dialing = {k: c for k, c in self._dialing.items() if c is not conn}
        self._by_peer.setdefault(peer, conn)
        log.debug("quic.connected", peer=str(peer), addr=conn.addr, role="client" if conn.is_client else "server")
        settle(conn.ready)
        self._emit(PathOpened(peer, conn.addr))

    def _emit(self, event: EndpointEvent) -> None:
        for fn in list(self._subscribers):
            try:
                fn(event)
            except Exception:  # a broken subscriber must not break the connection that triggered it
                log.exception("quic.subscriber_failed", event=type(event).__name__)

    def _closed_by(self, conn: Conn, event: events.ConnectionTerminated) -> TransportError:
        """The error for requests pending on a connection that ``event`` ends."""
        if event.error_code == ErrorCode.PEER_AUTH_FAILED and event.frame_type is None:
            return PeerAuthError(f"{conn.expected or conn.addr} refused our certificate: {event.reason_phrase}")
        reason = f"{event.reason_phrase or 'closed'} (error {event.error_code})"
        return ConnectionLost(conn.peer or conn.expected, conn.addr, reason)

    def _fail(self, conn: Conn, error: TransportError, reason: str, code: int) -> None:
        """Fail everything pending on a connection that is closing; route new requests elsewhere."""
        conn.failure = error
        conn.close_reason = f"{reason or 'closed'} (error {int(code)})"
        settle(conn.ready, error=error)
        if conn.streams is not None:
            self._perform(conn, conn.streams.close(error))
        self._dialing = {k: c for k, c in self._dialing.items() if c is not conn}
        if conn.peer is not None and self._by_peer.get(conn.peer) is conn:
            del self._by_peer[conn.peer]
            spare = next((c for c in self._conns if c.peer == conn.peer and c.failure is None), None)
            if spare is not None:
                self._by_peer[conn.peer] = spare
        if conn.peer is not None:
            self._emit(PathClosed(conn.peer, conn.addr, conn.close_reason))

    def _forget(self, conn: Conn, *, quiet: bool = False) -> None:
        """Drop a terminated connection from every table (``quiet``: one that never was, a junk Initial's)."""
        if conn not in self._conns:
            return
        self._conns.discard(conn)
        for cid in conn.cids:
            if self._by_cid.get(cid) is conn:
                del self._by_cid[cid]
        if conn.timer is not None:
            conn.timer.cancel()
            conn.timer = None
        if quiet:
            return
        log.debug("quic.closed", peer=conn.peer and str(conn.peer), addr=conn.addr, reason=conn.close_reason)

    async def _keep_alive(self) -> None:
        while True:
            await asyncio.sleep(self._idle_timeout / 3)
            for conn in list(self._conns):
                if conn.peer is not None and conn.failure is None:
                    conn.quic.send_ping(0)
                    self._pump(conn)

    # --- requests -----------------------------------------------------------------------------------------------

    async def _call(self, conn: Conn, payload: bytes) -> bytes:
        if conn.failure is not None:
            raise conn.failure
        assert conn.streams is not None  # a connection is ready only once verified
        stream_id, commands = conn.streams.request(payload)
        future = conn.calls[stream_id] = self._loop.create_future()
        self._perform(conn, commands)
        self._pump(conn)
        try:
            return await future
        except asyncio.CancelledError:
            if conn.calls.pop(stream_id, None) is not None and conn.failure is None:
                self._perform(conn, conn.streams.cancel(stream_id))
                self._pump(conn)
            raise

    def _on_stream_data(self, conn: Conn, event: events.StreamDataReceived) -> None:
        if conn.streams is None:
            if conn.failure is None:  # TLS completes before 1-RTT data is readable; anything else is an attack
                reason = "stream data before authentication"
                conn.quic.close(error_code=ErrorCode.PROTOCOL_VIOLATION, reason_phrase=reason)
                error = PeerAuthError(f"peer at {conn.addr} sent {reason}")
                self._fail(conn, error, reason, ErrorCode.PROTOCOL_VIOLATION)
            return
        now = self._loop.time()
        self._perform(conn, conn.streams.stream_data(event.stream_id, event.data, event.end_stream, now))

    def _perform(self, conn: Conn, outputs: Sequence[Output]) -> None:
        """Carry out what ``RequestStreams`` returned: stream commands to aioquic, results to futures and tasks."""
        for out in outputs:
            if isinstance(out, SendStream):
                conn.quic.send_stream_data(out.stream_id, out.data, end_stream=out.end_stream)
            elif isinstance(out, ResetStream):
                with contextlib.suppress(ValueError):  # a stream aioquic already discarded needs nothing
                    conn.quic.reset_stream(out.stream_id, out.code)
            elif isinstance(out, AbortStream):
                with contextlib.suppress(ValueError):
                    conn.quic.stop_stream(out.stream_id, out.code)
                if not out.stream_id & 2:
                    with contextlib.suppress(ValueError):
                        conn.quic.reset_stream(out.stream_id, out.code)
            elif isinstance(out, ReplyReceived):
                if (future := conn.calls.pop(out.stream_id, None)) is not None:
                    settle(future, result=out.data)
            elif isinstance(out, CallFailed):
                if (future := conn.calls.pop(out.stream_id, None)) is not None:
                    settle(future, error=out.error)
            elif isinstance(out, RequestReceived):
                conn.serves[out.stream_id] = self._spawn(self._serve(conn, out.stream_id, out.data))
            elif isinstance(out, ServeCancelled) and (task := conn.serves.pop(out.stream_id, None)) is not None:
                task.cancel()
            elif isinstance(out, StreamsEvicted):
                self._evict(out)

    def _evict(self, evicted: StreamsEvicted) -> None:
        """Reset the streams of other connections that the shared budget evicted for this one's request."""
        for owner, stream_id in evicted.victims:
            victim = next((c for c in self._conns if c.streams is owner), None)
            if victim is not None and victim.streams is not None and victim.failure is None:
                self._perform(victim, victim.streams.evict(stream_id))
                self._pump(victim)

    async def _serve(self, conn: Conn, sid: int, request: bytes) -> None:
        assert self._handler is not None and conn.peer is not None and conn.streams is not None
        try:
            reply = await self._handler(conn.peer, request)
            if not isinstance(reply, (bytes, bytearray, memoryview)):
                raise TypeError(f"handler returned {type(reply).__name__}, not bytes")
        except Exception:  # the caller gets HANDLER_FAILED; the log keeps the traceback
            log.exception("quic.handler_failed", peer=str(conn.peer), stream=sid)
            commands = conn.streams.refuse(sid, ErrorCode.HANDLER_FAILED)
        else:
            commands = conn.streams.reply(sid, reply)
        conn.serves.pop(sid, None)
        if conn.failure is None:  # else the connection closed meanwhile (and cancelled every serve)
            self._perform(conn, commands)
            self._pump(conn)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = self._loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task
