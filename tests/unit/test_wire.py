"""The dispatch wire protocol: exact bytes, round trips, limits, and decoding hostile input."""

from __future__ import annotations

import dataclasses
import hashlib
import struct
import tracemalloc

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from p2p.wire import messages as wire
from p2p.wire.messages import (
    MAX_ERROR_TEXT,
    MAX_MESSAGE,
    MAX_RECEIPT,
    MAX_TOKENS,
    MAX_TOP_K,
    MODEL_ID_LEN,
    ZERO_ID,
    BadCodec,
    Codec,
    DispatchReply,
    DispatchRequest,
    ErrorCode,
    ErrorReply,
    Hello,
    HelloAck,
    InvalidField,
    LedgerHead,
    MsgType,
    Piece,
    PieceRequest,
    Ping,
    Pong,
    ProtocolError,
    Role,
    SliceInfo,
    SliceInfoRequest,
    TooLarge,
    Truncated,
    Unknown,
    UnsupportedVersion,
    decode,
    decode_header,
    error_reply_for,
    model_id_of,
    negotiate,
    peek_dispatch_id,
)

FUZZ = settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
ID = bytes(range(16))


def frame(msg_type: int, body: bytes, *, version: int = 1, flags: int = 0, body_len: int | None = None) -> bytes:
    """A message built by hand from the spec's header layout, independent of the encoder."""
    return b"MSW" + struct.pack("<BBHI", version, msg_type, flags, len(body) if body_len is None else body_len) + body


# --- exact bytes: each hex literal is written from the layout table in the module docstring -------------------------

REQUEST = DispatchRequest(
    dispatch_id=ID,
    model_id=b"\xdd" * 16,
    layer=258,
    codec=Codec.F16,
    n_tokens=2,
    top_k=2,
    expert_ids=(3, -1, 0, 7),
    router_weights=(0.5, 0.0, 1.0, -2.0),
    hidden=b"\x01\x02\x03",
)
REQUEST_BODY = bytes.fromhex(
    "000102030405060708090a0b0c0d0e0f"  # dispatch_id
    + "dd" * 16  # model_id
    + "0201"  # layer 258
    + "01"  # codec F16
    + "02"  # top_k
    + "0200"  # n_tokens
    + "0300" "ffff" "0000" "0700"  # expert_ids 3, -1, 0, 7
    + "0000003f" "00000000" "0000803f" "000000c0"  # router_weights 0.5, 0.0, 1.0, -2.0
    + "010203"  # hidden: the rest of the body
)
# Offsets of request fields inside REQUEST_BODY, for the malformed-input tests below.
R_CODEC, R_TOP_K, R_N_TOKENS, R_IDS, R_WEIGHTS, R_HIDDEN = 34, 35, 36, 38, 46, 62

