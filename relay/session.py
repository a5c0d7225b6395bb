"""Per-connection relay state machines: sans-IO, with an injected clock.

Theory of operation. A WebSocket connection to the relay is in one of three states::

    AWAITING_AUTH --(ClientAuth verified / ServerAuthOk)--> AUTHENTICATED
    AWAITING_AUTH --(refusal, violation, timeout)---------> CLOSED
    AUTHENTICATED --(violation, keepalive timeout, close)-> CLOSED

``TRANSITIONS`` lists those edges and nothing else; ``RECEIVES`` lists, per role and state, which frame types may
arrive. ``Unknown`` frames are ignored everywhere (forward compatibility); any other frame not in the table, and any
message that does not decode, is a protocol violation: the session answers ``Error(reason)`` and closes.

The edge (``relay.server`` / ``relay.client``) feeds each received message to ``receive(message, now)``, arms one
timer at ``get_timer()`` and calls ``handle_timer(now)`` when it fires, and carries out the returned events in order:
``Send(frame)`` to the other side, ``Forward`` a packet to another client, ``Closed`` the connection, and so on.
Keepalive: every received frame proves the other side alive; after ``ping_interval`` of silence a ``Ping`` goes out,
and if nothing at all arrives within ``ping_timeout`` after it the session closes. The relay meters each client's
``SendPacket`` and ``Ping`` frames with two token buckets (bytes and packets per second); over-rate packets are
dropped, not queued, and the client hears about it by a ``Health`` notice at most once per ``ping_interval``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from p2p.identity import Identity, PeerId
from p2p.ratelimit import TokenBucket

from .protocol import (
    MAX_TEXT,
    ClientAuth,
    Error,
    Frame,
    FrameError,
    FrameType,
    Health,
    LocalProtocolError,
    PeerGone,
    Ping,
    Pong,
    RecvPacket,
    Refused,
    RelayError,
    RemoteProtocolError,
    SendPacket,
    ServerAuthOk,
    ServerChallenge,
    Unknown,
    decode,
)


class State(Enum):
    AWAITING_AUTH = "awaiting_auth"
    AUTHENTICATED = "authenticated"
    CLOSED = "closed"


TRANSITIONS: frozenset[tuple[State, State]] = frozenset(
    {
        (State.AWAITING_AUTH, State.AUTHENTICATED),
        (State.AWAITING_AUTH, State.CLOSED),
        (State.AUTHENTICATED, State.CLOSED),
    }
)

_T = FrameType
SERVER_RECEIVES: dict[State, frozenset[FrameType]] = {
    State.AWAITING_AUTH: frozenset({_T.CLIENT_AUTH}),
    State.AUTHENTICATED: frozenset({_T.SEND_PACKET, _T.PING, _T.PONG}),
    State.CLOSED: frozenset(),
}
CLIENT_RECEIVES: dict[State, frozenset[FrameType]] = {
    State.AWAITING_AUTH: frozenset({_T.SERVER_CHALLENGE, _T.SERVER_AUTH_OK, _T.REFUSED, _T.ERROR, _T.HEALTH}),
    State.AUTHENTICATED: frozenset({_T.RECV_PACKET, _T.PEER_GONE, _T.PING, _T.PONG, _T.HEALTH, _T.ERROR}),
    State.CLOSED: frozenset(),
}


class UnexpectedFrame(RemoteProtocolError):
    """A well-formed frame that the other side may not send in this state."""

    def __init__(self, state: State, frame_type: FrameType, detail: str = "") -> None:
        super().__init__(f"unexpected {frame_type.name} frame in state {state.value}{detail}")
        self.state = state
        self.frame_type = frame_type


class TextMessage(RemoteProtocolError):
    """The other side sent a WebSocket text message."""


class AuthFailed(RemoteProtocolError):
    """The client's signature does not prove the peer id it claims."""


class WrongRelay(RemoteProtocolError):
    """The relay presented a different key than the one the client pinned."""


@dataclass(frozen=True)
class SessionLimits:
    """Timeouts and per-client rates; the defaults suit a relay serving a few hundred peers' fallback traffic."""

    auth_timeout: float = 10.0
    ping_interval: float = 15.0
    ping_timeout: float = 15.0
    rate_bytes: float = 8 << 20  # bytes per second a client may send through the relay
    burst_bytes: float = 2 << 20
    rate_packets: float = 8000.0  # SendPacket + Ping frames per second
    burst_packets: float = 2000.0


