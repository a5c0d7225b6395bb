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

Authentication. aioquic 1.7.2's TLS can request a client certificate but has no public switch for it
(``tls.Context._request_client_certificate``, "for test purposes only"; aiortc/aioquic#541). ``AuthQuicConnection`` (``p2p.quic_aioquic``)
sets it on the server side; both sides present a ``p2p.tls`` certificate and TLS proves each holds its certificate
key (CertificateVerify). aioquic checks no chain (``CERT_NONE``: there is no CA); when it reports the handshake
complete we run ``p2p.tls.verify_certificate`` before reading one stream byte: the client against the peer id it
dialled, the server to learn who called. A failure closes the connection with ``ErrorCode.PEER_AUTH_FAILED`` and
the reason. No session tickets are issued (a resumed session carries no certificate).

Messages. A request is one bidirectional stream: payload, FIN; the reply returns on it, FIN. The stream's end
delimits the message: no framing, no head-of-line blocking between requests (``p2p/bench_quic.py`` compares a framed
persistent stream). A message above ``max_message`` is refused with STOP_SENDING/RESET_STREAM
(``ErrorCode.MESSAGE_TOO_LARGE``), never buffered further, and stream windows stop at ``max_message + 1``.

aioquic 1.7.2 pitfalls handled (FIELD-NOTES): ``max_datagram_size`` is at most 16384 (beyond, a STREAM frame can
overflow aioquic's 2-byte length field and kill the connection) and is set on both configurations; streams are
opened with ``get_next_available_stream_id`` + ``send_stream_data`` (``create_stream`` hands out one id twice);
per-stream state is ours and dropped when the stream ends (aioquic's reader table never forgets one); pending
requests fail with ``ConnectionLost`` naming the peer as soon as the connection closes; our streams send with
aioquic's own ``QuicStreamSender.get_frame``, reloaded from its source, since importing libp2p replaces it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ipaddress
import ssl
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

import structlog
from aioquic.buffer import Buffer
from aioquic.quic import events
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.packet import QuicPacketType, pull_quic_header

from p2p.identity import Identity, PeerId
from p2p.quic_aioquic import AuthQuicConnection
from p2p.tls import PeerCertificateError, make_certificate, verify_certificate

Address = tuple[str, int]
Handler = Callable[[PeerId, bytes], Awaitable[bytes]]

ALPN = "moeswarm/1"
CID_LENGTH = 8
MIN_DATAGRAM = 1200  # QUIC's minimum; safe on any path
MAX_DATAGRAM = 16384  # above this aioquic 1.7.2 can emit STREAM frames > 16383 bytes and break the connection
_MAX_REASON = 200

log = structlog.get_logger("p2p.quic")


class ErrorCode(IntEnum):
    """Application error codes on our streams (RESET_STREAM/STOP_SENDING) and connections (CONNECTION_CLOSE)."""

    NO_ERROR = 0
    MESSAGE_TOO_LARGE = 1
    HANDLER_FAILED = 2
    NO_HANDLER = 3
    CANCELLED = 4
    PEER_AUTH_FAILED = 5
    PROTOCOL_VIOLATION = 6


class TransportError(Exception):
    """A request on the data path failed."""


class TransportTimeout(TransportError, TimeoutError):
    """No reply within the caller's timeout."""


class PeerAuthError(TransportError):
    """The peer's certificate did not prove the expected peer id, or the peer refused ours."""


class ConnectionLost(TransportError):
    """The connection to a peer ended (closed, idle timeout, endpoint closed) while a request was pending."""

    def __init__(self, peer: PeerId | None, addr: Address | None, reason: str) -> None:
        super().__init__(f"connection to {peer or 'unverified peer'} at {addr} lost: {reason}")
        self.peer = peer
        self.addr = addr
        self.reason = reason


class MessageTooLarge(TransportError):
    """A request or reply exceeds this endpoint's or the peer's ``max_message``."""


class RemoteError(TransportError):
    """The peer reset the stream: its handler failed, it has no handler, or it broke off."""

    def __init__(self, peer: PeerId | None, code: int) -> None:
        name = ErrorCode(code).name if code in ErrorCode._value2member_map_ else str(code)
        super().__init__(f"{peer} reset the request stream: {name}")
        self.peer = peer
        self.code = code


@dataclass(eq=False)
class _Call:
    """A request we sent, waiting for its reply."""

    future: asyncio.Future[bytes]
    data: bytearray = field(default_factory=bytearray)


@dataclass(eq=False)
class _Serve:
    """A request we are receiving (``task`` None) or answering; ``refused`` ones only wait for the stream to end."""

    data: bytearray = field(default_factory=bytearray)
    task: asyncio.Task[None] | None = None
    refused: bool = False


@dataclass(eq=False)
class _Conn:
    quic: AuthQuicConnection
    ready: asyncio.Future[None]  # resolves once the peer's certificate is verified
    expected: PeerId | None = None  # the peer id we dialled (None: the peer dialled us)
    peer: PeerId | None = None  # the verified peer id
    failure: TransportError | None = None  # set when the connection starts closing
    close_reason: str = ""
    calls: dict[int, _Call] = field(default_factory=dict)
    serves: dict[int, _Serve] = field(default_factory=dict)
    cids: set[bytes] = field(default_factory=set)
    timer: asyncio.TimerHandle | None = None
    timer_at: float | None = None

    @property
    def is_client(self) -> bool:
        return self.quic.configuration.is_client

    @property
    def addr(self) -> Address | None:
        return self.quic.get_peer_address()

    def is_local(self, stream_id: int) -> bool:
        return (stream_id & 1) == (0 if self.is_client else 1)


def _settle(future: asyncio.Future[Any], *, result: Any = None, error: BaseException | None = None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


@functools.lru_cache(maxsize=1024)
def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _retrieve(future: asyncio.Future[Any]) -> None:
    """Mark a future's exception as seen: a failed dial nobody waits for is not an error worth a warning."""
    if not future.cancelled():
        future.exception()


class _Socket(asyncio.DatagramProtocol):
    def __init__(self, endpoint: Endpoint) -> None:
        self._endpoint = endpoint

    def datagram_received(self, data: bytes, addr: Any) -> None:
        self._endpoint.datagram_received(data, (addr[0], addr[1]))

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
    ) -> None:
        """Use ``await Endpoint.bind(...)``; this constructor opens no socket."""
        if not MIN_DATAGRAM <= max_datagram_size <= MAX_DATAGRAM:
            raise ValueError(f"max_datagram_size {max_datagram_size} is outside {MIN_DATAGRAM}..{MAX_DATAGRAM}")
        if max_message < 1 or idle_timeout <= 0:
            raise ValueError("max_message and idle_timeout must be positive")
        self.identity = identity
        self.peer_id = identity.peer_id
        self.max_message = max_message
        self.local_addr: Address = ("", 0)
        self._handler = handler
        self._idle_timeout = idle_timeout
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
        self._conns: set[_Conn] = set()
        self._by_cid: dict[bytes, _Conn] = {}
        self._by_peer: dict[PeerId, _Conn] = {}
        self._dialing: dict[tuple[PeerId, Address], _Conn] = {}
        self._routes: dict[Address, Callable[[bytes], None]] = {}
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
    ) -> Endpoint:
        """Open the UDP socket at (host, port) (port 0: any free port; see ``local_addr``).

        ``handler(peer_id, request) -> reply`` answers requests; with ``None`` requests to us are refused
        (``ErrorCode.NO_HANDLER``). ``max_datagram_size`` applies to what this end sends, so set it alike on both
        ends: 1200 works on every path, 1452 fits Ethernet without tunnels, 16384 is for loopback. A silent peer is
        declared gone after ``idle_timeout`` seconds; ``keepalive`` PINGs keep quiet connections open meanwhile.
        """
        endpoint = cls(
            identity,
            handler=handler,
            max_message=max_message,
            max_datagram_size=max_datagram_size,
            idle_timeout=idle_timeout,
            keepalive=keepalive,
        )
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
        if len(payload) > self.max_message:
            raise MessageTooLarge(f"request of {len(payload)} bytes exceeds max_message {self.max_message}")
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

    def datagram_received(self, data: bytes, addr: Address) -> None:
        """Feed one datagram from ``addr``: the socket calls this, and so may a relay for datagrams it carried."""
        if self._closed:
            return
        try:
            header = pull_quic_header(Buffer(data=data), host_cid_length=CID_LENGTH)
        except ValueError:
            return
        conn = self._by_cid.get(header.destination_cid)
        if conn is None:
            if (
                header.packet_type != QuicPacketType.INITIAL
                or len(data) < MIN_DATAGRAM
                or header.version not in self._configs[False].supported_versions
            ):
                return
            conn = self._accept(header.destination_cid)
        conn.quic.receive_datagram(data, addr, now=self._loop.time())
        self._pump(conn)

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

    # --- connections --------------------------------------------------------------------------------------------

    async def _connection(self, addr: Address, peer_id: PeerId) -> _Conn:
        if self._closed:
            raise ConnectionLost(peer_id, addr, "local endpoint closed")
        if peer_id == self.peer_id:
            raise ValueError("an endpoint cannot connect to its own peer id")
        conn = self._by_peer.get(peer_id) or self._dialing.get((peer_id, addr)) or self._dial(addr, peer_id)
        await asyncio.shield(conn.ready)
        return conn

    def _new_conn(self, quic: AuthQuicConnection, expected: PeerId | None) -> _Conn:
        conn = _Conn(quic=quic, ready=self._loop.create_future(), expected=expected)
        conn.ready.add_done_callback(_retrieve)
        self._conns.add(conn)
        self._register_cid(conn, quic.host_cid)
        return conn

    def _dial(self, addr: Address, peer_id: PeerId) -> _Conn:
        quic = AuthQuicConnection(configuration=self._configs[True], window_cap=self.max_message + 1)
        conn = self._new_conn(quic, peer_id)
        self._dialing[(peer_id, addr)] = conn
        conn.quic.connect(addr, now=self._loop.time())
        self._pump(conn)
        return conn

    def _accept(self, original_cid: bytes) -> _Conn:
        quic = AuthQuicConnection(
            configuration=self._configs[False],
            original_destination_connection_id=original_cid,
            window_cap=self.max_message + 1,
        )
        conn = self._new_conn(quic, None)
        self._register_cid(conn, original_cid)  # the client's Initial packets are addressed to its chosen id
        return conn

    def _register_cid(self, conn: _Conn, cid: bytes) -> None:
        self._by_cid[cid] = conn
        conn.cids.add(cid)

    def _pump(self, conn: _Conn) -> None:
        """Handle the connection's pending events, then send what it has to send."""
        while (event := conn.quic.next_event()) is not None:
            self._on_event(conn, event)
        closing = conn.quic._close_event  # set as soon as either side closes; the event itself comes 3 PTO later
        if conn.failure is None and closing is not None:
            self._fail(conn, self._closed_by(conn, closing), closing.reason_phrase, closing.error_code)
        self._transmit(conn)

    def _transmit(self, conn: _Conn) -> None:
        for data, addr in conn.quic.datagrams_to_send(now=self._loop.time()):
            route = self._routes.get(addr)
            if route is not None:
                route(data)
            elif self._transport is not None and _is_ip(addr[0]):  # a name would block the loop on DNS
                self._transport.sendto(data, addr)
        timer_at = conn.quic.get_timer()
        if conn.timer is not None and conn.timer_at != timer_at:
            conn.timer.cancel()
            conn.timer = None
        if conn.timer is None and timer_at is not None and not self._closed:
            conn.timer = self._loop.call_at(timer_at, self._on_timer, conn)
        conn.timer_at = timer_at

    def _on_timer(self, conn: _Conn) -> None:
        now = max(conn.timer_at or 0.0, self._loop.time())
        conn.timer = conn.timer_at = None
        conn.quic.handle_timer(now=now)
        self._pump(conn)

    def _on_event(self, conn: _Conn, event: events.QuicEvent) -> None:
        if isinstance(event, events.StreamDataReceived):
            self._on_stream_data(conn, event)
        elif isinstance(event, (events.StreamReset, events.StopSendingReceived)):
            self._on_stream_reset(conn, event.stream_id, event.error_code)
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

    def _on_handshake(self, conn: _Conn) -> None:
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
        if conn.expected is not None:
            self._dialing = {k: c for k, c in self._dialing.items() if c is not conn}
        self._by_peer.setdefault(peer, conn)
        log.info("quic.connected", peer=str(peer), addr=conn.addr, role="client" if conn.is_client else "server")
        _settle(conn.ready)

    def _closed_by(self, conn: _Conn, event: events.ConnectionTerminated) -> TransportError:
        """The error for requests pending on a connection that ``event`` ends."""
        if event.error_code == ErrorCode.PEER_AUTH_FAILED and event.frame_type is None:
            return PeerAuthError(f"{conn.expected or conn.addr} refused our certificate: {event.reason_phrase}")
        reason = f"{event.reason_phrase or 'closed'} (error {event.error_code})"
        return ConnectionLost(conn.peer or conn.expected, conn.addr, reason)

    def _fail(self, conn: _Conn, error: TransportError, reason: str, code: int) -> None:
        """Fail everything pending on a connection that is closing; route new requests elsewhere."""
        conn.failure = error
        conn.close_reason = f"{reason or 'closed'} (error {int(code)})"
        _settle(conn.ready, error=error)
        for call in conn.calls.values():
            _settle(call.future, error=error)
        for serve in conn.serves.values():
            if serve.task is not None:
                serve.task.cancel()
        conn.calls.clear()
        conn.serves.clear()
        self._dialing = {k: c for k, c in self._dialing.items() if c is not conn}
        if conn.peer is not None and self._by_peer.get(conn.peer) is conn:
            del self._by_peer[conn.peer]
            spare = next((c for c in self._conns if c.peer == conn.peer and c.failure is None), None)
            if spare is not None:
                self._by_peer[conn.peer] = spare

    def _forget(self, conn: _Conn) -> None:
        """Drop a terminated connection from every table."""
        if conn not in self._conns:
            return
        self._conns.discard(conn)
        for cid in conn.cids:
            if self._by_cid.get(cid) is conn:
                del self._by_cid[cid]
        if conn.timer is not None:
            conn.timer.cancel()
            conn.timer = None
        log.info("quic.closed", peer=conn.peer and str(conn.peer), addr=conn.addr, reason=conn.close_reason)

    async def _keep_alive(self) -> None:
        while True:
            await asyncio.sleep(self._idle_timeout / 3)
            for conn in list(self._conns):
                if conn.peer is not None and conn.failure is None:
                    conn.quic.send_ping(0)
                    self._pump(conn)

    # --- requests -----------------------------------------------------------------------------------------------

    async def _call(self, conn: _Conn, payload: bytes) -> bytes:
        if conn.failure is not None:
            raise conn.failure
        stream_id = conn.quic.get_next_available_stream_id()
        call = _Call(self._loop.create_future())
        conn.calls[stream_id] = call
        conn.quic.send_stream_data(stream_id, payload, end_stream=True)
        self._pump(conn)
        try:
            return await call.future
        except asyncio.CancelledError:
            if conn.calls.pop(stream_id, None) is not None and conn.failure is None:
                self._abort(conn, stream_id, ErrorCode.CANCELLED)
                self._pump(conn)
            raise

    def _on_stream_data(self, conn: _Conn, event: events.StreamDataReceived) -> None:
        sid = event.stream_id
        if conn.peer is None:
            if conn.failure is None:  # TLS completes before 1-RTT data is readable; anything else is an attack
                reason = "stream data before authentication"
                conn.quic.close(error_code=ErrorCode.PROTOCOL_VIOLATION, reason_phrase=reason)
                error = PeerAuthError(f"peer at {conn.addr} sent {reason}")
                self._fail(conn, error, reason, ErrorCode.PROTOCOL_VIOLATION)
            return
        if conn.is_local(sid):
            self._on_reply_data(conn, sid, event)
        else:
            self._on_request_data(conn, sid, event)

    def _on_reply_data(self, conn: _Conn, sid: int, event: events.StreamDataReceived) -> None:
        call = conn.calls.get(sid)
        if call is None:  # a request we gave up on
            return
        call.data += event.data
        if len(call.data) > self.max_message:
            del conn.calls[sid]
            self._abort(conn, sid, ErrorCode.MESSAGE_TOO_LARGE)
            error = MessageTooLarge(f"reply from {conn.peer} exceeds max_message {self.max_message}")
            _settle(call.future, error=error)
        elif event.end_stream:
            del conn.calls[sid]
            _settle(call.future, result=bytes(call.data))

    def _on_request_data(self, conn: _Conn, sid: int, event: events.StreamDataReceived) -> None:
        serve = conn.serves.get(sid)
        if serve is None:
            serve = conn.serves[sid] = _Serve()
            if self._handler is None:
                self._refuse(conn, sid, serve, ErrorCode.NO_HANDLER)
            elif sid & 2:  # unidirectional streams carry nothing in our protocol
                self._refuse(conn, sid, serve, ErrorCode.PROTOCOL_VIOLATION)
        if not serve.refused:
            serve.data += event.data
            if len(serve.data) > self.max_message:
                log.warning("quic.request_too_large", peer=str(conn.peer), limit=self.max_message)
                self._refuse(conn, sid, serve, ErrorCode.MESSAGE_TOO_LARGE)
        if event.end_stream:
            if serve.refused:
                del conn.serves[sid]
            else:
                request, serve.data = bytes(serve.data), bytearray()
                serve.task = self._spawn(self._serve(conn, sid, request))

    def _refuse(self, conn: _Conn, sid: int, serve: _Serve, code: ErrorCode) -> None:
        serve.refused = True
        serve.data = bytearray()
        self._abort(conn, sid, code)

    def _abort(self, conn: _Conn, sid: int, code: ErrorCode) -> None:
        """Stop both directions of a stream; a stream aioquic already discarded needs nothing."""
        with contextlib.suppress(ValueError):
            conn.quic.stop_stream(sid, code)
        if not sid & 2:
            with contextlib.suppress(ValueError):
                conn.quic.reset_stream(sid, code)

    def _on_stream_reset(self, conn: _Conn, sid: int, code: int) -> None:
        if conn.is_local(sid):
            call = conn.calls.pop(sid, None)
            if call is not None:
                error: TransportError = (
                    MessageTooLarge(f"{conn.peer} refused the request: it exceeds the peer's max_message")
                    if code == ErrorCode.MESSAGE_TOO_LARGE
                    else RemoteError(conn.peer, code)
                )
                _settle(call.future, error=error)
        else:
            serve = conn.serves.pop(sid, None)
            if serve is not None and serve.task is not None:
                serve.task.cancel()

    async def _serve(self, conn: _Conn, sid: int, request: bytes) -> None:
        assert self._handler is not None and conn.peer is not None
        code: ErrorCode | None = None
        try:
            reply = await self._handler(conn.peer, request)
            if not isinstance(reply, (bytes, bytearray, memoryview)):
                raise TypeError(f"handler returned {type(reply).__name__}, not bytes")
        except Exception:  # the caller gets HANDLER_FAILED; the log keeps the traceback
            log.exception("quic.handler_failed", peer=str(conn.peer), stream=sid)
            code = ErrorCode.HANDLER_FAILED
        else:
            if len(reply) > self.max_message:
                log.warning("quic.reply_too_large", peer=str(conn.peer), size=len(reply), limit=self.max_message)
                code = ErrorCode.MESSAGE_TOO_LARGE
        if conn.serves.pop(sid, None) is None or conn.failure is not None:
            return  # the caller cancelled, or the connection closed meanwhile
        if code is None:
            conn.quic.send_stream_data(sid, reply, end_stream=True)
        else:
            conn.quic.reset_stream(sid, code)
        self._pump(conn)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = self._loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task
