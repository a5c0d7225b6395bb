"""UDP hole punching coordinated through the relay, and keepalives on the punched path.

Theory of operation. Peers A and B already talk over a relayed QUIC connection. A (the initiator) sends a signed
``PunchRequest`` through the relay: a fresh 16-byte nonce, its NAT kind and observed addresses
(``p2p.nat.reachability``). B answers ``PunchAccept`` with its own kind and addresses and a delay; B starts punching
``delay`` after sending, A ``delay - rtt/2`` after receiving (rtt: its request-to-accept time through the relay),
so both start at about the same moment. Each then sends a burst of small ``PathPacket`` PUNCHes from its QUIC
socket to every address of the other. A's packets open A's NAT towards B's mapping and B's open B's towards A's;
the first packets may die at the other NAT, the later ones pass. B echoes every punch it receives; the first punch
A receives tells A a path exists, and from which address: A dials QUIC there (a new connection on the same socket;
``Dial``). The verified connection makes the path DIRECT on both sides (``connected``). No punch in time, a failed
dial, or a ``PunchReject`` puts the peer back on the relay with a backoff (``p2p.nat.paths``); a peer behind a
symmetric NAT (either side) is skipped without sending anything, since its next port cannot be predicted.

Both peers may start at once: the request from the lower peer id wins; the other drops its own request and
answers. Once DIRECT, both send a KEEPALIVE every ``keepalive_interval`` (under UDP conntrack's 30 s for
unanswered flows) and answer each with KEEPALIVE_ACK (which makes the flow "established", ~120 s); after
``keepalive_misses`` unanswered ones the direct path is declared lost.

Authentication. Coordination frames are signed (``p2p.nat.envelope``; the relay vouches for the sender too, and the
two must agree). Path packets are too frequent and too small to sign: they carry a session id (a hash of the
nonce) and a 16-byte HMAC keyed by the nonce, which only the two peers (and the relay that carried it) know. A
forged punch can at worst make A dial a wrong address, where QUIC's mutual authentication fails the attempt.

Path packet (big-endian, 34 bytes)::

    magic 3 = 0x0D "PP" | version u8 = 1 | kind u8 | role u8 | session id 8 | seq u32
    | HMAC-SHA256(key = nonce, all bytes before)[:16]

Sans-IO: inputs and timers in, ``Action`` values out; the clock and randomness are parameters.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import IntEnum, StrEnum
from typing import ClassVar, Self

import structlog

from p2p.identity import Identity, PeerId
from p2p.nat.envelope import (
    NONCE_LEN,
    Address,
    FrameError,
    InvalidField,
    Reader,
    SignedCodec,
    Truncated,
    check_addrs,
    check_nonce,
    encode_addrs,
    read_addrs,
)
from p2p.nat.paths import Backoff, PathEvent, PathState, PathTable
from p2p.nat.reachability import NatKind, Verdict
from p2p.ratelimit import RateLimiter
from p2p.wire.frames import int_in, prefixed

MAGIC = b"\x0dHP"
CONTEXT = b"moeswarm/holepunch/v1\n"
PATH_MAGIC = b"\x0dPP"
MAX_ADDRS = 4
SID_LEN = 8
MAC_LEN = 16
_PATH = struct.Struct(">3sBBB8sI")  # magic, version, kind, role, session id, seq
PATH_LEN = _PATH.size + MAC_LEN

log = structlog.get_logger("p2p.nat.holepunch")


class PunchType(IntEnum):
    """Coordination frame types (through the relay); a number, once used, is never reused (0 is reserved)."""

    REQUEST = 1
    ACCEPT = 2
    REJECT = 3


class RejectReason(IntEnum):
    SYMMETRIC = 1  # one side is behind a symmetric NAT
    NO_ADDRESS = 2  # one side knows no observed address to punch to
    BUSY = 3  # too many requests from this peer


_refused = prefixed(ValueError)  # a frame this side may not build (SignedCodec.decode reports it as InvalidField)


def _check_kind(nat: NatKind) -> None:
    if not isinstance(nat, NatKind):
        raise ValueError(f"nat must be a NatKind, got {nat!r}")


def _read_kind(r: Reader) -> NatKind:
    value = r.u8("nat")
    if value not in NatKind._value2member_map_:
        raise InvalidField(f"nat: {value} is not a NatKind")
    return NatKind(value)


@dataclass(frozen=True)
class PunchRequest:
    TYPE: ClassVar[int] = PunchType.REQUEST
    MIN_SIZE: ClassVar[int] = 0
    nonce: bytes
    target: PeerId  # the responder: a request is not valid for anyone else
    nat: NatKind
    addrs: tuple[Address, ...]

    def __post_init__(self) -> None:
        check_nonce(self.nonce)
        _check_kind(self.nat)
        check_addrs(self.addrs, MAX_ADDRS)

    def body(self) -> bytes:
        return self.nonce + self.target.public_bytes + bytes([self.nat]) + encode_addrs(self.addrs)

    @classmethod
    def parse(cls, r: Reader) -> Self:
        return cls(r.take(NONCE_LEN, "nonce"), r.peer("target"), _read_kind(r), read_addrs(r, "addrs", MAX_ADDRS))


@dataclass(frozen=True)
class PunchAccept:
    TYPE: ClassVar[int] = PunchType.ACCEPT
    MIN_SIZE: ClassVar[int] = 0
    nonce: bytes
    nat: NatKind
    addrs: tuple[Address, ...]
    delay_ms: int  # the responder starts punching this long after sending the accept

    def __post_init__(self) -> None:
        check_nonce(self.nonce)
        _check_kind(self.nat)
        check_addrs(self.addrs, MAX_ADDRS)
        int_in("delay_ms", self.delay_ms, 0, 0xFFFF, _refused)

    def body(self) -> bytes:
        return self.nonce + bytes([self.nat]) + encode_addrs(self.addrs) + self.delay_ms.to_bytes(2, "big")

    @classmethod
    def parse(cls, r: Reader) -> Self:
        return cls(r.take(NONCE_LEN, "nonce"), _read_kind(r), read_addrs(r, "addrs", MAX_ADDRS), r.u16("delay_ms"))


@dataclass(frozen=True)
class PunchReject:
    TYPE: ClassVar[int] = PunchType.REJECT
    MIN_SIZE: ClassVar[int] = 0
    nonce: bytes
    reason: RejectReason

    def __post_init__(self) -> None:
        check_nonce(self.nonce)
        RejectReason(self.reason)

    def body(self) -> bytes:
        return self.nonce + bytes([self.reason])

    @classmethod
    def parse(cls, r: Reader) -> Self:
        nonce, reason = r.take(NONCE_LEN, "nonce"), r.u8("reason")
        if reason not in RejectReason._value2member_map_:
            raise InvalidField(f"reason: {reason} is not a RejectReason")
        return cls(nonce, RejectReason(reason))


CODEC = SignedCodec(MAGIC, CONTEXT, (PunchRequest, PunchAccept, PunchReject))


class PathKind(IntEnum):
    PUNCH = 1
    KEEPALIVE = 2
    KEEPALIVE_ACK = 3


class Role(IntEnum):
    INITIATOR = 0
    RESPONDER = 1


def session_id(nonce: bytes) -> bytes:
    return hashlib.sha256(b"moeswarm/punch-session\0" + nonce).digest()[:SID_LEN]


@dataclass(frozen=True)
class PathPacket:
    """A punch or keepalive on the direct path; ``encode``/``verify`` take the session's nonce as the MAC key."""

    sid: bytes
    kind: PathKind
    role: Role
    seq: int

    def __post_init__(self) -> None:
        if not isinstance(self.sid, bytes) or len(self.sid) != SID_LEN:
            raise ValueError(f"a session id has {SID_LEN} bytes")
        PathKind(self.kind)
        Role(self.role)
        int_in("seq", self.seq, 0, 0xFFFF_FFFF, _refused)

    def encode(self, key: bytes) -> bytes:
        head = _PATH.pack(PATH_MAGIC, 1, self.kind, self.role, self.sid, self.seq)
        return head + hmac.new(key, head, hashlib.sha256).digest()[:MAC_LEN]

    @classmethod
    def decode(cls, data: bytes) -> Self:
        """The packet's fields (the MAC is not checked here: see ``verify``)."""
        if len(data) != PATH_LEN:
            raise Truncated(f"a path packet has {PATH_LEN} bytes, got {len(data)}")
        magic, version, kind, role, sid, seq = _PATH.unpack_from(data)
        if magic != PATH_MAGIC or version != 1:
            raise InvalidField(f"magic {magic!r} version {version} is not a path packet")
        if kind not in PathKind._value2member_map_ or role not in Role._value2member_map_:
            raise InvalidField(f"kind {kind} or role {role} is unknown")
        return cls(sid, PathKind(kind), Role(role), seq)

    @staticmethod
    def verify(data: bytes, key: bytes) -> bool:
        mac = hmac.new(key, data[: _PATH.size], hashlib.sha256).digest()[:MAC_LEN]
        return hmac.compare_digest(mac, data[_PATH.size : PATH_LEN])


