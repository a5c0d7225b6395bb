"""The relay server: WebSocket over HTTP(S), so it can sit behind a CDN or a reverse proxy.

``GET /healthz`` answers ``200 ok``; ``/relay`` is the WebSocket endpoint (subprotocol ``moeswarm-relay.v1``); any
other path is 404. Each connection runs a ``relay.session.ServerSession``: the client proves its peer id by signing
the challenge, and from then on its ``SendPacket`` frames reach the named peer as ``RecvPacket`` with the source the
relay verified. A second connection for the same peer id replaces the first.

Connections are bounded whatever clients do (``relay.admission``): at most ``max_clients`` in all and ``max_per_ip``
from one remote IP; a connection that has not authenticated within the session's ``auth_timeout`` is closed (and a
TCP connection that sends no WebSocket handshake within it too); when a newcomer would exceed a cap, the oldest
unauthenticated connection in that scope is closed to make room, and only a scope full of authenticated peers
answers HTTP 503. Behind a reverse proxy every client has the proxy's IP: raise ``max_per_ip`` (or 0: no cap).

Memory is bounded whatever clients do: an incoming message
is at most ``MAX_FRAME`` bytes (websockets rejects a larger length before reading it) and at most ``max_queue``
are buffered per connection; each client's outgoing queue holds at most ``queue_packets`` frames and
``queue_bytes`` bytes, and all queues together at most ``total_queue_bytes``; a packet that does not fit is dropped
(the newest goes, the queue is not reordered) and counted. A receiver that does not read therefore costs the relay
one full queue plus the socket buffers, and its senders lose packets, which QUIC retransmits or gives up on.
Peers that sent to a departed peer get ``PeerGone`` (up to ``max_senders`` remembered per peer).
"""

from __future__ import annotations

import asyncio
import collections
import os
import ssl
from collections.abc import Iterable
from dataclasses import dataclass, field
from http import HTTPStatus

import structlog
from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response
from websockets.typing import Subprotocol

from experts.errors import UsageError
from p2p.identity import Identity, PeerId
from p2p.lograte_edge import ThrottledLog

from .admission import Admission
from .protocol import MAX_FRAME, NONCE_SIZE, SUBPROTOCOL, PeerGone, Pong, RecvPacket
from .session import (
    Authenticated,
    Closed,
    Dropped,
    Event,
    Forward,
    Send,
    ServerSession,
    SessionLimits,
    State,
)

RELAY_PATH = "/relay"
HEALTH_PATH = "/healthz"
_DROP_LOG_INTERVAL = 1.0  # seconds between relay.dropped events per client (the count says how many)

log = structlog.get_logger("relay.server")


@dataclass(frozen=True)
class RelayLimits:
    """Caps that bound the relay's memory; see the module docstring for what each one guards."""

    max_clients: int = 1024
    max_per_ip: int = 64  # connections from one remote IP; 0: no cap (behind a proxy every client shares its IP)
    queue_packets: int = 256
    queue_bytes: int = 1 << 20
    total_queue_bytes: int = 256 << 20
    max_queue: int = 16  # incoming messages buffered per connection by websockets
    max_senders: int = 1024
    close_timeout: float = 2.0
    session: SessionLimits = field(default_factory=SessionLimits)


@dataclass
class RelayStats:
    """Counters since the relay started."""

    forwarded: int = 0
    dropped: collections.Counter[str] = field(default_factory=collections.Counter)
    refused: int = 0


@dataclass(eq=False)
class _Client:
    """One WebSocket connection and what the relay keeps for it."""

    ws: ServerConnection
    session: ServerSession
    peer: PeerId | None = None
    queue: collections.deque[bytes] = field(default_factory=collections.deque)
    queued_bytes: int = 0
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)
    senders: set[PeerId] = field(default_factory=set)  # peers that sent to this one: told when it leaves
    close_reason: str = ""
    closed_by_relay: bool = False
    protocol_error: bool = False
    dropped: int = 0
    drops_logged: int = 0
    drop_logged_at: float = float("-inf")
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    shutdown: asyncio.Task[None] | None = None


