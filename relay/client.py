"""The relay client, and the glue that lets a QUIC ``Endpoint`` reach peers through it.

``RelayClient`` keeps one outbound WebSocket to a relay: it authenticates with the node's identity, hands every
``RecvPacket`` to ``on_packet(src, data)``, and reconnects with exponential backoff and jitter whenever the relay
goes away (the backoff starts over after every connection the relay accepted: a restart of the relay or of a proxy
in front of it costs one short wait, however many attempts the previous outage took). ``send`` never blocks:
packets wait in a bounded buffer (the newest is dropped when it is full) and go out once the relay has accepted
us, so a QUIC connection rides out a relay restart on retransmissions.

``wss://`` URLs verify the relay's certificate against the system trust store, plus the private CA of
``RelaySettings.ca_file`` when one is given (a relay with its own certificate, or behind a TLS-terminating proxy
with one). ``RelaySettings`` is what the worker and backbone commands configure (``--relay-ca``,
``--relay-keepalive``); ``RelaySettings.client`` builds each link with them.

``RelayPath`` gives each remote peer a stable virtual address, ``("relay:<peer id>", 0)``, and routes the endpoint's
datagrams for it through the client; datagrams from the relay are fed back with ``datagram_received`` under that
same address (an aioquic client drops packets from any other address than the one it dialled). So
``endpoint.request(path.address(peer), peer, payload)`` over the relay is the very same authenticated, encrypted
QUIC exchange as a direct one, and an endpoint answers relayed clients without knowing it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import random
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import structlog
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidURI
from websockets.typing import Subprotocol

from experts.errors import MoeSwarmError, TrustError
from p2p import backoff
from p2p.identity import Identity, PeerId
from p2p.pathkind import RELAY_HOST_PREFIX

from .protocol import MAX_FRAME, SUBPROTOCOL, SendPacket
from .session import (
    Authenticated,
    ClientSession,
    Closed,
    Event,
    Notice,
    PacketReceived,
    PeerDeparted,
    Send,
    SessionLimits,
    State,
)

Address = tuple[str, int]  # p2p.quic.endpoint's address type
PacketHandler = Callable[[PeerId, bytes], None]

log = structlog.get_logger("relay.client")


class RelayUnavailable(MoeSwarmError, TimeoutError):
    """The relay did not accept us within the caller's timeout."""


@dataclass(frozen=True)
class Backoff(backoff.Backoff):
    """Delays between reconnection attempts: ``first * factor**n`` capped at ``cap``, each scaled by a random
    factor in [0.5, 1] so that clients cut off together do not come back together."""

    first: float = 0.1
    cap: float = 10.0
    jitter: float = 0.5
    stable_after: float = 5.0  # a connection that lasted this long resets the delay to ``first``


DEFAULT_KEEPALIVE = SessionLimits().ping_interval


def client_tls(ca_file: Path | None = None) -> ssl.SSLContext:
    """The TLS context for ``wss://`` relays: the system trust store, plus ``ca_file`` (PEM) if given."""
    context = ssl.create_default_context()
    if ca_file is not None:
        try:
            context.load_verify_locations(cafile=str(ca_file))
        except (OSError, ssl.SSLError) as exc:
            raise TrustError(f"cannot use {ca_file} as a relay CA (a PEM certificate file is needed): {exc}") from None
    return context


@dataclass(frozen=True)
class RelaySettings:
    """How a node links to relays: whom to trust for ``wss://`` and how often to prove the link alive.

    ``keepalive``: seconds of silence before the client pings the relay; keep it below the idle timeout of any
    proxy or load balancer in front of the relay (nginx's ``proxy_read_timeout`` is 60 s, some CDNs close idle
    WebSockets after 10-30 s). The relay must answer within ``SessionLimits.ping_timeout`` of a ping.
    """

    ca_file: Path | None = None
    keepalive: float = DEFAULT_KEEPALIVE

    def tls(self) -> ssl.SSLContext:
        """The context for a ``wss://`` link with these settings (a new one per call: CA files are small)."""
        return client_tls(self.ca_file)

    def client(self, identity: Identity, url: str, *, expected_relay: PeerId | None = None, backoff: Backoff = Backoff()) -> RelayClient:
        """A ``RelayClient`` for ``url`` with these settings."""
        tls = self.tls() if url.startswith("wss://") else None
        limits = SessionLimits(ping_interval=self.keepalive)
        return RelayClient(identity, url, expected_relay=expected_relay, tls=tls, backoff=backoff, limits=limits)