SNAPSHOTS = [
    pytest.param(
        Hello(Role.WORKER, versions=(1,), codecs=(Codec.F32, Codec.F16), models=(b"\xaa" * 32,)),
        "4d5357 01 01 0000 27000000" "02" "01 01" "02 0001" "01" + "aa" * 32,
        id="hello",
    ),
    pytest.param(
        HelloAck(Role.BACKBONE, versions=(1, 2), codecs=(Codec.INT8,)),
        "4d5357 01 02 0000 07000000" "01" "02 0102" "01 02" "00",
        id="hello_ack",
    ),
    pytest.param(REQUEST, "4d5357 01 03 0000 41000000" + REQUEST_BODY.hex(), id="dispatch_request"),
    pytest.param(
        DispatchReply(ID, Codec.F32, n_tokens=1, partial=b"\xab\xcd\xef\x01", compute_us=1000, receipt=b"sig"),
        "4d5357 01 04 0000 20000000" "000102030405060708090a0b0c0d0e0f" "00" "0100" "e8030000"
        "0300 736967" "abcdef01",
        id="dispatch_reply",
    ),
    pytest.param(
        ErrorReply(ZERO_ID, ErrorCode.OVERLOADED, "busy"),
        "4d5357 01 05 0000 17000000" + "00" * 16 + "07" "0400 62757379",
        id="error_reply",
    ),
    pytest.param(
        Ping(nonce=0x1122334455667788, sent_at_us=1),
        "4d5357 01 06 0000 10000000" "8877665544332211" "0100000000000000",
        id="ping",
    ),
    pytest.param(
        Pong(nonce=0x1122334455667788, sent_at_us=1),
        "4d5357 01 07 0000 10000000" "8877665544332211" "0100000000000000",
        id="pong",
    ),
    pytest.param(
        LedgerHead(Role.WORKER, seq=2, entry_hash=b"\x11" * 32, signature=b"\x22" * 64, ask_seq=1, ask_hash=b"\x33" * 32),
        "4d5357 01 08 0000 91000000" "02" "0200000000000000" + "11" * 32 + "22" * 64 + "0100000000000000" + "33" * 32,
        id="ledger_head",
    ),
    pytest.param(SliceInfoRequest(b"\xdd" * 16), "4d5357 01 09 0000 10000000" + "dd" * 16, id="slice_info_request"),
    pytest.param(
        SliceInfo((1, 3), (0, 2), ("config|{}", "t|F32|2|ab"), (("n", ("a" * 64, "b" * 64)),)),
        "4d5357 01 0a 0000 a2000000" "0100 0300" "0000 0200" "14000000"
        + b"config|{}\nt|F32|2|ab".hex() + b"n|".hex() + b"a".hex() * 64 + b"b".hex() * 64,
        id="slice_info",
    ),
    pytest.param(
        PieceRequest(b"\xdd" * 16, "n", expert=3, offset=16, length=256),
        "4d5357 01 0b 0000 1c000000" + "dd" * 16 + "0300" "10000000" "00010000" "01 6e",
        id="piece_request",
    ),
    pytest.param(Piece(16, b"\xab\xcd"), "4d5357 01 0c 0000 06000000" "10000000" "abcd", id="piece"),
    pytest.param(
        wire.ReceiptSignRequest((b"\x01" * 16, b"\x02" * 16)), "4d5357 01 0d 0000 22000000" "0200" + "01" * 16 + "02" * 16, id="receipt_sign_request"
    ),
    pytest.param(
        wire.ReceiptBatch((b"\x01" * 16,), (b"\x0a" * 32,), b"\x5e" * 64),
        "4d5357 01 0e 0000 72000000" "0100" + "01" * 16 + "0a" * 32 + "5e" * 64,
        id="receipt_batch",
    ),
    pytest.param(
        wire.StagePass(ID, b"\xdd" * 16, (2, 4), 7, 1, 2, bytes.fromhex("0000803f000000c0")),
        "4d5357 01 0f 0000 36000000" "000102030405060708090a0b0c0d0e0f" + "dd" * 16 + "0200 0400" "07000000" "0100" "02000000"
        "0000803f" "000000c0",
        id="stage_pass",
    ),
    pytest.param(
        wire.StageReply(ID, 1, 2, bytes.fromhex("0000803f000000c0"), compute_us=99),
        "4d5357 01 10 0000 22000000" "000102030405060708090a0b0c0d0e0f" "0100" "02000000" "63000000" "0000803f" "000000c0",
        id="stage_reply",
    ),
    pytest.param(
        ErrorReply(ID, ErrorCode.STAGE_GAP, "gap", held=3),
        "4d5357 01 05 0000 1a000000" "000102030405060708090a0b0c0d0e0f" "0a" "0300 676170" "03000000",
        id="error_reply_stage_gap",
    ),
    pytest.param(Unknown(0xC8, b"\xff", flags=3), "4d5357 01 c8 0300 01000000 ff", id="unknown"),
]


@pytest.mark.parametrize(("message", "hex_bytes"), SNAPSHOTS)
def test_snapshot_bytes(message, hex_bytes):
    """Each message type encodes to exactly the bytes the spec table gives, and those bytes decode back to it."""
    expected = bytes.fromhex(hex_bytes)
    assert message.encode() == expected
    assert message.encoded_len() == len(expected)
    assert decode(expected) == message


def test_every_message_type_has_a_snapshot():
    """The snapshot table covers every MsgType, so a new type cannot ship without its exact bytes."""
    covered = {p.values[0].TYPE for p in SNAPSHOTS}
    assert set(MsgType) <= covered


# --- round trips -----------------------------------------------------------------------------------------------------

ids16 = st.binary(min_size=16, max_size=16)
model_ids = st.binary(min_size=MODEL_ID_LEN, max_size=MODEL_ID_LEN)
digests = st.binary(min_size=32, max_size=32)
u64 = st.integers(0, 2**64 - 1)
f32 = st.floats(width=32, allow_nan=False, allow_infinity=False)
codecs = st.sampled_from(Codec)


