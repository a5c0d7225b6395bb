"""The relay's wire frames: one WebSocket binary message carries one frame, ``type (1 byte) || body``.

Sans-IO: this module only turns bytes into frames and back. WebSocket delimits messages, so frames carry no
length prefix; every field has a fixed size except the last one (packet data or text), which runs to the end.
Peers are named on the wire by their 32-byte Ed25519 public key: a moeswarm peer id *is* its key
(``p2p.identity``), so any 32 bytes name a valid peer id and the relay parses no multihash on the hot path.

Handshake (server speaks first)::

    relay  -> client   ServerChallenge(nonce, relay)
    client -> relay    ClientAuth(peer, signature over AUTH_DOMAIN || nonce || relay key)
    relay  -> client   ServerAuthOk() | Refused(reason)

then ``SendPacket(dst, data)`` from a client becomes ``RecvPacket(src, data)`` at ``dst``; ``PeerGone(peer)`` tells
a sender that ``peer`` is not (or no longer) connected; either side may ``Ping(nonce)`` and gets ``Pong(nonce)``;
``Health(text)`` is a notice from the relay and ``Error(text)`` explains why it is about to close the connection.
The packets are QUIC datagrams, end-to-end encrypted and authenticated by the peers themselves: the relay sees
who talks to whom and how much, never what. The signature is bound to the relay's key: a client that pinned its
relay's key (worker records carry it) signs for no other relay, so a machine in the middle cannot pass the real
relay's challenge on and log in as the client with the answer (without a pin or TLS, it can).

Frame type numbers are never reused; an unknown number decodes to ``Unknown`` so that newer peers can add
frames. Every decode error is a ``FrameError``; lengths are checked before anything is sliced or allocated (``p2p.wire.frames.Reader``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from enum import IntEnum
from typing import ClassVar, Self

from experts import errors
from experts.errors import MoeSwarmError
from p2p.identity import PeerId
from p2p.wire.frames import Reader, exact_bytes, prefixed

SUBPROTOCOL = "moeswarm-relay.v1"  # the WebSocket subprotocol (an HTTP token): versions the whole frame set
AUTH_DOMAIN = b"moeswarm-relay.v1 client auth\x00"  # domain separation: this signature means nothing elsewhere

KEY_SIZE = 32  # Ed25519 public key: how a peer is named on the wire
SIGNATURE_SIZE = 64
NONCE_SIZE = 32
PING_SIZE = 8
MAX_PACKET = 16384  # p2p.quic.endpoint's largest datagram (MAX_DATAGRAM); the relay carries nothing bigger
MAX_TEXT = 256  # bytes of UTF-8 in Refused / Health / Error
MAX_FRAME = 1 + KEY_SIZE + MAX_PACKET  # the largest frame of any type, checked before decoding


class RelayError(MoeSwarmError):
    """Base of every relay protocol error (a session's ``error`` is one, from either side)."""


class LocalProtocolError(RelayError, errors.LocalProtocolError):
    """This side misused the protocol API (a bad field size, sending before authentication, ...)."""


class RemoteProtocolError(RelayError, errors.RemoteProtocolError):
    """The other side broke the protocol."""


class FrameError(RemoteProtocolError):
    """A message could not be decoded into a frame."""


class FrameTooLarge(FrameError):
    def __init__(self, frame_len: int, limit: int) -> None:
        super().__init__(f"frame of {frame_len} bytes exceeds the limit of {limit}")
        self.frame_len = frame_len
        self.limit = limit


class FrameTruncated(FrameError):
    """The body is shorter or longer than its type requires."""

    def __init__(self, frame_type: int, body_len: int, expected: str) -> None:
        super().__init__(f"frame type {frame_type} has a {body_len}-byte body; expected {expected}")
        self.frame_type = frame_type
        self.body_len = body_len
        self.expected = expected


class BadField(FrameError):
    """A field has the right size but an invalid value (e.g. text that is not UTF-8)."""

    def __init__(self, frame_type: int, field: str, reason: str) -> None:
        super().__init__(f"frame type {frame_type}: field {field!r} {reason}")
        self.frame_type = frame_type
        self.field = field


class FrameType(IntEnum):
    """Every frame type; numbers are never reused (0 is reserved)."""

    SERVER_CHALLENGE = 1
    CLIENT_AUTH = 2
    SERVER_AUTH_OK = 3
    REFUSED = 4
    SEND_PACKET = 5
    RECV_PACKET = 6
    PEER_GONE = 7
    PING = 8
    PONG = 9
    HEALTH = 10
    ERROR = 11


def _need(name: str, value: bytes, size: int) -> None:
    exact_bytes(name, value, size, prefixed(LocalProtocolError))


def _need_text(text: str) -> None:
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError:
        raise LocalProtocolError("text must be encodable as UTF-8 (no lone surrogates)") from None
    if size > MAX_TEXT:
        raise LocalProtocolError(f"text exceeds {MAX_TEXT} bytes of UTF-8; shorten it")


def _need_packet(data: bytes) -> None:
    if len(data) > MAX_PACKET:
        raise LocalProtocolError(f"packet of {len(data)} bytes exceeds MAX_PACKET {MAX_PACKET}")


def _reader(frame_type: FrameType, body: bytes, expected: str) -> Reader:
    """The shared frame reader over ``body``; running short or leaving bytes is a FrameTruncated saying ``expected``."""

    def wrong_size(field: str, detail: str) -> FrameTruncated:
        return FrameTruncated(frame_type, len(body), expected)

    return Reader(body, truncated=wrong_size, trailing=wrong_size)


def _fixed(frame_type: FrameType, body: bytes, *sizes: int) -> list[bytes]:
    """The fields of a body made of fixed-size fields only, in order; any other body length is refused."""
    r = _reader(frame_type, body, f"exactly {sum(sizes)}")
    fields = [r.take(size, "body") for size in sizes]
    r.finish()
    return fields


def _split_packet(frame_type: FrameType, body: bytes) -> tuple[PeerId, bytes]:
    r = _reader(frame_type, body, f"at least {KEY_SIZE}")
    peer = PeerId.from_public_bytes(r.take(KEY_SIZE, "peer"))
    return peer, r.rest("data")


def _text(frame_type: FrameType, body: bytes) -> str:
    if len(body) > MAX_TEXT:
        raise FrameTruncated(frame_type, len(body), f"at most {MAX_TEXT}")
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError:
        raise BadField(frame_type, "text", "is not UTF-8") from None


@dataclass(frozen=True)
class ServerChallenge:
    """The relay's first frame: sign ``nonce`` bound to ``relay`` to prove your peer id."""

    TYPE: ClassVar[FrameType] = FrameType.SERVER_CHALLENGE
    nonce: bytes
    relay: PeerId

    def __post_init__(self) -> None:
        _need("nonce", self.nonce, NONCE_SIZE)

    def signed_message(self) -> bytes:
        """What a client signs: domain, nonce, relay key (fixed sizes, so the concatenation is unambiguous)."""
        return AUTH_DOMAIN + self.nonce + self.relay.public_bytes

    def encode(self) -> bytes:
        return bytes((self.TYPE,)) + self.nonce + self.relay.public_bytes

    @classmethod
    def decode_body(cls, body: bytes) -> ServerChallenge:
        nonce, relay = _fixed(cls.TYPE, body, NONCE_SIZE, KEY_SIZE)
        return cls(nonce, PeerId.from_public_bytes(relay))


@dataclass(frozen=True)
class ClientAuth:
    """The client's answer: its peer id (key) and its signature over ``ServerChallenge.signed_message()``."""

    TYPE: ClassVar[FrameType] = FrameType.CLIENT_AUTH
    peer: PeerId
    signature: bytes

    def __post_init__(self) -> None:
        _need("signature", self.signature, SIGNATURE_SIZE)

    def encode(self) -> bytes:
        return bytes((self.TYPE,)) + self.peer.public_bytes + self.signature

    @classmethod
    def decode_body(cls, body: bytes) -> ClientAuth:
        peer, signature = _fixed(cls.TYPE, body, KEY_SIZE, SIGNATURE_SIZE)
        return cls(PeerId.from_public_bytes(peer), signature)


@dataclass(frozen=True)
class ServerAuthOk:
    """The relay accepted the client's proof; packets may flow."""

    TYPE: ClassVar[FrameType] = FrameType.SERVER_AUTH_OK

    def encode(self) -> bytes:
        return bytes((self.TYPE,))

    @classmethod
    def decode_body(cls, body: bytes) -> ServerAuthOk:
        _fixed(cls.TYPE, body)
        return cls()


@dataclass(frozen=True)
class _TextFrame:
    text: str

    TYPE: ClassVar[FrameType]

    def __post_init__(self) -> None:
        _need_text(self.text)

    def encode(self) -> bytes:
        return bytes((self.TYPE,)) + self.text.encode("utf-8")

    @classmethod
    def decode_body(cls, body: bytes) -> Self:
        return cls(_text(cls.TYPE, body))


@dataclass(frozen=True)
class Refused(_TextFrame):
    """The relay refused the login (bad signature, relay full, ...); it closes the connection next."""

    TYPE: ClassVar[FrameType] = FrameType.REFUSED


@dataclass(frozen=True)
class Health(_TextFrame):
    """A notice from the relay about this connection (e.g. "replaced by a newer connection")."""

    TYPE: ClassVar[FrameType] = FrameType.HEALTH


@dataclass(frozen=True)
class Error(_TextFrame):
    """Why the sender is about to close the connection (a protocol violation, a keepalive timeout)."""

    TYPE: ClassVar[FrameType] = FrameType.ERROR


class _PacketFrame:
    """A peer id and one QUIC packet: the two directions differ only in whose id it is (the first field)."""

    TYPE: ClassVar[FrameType]
    data: bytes

    def __post_init__(self) -> None:
        _need_packet(self.data)

    def encode(self) -> bytes:
        peer: PeerId = getattr(self, fields(self)[0].name)  # type: ignore[arg-type]  # subclasses are dataclasses
        return b"".join((bytes((self.TYPE,)), peer.public_bytes, self.data))

    @classmethod
    def decode_body(cls, body: bytes) -> Self:
        return cls(*_split_packet(cls.TYPE, body))  # type: ignore[call-arg]  # (peer, data): the subclass's fields


@dataclass(frozen=True)
class SendPacket(_PacketFrame):
    """Client -> relay: deliver ``data`` to ``dst``."""

    TYPE: ClassVar[FrameType] = FrameType.SEND_PACKET
    dst: PeerId
    data: bytes


@dataclass(frozen=True)
class RecvPacket(_PacketFrame):
    """Relay -> client: ``src`` (authenticated by the relay) sent you ``data``."""

    TYPE: ClassVar[FrameType] = FrameType.RECV_PACKET
    src: PeerId
    data: bytes


@dataclass(frozen=True)
class PeerGone:
    """Relay -> client: ``peer``, whom you sent packets to, is not connected to this relay."""

    TYPE: ClassVar[FrameType] = FrameType.PEER_GONE
    peer: PeerId

    def encode(self) -> bytes:
        return bytes((self.TYPE,)) + self.peer.public_bytes

    @classmethod
    def decode_body(cls, body: bytes) -> PeerGone:
        [peer] = _fixed(cls.TYPE, body, KEY_SIZE)
        return cls(PeerId.from_public_bytes(peer))


@dataclass(frozen=True)
class _PingFrame:
    nonce: bytes

    TYPE: ClassVar[FrameType]

    def __post_init__(self) -> None:
        _need("nonce", self.nonce, PING_SIZE)

    def encode(self) -> bytes:
        return bytes((self.TYPE,)) + self.nonce

    @classmethod
    def decode_body(cls, body: bytes) -> Self:
        [nonce] = _fixed(cls.TYPE, body, PING_SIZE)
        return cls(nonce)


@dataclass(frozen=True)
class Ping(_PingFrame):
    """Are you there? Answered by ``Pong`` with the same nonce."""

    TYPE: ClassVar[FrameType] = FrameType.PING


@dataclass(frozen=True)
class Pong(_PingFrame):
    """The answer to ``Ping``."""

    TYPE: ClassVar[FrameType] = FrameType.PONG


@dataclass(frozen=True)
class Unknown:
    """A frame type this version does not know; receivers ignore it (newer peers may add frames)."""

    frame_type: int
    body: bytes

    def __post_init__(self) -> None:
        if not 0 <= self.frame_type <= 255 or self.frame_type in FrameType._value2member_map_:
            raise LocalProtocolError(f"{self.frame_type} is not an unknown frame type")
        if len(self.body) > MAX_FRAME - 1:
            raise LocalProtocolError(f"unknown frame body exceeds {MAX_FRAME - 1} bytes")

    def encode(self) -> bytes:
        return bytes((self.frame_type,)) + self.body


Frame = (
    ServerChallenge
    | ClientAuth
    | ServerAuthOk
    | Refused
    | SendPacket
    | RecvPacket
    | PeerGone
    | Ping
    | Pong
    | Health
    | Error
    | Unknown
)

_DECODERS = {
    cls.TYPE: cls.decode_body
    for cls in (
        ServerChallenge,
        ClientAuth,
        ServerAuthOk,
        Refused,
        SendPacket,
        RecvPacket,
        PeerGone,
        Ping,
        Pong,
        Health,
        Error,
    )
}
assert set(_DECODERS) == set(FrameType), "every frame type needs a decoder"


def decode(message: bytes) -> Frame:
    """One frame from one WebSocket binary message; raises ``FrameError`` (and nothing else) on bad input."""
    if len(message) > MAX_FRAME:
        raise FrameTooLarge(len(message), MAX_FRAME)
    if not message:
        raise FrameTruncated(0, 0, "a type byte")
    frame_type = message[0]
    decoder = _DECODERS.get(frame_type)  # type: ignore[call-overload]
    if decoder is None:
        return Unknown(frame_type, bytes(message[1:]))
    return decoder(bytes(message[1:]))