class RelayClient:
    """One node's link to one relay (``ws://`` or ``wss://`` URL ending in ``/relay``)."""

    def __init__(
        self,
        identity: Identity,
        url: str,
        *,
        on_packet: PacketHandler | None = None,
        on_peer_gone: Callable[[PeerId], None] | None = None,
        on_connected: Callable[[], None] | None = None,
        expected_relay: PeerId | None = None,
        tls: ssl.SSLContext | None = None,
        buffer_packets: int = 512,
        buffer_bytes: int = 2 << 20,
        backoff: Backoff = Backoff(),
        limits: SessionLimits = SessionLimits(),
    ) -> None:
        """``expected_relay`` pins the relay's key; ``tls`` overrides the system trust store for ``wss://``."""
        self.identity = identity
        self.peer_id = identity.peer_id
        self.url = url
        self.on_packet = on_packet
        self.on_peer_gone = on_peer_gone
        self.on_connected = on_connected  # after every accepted connection, reconnections included
        self.expected_relay = expected_relay
        self.relay_peer: PeerId | None = None
        self.sent = 0
        self.received = 0
        self.dropped = 0  # packets refused by a full buffer
        self._tls = tls if tls is not None or not url.startswith("wss://") else client_tls()
        self._buffer_packets = buffer_packets
        self._buffer_bytes = buffer_bytes
        self._backoff = backoff
        self._limits = limits
        self._rng = random.Random()
        self._packets: collections.deque[bytes] = collections.deque()
        self._packet_bytes = 0
        self._control: collections.deque[bytes] = collections.deque()
        self._close_reason = ""
        self._closing = False
        self._wakeup = asyncio.Event()
        self._rearm = asyncio.Event()  # a received frame moved the session's timer sooner
        self._connected = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def connected(self) -> bool:
        """True while the relay has accepted us."""
        return self._connected.is_set()

    def start(self) -> None:
        """Begin connecting (and reconnecting) in the background; call from the event loop."""
        if self._task is None:
            self._closing = False
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def close(self) -> None:
        """Disconnect and stop reconnecting; buffered packets are discarded."""
        self._closing = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def __aenter__(self) -> RelayClient:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def wait_connected(self, timeout: float) -> None:
        """Return once the relay has accepted us; ``RelayUnavailable`` after ``timeout`` seconds."""
        try:
            async with asyncio.timeout(timeout):
                await self._connected.wait()
        except TimeoutError:
            raise RelayUnavailable(f"relay {self.url} did not accept us within {timeout} s") from None

    def send(self, dst: PeerId, data: bytes) -> bool:
        """Queue ``data`` for ``dst``; False if the buffer is full and it was dropped. Never blocks."""
        frame = SendPacket(dst, data).encode()  # LocalProtocolError above MAX_PACKET: a caller's bug
        if len(self._packets) >= self._buffer_packets or self._packet_bytes + len(frame) > self._buffer_bytes:
            self.dropped += 1
            return False
        self._packets.append(frame)
        self._packet_bytes += len(frame)
        self._wakeup.set()
        return True

    # --- connection loop ----------------------------------------------------------------------------------------

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        attempt = 0
        while True:
            started = loop.time()
            accepted = False
            try:
                accepted = await self._connect_once()
            except (OSError, InvalidHandshake, InvalidURI, TimeoutError, ConnectionClosed) as exc:
                log.info("relay.connect_failed", url=self.url, error=f"{type(exc).__name__}: {exc}")
            except Exception:  # a bug must not end reconnection silently: log it loudly and keep trying
                log.exception("relay.client_failed", url=self.url)
            if accepted or self._backoff.lasted(loop.time() - started):  # see _connect_once
                attempt = 0
            delay = self._backoff.delay(attempt, self._rng)
            attempt += 1
            await asyncio.sleep(delay)

    async def _connect_once(self) -> bool:
        """One connection, from the handshake until it ends. True if the relay accepted us and the link then just
        ended (a relay or proxy restart, a network drop): reconnecting starts over from the first backoff delay.
        A session closed by a frame (the relay's Error, e.g. "replaced by a newer connection", or our keepalive
        timeout) keeps counting, so two processes sharing one key do not take turns at full speed."""
        loop = asyncio.get_running_loop()
        async with connect(
            self.url,
            subprotocols=[Subprotocol(SUBPROTOCOL)],
            ssl=self._tls,
            compression=None,
            max_size=MAX_FRAME,
            ping_interval=None,
            open_timeout=self._limits.auth_timeout,
            close_timeout=2.0,
        ) as ws:
            session = ClientSession(self.identity, loop.time(), self._limits, expected_relay=self.expected_relay)
            self._control.clear()
            self._close_reason = ""  # set by the session's Closed event
            tasks = [loop.create_task(self._write(ws, session)), loop.create_task(self._keep_alive(ws, session))]
            lost: ConnectionClosed | None = None
            try:
                async for message in ws:
                    armed = session.get_timer()
                    self._on_events(session.receive(message, loop.time()))
                    if (timer := session.get_timer()) is not None and armed is not None and timer < armed:
                        self._rearm.set()  # sooner than the keepalive task sleeps: wake it (a later one it finds itself)
                    if session.state is State.CLOSED:
                        break
            except ConnectionClosed as exc:  # the TCP/TLS stream ended without a close handshake (e.g. a proxy died)
                lost = exc
            finally:
                was_connected = self.connected
                accepted = was_connected and not self._close_reason
                self._connected.clear()
                session.connection_lost()
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                reason = self._end_reason(ws, lost)
                if was_connected:
                    log.info("relay.disconnected", url=self.url, reason=reason, peer=str(self.peer_id))
                elif self._close_reason:
                    log.warning("relay.refused", url=self.url, reason=reason)
                elif lost is not None:
                    log.info("relay.connect_failed", url=self.url, error=reason)
        return accepted

    def _end_reason(self, ws: ClientConnection, lost: ConnectionClosed | None) -> str:
        """Who ended a connection, as far as this side can tell: us, the relay's session (with its reason), the
        relay's WebSocket close, or neither (the stream broke: the network, or a proxy in between went away)."""
        if self._closing:
            return "client closing"
        if self._close_reason:
            return self._close_reason
        received = ws.protocol.close_rcvd
        if received is not None:
            return f"closed by the relay (code {received.code}{': ' + received.reason if received.reason else ''})"
        cause = f": {lost.__cause__!r}" if lost is not None and lost.__cause__ is not None else ""
        return f"connection lost without a close from the relay{cause}"

    def _on_events(self, events: list[Event]) -> None:
        for event in events:
            self._on_event(event)

    def _on_event(self, event: Event) -> None:
        if isinstance(event, Closed):
            self._close_reason = event.reason
        elif isinstance(event, PacketReceived):
            self.received += 1
            if self.on_packet is not None:
                try:
                    self.on_packet(event.src, event.data)
                except Exception:  # a consumer's bug must not cut the relay link; the log keeps the traceback
                    log.exception("relay.on_packet_failed", src=str(event.src))
        elif isinstance(event, Send):
            self._control.append(event.frame.encode())
            self._wakeup.set()
        elif isinstance(event, Authenticated):
            self.relay_peer = event.peer
            self._connected.set()
            self._wakeup.set()
            log.info("relay.connected", url=self.url, relay=str(event.peer), peer=str(self.peer_id))
            if self.on_connected is not None:
                try:
                    self.on_connected()
                except Exception:  # as for on_packet: a consumer's bug must not cut the link
                    log.exception("relay.on_connected_failed", url=self.url)
        elif isinstance(event, PeerDeparted):
            if self.on_peer_gone is not None:
                self.on_peer_gone(event.peer)
        elif isinstance(event, Notice):
            log.warning("relay.health", url=self.url, text=event.text)

    async def _write(self, ws: ClientConnection, session: ClientSession) -> None:
        """Send control frames as they come and buffered packets once authenticated, in order."""
        while True:
            if self._control:
                await ws.send(self._control.popleft())
            elif self._packets and session.state is State.AUTHENTICATED:
                frame = self._packets.popleft()
                self._packet_bytes -= len(frame)
                await ws.send(frame)
                self.sent += 1
            else:
                self._wakeup.clear()
                await self._wakeup.wait()

    async def _keep_alive(self, ws: ClientConnection, session: ClientSession) -> None:
        """Run the session's one timer, re-armed whenever a received frame moved it: authentication replaces the
        auth deadline by the keepalive, which may be sooner (a keepalive shorter than ``auth_timeout``)."""
        loop = asyncio.get_running_loop()
        while (timer := session.get_timer()) is not None:
            self._rearm.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._rearm.wait(), max(0.0, timer - loop.time()))
            self._on_events(session.handle_timer(loop.time()))
        await ws.close(1000, self._close_reason[:120])  # the session closed: a silent relay, or no auth in time


