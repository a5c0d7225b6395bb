"""The one bounds-checked reader of binary frames, shared by the wire protocol, the NAT frames, the relay and DHT records.

Every codec reads a frame front to back, and every read checks that its bytes are present before it slices or
converts anything, so a length field that lies costs nothing: the truncation error comes first. Each protocol
keeps its own exceptions (their types and messages are part of its tests and its error replies): a reader is
built with two factories, ``(field, detail) -> exception``, one for data that ends inside a field and one for
bytes left over after the last field. The field checks below (integer ranges, exact sizes) take such a factory
too, so constructors and decoders of every protocol refuse a value in the same words. Sans-IO, no dependencies.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Literal

FieldError = Callable[[str, str], Exception]  # (field, detail) -> the protocol's own exception, raised by the reader
ByteOrder = Literal["big", "little"]

_UINTS = {
    order: {struct.calcsize(code): struct.Struct(prefix + code) for code in "BHIQ"}
    for order, prefix in (("big", ">"), ("little", "<"))
}


class Reader:
    """Reads ``data[start:end]`` front to back; every read checks that its bytes are present before slicing."""

    __slots__ = ("_data", "_end", "_pos", "_prefix", "_trailing", "_truncated", "_uints")

    def __init__(
        self,
        data: bytes | memoryview,
        *,
        truncated: FieldError,
        trailing: FieldError,
        byteorder: ByteOrder = "big",
        start: int = 0,
        end: int | None = None,
    ) -> None:
        self._data = data
        self._pos = start
        self._end = len(data) if end is None else end
        self._uints = _UINTS[byteorder]
        self._prefix = ">" if byteorder == "big" else "<"
        self._truncated = truncated
        self._trailing = trailing

    @property
    def left(self) -> int:
        """Bytes not read yet."""
        return self._end - self._pos

    def _advance(self, n: int, field: str) -> int:
        start, left = self._pos, self._end - self._pos
        if n > left:
            raise self._truncated(field, f"needs {n} bytes, {left} left")
        self._pos = start + n
        return start

    def take(self, n: int, field: str) -> bytes:
        start = self._advance(n, field)
        return bytes(self._data[start : start + n])

    def uint(self, size: int, field: str) -> int:
        """An unsigned integer of ``size`` bytes (1, 2, 4 or 8) in the reader's byte order."""
        fmt = self._uints[size]
        return fmt.unpack_from(self._data, self._advance(size, field))[0]

    def u8(self, field: str) -> int:
        return self.uint(1, field)

    def u16(self, field: str) -> int:
        return self.uint(2, field)

    def u32(self, field: str) -> int:
        return self.uint(4, field)

    def u64(self, field: str) -> int:
        return self.uint(8, field)

    def array(self, code: str, count: int, field: str) -> tuple:
        """``count`` values of struct type ``code`` (e.g. ``"f"``, ``"h"``) in the reader's byte order."""
        fmt = struct.Struct(f"{self._prefix}{count}{code}")
        return fmt.unpack_from(self._data, self._advance(fmt.size, field))

    def sized(self, width: int, field: str) -> bytes:
        """A byte string after its length (an unsigned integer of ``width`` bytes), checked before slicing."""
        return self.take(self.uint(width, field), field)

    def rest(self, field: str) -> bytes:
        """Everything not read yet: a last field that runs to the end of the frame."""
        return self.take(self.left, field)

    def finish(self, field: str = "body") -> None:
        """Refuse bytes after the last field."""
        if self.left:
            raise self._trailing(field, f"{self.left} bytes after the last field")


def prefixed(error: Callable[[str], Exception]) -> FieldError:
    """A factory for an exception that takes one message: ``"field: detail"``."""
    return lambda field, detail: error(f"{field}: {detail}")


# --- field checks, shared by the codecs' constructors and decoders ---------------------------------------------------


def int_in(field: str, value: object, lo: int, hi: int, error: FieldError) -> int:
    """``value`` if it is an integer (not a bool) in ``[lo, hi]``; else the protocol's ``error``."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise error(field, f"expected an integer, got {type(value).__name__}")
    if not lo <= value <= hi:
        raise error(field, f"{value} is outside [{lo}, {hi}]")
    return value


def exact_bytes(field: str, value: object, size: int, error: FieldError) -> bytes:
    """``value`` as bytes if it is bytes-like of exactly ``size`` bytes; else the protocol's ``error``."""
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise error(field, f"expected bytes, got {type(value).__name__}")
    if len(value) != size:
        raise error(field, f"must be {size} bytes, got {len(value)}")
    return bytes(value)