@st.composite
def requests(draw, max_tokens: int = 5, max_top_k: int = 5) -> DispatchRequest:
    n_tokens = draw(st.integers(1, max_tokens))
    top_k = draw(st.integers(1, max_top_k))
    ids: list[int] = []
    for _ in range(n_tokens):
        experts = draw(st.lists(st.integers(0, 32767), min_size=top_k, max_size=top_k, unique=True))
        ours = draw(st.lists(st.booleans(), min_size=top_k, max_size=top_k))
        ids += [e if mine else -1 for e, mine in zip(experts, ours)]
    return DispatchRequest(
        dispatch_id=draw(ids16),
        model_id=draw(model_ids),
        layer=draw(st.integers(0, 0xFFFF)),
        codec=draw(codecs),
        n_tokens=n_tokens,
        top_k=top_k,
        expert_ids=tuple(ids),
        router_weights=tuple(draw(st.lists(f32, min_size=n_tokens * top_k, max_size=n_tokens * top_k))),
        hidden=draw(st.binary(min_size=1, max_size=64)),
    )


def capabilities(cls):
    return st.builds(
        cls,
        role=st.sampled_from(Role),
        versions=st.lists(st.integers(1, 255), min_size=1, max_size=8).map(tuple),
        codecs=st.lists(st.integers(0, 255), min_size=1, max_size=8).map(tuple),
        models=st.lists(digests, max_size=3).map(tuple),
    )


STRATEGIES = {
    "hello": capabilities(Hello),
    "hello_ack": capabilities(HelloAck),
    "dispatch_request": requests(),
    "dispatch_reply": st.builds(
        DispatchReply,
        dispatch_id=ids16,
        codec=codecs,
        n_tokens=st.integers(1, MAX_TOKENS),
        partial=st.binary(min_size=1, max_size=64),
        compute_us=st.integers(0, 2**32 - 1),
        receipt=st.binary(max_size=96),
    ),
    "error_reply": st.builds(
        ErrorReply,
        dispatch_id=ids16,
        code=st.sampled_from(ErrorCode),
        message=st.text(max_size=100),
    ),
    "ping": st.builds(Ping, nonce=u64, sent_at_us=u64),
    "pong": st.builds(Pong, nonce=u64, sent_at_us=u64),
    "receipt_sign_request": st.builds(wire.ReceiptSignRequest, st.lists(ids16, min_size=1, max_size=8, unique=True).map(tuple)),
    "receipt_batch": st.lists(st.tuples(ids16, digests), min_size=1, max_size=8, unique_by=lambda p: p[0]).flatmap(
        lambda pairs: st.builds(wire.ReceiptBatch, st.just(tuple(i for i, _ in pairs)), st.just(tuple(v for _, v in pairs)), st.binary(min_size=64, max_size=64))
    ),
    "unknown": st.builds(
        Unknown,
        msg_type=st.integers(0, 255).filter(lambda t: t not in {int(m) for m in MsgType}),
        body=st.binary(max_size=64),
        flags=st.integers(0, 0xFFFF),
    ),
}
any_message = st.one_of(*STRATEGIES.values())


@pytest.mark.parametrize("kind", STRATEGIES)
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_round_trip(kind, data):
    """Every message decodes from its own encoding to an equal value, and encoded_len() is the encoding's length."""
    message = data.draw(STRATEGIES[kind])
    encoded = message.encode()
    assert len(encoded) == message.encoded_len()
    assert decode(encoded) == message
    assert decode(bytearray(encoded)) == decode(memoryview(encoded)) == message


def test_receipt_batch_counts_are_checked_before_reading():
    """A sign request or batch naming more than MAX_RECEIPT_BATCH dispatches is TooLarge from its count alone (nothing
    after it is read), none is malformed, and an id named twice is refused."""
    for t in (MsgType.RECEIPT_SIGN_REQUEST, MsgType.RECEIPT_BATCH):
        with pytest.raises(TooLarge, match="count"):
            decode(wire.MAGIC + struct.pack("<BBHI", 1, t, 0, 2) + struct.pack("<H", wire.MAX_RECEIPT_BATCH + 1))
        with pytest.raises(ProtocolError, match="count"):
            decode(wire.MAGIC + struct.pack("<BBHI", 1, t, 0, 2) + struct.pack("<H", 0))
    with pytest.raises(ProtocolError, match="twice"):
        wire.ReceiptSignRequest((ID, ID))
    with pytest.raises(ProtocolError, match="leaves"):
        wire.ReceiptBatch((ID,), (), bytes(64))
    ids = tuple(i.to_bytes(16, "little") for i in range(wire.MAX_RECEIPT_BATCH))
    assert decode(wire.ReceiptSignRequest(ids).encode()) == wire.ReceiptSignRequest(ids)


