"""Wire protocol building blocks: error codes and exceptions, field checks, and the bounds-checked body reader.

Shared by every message type of :mod:`p2p.wire`; split out so the message definitions read on their own. Every
check raises a :class:`ProtocolError` subclass naming the field, so a peer's bad bytes become an error reply.
"""

from __future__ import annotations

import struct
from enum import IntEnum
from typing import ClassVar

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


class ProtocolError(ValueError):
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
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidField(field, f"expected an integer, got {type(value).__name__}")
    if not lo <= value <= hi:
        raise InvalidField(field, f"{value} is outside [{lo}, {hi}]")
    return value


def count_field(field: str, value: object, lo: int, limit: int) -> int:
    """A count or length: above ``limit`` is too large, below ``lo`` (or not an integer) is malformed."""
    if isinstance(value, int) and value > limit:
        raise TooLarge(field, value, limit)
    return int_field(field, value, lo, limit)


def bytes_field(field: str, value: object, lo: int, limit: int) -> bytes:
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise InvalidField(field, f"expected bytes, got {type(value).__name__}")
    value = bytes(value)
    if lo == limit and len(value) != lo:
        raise InvalidField(field, f"must be {lo} bytes, got {len(value)}")
    count_field(field, len(value), lo, limit)
    return value


def enum_field(enum: type[IntEnum], field: str, value: object, error: type[InvalidField] = InvalidField) -> IntEnum:
    try:
        return enum(value)
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


class Reader:
    """Reads a body front to back; every read checks that its bytes are present before slicing."""

    __slots__ = ("_view", "_pos")

    def __init__(self, view: memoryview) -> None:
        self._view = view
        self._pos = 0

    def _advance(self, n: int, field: str) -> int:
        start = self._pos
        left = len(self._view) - start
        if n > left:
            raise Truncated(field, f"needs {n} bytes, {left} left")
        self._pos = start + n
        return start

    def bytes(self, n: int, field: str) -> bytes:
        start = self._advance(n, field)
        return bytes(self._view[start : start + n])

    def int(self, fmt: struct.Struct, field: str) -> int:
        return fmt.unpack_from(self._view, self._advance(fmt.size, field))[0]

    def sized(self, len_fmt: struct.Struct, lo: int, limit: int, field: str) -> bytes:
        """A length-prefixed byte string, its length checked against ``lo`` and ``limit`` before slicing."""
        return self.bytes(count_field(field, self.int(len_fmt, field), lo, limit), field)

    def array(self, code: str, count: int, field: str) -> tuple:
        fmt = struct.Struct(f"<{count}{code}")
        return fmt.unpack_from(self._view, self._advance(fmt.size, field))

    def rest(self, lo: int, field: str) -> bytes:
        """The body's remaining bytes: a last field without a length prefix (``body_len`` already bounds it)."""
        return self.bytes(count_field(field, len(self._view) - self._pos, lo, MAX_MESSAGE), field)

    def finish(self) -> None:
        left = len(self._view) - self._pos
        if left:
            raise InvalidField("body", f"{left} bytes after the last field")