class RelayServer:
    """Forwards packets between authenticated peers; ``start`` it, ``close`` it."""

    def __init__(self, identity: Identity, limits: RelayLimits | None = None) -> None:
        self.identity = identity
        self.peer_id = identity.peer_id
        self.limits = limits or RelayLimits()
        self.stats = RelayStats()
        self.address: tuple[str, int] = ("", 0)
        self.url = ""
        self._clients: dict[PeerId, _Client] = {}  # authenticated, by peer id
        self._conns: set[_Client] = set()  # every open connection
        self._queued_total = 0
        self._admission = Admission(self.limits.max_clients, self.limits.max_per_ip)
        self._server: Server | None = None
        self._peer_log = ThrottledLog(log)  # what unauthenticated peers trigger: a few lines, then a count

    async def start(self, host: str, port: int, *, tls: ssl.SSLContext | None = None) -> None:
        """Listen on (host, port); port 0 picks a free port (see ``address`` and ``url``)."""
        self._server = await serve(
            self._handle,
            host,
            port,
            ssl=tls,
            subprotocols=[Subprotocol(SUBPROTOCOL)],  # a client that offers no subprotocol gets HTTP 400
            process_request=self._process_request,
            compression=None,  # QUIC packets are encrypted: nothing to compress, and deflate costs memory
            max_size=MAX_FRAME,
            max_queue=self.limits.max_queue,
            ping_interval=None,  # the session's own Ping frames keep connections alive (through proxies too)
            open_timeout=self.limits.session.auth_timeout,  # a TCP connection that never sends its handshake
            close_timeout=self.limits.close_timeout,
        )
        sockname = next(iter(self._server.sockets)).getsockname()
        self.address = (sockname[0], sockname[1])
        scheme = "wss" if tls is not None else "ws"
        self.url = f"{scheme}://{_host_for_url(sockname[0])}:{sockname[1]}{RELAY_PATH}"
        log.info("relay.listening", url=self.url, relay=str(self.peer_id))

    async def close(self) -> None:
        """Stop accepting and close every connection, then write the pending log summaries."""
        if self._server is not None:
            server, self._server = self._server, None
            server.close()
            await server.wait_closed()
        self._peer_log.close()

    def clients(self) -> list[PeerId]:
        """The authenticated peers now connected."""
        return list(self._clients)

    def queued(self, peer: PeerId) -> tuple[int, int]:
        """(frames, bytes) waiting to be written to ``peer``."""
        client = self._clients.get(peer)
        return (len(client.queue), client.queued_bytes) if client else (0, 0)

    # --- HTTP ---------------------------------------------------------------------------------------------------

    def _process_request(self, ws: ServerConnection, request: Request) -> Response | None:
        if request.path == HEALTH_PATH:
            return ws.respond(HTTPStatus.OK, "ok\n")
        if request.path != RELAY_PATH:
            return ws.respond(HTTPStatus.NOT_FOUND, "not found\n")
        verdict = self._admission.check(_ip(ws))
        if not verdict.admit:
            self._refused(ws, verdict.reason)
            return ws.respond(HTTPStatus.SERVICE_UNAVAILABLE, f"{verdict.reason}\n")
        return None

    def _refused(self, ws: ServerConnection, reason: str) -> None:
        self.stats.refused += 1
        self._peer_log.warning("relay.refused", remote=_remote(ws), reason=reason)

    # --- one connection -----------------------------------------------------------------------------------------

    async def _handle(self, ws: ServerConnection) -> None:
        loop = asyncio.get_running_loop()
        session = ServerSession(self.peer_id, os.urandom(NONCE_SIZE), loop.time(), self.limits.session)
        client = _Client(ws, session)
        verdict = self._admission.open(client, _ip(ws))  # again: handshakes may have raced past _process_request
        if not verdict.admit:
            self._refused(ws, verdict.reason)
            await ws.close(1013, verdict.reason[:120])  # 1013: try again later
            return
        for victim in verdict.evict:
            assert isinstance(victim, _Client)
            self._peer_log.info("relay.evicted", remote=_remote(victim.ws), reason="unauthenticated, room needed for a newcomer")
            self._apply(victim, victim.session.close("evicted: not authenticated, and the relay needed the room"))
        self._conns.add(client)
        client.tasks = [loop.create_task(self._write(client)), loop.create_task(self._keep_alive(client))]
        try:
            self._apply(client, session.start())
            async for message in ws:
                self._apply(client, session.receive(message, loop.time()))
                if session.state is State.CLOSED:
                    break
        except ConnectionClosed:
            pass
        finally:
            if session.state is not State.CLOSED:
                session.connection_lost()
                client.close_reason = ws.close_reason or "connection closed by the client"
            await self._shutdown_task(client)
            self._leave(client)

    def _apply(self, client: _Client, events: Iterable[Event]) -> None:
        """Carry out a session's events."""
        for event in events:
            if isinstance(event, Forward):
                self._forward(client, event.dst, event.data)
            elif isinstance(event, Send):
                self._enqueue(client, event.frame.encode(), essential=not isinstance(event.frame, Pong))
            elif isinstance(event, Dropped):
                self._drop(client, event.dst, event.reason)
            elif isinstance(event, Authenticated):
                self._admission.authenticated(client)
                self._register(client, event.peer)
            elif isinstance(event, Closed):
                client.closed_by_relay = True
                client.close_reason = event.reason
                client.protocol_error = event.error is not None
                self._shutdown_task(client)

    def _register(self, client: _Client, peer: PeerId) -> None:
        client.peer = peer
        old = self._clients.get(peer)
        if old is not None:
            client.senders = old.senders
            old.senders = set()
            self._apply(old, old.session.close("replaced by a newer connection for the same peer id"))
        self._clients[peer] = client
        log.info("relay.client_connected", peer=str(peer), remote=_remote(client.ws), replaced=old is not None)

    def _leave(self, client: _Client) -> None:
        self._conns.discard(client)
        self._admission.close(client)
        self._queued_total -= client.queued_bytes
        client.queue.clear()
        client.queued_bytes = 0
        if client.peer is None:
            if client.closed_by_relay:  # a bad signature, a violation or a timeout before authentication
                self._peer_log.warning("relay.refused", remote=_remote(client.ws), reason=client.close_reason)
                self.stats.refused += 1
            return
        if self._clients.get(client.peer) is client:
            del self._clients[client.peer]
            gone = PeerGone(client.peer).encode()
            for sender in client.senders:
                other = self._clients.get(sender)
                if other is not None:
                    self._enqueue(other, gone)
        log.info(
            "relay.client_gone",
            peer=str(client.peer),
            reason=client.close_reason,
            protocol_error=client.protocol_error,
            dropped=client.dropped,
        )

    # --- packets ------------------------------------------------------------------------------------------------

    def _forward(self, source: _Client, dst: PeerId, data: bytes) -> None:
        assert source.peer is not None  # the session forwards only once authenticated
        target = self._clients.get(dst)
        if target is None:
            self._drop(source, dst, "no_such_peer")
            self._enqueue(source, PeerGone(dst).encode())
            return
        if len(target.senders) < self.limits.max_senders:
            target.senders.add(source.peer)
        if self._enqueue(target, RecvPacket(source.peer, data).encode()):
            self.stats.forwarded += 1
        else:
            self._drop(target, source.peer, "queue_full")

    def _enqueue(self, client: _Client, frame: bytes, *, essential: bool = False) -> bool:
        """Queue ``frame`` for ``client``; a non-essential frame that would overflow a cap is refused.

        Essential frames (challenge, auth result, our Ping, Health, Error) are few per connection by construction.
        """
        size = len(frame)
        limits = self.limits
        if client not in self._conns or (client.session.state is State.CLOSED and not essential):
            return False
        if not essential and (
            len(client.queue) >= limits.queue_packets
            or client.queued_bytes + size > limits.queue_bytes
            or self._queued_total + size > limits.total_queue_bytes
        ):
            return False
        client.queue.append(frame)
        client.queued_bytes += size
        self._queued_total += size
        client.wakeup.set()
        return True

    def _drop(self, client: _Client, peer: PeerId, reason: str) -> None:
        """Count a dropped packet (``peer``: its destination, or its source when the receiver's queue is full)."""
        self.stats.dropped[reason] += 1
        client.dropped += 1
        now = asyncio.get_running_loop().time()
        if now - client.drop_logged_at >= _DROP_LOG_INTERVAL:
            log.warning(
                "relay.dropped",
                peer=client.peer and str(client.peer),
                other=str(peer),
                reason=reason,
                count=client.dropped - client.drops_logged,
            )
            client.drop_logged_at, client.drops_logged = now, client.dropped

    async def _write(self, client: _Client) -> None:
        """Drain the client's queue onto its WebSocket, one frame per message, until the session closes."""
        while True:
            while client.queue:
                frame = client.queue.popleft()
                client.queued_bytes -= len(frame)
                self._queued_total -= len(frame)
                await client.ws.send(frame)
            if client.session.state is State.CLOSED:
                return
            client.wakeup.clear()
            await client.wakeup.wait()

    async def _keep_alive(self, client: _Client) -> None:
        loop = asyncio.get_running_loop()
        while (timer := client.session.get_timer()) is not None:
            await asyncio.sleep(max(0.0, timer - loop.time()))
            self._apply(client, client.session.handle_timer(loop.time()))

    def _shutdown_task(self, client: _Client) -> asyncio.Task[None]:
        if client.shutdown is None:
            client.shutdown = asyncio.get_running_loop().create_task(self._shutdown(client))
        return client.shutdown

    async def _shutdown(self, client: _Client) -> None:
        """Flush what is queued (the Error frame last) for up to ``close_timeout``, then close the WebSocket."""
        writer, keep_alive = client.tasks
        keep_alive.cancel()
        client.wakeup.set()
        try:
            async with asyncio.timeout(self.limits.close_timeout):
                await writer
        except (TimeoutError, ConnectionClosed):
            pass
        finally:
            writer.cancel()
        code = 1008 if client.protocol_error else 1000  # 1008: policy violation
        await client.ws.close(code, client.close_reason.encode()[:120].decode("utf-8", "ignore"))