def test_largest_request_round_trips():
    """A request at MAX_TOKENS x MAX_TOP_K is accepted and survives the round trip."""
    slots = MAX_TOKENS * MAX_TOP_K
    ids = tuple(e for _ in range(MAX_TOKENS) for e in range(MAX_TOP_K))
    request = DispatchRequest(ID, b"\0" * 16, 1, Codec.INT8, MAX_TOKENS, MAX_TOP_K, ids, (0.25,) * slots, b"h")
    assert decode(request.encode()) == request


def test_weights_are_held_as_float32():
    """Router weights are rounded to float32 on construction, so what a sender holds is exactly what arrives."""
    request = DispatchRequest(ID, b"\0" * 16, 0, Codec.F32, 1, 1, (4,), (0.1,), b"h")
    assert request.router_weights == struct.unpack("<f", struct.pack("<f", 0.1))
    assert request.router_weights != (0.1,)
    assert decode(request.encode()) == request


# --- hostile input ---------------------------------------------------------------------------------------------------


def _decodes_canonically_or_refuses(data: bytes) -> None:
    try:
        message = decode(data)
    except ProtocolError:
        return
    assert message.encode() == data  # one value, one encoding: nothing decodes that would re-encode differently


@FUZZ
@given(message=any_message, data=st.data())
def test_truncated_input_is_refused(message, data):
    """Every proper prefix of a valid message raises Truncated, never anything else."""
    encoded = message.encode()
    cut = data.draw(st.integers(0, len(encoded) - 1))
    with pytest.raises(Truncated):
        decode(encoded[:cut])


@FUZZ
@given(message=any_message, data=st.data())
def test_bit_flipped_input_decodes_canonically_or_raises_protocol_error(message, data):
    """Flipping bits of a valid message yields a canonical message or a ProtocolError, never another exception."""
    encoded = bytearray(message.encode())
    for position in data.draw(st.lists(st.integers(0, len(encoded) * 8 - 1), min_size=1, max_size=3)):
        encoded[position // 8] ^= 1 << (position % 8)
    _decodes_canonically_or_refuses(bytes(encoded))


@FUZZ
@given(data=st.binary(max_size=300))
def test_random_bytes_raise_only_protocol_error(data):
    """Arbitrary bytes decode canonically or raise a ProtocolError."""
    _decodes_canonically_or_refuses(data)


@FUZZ
@given(msg_type=st.sampled_from(MsgType), body=st.binary(max_size=200))
def test_random_bodies_behind_valid_headers_raise_only_protocol_error(msg_type, body):
    """Random bodies under a correct header reach every body parser and still only raise ProtocolError."""
    _decodes_canonically_or_refuses(frame(msg_type, body))


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=64))
def test_peek_dispatch_id_never_raises(data):
    """peek_dispatch_id returns a 16-byte id for any input."""
    assert len(peek_dispatch_id(data)) == 16


# --- limits ----------------------------------------------------------------------------------------------------------


def test_header_claiming_4_gib_is_refused_without_allocating():
    """A header announcing a 4 GiB body is TooLarge at once, and decoding it allocates almost nothing."""
    data = frame(MsgType.DISPATCH_REQUEST, b"\0" * 16, body_len=0xFFFFFFFF)
    tracemalloc.start()
    try:
        with pytest.raises(TooLarge) as refused:
            decode(data)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert refused.value.field == "body_len"
    assert refused.value.size == wire.HEADER_LEN + 0xFFFFFFFF and refused.value.limit == MAX_MESSAGE
    assert peak < 64 * 1024


def test_header_alone_gives_total_length_for_streaming():
    """decode_header needs only the first HEADER_LEN bytes and reports the whole message's length."""
    encoded = REQUEST.encode()
    header = decode_header(encoded[: wire.HEADER_LEN])
    assert (header.version, header.msg_type, header.flags) == (1, MsgType.DISPATCH_REQUEST, 0)
    assert header.total_len == len(encoded)
    with pytest.raises(TooLarge):
        decode_header(frame(MsgType.PING, b"", body_len=MAX_MESSAGE))


def _patched_request(offset: int, replacement: bytes) -> bytes:
    body = REQUEST_BODY[:offset] + replacement + REQUEST_BODY[offset + len(replacement) :]
    return frame(MsgType.DISPATCH_REQUEST, body)


