"""Wire protocol building blocks: error codes and exceptions, field checks, and the body reader (``p2p.wire.frames``).

Shared by every message type of :mod:`p2p.wire.messages`; split out so the message definitions read on their own. Every
check raises a :class:`ProtocolError` subclass naming the field, so a peer's bad bytes become an error reply.
"""

from __future__ import annotations

import struct
from enum import IntEnum
from typing import ClassVar, TypeVar

from experts.errors import RemoteProtocolError
from p2p.wire.frames import Reader, exact_bytes, int_in

MAX_MESSAGE = 64 * 1024 * 1024  # header included


class ErrorCode(IntEnum):
    """Why a request was refused (0 reserved)."""

    MALFORMED = 1
    UNSUPPORTED_VERSION = 2
    UNKNOWN_MODEL = 3
    NOT_HOSTED = 4
    BAD_CODEC = 5
    TOO_LARGE = 6
    OVERLOADED = 7
    INTERNAL = 8
    DRAINING = 9  # the worker is shutting down: it withdrew its records; ask another replica
    STAGE_GAP = 10  # a stage pass starts after the positions the stage holds; the ErrorReply's ``held`` says where


class ProtocolError(RemoteProtocolError):
    """A message breaks this protocol. ``field`` names the part at fault; ``error_code`` is the code to answer with.

    Raised by ``decode`` when a peer sends such bytes, and by the constructors when local code builds such a value.
    """

    error_code: ClassVar[ErrorCode] = ErrorCode.MALFORMED

    def __init__(self, field: str, detail: str) -> None:
        super().__init__(f"{field}: {detail}")
        self.field = field
        self.detail = detail


class Truncated(ProtocolError):
    """The data ends inside ``field``."""


class InvalidField(ProtocolError):
    """``field`` holds a value the protocol forbids, or one that disagrees with another field."""


class BadCodec(InvalidField):
    """A payload claims a codec this side does not know."""

    error_code = ErrorCode.BAD_CODEC


class TooLarge(ProtocolError):
    """``field`` exceeds a hard limit; ``size`` and ``limit`` say by how much."""

    error_code = ErrorCode.TOO_LARGE

    def __init__(self, field: str, size: int, limit: int) -> None:
        super().__init__(field, f"{size} exceeds the limit of {limit}")
        self.size = size
        self.limit = limit


class UnsupportedVersion(ProtocolError):
    """A message (or a peer's Hello) uses only protocol versions this side does not speak."""

    error_code = ErrorCode.UNSUPPORTED_VERSION


# --- field checks, shared by the constructors and the decoder -------------------------------------------------------


def set_frozen(obj: object, name: str, value: object) -> None:
    object.__setattr__(obj, name, value)  # normalise a field of a frozen dataclass in __post_init__


def int_field(field: str, value: object, lo: int, hi: int) -> int:
    return int_in(field, value, lo, hi, InvalidField)


def count_field(field: str, value: object, lo: int, limit: int) -> int:
    """A count or length: above ``limit`` is too large, below ``lo`` (or not an integer) is malformed."""
    if isinstance(value, int) and value > limit:
        raise TooLarge(field, value, limit)
    return int_field(field, value, lo, limit)


def bytes_field(field: str, value: object, lo: int, limit: int) -> bytes:
    if lo == limit:
        return exact_bytes(field, value, lo, InvalidField)
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise InvalidField(field, f"expected bytes, got {type(value).__name__}")
    value = bytes(value)
    count_field(field, len(value), lo, limit)
    return value


E = TypeVar("E", bound=IntEnum)


def enum_field(enum: type[E], field: str, value: object, error: type[InvalidField] = InvalidField) -> E:
    try:
        return enum(value)  # type: ignore[arg-type]  # any value: the enum itself refuses what it does not know
    except ValueError:
        raise error(field, f"{value!r} is not a known {enum.__name__}") from None


def as_wire(field: str, code: str, values: object) -> tuple:
    """``values`` exactly as they will decode from a little-endian array of struct type ``code`` (e.g. f32-rounded)."""
    values = tuple(values)  # type: ignore[arg-type]
    fmt = f"<{len(values)}{code}"
    try:
        return struct.unpack(fmt, struct.pack(fmt, *values))
    except (struct.error, OverflowError) as exc:
        raise InvalidField(field, f"does not fit the wire type ({exc})") from None


def body_reader(body: memoryview) -> Reader:
    """The shared reader over a message body: little-endian, running short is ``Truncated``, leftovers ``InvalidField``."""
    return Reader(body, truncated=Truncated, trailing=InvalidField, byteorder="little")


def sized(r: Reader, width: int, lo: int, limit: int, field: str) -> bytes:
    """A length-prefixed byte string, its length checked against ``lo`` and ``limit`` before slicing."""
    return r.take(count_field(field, r.uint(width, field), lo, limit), field)


def rest(r: Reader, lo: int, field: str) -> bytes:
    """The body's remaining bytes: a last field without a length prefix (``body_len`` already bounds it)."""
    return r.take(count_field(field, r.left, lo, MAX_MESSAGE), field)
