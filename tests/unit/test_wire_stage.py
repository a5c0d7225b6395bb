"""Stage messages on the wire (issue 26): StagePass, StageReply and the STAGE_GAP error reply's structured ``held``."""

from __future__ import annotations

import struct
import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from p2p.wire import messages as wire
from p2p.wire.messages import (
    MAX_MESSAGE,
    MAX_STAGE_WIDTH,
    MAX_TOKENS,
    ErrorCode,
    ErrorReply,
    InvalidField,
    MsgType,
    ProtocolError,
    StagePass,
    StageReply,
    TooLarge,
    Truncated,
    decode,
    error_reply_for,
)

SESSION = bytes(range(16))
MODEL = bytes(range(16, 32))


def frame(msg_type: int, body: bytes) -> bytes:
    return b"MSW" + struct.pack("<BBHI", 1, msg_type, 0, len(body)) + body


@st.composite
def passes(draw) -> StagePass:
    n, w = draw(st.integers(1, 4)), draw(st.integers(1, 8))
    start_layer = draw(st.integers(0, 100))
    rows = draw(st.binary(min_size=4 * n * w, max_size=4 * n * w))
    return StagePass(draw(st.binary(min_size=16, max_size=16)), draw(st.binary(min_size=16, max_size=16)), (start_layer, start_layer + draw(st.integers(1, 100))), draw(st.integers(0, 2**32 - 1)), n, w, rows)


@st.composite
def replies(draw) -> StageReply:
    n, w = draw(st.integers(1, 4)), draw(st.integers(1, 8))
    return StageReply(draw(st.binary(min_size=16, max_size=16)), n, w, draw(st.binary(min_size=4 * n * w, max_size=4 * n * w)), draw(st.integers(0, 2**32 - 1)))


gaps = st.builds(ErrorReply, st.binary(min_size=16, max_size=16), st.just(ErrorCode.STAGE_GAP), st.text(max_size=40), st.integers(0, 2**32 - 1))


@settings(max_examples=300, deadline=None)
@given(message=st.one_of(passes(), replies(), gaps))
def test_stage_messages_round_trip(message):
    encoded = message.encode()
    assert len(encoded) == message.encoded_len()
    assert decode(encoded) == message


def test_exact_bytes_of_a_stage_pass_and_reply():
    """Written from the layout table in the module docstring, not from the encoder."""
    rows = np.array([[1.0, -2.0]], dtype="<f4").tobytes()
    body = SESSION + MODEL + struct.pack("<HHIHI", 2, 4, 7, 1, 2) + rows
    assert StagePass(SESSION, MODEL, (2, 4), 7, 1, 2, rows).encode() == frame(MsgType.STAGE_PASS, body)
    assert decode(frame(MsgType.STAGE_PASS, body)) == StagePass(SESSION, MODEL, (2, 4), 7, 1, 2, rows)
    reply = SESSION + struct.pack("<HII", 1, 2, 99) + rows
    assert StageReply(SESSION, 1, 2, rows, 99).encode() == frame(MsgType.STAGE_REPLY, reply)


def test_gap_reply_carries_held_as_a_field():
    """STAGE_GAP's ``held`` is a u32 after the text; no other code has it, so their layout is unchanged."""
    gap = ErrorReply(SESSION, ErrorCode.STAGE_GAP, "lost", held=5)
    assert gap.encode() == frame(MsgType.ERROR_REPLY, SESSION + bytes([ErrorCode.STAGE_GAP]) + struct.pack("<H", 4) + b"lost" + struct.pack("<I", 5))
    assert decode(gap.encode()).held == 5
    assert ErrorReply(SESSION, ErrorCode.INTERNAL, "x").encode() == frame(MsgType.ERROR_REPLY, SESSION + bytes([8, 1, 0]) + b"x")
    with pytest.raises(InvalidField, match="held"):
        ErrorReply(SESSION, ErrorCode.INTERNAL, "x", held=1)
    with pytest.raises(Truncated, match="held"):  # a gap reply without its held
        decode(frame(MsgType.ERROR_REPLY, SESSION + bytes([ErrorCode.STAGE_GAP, 0, 0])))


def test_error_reply_for_a_gap_takes_held_from_the_exception():
    class Gap(Exception):
        error_code = ErrorCode.STAGE_GAP
        held = 12

    reply = error_reply_for(Gap("replay from 12"), SESSION)
    assert (reply.code, reply.held, reply.dispatch_id) == (ErrorCode.STAGE_GAP, 12, SESSION)


@pytest.mark.parametrize(
    ("n_rows", "width", "field", "error"),
    [
        (MAX_TOKENS + 1, 1, "n_rows", TooLarge),
        (1, MAX_STAGE_WIDTH + 1, "width", TooLarge),
        (0, 4, "n_rows", InvalidField),
        (1, 0, "width", InvalidField),
    ],
)
def test_row_counts_are_checked_before_the_rows_are_read(n_rows, width, field, error):
    """A count past its limit is refused from the header alone: the rows it claims are absent and never allocated."""
    body = SESSION + MODEL + struct.pack("<HHIHI", 0, 1, 0, n_rows, width) + bytes(8)
    with pytest.raises(error) as refused:
        decode(frame(MsgType.STAGE_PASS, body))
    assert refused.value.field == field


def test_rows_must_fill_the_body_exactly():
    for extra in (-1, 1):
        body = SESSION + struct.pack("<HII", 2, 3, 0) + bytes(24 + extra)
        with pytest.raises(InvalidField, match="rows"):
            decode(frame(MsgType.STAGE_REPLY, body))
    with pytest.raises(InvalidField, match="rows"):
        StageReply(SESSION, 2, 3, bytes(23))
    with pytest.raises(InvalidField, match="layers"):
        StagePass(SESSION, MODEL, (3, 3), 0, 1, 1, bytes(4))


def test_a_pass_may_not_exceed_max_message():
    width = MAX_STAGE_WIDTH
    n = MAX_MESSAGE // (4 * width)  # exactly MAX_MESSAGE of rows: with the header, one message too many
    with pytest.raises(TooLarge) as refused:
        StageReply(SESSION, n, width, bytes(4 * n * width))
    assert refused.value.field == "message"


def test_a_huge_claim_allocates_nothing():
    """A header claiming MAX_TOKENS x MAX_STAGE_WIDTH rows with a tiny body is refused without a large allocation."""
    body = SESSION + MODEL + struct.pack("<HHIHI", 0, 1, 0, MAX_TOKENS, MAX_STAGE_WIDTH) + bytes(4)
    tracemalloc.start()
    try:
        with pytest.raises(ProtocolError):
            decode(frame(MsgType.STAGE_PASS, body))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(message=st.one_of(passes(), replies(), gaps), cut=st.integers(0, 200), byte=st.integers(0, 255))
def test_mangled_stage_messages_decode_canonically_or_refuse(message, cut, byte):
    """Any single-byte change or truncation either is refused with a ProtocolError or decodes to a value that
    re-encodes to exactly those bytes."""
    data = bytearray(message.encode())
    at = cut % len(data)
    for mangled in (bytes(data[:at]), bytes(data[:at]) + bytes([byte]) + bytes(data[at + 1 :])):
        try:
            decoded = decode(mangled)
        except ProtocolError:
            continue
        assert decoded.encode() == mangled


def test_stage_types_are_known():
    assert wire.MsgType.STAGE_PASS == 15 and wire.MsgType.STAGE_REPLY == 16