@pytest.mark.parametrize(
    ("data", "field"),
    [
        pytest.param(_patched_request(R_N_TOKENS, struct.pack("<H", MAX_TOKENS + 1)), "n_tokens", id="n_tokens"),
        pytest.param(_patched_request(R_TOP_K, bytes([MAX_TOP_K + 1])), "top_k", id="top_k"),
        pytest.param(frame(MsgType.DISPATCH_REQUEST, REQUEST_BODY, body_len=MAX_MESSAGE - wire.HEADER_LEN + 1),
                     "body_len", id="hidden"),  # the last field's only bound is the header's
        pytest.param(frame(MsgType.ERROR_REPLY, ZERO_ID + b"\x01" + struct.pack("<H", MAX_ERROR_TEXT + 1)), "message",
                     id="error_text"),
        pytest.param(frame(MsgType.DISPATCH_REPLY, ID + bytes.fromhex("00 0100 00000000")
                           + struct.pack("<H", MAX_RECEIPT + 1) + b"\xff"), "receipt", id="receipt"),
        pytest.param(frame(MsgType.HELLO, bytes.fromhex("01 0101 0100") + bytes([wire.MAX_MODELS + 1])), "models",
                     id="models"),
    ],
)
def test_field_limits_are_checked_before_slicing(data, field):
    """A length or count over its limit raises TooLarge for that field, even though the bytes it claims are absent."""
    with pytest.raises(TooLarge) as refused:
        decode(data)
    assert refused.value.field == field


def test_constructors_enforce_limits():
    """Local code cannot build a message the peer would refuse for size."""
    with pytest.raises(TooLarge):
        ErrorReply(ZERO_ID, ErrorCode.INTERNAL, "x" * (MAX_ERROR_TEXT + 1))
    with pytest.raises(TooLarge):
        DispatchReply(ID, Codec.F32, 1, b"p", 0, receipt=b"r" * (MAX_RECEIPT + 1))
    with pytest.raises(TooLarge) as refused:
        DispatchReply(ID, Codec.F32, 1, b"p" * MAX_MESSAGE, 0)
    assert refused.value.field == "message"


@pytest.mark.parametrize(
    ("message", "field"),
    [
        pytest.param(REQUEST, "hidden", id="request"),
        pytest.param(DispatchReply(ID, Codec.F16, 1, b"p", 0, b"r" * 72), "partial", id="reply"),
    ],
)
def test_payload_may_fill_a_message_up_to_max_message(message, field):
    """The unprefixed last field can grow until the message is exactly MAX_MESSAGE bytes, and not one byte more."""
    room = MAX_MESSAGE - message.encoded_len() + len(getattr(message, field))
    assert dataclasses.replace(message, **{field: b"x" * room}).encoded_len() == MAX_MESSAGE
    with pytest.raises(TooLarge) as refused:
        dataclasses.replace(message, **{field: b"x" * (room + 1)})
    assert refused.value.field == "message"


def test_reference_dispatch_fits_the_byte_budget():
    """At hidden 3072, top-8, F16, 1 token and a 72-byte receipt, request + reply total at most 12,500 bytes."""
    payload = bytes(3072 * 2)
    request = DispatchRequest(ID, bytes(MODEL_ID_LEN), 0, Codec.F16, 1, 8, tuple(range(8)), (0.125,) * 8, payload)
    reply = DispatchReply(ID, Codec.F16, 1, payload, 0, bytes(72))
    sizes = len(request.encode()), len(reply.encode())
    assert sizes == (wire.HEADER_LEN + 38 + 6 * 8 + 6144, wire.HEADER_LEN + 25 + 72 + 6144) == (6241, 6252)
    assert sum(sizes) <= 12_500


def test_last_field_is_the_rest_of_the_body():
    """hidden and partial carry no length: a byte appended to the body (body_len grown to match) joins them."""
    request = decode(frame(MsgType.DISPATCH_REQUEST, REQUEST_BODY + b"\x04"))
    assert request.hidden == b"\x01\x02\x03\x04"
    assert dataclasses.replace(request, hidden=REQUEST.hidden) == REQUEST
    reply = decode(frame(MsgType.DISPATCH_REPLY, ID + bytes.fromhex("01 0100 00000000 0100 aa bbcc")))
    assert (reply.receipt, reply.partial) == (b"\xaa", b"\xbb\xcc")