# --- the engine -----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PunchConfig:
    request_timeout: float = 5.0  # for the accept/reject to come back through the relay
    start_delay: float = 0.3  # the responder's delay before punching (covers the accept's trip)
    interval: float = 0.05  # between punch packets
    burst: int = 20  # punch packets per address
    grace: float = 1.0  # after the burst, how long a late punch may still arrive
    dial_timeout: float = 5.0  # for the direct QUIC handshake
    keepalive_interval: float = 15.0  # under UDP conntrack's 30 s for unanswered flows
    keepalive_misses: int = 3
    request_rate: float = 0.1  # punch requests accepted per second per peer...
    request_burst: float = 3.0  # ...after a burst of this many


@dataclass(frozen=True)
class SendRelay:
    peer: PeerId
    data: bytes


@dataclass(frozen=True)
class SendUdp:
    addr: Address
    data: bytes


@dataclass(frozen=True)
class Dial:
    """Open a new QUIC connection to ``peer`` at ``addr`` from the punched socket; report ``connected`` or
    ``dial_failed``."""

    peer: PeerId
    addr: Address


@dataclass(frozen=True)
class Upgraded:
    """Send ``peer``'s requests over the direct connection at ``addr`` from now on."""

    peer: PeerId
    addr: Address


@dataclass(frozen=True)
class Downgraded:
    """The direct path at ``addr`` is dead: close it if it is still open; requests go back to the relay."""

    peer: PeerId
    addr: Address
    reason: str