# --- events the edge carries out ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Send:
    """Write ``frame`` to the other side of this connection."""

    frame: Frame


@dataclass(frozen=True)
class Authenticated:
    """Server: the client proved ``peer``. Client: the relay ``peer`` accepted our proof."""

    peer: PeerId


@dataclass(frozen=True)
class Forward:
    """Server: deliver ``data`` from this session's peer to ``dst``."""

    dst: PeerId
    data: bytes


@dataclass(frozen=True)
class Dropped:
    """Server: a packet to ``dst`` was dropped (``reason``: "rate_limited")."""

    dst: PeerId
    size: int
    reason: str


@dataclass(frozen=True)
class PacketReceived:
    """Client: ``src`` sent us ``data`` through the relay."""

    src: PeerId
    data: bytes


@dataclass(frozen=True)
class PeerDeparted:
    """Client: ``peer`` is not connected to the relay (it left, or never came)."""

    peer: PeerId


@dataclass(frozen=True)
class Notice:
    """Client: a ``Health`` notice from the relay."""

    text: str


@dataclass(frozen=True)
class Closed:
    """Close the connection now; ``error`` says who broke what, if anyone did."""

    reason: str
    error: RelayError | None = None


Event = Send | Authenticated | Forward | Dropped | PacketReceived | PeerDeparted | Notice | Closed


class _Session:
    """What both roles share: the state, the transition table, the keepalive timer."""

    RECEIVES: dict[State, frozenset[FrameType]]

    def __init__(self, limits: SessionLimits, now: float) -> None:
        self.limits = limits
        self.state = State.AWAITING_AUTH
        self.error: RelayError | None = None
        self._created = now
        self._last_rx = now
        self._ping_sent: float | None = None
        self._pings = 0

    def receive(self, message: bytes | str, now: float) -> list[Event]:
        """Events for one received WebSocket message (a text message is a violation: the protocol is binary)."""
        if self.state is State.CLOSED:
            return []
        if isinstance(message, str):
            return self._fail(TextMessage("a text message; the relay protocol is binary frames only"))
        try:
            frame = decode(message)
        except FrameError as exc:
            return self._fail(exc)
        self._last_rx, self._ping_sent = now, None
        if isinstance(frame, Unknown):
            return []
        if frame.TYPE not in self.RECEIVES[self.state]:
            return self._fail(UnexpectedFrame(self.state, frame.TYPE))
        return self._handle(frame, now)

    def get_timer(self) -> float | None:
        """When ``handle_timer`` must next run (None: never)."""
        if self.state is State.CLOSED:
            return None
        if self.state is State.AWAITING_AUTH:
            return self._created + self.limits.auth_timeout
        if self._ping_sent is not None:
            return self._ping_sent + self.limits.ping_timeout
        return self._last_rx + self.limits.ping_interval

    def handle_timer(self, now: float) -> list[Event]:
        timer = self.get_timer()
        if timer is None or now < timer:
            return []
        if self.state is State.AWAITING_AUTH:
            return self.close(f"authentication not completed within {self.limits.auth_timeout:g} s")
        if self._ping_sent is not None:
            return self.close(f"keepalive timeout: nothing received for {now - self._last_rx:.1f} s")
        self._ping_sent = now
        self._pings += 1
        return [Send(Ping(self._pings.to_bytes(8, "big")))]

    def close(self, reason: str) -> list[Event]:
        """Close from this side, telling the other side why."""
        if self.state is State.CLOSED:
            return []
        self._to(State.CLOSED)
        return [Send(Error(_clip(reason))), Closed(reason, self.error)]

    def connection_lost(self) -> None:
        """The transport ended under us: nothing can be sent any more."""
        if self.state is not State.CLOSED:
            self._to(State.CLOSED)

    def _fail(self, error: RemoteProtocolError) -> list[Event]:
        self.error = error
        return self.close(str(error))

    def _to(self, state: State) -> None:
        if (self.state, state) not in TRANSITIONS:
            raise LocalProtocolError(f"no transition from {self.state.value} to {state.value}")
        self.state = state

    def _handle(self, frame: Frame, now: float) -> list[Event]:
        raise NotImplementedError