# --- malformed fields: each refusal names its field -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "error", "field"),
    [
        pytest.param(b"XSW" + REQUEST.encode()[3:], InvalidField, "magic", id="magic"),
        pytest.param(REQUEST.encode() + b"\0", InvalidField, "body_len", id="bytes-after-message"),
        pytest.param(frame(MsgType.ERROR_REPLY, ZERO_ID + bytes.fromhex("07 0400 62757379 00")), InvalidField, "body",
                     id="bytes-after-error-reply"),
        pytest.param(frame(MsgType.PING, bytes(17)), InvalidField, "body", id="bytes-after-ping"),
        pytest.param(frame(MsgType.HELLO, bytes.fromhex("01 0101 0100 00 ff")), InvalidField, "body",
                     id="bytes-after-hello"),
        pytest.param(frame(MsgType.PING, bytes(16), flags=1), InvalidField, "flags", id="flags"),
        pytest.param(_patched_request(R_N_TOKENS, b"\0\0"), InvalidField, "n_tokens", id="zero-tokens"),
        pytest.param(_patched_request(R_TOP_K, b"\0"), InvalidField, "top_k", id="zero-top-k"),
        pytest.param(_patched_request(R_CODEC, b"\x09"), BadCodec, "codec", id="unknown-codec"),
        pytest.param(_patched_request(R_IDS, b"\xfe\xff"), InvalidField, "expert_ids", id="expert-below-minus-1"),
        pytest.param(_patched_request(R_IDS + 2, b"\x03\x00"), InvalidField, "expert_ids", id="expert-twice-in-token"),
        pytest.param(_patched_request(R_WEIGHTS, b"\x00\x00\xc0\x7f"), InvalidField, "router_weights", id="nan"),
        pytest.param(_patched_request(R_WEIGHTS, b"\x00\x00\x80\x7f"), InvalidField, "router_weights", id="inf"),
        pytest.param(frame(MsgType.DISPATCH_REQUEST, REQUEST_BODY[:R_HIDDEN]), InvalidField, "hidden",
                     id="hidden-empty"),
        pytest.param(frame(MsgType.DISPATCH_REQUEST, REQUEST_BODY[:R_WEIGHTS]), Truncated, "router_weights",
                     id="weights-missing"),
        pytest.param(frame(MsgType.DISPATCH_REQUEST, REQUEST_BODY[: R_WEIGHTS - 1]), Truncated, "expert_ids",
                     id="ids-cut"),
        pytest.param(frame(MsgType.DISPATCH_REQUEST, REQUEST_BODY[:20]), Truncated, "model_id", id="model-id-cut"),
        pytest.param(frame(MsgType.DISPATCH_REPLY, ID + bytes.fromhex("00 0100 00000000 0000")),
                     InvalidField, "partial", id="partial-empty"),
        pytest.param(frame(MsgType.DISPATCH_REPLY, ID + bytes.fromhex("00 0100 00000000 0100 ff")),
                     InvalidField, "partial", id="receipt-leaves-no-partial"),
        pytest.param(frame(MsgType.DISPATCH_REPLY, ID + bytes.fromhex("00 0100 00000000 0500 ffff")),
                     Truncated, "receipt", id="receipt-longer-than-body"),
        pytest.param(frame(MsgType.DISPATCH_REPLY, ID + bytes.fromhex("00 0000 00000000 0000 ff")),
                     InvalidField, "n_tokens", id="reply-zero-tokens"),
        pytest.param(frame(MsgType.DISPATCH_REPLY, ID + bytes.fromhex("09 0100 00000000 0000 ff")),
                     BadCodec, "codec", id="reply-unknown-codec"),
        pytest.param(frame(MsgType.ERROR_REPLY, ZERO_ID + bytes.fromhex("01 0200 c328")), InvalidField, "message",
                     id="bad-utf8"),
        pytest.param(frame(MsgType.ERROR_REPLY, ZERO_ID + bytes.fromhex("63 0000")), InvalidField, "code",
                     id="unknown-error-code"),
        pytest.param(frame(MsgType.HELLO, bytes.fromhex("09 0101 0100 00")), InvalidField, "role", id="unknown-role"),
        pytest.param(frame(MsgType.HELLO, bytes.fromhex("01 00 0100 00")), InvalidField, "versions", id="no-versions"),
        pytest.param(frame(MsgType.HELLO, bytes.fromhex("01 0100 0100 00")), InvalidField, "versions", id="version-0"),
        pytest.param(frame(MsgType.HELLO, bytes.fromhex("01 0101 00 00")), InvalidField, "codecs", id="no-codecs"),
        pytest.param(frame(MsgType.PING, bytes(15)), Truncated, "sent_at_us", id="short-ping"),
        pytest.param(b"MSW\x01\x06", Truncated, "header", id="short-header"),
    ],
)
def test_malformed_input_names_its_field(data, error, field):
    """Each inconsistency raises the specific ProtocolError subclass, naming the field at fault."""
    with pytest.raises(error) as refused:
        decode(data)
    assert refused.value.field == field
    assert str(refused.value).startswith(f"{field}: ")


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"expert_ids": (3, -1, 0)}, "expert_ids"),
        ({"router_weights": (0.5, 0.0, 1.0)}, "router_weights"),
        ({"router_weights": (0.5, 0.0, 1.0, 1e39)}, "router_weights"),
        ({"expert_ids": (3, -1, 0, 40000)}, "expert_ids"),
        ({"dispatch_id": b"short"}, "dispatch_id"),
        ({"model_id": "not bytes"}, "model_id"),
        ({"model_id": b"\xdd" * 32}, "model_id"),  # the full digest where its 16-byte prefix belongs
        ({"layer": -1}, "layer"),
        ({"codec": 7}, "codec"),
        ({"hidden": b""}, "hidden"),
    ],
)
def test_constructor_refuses_inconsistent_requests(change, field):
    """Building a request that breaks the protocol raises the same field-naming error the decoder would."""
    with pytest.raises(ProtocolError) as refused:
        dataclasses.replace(REQUEST, **change)
    assert refused.value.field == field