Action = SendRelay | SendUdp | Dial | Upgraded | Downgraded


class Phase(StrEnum):
    REQUESTED = "requested"  # initiator: waiting for the accept
    PUNCHING = "punching"
    DIALING = "dialing"  # initiator: heard a punch, QUIC handshake under way


@dataclass(eq=False)
class _Session:
    peer: PeerId
    role: Role
    nonce: bytes
    phase: Phase
    deadline: float
    requested_at: float = 0.0
    peer_addrs: tuple[Address, ...] = ()
    next_send: float = 0.0
    sent: int = 0
    heard: list[Address] = field(default_factory=list)  # where the peer's punches came from

    @property
    def sid(self) -> bytes:
        return session_id(self.nonce)


@dataclass(eq=False)
class _Direct:
    peer: PeerId
    addr: Address
    nonce: bytes
    role: Role
    next_keepalive: float
    unanswered: int = 0
    seq: int = 0


class HolePunch:
    """Punch sessions and direct-path keepalives for one node; ``paths`` holds each peer's path state.

    Inputs: ``start`` (try to get a direct path to a peer), ``relay_received``, ``udp_received``, ``connected``,
    ``dial_failed``, ``path_lost`` and ``handle_timer`` at ``get_timer()``. Each returns the actions to perform.
    ``local`` is this node's current reachability verdict.
    """

    def __init__(
        self,
        identity: Identity,
        config: PunchConfig = PunchConfig(),
        *,
        backoff: Backoff = Backoff(),
        rng: Callable[[int], bytes] = os.urandom,
    ) -> None:
        self.identity = identity
        self.peer_id = identity.peer_id
        self.config = config
        self.paths = PathTable(backoff)
        self._rng = rng
        self._sessions: dict[PeerId, _Session] = {}
        self._direct: dict[PeerId, _Direct] = {}
        self._by_sid: dict[bytes, _Session | _Direct] = {}
        self._requests = RateLimiter(config.request_rate, config.request_burst)

    def direct(self) -> dict[PeerId, Address]:
        """The peers on a direct path, and its address."""
        return {peer: d.addr for peer, d in self._direct.items()}

    def awaiting_connection(self) -> dict[PeerId, set[Address]]:
        """Responder sessions, and the addresses from which the initiator's direct connection may come."""
        return {s.peer: {*s.heard, *s.peer_addrs} for s in self._sessions.values() if s.role is Role.RESPONDER}

    # --- starting -------------------------------------------------------------------------------------------

    def start(self, peer: PeerId, local: Verdict, now: float) -> list[Action]:
        """Try to punch to ``peer`` unless a session runs, the path is not RELAY, or its backoff holds."""
        if peer in self._sessions or peer == self.peer_id or not self.paths.may_punch(peer, now):
            return []
        if local.kind is NatKind.SYMMETRIC:
            self.paths.apply(peer, PathEvent.PUNCH_SKIPPED, now, f"we are behind a symmetric NAT ({local.reason})")
            return []
        if not local.addresses:
            return []  # nothing to tell the peer yet; reachability will find our address
        nonce = self._rng(NONCE_LEN)
        self._open(_Session(peer, Role.INITIATOR, nonce, Phase.REQUESTED, now + self.config.request_timeout, now))
        self.paths.apply(peer, PathEvent.PUNCH_STARTED, now, f"we initiate; we are {local.kind.name}")
        request = PunchRequest(nonce, peer, local.kind, local.addresses)
        return [SendRelay(peer, CODEC.encode(request, self.identity))]

    def relay_received(self, src: PeerId, data: bytes, local: Verdict, now: float) -> list[Action]:
        """A coordination frame that the relay says ``src`` sent."""
        try:
            sender, frame = CODEC.decode(data)
        except FrameError as exc:
            log.info("holepunch.bad_frame", peer=str(src), error=f"{type(exc).__name__}: {exc}")
            return []
        if sender != src:
            log.warning("holepunch.sender_mismatch", relay_says=str(src), signed_by=str(sender))
            return []
        if isinstance(frame, PunchRequest):
            return self._on_request(src, frame, local, now)
        session = self._sessions.get(src)
        if session is None or session.role is not Role.INITIATOR or session.phase is not Phase.REQUESTED:
            return []
        if isinstance(frame, (PunchAccept, PunchReject)) and frame.nonce == session.nonce:
            if isinstance(frame, PunchReject):
                event = PathEvent.PUNCH_SKIPPED if frame.reason is RejectReason.SYMMETRIC else PathEvent.PUNCH_FAILED
                self._end(session, event, f"the peer refused: {frame.reason.name}", now)
            elif frame.nat is NatKind.SYMMETRIC or not frame.addrs:
                self._end(session, PathEvent.PUNCH_SKIPPED, "the peer accepted but gave no punchable address", now)
            else:
                rtt = now - session.requested_at
                session.phase, session.peer_addrs = Phase.PUNCHING, frame.addrs
                session.next_send = max(now, now + frame.delay_ms / 1000 - rtt / 2)
                session.deadline = session.next_send + self._burst_time() + self.config.grace
        return []

    def _on_request(self, src: PeerId, request: PunchRequest, local: Verdict, now: float) -> list[Action]:
        if request.target != self.peer_id:
            return []
        out: list[Action] = []
        ours = self._sessions.get(src)
        if ours is not None:
            if not (ours.role is Role.INITIATOR and ours.phase is Phase.REQUESTED and src < self.peer_id):
                return []  # a duplicate, or our own request wins (lower peer id): the peer will answer ours
            self._close(ours)  # both started: the lower peer id initiates, we answer (the path stays PUNCHING)
        elif not self._requests.allow(src, now):
            return [SendRelay(src, CODEC.encode(PunchReject(request.nonce, RejectReason.BUSY), self.identity))]
        elif self.paths.state(src) is PathState.DIRECT:
            out += self.path_lost(src, "the peer asked to punch again", now)
        reason = None
        if NatKind.SYMMETRIC in (local.kind, request.nat):
            reason = RejectReason.SYMMETRIC
        elif not (local.addresses and request.addrs):
            reason = RejectReason.NO_ADDRESS
        if reason is not None:
            event = PathEvent.PUNCH_SKIPPED if reason is RejectReason.SYMMETRIC else PathEvent.PUNCH_FAILED
            if ours is not None or event is PathEvent.PUNCH_SKIPPED:
                self.paths.apply(src, event, now, f"we refused the peer's request: {reason.name}")
            return [*out, SendRelay(src, CODEC.encode(PunchReject(request.nonce, reason), self.identity))]
        if ours is None:
            self.paths.apply(src, PathEvent.PUNCH_STARTED, now, f"the peer initiates; we are {local.kind.name}")
        start = now + self.config.start_delay
        deadline = start + self._burst_time() + self.config.grace + self.config.dial_timeout
        session = _Session(src, Role.RESPONDER, request.nonce, Phase.PUNCHING, deadline, now, request.addrs, start)
        self._open(session)
        accept = PunchAccept(request.nonce, local.kind, local.addresses, round(self.config.start_delay * 1000))
        return [*out, SendRelay(src, CODEC.encode(accept, self.identity))]

    # --- the punched path -----------------------------------------------------------------------------------

    def udp_received(self, data: bytes, addr: Address, now: float) -> list[Action]:
        """A path packet that arrived on the QUIC socket from ``addr``."""
        try:
            packet = PathPacket.decode(data)
        except FrameError:
            return []
        owner = self._by_sid.get(packet.sid)
        if owner is None or packet.role is owner.role or not PathPacket.verify(data, owner.nonce):
            return []
        if isinstance(owner, _Direct):
            if addr != owner.addr:
                return []  # a replayed packet from elsewhere: answer only the direct path itself
            if packet.kind is PathKind.KEEPALIVE:
                owner.unanswered = 0
                ack = PathPacket(packet.sid, PathKind.KEEPALIVE_ACK, owner.role, packet.seq)
                return [SendUdp(addr, ack.encode(owner.nonce))]
            if packet.kind is PathKind.KEEPALIVE_ACK:
                owner.unanswered = 0
            return []
        if packet.kind is not PathKind.PUNCH or owner.phase is Phase.REQUESTED:
            return []
        if addr not in owner.heard:
            owner.heard.append(addr)
        if owner.role is Role.RESPONDER:
            echo = PathPacket(packet.sid, PathKind.PUNCH, Role.RESPONDER, packet.seq)
            return [SendUdp(addr, echo.encode(owner.nonce))]
        if owner.phase is Phase.PUNCHING:
            owner.phase, owner.deadline = Phase.DIALING, now + self.config.dial_timeout
            return [Dial(owner.peer, addr)]
        return []

    def connected(self, peer: PeerId, addr: Address, now: float) -> list[Action]:
        """A verified QUIC connection to ``peer`` at ``addr`` exists (we dialled it, or the initiator did)."""
        session = self._sessions.get(peer)
        if session is None:
            return []
        if session.role is Role.INITIATOR:
            if session.phase is not Phase.DIALING or addr != session.heard[0]:
                return []
        elif addr not in session.heard and addr not in session.peer_addrs:
            return []
        self._close(session)
        self.paths.apply(peer, PathEvent.PUNCH_SUCCEEDED, now, f"direct QUIC connection at {addr[0]}:{addr[1]}", addr)
        direct = _Direct(peer, addr, session.nonce, session.role, now + self.config.keepalive_interval)
        self._direct[peer] = direct
        self._by_sid[session.sid] = direct
        return [Upgraded(peer, addr)]

    def dial_failed(self, peer: PeerId, reason: str, now: float) -> list[Action]:
        session = self._sessions.get(peer)
        if session is not None and session.role is Role.INITIATOR and session.phase is Phase.DIALING:
            self._end(session, PathEvent.PUNCH_FAILED, f"direct QUIC dial failed: {reason}", now)
        return []

    def path_lost(self, peer: PeerId, reason: str, now: float) -> list[Action]:
        """The direct path to ``peer`` died (its connection closed, or keepalives went unanswered)."""
        direct = self._direct.pop(peer, None)
        if direct is None:
            return []
        self._by_sid.pop(session_id(direct.nonce), None)
        self.paths.apply(peer, PathEvent.DIRECT_LOST, now, reason)
        return [Downgraded(peer, direct.addr, reason)]

    # --- time -----------------------------------------------------------------------------------------------

    def get_timer(self) -> float | None:
        times = [s.deadline for s in self._sessions.values()]
        times += [s.next_send for s in self._sessions.values() if self._punching(s)]
        times += [d.next_keepalive for d in self._direct.values()]
        return min(times, default=None)

    def handle_timer(self, now: float) -> list[Action]:
        out: list[Action] = []
        for session in list(self._sessions.values()):
            if self._punching(session) and session.next_send <= now:
                packet = PathPacket(session.sid, PathKind.PUNCH, session.role, session.sent)
                data = packet.encode(session.nonce)
                out += [SendUdp(addr, data) for addr in session.peer_addrs]
                session.sent += 1
                session.next_send = max(session.next_send + self.config.interval, now)
            if session.deadline <= now:
                self._end(session, PathEvent.PUNCH_FAILED, self._why_failed(session), now)
        for direct in list(self._direct.values()):
            if direct.next_keepalive > now:
                continue
            if direct.unanswered >= self.config.keepalive_misses:
                out += self.path_lost(direct.peer, f"{direct.unanswered} keepalives unanswered", now)
                continue
            direct.unanswered += 1
            direct.seq = (direct.seq + 1) & 0xFFFF_FFFF
            direct.next_keepalive = now + self.config.keepalive_interval
            packet = PathPacket(session_id(direct.nonce), PathKind.KEEPALIVE, direct.role, direct.seq)
            out.append(SendUdp(direct.addr, packet.encode(direct.nonce)))
        return out

    # --- internals ------------------------------------------------------------------------------------------

    def _burst_time(self) -> float:
        return self.config.burst * self.config.interval

    def _punching(self, session: _Session) -> bool:
        return session.phase is not Phase.REQUESTED and session.sent < self.config.burst

    def _why_failed(self, session: _Session) -> str:
        if session.phase is Phase.REQUESTED:
            return f"no answer through the relay within {self.config.request_timeout} s"
        if session.phase is Phase.DIALING:
            return f"direct QUIC dial did not finish within {self.config.dial_timeout} s"
        if session.heard:
            return "the peer's punches arrived but no direct connection followed"
        return f"no punch packet arrived from {', '.join(f'{h}:{p}' for h, p in session.peer_addrs)}"

    def _open(self, session: _Session) -> None:
        self._sessions[session.peer] = session
        self._by_sid[session.sid] = session

    def _close(self, session: _Session) -> None:
        if self._sessions.get(session.peer) is session:
            del self._sessions[session.peer]
        if self._by_sid.get(session.sid) is session:
            del self._by_sid[session.sid]

    def _end(self, session: _Session, event: PathEvent, reason: str, now: float) -> None:
        self._close(session)
        self.paths.apply(session.peer, event, now, reason)
