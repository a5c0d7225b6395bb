"""The shared frame reader and field checks: bounds first, each protocol's own errors, either byte order."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from p2p.wire.frames import Reader, exact_bytes, int_in


class Short(Exception):
    """The test protocol's truncation error."""


class Leftover(Exception):
    """The test protocol's trailing-bytes error."""


def reader(data: bytes, **kwargs) -> Reader:
    return Reader(data, truncated=lambda f, d: Short(f, d), trailing=lambda f, d: Leftover(f, d), **kwargs)


def test_reads_in_either_byte_order():
    """u8..u64, arrays and length-prefixed fields read front to back in the reader's byte order."""
    data = bytes([1]) + (2).to_bytes(2, "big") + (3).to_bytes(4, "big") + (4).to_bytes(8, "big") + b"\x02hi" + b"tail"
    r = reader(data)
    assert (r.u8("a"), r.u16("b"), r.u32("c"), r.u64("d"), r.sized(1, "e"), r.rest("f")) == (1, 2, 3, 4, b"hi", b"tail")
    r.finish()
    little = reader((513).to_bytes(2, "little") + (7).to_bytes(2, "little"), byteorder="little")
    assert (little.u16("x"), little.array("h", 1, "y")) == (513, (7,))


def test_a_lying_length_is_refused_before_slicing():
    """A length prefix larger than what is left raises the protocol's truncation error naming the field."""
    r = reader(b"\xff\xffab")
    with pytest.raises(Short) as info:
        r.sized(2, "payload")
    assert info.value.args == ("payload", "needs 65535 bytes, 2 left")


def test_window_and_leftovers():
    """``start``/``end`` bound the reader; bytes left at ``finish`` are the protocol's trailing error."""
    r = reader(b"xxabcyy", start=2, end=5)
    assert r.take(2, "ab") == b"ab" and r.left == 1
    with pytest.raises(Leftover, match="1 bytes after the last field"):
        r.finish()
    with pytest.raises(Short):
        r.take(2, "c")


@given(data=st.binary(max_size=64), sizes=st.lists(st.sampled_from([1, 2, 4, 8]), max_size=12))
def test_never_raises_anything_but_the_protocol_errors(data, sizes):
    """Any sequence of reads over any bytes returns values or raises only the protocol's two errors."""
    r = reader(data)
    try:
        for size in sizes:
            r.uint(size, "n")
        r.finish()
    except (Short, Leftover):
        pass


def test_field_checks_raise_the_given_error():
    """int_in and exact_bytes accept good values and raise the protocol's error for bad ones."""
    assert int_in("n", 5, 0, 9, Short) == 5
    assert exact_bytes("k", bytearray(b"ab"), 2, Short) == b"ab"
    for bad in (True, "5", 10, -1):
        with pytest.raises(Short):
            int_in("n", bad, 0, 9, Short)
    for bad in ("ab", b"abc"):
        with pytest.raises(Short):
            exact_bytes("k", bad, 2, Short)