@pytest.mark.parametrize("msg_type", [0, 17, 0x7F, 0xFF])
def test_unknown_type_decodes_to_unknown(msg_type):
    """A type this side does not know decodes to Unknown with its flags and body intact."""
    data = frame(msg_type, b"future", flags=0x8001)
    assert decode(data) == Unknown(msg_type, b"future", flags=0x8001)
    assert decode(data).encode() == data


def test_unknown_cannot_impersonate_a_known_type():
    """Unknown refuses a known type number, so each known type has exactly one representation."""
    with pytest.raises(InvalidField):
        Unknown(MsgType.PING, bytes(16))


@pytest.mark.parametrize("version", [0, 2, 255])
@pytest.mark.parametrize("msg_type", [MsgType.HELLO, MsgType.DISPATCH_REQUEST, 0xC8])
def test_other_versions_raise_unsupported_version(version, msg_type):
    """A header version this side does not speak raises UnsupportedVersion, whatever the type."""
    with pytest.raises(UnsupportedVersion) as refused:
        decode(frame(msg_type, REQUEST_BODY, version=version))
    assert refused.value.field == "version"
    assert refused.value.error_code is ErrorCode.UNSUPPORTED_VERSION


# --- answering failures ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "code"),
    [
        pytest.param(REQUEST.encode()[:-1], ErrorCode.MALFORMED, id="truncated"),
        pytest.param(_patched_request(R_IDS, b"\xfe\xff"), ErrorCode.MALFORMED, id="invalid-field"),
        pytest.param(frame(MsgType.DISPATCH_REQUEST, REQUEST_BODY, version=2), ErrorCode.UNSUPPORTED_VERSION,
                     id="version"),
        pytest.param(_patched_request(R_CODEC, b"\x09"), ErrorCode.BAD_CODEC, id="codec"),
        pytest.param(_patched_request(R_N_TOKENS, b"\xff\xff"), ErrorCode.TOO_LARGE, id="too-large"),
    ],
)
def test_error_reply_for_decode_failures(data, code):
    """A worker answers any decode failure with the matching code, correlated to the request's dispatch id."""
    with pytest.raises(ProtocolError) as refused:
        decode(data)
    reply = error_reply_for(refused.value, peek_dispatch_id(data))
    assert reply.code is code
    assert reply.dispatch_id == ID
    assert reply.message == str(refused.value)
    assert decode(reply.encode()) == reply


@pytest.mark.parametrize("code", list(ErrorCode))
def test_error_reply_for_uses_an_exceptions_error_code(code):
    """Any exception carrying an ErrorCode (e.g. a worker's unknown-model error) is answered with that code."""

    class WorkerRefusal(Exception):
        error_code = code

    reply = error_reply_for(WorkerRefusal("no such model"))
    assert (reply.code, reply.message, reply.dispatch_id) == (code, "no such model", ZERO_ID)


def test_error_reply_for_unexpected_exception_is_internal_and_discreet():
    """An exception without an ErrorCode becomes INTERNAL and its text (which may hold local details) is not sent."""
    reply = error_reply_for(RuntimeError("/home/alice/secret.gguf"), ID)
    assert reply.code is ErrorCode.INTERNAL
    assert reply.dispatch_id == ID
    assert "secret" not in reply.message and "RuntimeError" in reply.message


def test_error_reply_for_survives_text_that_is_not_utf8():
    """An exception text holding a lone surrogate (e.g. from a mis-decoded file name) still yields a valid reply."""
    reply = error_reply_for(InvalidField("model_id", "file \udcff missing"))
    assert reply.message == "model_id: file ? missing"
    assert decode(reply.encode()) == reply


def test_error_reply_for_clips_long_text_on_a_character_boundary():
    """A long multi-byte message is clipped to MAX_ERROR_TEXT bytes without splitting a character."""
    reply = error_reply_for(InvalidField("message", "é" * MAX_ERROR_TEXT))
    assert MAX_ERROR_TEXT - 2 < len(reply.message.encode()) <= MAX_ERROR_TEXT
    assert decode(reply.encode()) == reply