class ServerSession(_Session):
    """The relay's side of one client connection."""

    RECEIVES = SERVER_RECEIVES

    def __init__(self, relay: PeerId, nonce: bytes, now: float, limits: SessionLimits = SessionLimits()) -> None:
        super().__init__(limits, now)
        self.challenge = ServerChallenge(nonce, relay)
        self.peer: PeerId | None = None
        self._bytes = TokenBucket.full(limits.rate_bytes, limits.burst_bytes, now)
        self._packets = TokenBucket.full(limits.rate_packets, limits.burst_packets, now)
        self._warned_at: float | None = None

    def start(self) -> list[Event]:
        """The first events of a new connection: send the challenge."""
        return [Send(self.challenge)]

    def _handle(self, frame: Frame, now: float) -> list[Event]:
        if isinstance(frame, ClientAuth):
            return self._authenticate(frame)
        if isinstance(frame, SendPacket):
            if self._admit(len(frame.data), now):
                return [Forward(frame.dst, frame.data)]
            return self._rate_limited(frame.dst, len(frame.data), now)
        if isinstance(frame, Ping):
            return [Send(Pong(frame.nonce))] if self._admit(0, now) else []
        return []  # Pong: liveness is all it carries

    def _authenticate(self, auth: ClientAuth) -> list[Event]:
        if not auth.peer.verify(self.challenge.signed_message(), auth.signature):
            self.error = AuthFailed(f"signature does not prove peer id {auth.peer}")
            self._to(State.CLOSED)
            return [Send(Refused("signature does not prove the claimed peer id")), Closed(str(self.error), self.error)]
        self.peer = auth.peer
        self._to(State.AUTHENTICATED)
        return [Send(ServerAuthOk()), Authenticated(auth.peer)]

    def _admit(self, size: int, now: float) -> bool:
        """Take one packet and ``size`` bytes from the buckets, or nothing if either lacks them."""
        self._bytes.refill(now)
        self._packets.refill(now)
        if self._packets.tokens < 1 or self._bytes.tokens < size:
            return False
        self._packets.tokens -= 1
        self._bytes.tokens -= size
        return True

    def _rate_limited(self, dst: PeerId, size: int, now: float) -> list[Event]:
        events: list[Event] = [Dropped(dst, size, "rate_limited")]
        if self._warned_at is None or now - self._warned_at >= self.limits.ping_interval:
            self._warned_at = now
            events.insert(0, Send(Health("rate limit exceeded: the relay is dropping your packets")))
        return events


class ClientSession(_Session):
    """A client's side of its connection to a relay; signs the relay's challenge with ``identity``."""

    RECEIVES = CLIENT_RECEIVES

    def __init__(
        self,
        identity: Identity,
        now: float,
        limits: SessionLimits = SessionLimits(),
        *,
        expected_relay: PeerId | None = None,
    ) -> None:
        super().__init__(limits, now)
        self._sign: Callable[[bytes], bytes] = identity.sign
        self.peer = identity.peer_id
        self.expected_relay = expected_relay
        self.relay: PeerId | None = None

    def _handle(self, frame: Frame, now: float) -> list[Event]:
        if isinstance(frame, ServerChallenge):
            return self._answer(frame)
        if isinstance(frame, ServerAuthOk):
            if self.relay is None:
                return self._fail(UnexpectedFrame(self.state, frame.TYPE, " before any challenge"))
            self._to(State.AUTHENTICATED)
            return [Authenticated(self.relay)]
        if isinstance(frame, (Refused, Error)):
            self._to(State.CLOSED)
            verb = "refused us" if isinstance(frame, Refused) else "closed the connection"
            return [Closed(f"relay {verb}: {frame.text}")]
        if isinstance(frame, RecvPacket):
            return [PacketReceived(frame.src, frame.data)]
        if isinstance(frame, PeerGone):
            return [PeerDeparted(frame.peer)]
        if isinstance(frame, Health):
            return [Notice(frame.text)]
        if isinstance(frame, Ping):
            return [Send(Pong(frame.nonce))]
        return []  # Pong

    def _answer(self, challenge: ServerChallenge) -> list[Event]:
        if self.relay is not None:
            return self._fail(UnexpectedFrame(self.state, challenge.TYPE, " after one was answered"))
        if self.expected_relay is not None and challenge.relay != self.expected_relay:
            return self._fail(WrongRelay(f"relay is {challenge.relay}, expected {self.expected_relay}"))
        self.relay = challenge.relay
        return [Send(ClientAuth(self.peer, self._sign(challenge.signed_message())))]


def _clip(text: str) -> str:
    """``text`` cut to fit a text frame (MAX_TEXT bytes of UTF-8)."""
    return text.encode("utf-8", "replace")[:MAX_TEXT].decode("utf-8", "ignore")
