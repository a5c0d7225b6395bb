"""The relay client, and the glue that lets a QUIC ``Endpoint`` reach peers through it.

``RelayClient`` keeps one outbound WebSocket to a relay: it authenticates with the node's identity, hands every
``RecvPacket`` to ``on_packet(src, data)``, and reconnects with exponential backoff and jitter whenever the relay
goes away. ``send`` never blocks: packets wait in a bounded buffer (the newest is dropped when it is full) and go
out once the relay has accepted us, so a QUIC connection rides out a relay restart on retransmissions.

``RelayPath`` gives each remote peer a stable virtual address, ``("relay:<peer id>", 0)``, and routes the endpoint's
datagrams for it through the client; datagrams from the relay are fed back with ``datagram_received`` under that
same address (an aioquic client drops packets from any other address than the one it dialled). So
``endpoint.request(path.address(peer), peer, payload)`` over the relay is the very same authenticated, encrypted
QUIC exchange as a direct one, and an endpoint answers relayed clients without knowing it.
"""

from __future__ import annotations

import asyncio
import collections
import random
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import structlog
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidURI
from websockets.typing import Subprotocol

from experts.errors import MoeSwarmError
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

Address = tuple[str, int]  # p2p.quic's address type
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


class RelayClient:
    """One node's link to one relay (``ws://`` or ``wss://`` URL ending in ``/relay``)."""

    def __init__(
        self,
        identity: Identity,
        url: str,
        *,
        on_packet: PacketHandler | None = None,
        on_peer_gone: Callable[[PeerId], None] | None = None,
        expected_relay: PeerId | None = None,
        tls: ssl.SSLContext | None = None,
        buffer_packets: int = 512,
        buffer_bytes: int = 2 << 20,
        backoff: Backoff = Backoff(),
        limits: SessionLimits = SessionLimits(),
    ) -> None:
        """``expected_relay`` pins the relay's key; ``tls`` overrides the default CA check for ``wss://``."""
        self.identity = identity
        self.peer_id = identity.peer_id
        self.url = url
        self.on_packet = on_packet
        self.on_peer_gone = on_peer_gone
        self.expected_relay = expected_relay
        self.relay_peer: PeerId | None = None
        self.sent = 0
        self.received = 0
        self.dropped = 0  # packets refused by a full buffer
        self._tls = tls
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
            try:
                await self._connect_once()
            except (OSError, InvalidHandshake, InvalidURI, TimeoutError, ConnectionClosed) as exc:
                log.info("relay.connect_failed", url=self.url, error=f"{type(exc).__name__}: {exc}")
            except Exception:  # a bug must not end reconnection silently: log it loudly and keep trying
                log.exception("relay.client_failed", url=self.url)
            if self._backoff.lasted(loop.time() - started):
                attempt = 0
            delay = self._backoff.delay(attempt, self._rng)
            attempt += 1
            await asyncio.sleep(delay)

    async def _connect_once(self) -> None:
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
            try:
                async for message in ws:
                    self._on_events(session.receive(message, loop.time()))
                    if session.state is State.CLOSED:
                        break
            finally:
                was_connected = self.connected
                self._connected.clear()
                session.connection_lost()
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                if self._closing:
                    reason = "client closing"
                else:
                    reason = self._close_reason or ws.close_reason or "connection closed by the relay"
                if was_connected:
                    log.info("relay.disconnected", url=self.url, reason=reason)
                elif self._close_reason:
                    log.warning("relay.refused", url=self.url, reason=reason)

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
        loop = asyncio.get_running_loop()
        while (timer := session.get_timer()) is not None:
            await asyncio.sleep(max(0.0, timer - loop.time()))
            self._on_events(session.handle_timer(loop.time()))
        await ws.close(1000, self._close_reason[:120])  # the session closed: a silent relay, or no auth in time


class _Endpoint(Protocol):
    """What ``RelayPath`` needs of ``p2p.quic.Endpoint`` (structural, so relay/ does not import aioquic)."""

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