def test_model_id_is_the_digest_prefix():
    """model_id_of keeps the first MODEL_ID_LEN bytes of a full 32-byte digest and refuses anything else."""
    digest = hashlib.sha256(b"a model").digest()
    assert model_id_of(digest) == digest[:MODEL_ID_LEN]
    request = dataclasses.replace(REQUEST, model_id=model_id_of(digest))
    assert decode(request.encode()).model_id == digest[:MODEL_ID_LEN]
    with pytest.raises(InvalidField):
        model_id_of(digest[:MODEL_ID_LEN])
    with pytest.raises(InvalidField):
        model_id_of(digest.hex())


def test_peek_dispatch_id():
    """The dispatch id is found in a mangled or other-version request, and is zero for anything else."""
    assert peek_dispatch_id(REQUEST.encode()[: wire.HEADER_LEN + 16]) == ID
    assert peek_dispatch_id(frame(MsgType.DISPATCH_REQUEST, ID, version=9)) == ID
    assert peek_dispatch_id(REQUEST.encode()[: wire.HEADER_LEN + 15]) == ZERO_ID
    assert peek_dispatch_id(frame(MsgType.DISPATCH_REPLY, ID + bytes(20))) == ZERO_ID
    assert peek_dispatch_id(b"XSW" + REQUEST.encode()[3:]) == ZERO_ID


# --- negotiation and ping --------------------------------------------------------------------------------------------


def test_negotiate_picks_highest_shared_version_and_shared_codecs_in_our_order():
    """Both sides agree on the highest common version; codecs keep the local preference order."""
    ours = Hello(Role.BACKBONE, versions=(1, 2, 3), codecs=(Codec.INT8, Codec.F16, Codec.F32))
    theirs = HelloAck(Role.WORKER, versions=(2, 1, 9), codecs=(Codec.F32, Codec.INT8, 200))
    assert negotiate(ours, theirs) == (2, (Codec.INT8, Codec.F32))
    assert negotiate(theirs, ours)[0] == 2


def test_negotiate_refuses_when_nothing_is_shared():
    """No shared version raises UnsupportedVersion; no shared codec raises BadCodec."""
    ours = Hello(Role.BACKBONE, versions=(1,), codecs=(Codec.F16,))
    with pytest.raises(UnsupportedVersion):
        negotiate(ours, HelloAck(Role.WORKER, versions=(2,), codecs=(Codec.F16,)))
    with pytest.raises(BadCodec):
        negotiate(ours, HelloAck(Role.WORKER, versions=(1,), codecs=(Codec.F32,)))


def test_pong_echoes_ping():
    """A Pong answering a Ping carries its nonce and the pinger's clock."""
    ping = Ping(nonce=42, sent_at_us=1_000_000)
    pong = decode(Pong.answering(ping).encode())
    assert isinstance(pong, Pong)
    assert (pong.nonce, pong.sent_at_us) == (42, 1_000_000)


# --- slice distribution ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("build", "field"),
    [
        (lambda: SliceInfo((3, 3), (0, 1), ("config|{}",), ()), "layers"),
        (lambda: SliceInfo((0, 1), (0, 1), ("a\nb",), ()), "manifest"),
        (lambda: SliceInfo((0, 1), (0, 1), ("config|{}",), (("n", ("xyz",)),)), "leaves"),
        (lambda: SliceInfo((0, 1), (0, 1), ("config|{}",), (("a|b", ("a" * 64,)),)), "leaves"),
        (lambda: PieceRequest(bytes(16), "n", 0, 0, wire.MAX_PIECE + 1), "length"),
        (lambda: PieceRequest(bytes(16), "", 0, 0, 1), "leaves"),
        (lambda: Piece(0, b""), "data"),
    ],
)
def test_slice_messages_refuse_bad_values(build, field):
    """A slice message that would not decode to itself cannot be built: each bad value names its field."""
    with pytest.raises(ProtocolError) as info:
        build()
    assert info.value.field == field


def test_slice_info_refuses_a_leaves_line_without_a_name():
    """Leaves text a peer sends that is not NAME|HASHES is malformed, not a crash."""
    good = SliceInfo((0, 1), (0, 1), ("config|{}",), (("n", ("a" * 64,)),)).encode()
    bad = good[: -(64 + 2)] + b"n" + b"a" * 65
    with pytest.raises(InvalidField, match="NAME|HASHES"):
        decode(bad[:7] + struct.pack("<I", len(bad) - 11) + bad[11:])
