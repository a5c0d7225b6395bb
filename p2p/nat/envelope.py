"""The signed datagram envelope and field codecs shared by ``p2p.nat.reachability`` and ``p2p.nat.holepunch``.

These frames travel as raw UDP datagrams on the QUIC socket (and some through the relay), so anyone can send one:
each is signed by its sender's identity key (Ed25519), with a per-protocol magic and signing context, and checked
in full before a field is used. Every frame starts with ``FRAME_MARK`` (0x0D): its two top bits are 0, and QUIC
sets its fixed bit 0x40 in every packet, so the socket tells the two apart by the first byte (``p2p.nat.udp_edge``).
Layout (big-endian)::

    magic 3 (FRAME_MARK + 2 letters) | version u8 = 1 | type u8 | pad_len u16 | sender Ed25519 key 32 | body
    | pad_len zero bytes | Ed25519 signature 64 over the protocol's context + everything before it

Padding lets a request be at least as large as anything it causes (no amplification). A type this version does
not know decodes to ``Unknown``; anything malformed raises a ``FrameError`` subclass. Sans-IO.
"""

from __future__ import annotations

import ipaddress
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from typing import ClassVar, Protocol, Self

from experts.errors import RemoteProtocolError
from p2p.identity import Identity, IdentityError, PeerId
from p2p.wire import frames

Address = tuple[str, int]

VERSION = 1
NONCE_LEN = 16
KEY_LEN = 32
SIGNATURE_LEN = 64
HEADER = struct.Struct(">3sBBH")  # magic, version, type, pad_len
ENVELOPE_LEN = HEADER.size + KEY_LEN + SIGNATURE_LEN
MAX_FRAME = 512  # every frame of both protocols is far smaller; checked before anything is parsed
FRAME_MARK = 0x0D  # first byte of every frame: 00xxxxxx is never a QUIC packet (fixed bit 0x40)


class FrameError(RemoteProtocolError):
    """Bytes that are not an acceptable frame; the subclass says why."""


class Truncated(FrameError):
    """The data ends inside a field."""


class FrameTooLarge(FrameError):
    """The datagram exceeds MAX_FRAME (checked before parsing)."""


class InvalidField(FrameError):
    """A field holds a value the protocol forbids (bad magic, address family, padding, size...)."""


class BadSignature(FrameError):
    """The signature does not verify against the sender key the frame names."""


# --- field codecs (shared with p2p.nat.holepunch) -----------------------------------------------------------------------


def _trailing(field: str, detail: str) -> InvalidField:
    return InvalidField(detail)  # the whole frame is the field here: "N bytes after the last field"


class Reader(frames.Reader):
    """The shared frame reader over a frame's body (big-endian, ``FrameError``s), plus peer and address fields."""

    __slots__ = ()

    def __init__(self, data: bytes, start: int = 0, end: int | None = None) -> None:
        super().__init__(data, truncated=frames.prefixed(Truncated), trailing=_trailing, start=start, end=end)

    def peer(self, name: str) -> PeerId:
        return PeerId.from_public_bytes(self.take(KEY_LEN, name))

    def ip(self, name: str) -> str:
        family = self.u8(name)
        if family not in (4, 6):
            raise InvalidField(f"{name}: address family {family} is neither 4 nor 6")
        return str(ipaddress.ip_address(self.take(4 if family == 4 else 16, name)))

    def addr(self, name: str) -> Address:
        host = self.ip(name)
        port = self.u16(name)
        if port == 0:
            raise InvalidField(f"{name}: port 0")
        return host, port


def encode_ip(host: str) -> bytes:
    """family (4 or 6) and the packed address; ValueError for anything that is not an IP literal."""
    ip = ipaddress.ip_address(host)
    return bytes([ip.version]) + ip.packed


def encode_addr(addr: Address) -> bytes:
    host, port = addr
    if not 0 < port <= 0xFFFF:
        raise ValueError(f"port {port} is outside 1..65535")
    return encode_ip(host) + port.to_bytes(2, "big")