class _Endpoint(Protocol):
    """What ``RelayPath`` needs of ``p2p.quic.endpoint.Endpoint`` (structural, so relay/ does not import aioquic)."""

    def add_route(self, addr: Address, send: Callable[[bytes], None]) -> None: ...

    def remove_route(self, addr: Address) -> None: ...

    def datagram_received(self, data: bytes, addr: Address) -> None: ...


class RelayPath:
    """Routes an ``Endpoint``'s QUIC datagrams for relayed peers through a ``RelayClient``.

    One virtual address per remote peer, kept while it is in use; at most ``max_peers`` are kept, and the least
    recently used one is forgotten first (a peer that still talks gets a fresh route on its next packet, with the
    same address).
    """

    def __init__(self, endpoint: _Endpoint, client: RelayClient, *, max_peers: int = 4096) -> None:
        if client.on_packet is not None:
            raise ValueError("this RelayClient already delivers its packets elsewhere; use one RelayPath per client")
        self.endpoint = endpoint
        self.client = client
        self.max_peers = max_peers
        self._routes: collections.OrderedDict[PeerId, Address] = collections.OrderedDict()
        client.on_packet = self.packet_received

    def address(self, peer: PeerId) -> Address:
        """The stable virtual address under which ``endpoint`` reaches ``peer`` through the relay."""
        vaddr = self._routes.get(peer)
        if vaddr is not None:
            self._routes.move_to_end(peer)
            return vaddr
        vaddr = virtual_address(peer)
        self.endpoint.add_route(vaddr, lambda data: self._send(peer, data))
        self._routes[peer] = vaddr
        while len(self._routes) > self.max_peers:
            _, old = self._routes.popitem(last=False)
            self.endpoint.remove_route(old)
        return vaddr

    def packet_received(self, src: PeerId, data: bytes) -> None:
        self.endpoint.datagram_received(data, self.address(src))

    def detach(self) -> None:
        """Remove every route and stop taking the client's packets."""
        for vaddr in self._routes.values():
            self.endpoint.remove_route(vaddr)
        self._routes.clear()
        self.client.on_packet = None

    def _send(self, peer: PeerId, data: bytes) -> None:
        if peer in self._routes:
            self._routes.move_to_end(peer)
        self.client.send(peer, data)


def virtual_address(peer: PeerId) -> Address:
    """A relayed peer's address: not an IP, so an endpoint never sends it to its UDP socket."""
    return (f"{RELAY_HOST_PREFIX}{peer}", 0)


def attach(endpoint: _Endpoint, client: RelayClient) -> RelayPath:
    """Route ``endpoint``'s traffic for relayed peers through ``client``; see ``RelayPath``."""
    return RelayPath(endpoint, client)