def tls_context(cert: str | None, key: str | None) -> ssl.SSLContext | None:
    """A server TLS context from PEM files, or None for plain ws://; both files or neither."""
    if cert is None and key is None:
        return None
    if cert is None or key is None:
        raise UsageError("TLS needs both --tls-cert and --tls-key; give both, or neither for plain ws://")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    return context


async def run_relay(
    identity: Identity,
    host: str,
    port: int,
    *,
    tls_cert: str | None = None,
    tls_key: str | None = None,
    ready: asyncio.Future[RelayServer] | None = None,
    limits: RelayLimits | None = None,
) -> None:
    """Serve a relay until cancelled; ``ready`` gets the started ``RelayServer`` (its ``url``, ``address``)."""
    server = RelayServer(identity, limits)
    await server.start(host, port, tls=tls_context(tls_cert, tls_key))
    try:
        if ready is not None and not ready.done():
            ready.set_result(server)
        await asyncio.Event().wait()
    finally:
        await server.close()


def _remote(ws: ServerConnection) -> str:
    addr = ws.remote_address
    return f"{addr[0]}:{addr[1]}" if addr else "?"


def _ip(ws: ServerConnection) -> str:
    addr = ws.remote_address
    return str(addr[0]) if addr else "?"


def _host_for_url(host: str) -> str:
    return f"[{host}]" if ":" in host else host