def check_nonce(nonce: bytes) -> None:
    if not isinstance(nonce, bytes) or len(nonce) != NONCE_LEN:
        raise ValueError(f"a nonce has {NONCE_LEN} bytes")


def check_addrs(addrs: tuple[Address, ...], limit: int) -> None:
    if not isinstance(addrs, tuple) or len(addrs) > limit:
        raise ValueError(f"at most {limit} addresses, as a tuple")
    for addr in addrs:
        encode_addr(addr)


def encode_addrs(addrs: tuple[Address, ...]) -> bytes:
    return bytes([len(addrs)]) + b"".join(encode_addr(a) for a in addrs)


def read_addrs(r: Reader, name: str, limit: int) -> tuple[Address, ...]:
    n = r.u8(name)
    if n > limit:
        raise InvalidField(f"{name}: {n} addresses, at most {limit}")
    return tuple(r.addr(name) for _ in range(n))


class Frame(Protocol):
    TYPE: ClassVar[int]
    MIN_SIZE: ClassVar[int]

    def body(self) -> bytes: ...

    @classmethod
    def parse(cls, r: Reader) -> Self: ...


@dataclass(frozen=True)
class Unknown:
    """A correctly signed frame of a type this version does not know: the receiver ignores it."""

    type: int
    body: bytes


class SignedCodec:
    """The signed envelope for one protocol: its magic, signing context and frame types."""

    def __init__(self, magic: bytes, context: bytes, frames: Iterable[type[Frame]]) -> None:
        self.magic = magic
        self.context = context
        self.frames = {cls.TYPE: cls for cls in frames}

    def encode(self, frame: Frame, identity: Identity) -> bytes:
        body = frame.body()
        pad = max(0, frame.MIN_SIZE - ENVELOPE_LEN - len(body))
        head = HEADER.pack(self.magic, VERSION, frame.TYPE, pad) + identity.public_bytes + body + bytes(pad)
        data = head + identity.sign(self.context + head)
        if len(data) > MAX_FRAME:
            raise ValueError(f"frame of {len(data)} bytes exceeds MAX_FRAME {MAX_FRAME}")
        return data

    def decode(self, data: bytes) -> tuple[PeerId, Frame | Unknown]:
        """The verified sender and the frame; a ``FrameError`` for anything else."""
        if len(data) > MAX_FRAME:
            raise FrameTooLarge(f"{len(data)} bytes exceed MAX_FRAME {MAX_FRAME}")
        if len(data) < ENVELOPE_LEN:
            raise Truncated(f"{len(data)} bytes are shorter than the {ENVELOPE_LEN}-byte envelope")
        magic, version, type_, pad = HEADER.unpack_from(data)
        if magic != self.magic or version != VERSION:
            raise InvalidField(f"magic {magic!r} version {version} is not {self.magic!r} version {VERSION}")
        body_end = len(data) - SIGNATURE_LEN - pad
        if body_end < HEADER.size + KEY_LEN:
            raise Truncated(f"padding of {pad} bytes does not fit in a {len(data)}-byte frame")
        if any(data[body_end : len(data) - SIGNATURE_LEN]):
            raise InvalidField("padding is not all zero")
        try:
            sender = PeerId.from_public_bytes(data[HEADER.size : HEADER.size + KEY_LEN])
        except IdentityError as exc:
            raise InvalidField(str(exc)) from None
        if not sender.verify(self.context + data[:-SIGNATURE_LEN], data[-SIGNATURE_LEN:]):
            raise BadSignature(f"type {type_} frame: signature does not verify for {sender}")
        cls = self.frames.get(type_)
        if cls is None:
            return sender, Unknown(type_, data[HEADER.size + KEY_LEN : body_end])
        if len(data) < cls.MIN_SIZE:
            raise InvalidField(f"{cls.__name__} of {len(data)} bytes is below its minimum {cls.MIN_SIZE}")
        r = Reader(data, HEADER.size + KEY_LEN, body_end)
        try:
            frame = cls.parse(r)
        except FrameError:
            raise
        except ValueError as exc:  # a value the frame's own checks refuse
            raise InvalidField(f"{cls.__name__}: {exc}") from None
        r.finish()
        return sender, frame
