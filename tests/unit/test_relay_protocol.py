"""The relay's frames (exact bytes, round trips, hostile input) and its per-connection state machines (in memory)."""

from __future__ import annotations

import random

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from p2p.identity import Identity, PeerId
from relay import protocol
from relay.client import Backoff
from relay.protocol import (
    MAX_FRAME,
    MAX_PACKET,
    MAX_TEXT,
    BadField,
    ClientAuth,
    Error,
    FrameError,
    FrameTooLarge,
    FrameTruncated,
    FrameType,
    Health,
    LocalProtocolError,
    PeerGone,
    Ping,
    Pong,
    RecvPacket,
    Refused,
    SendPacket,
    ServerAuthOk,
    ServerChallenge,
    Unknown,
    decode,
)
from relay.session import (
    CLIENT_RECEIVES,
    SERVER_RECEIVES,
    TRANSITIONS,
    Authenticated,
    AuthFailed,
    ClientSession,
    Closed,
    Dropped,
    Forward,
    Notice,
    PacketReceived,
    PeerDeparted,
    Send,
    ServerSession,
    SessionLimits,
    State,
    TextMessage,
    UnexpectedFrame,
    WrongRelay,
)

FUZZ = settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
KEY_A = bytes(range(32))
KEY_B = bytes(range(32, 64))
PEER_A = PeerId.from_public_bytes(KEY_A)
PEER_B = PeerId.from_public_bytes(KEY_B)
NONCE = bytes(range(100, 132))
RELAY = Identity(Ed25519PrivateKey.from_private_bytes(b"\x01" * 32))
ALICE = Identity(Ed25519PrivateKey.from_private_bytes(b"\x02" * 32))
MALLORY = Identity(Ed25519PrivateKey.from_private_bytes(b"\x03" * 32))

# --- exact bytes: each literal is written from the layout in relay/protocol.py's docstring ---------------------------

SNAPSHOTS = [
    (ServerChallenge(NONCE, PEER_A), "01" + NONCE.hex() + KEY_A.hex()),
    (ClientAuth(PEER_B, b"\xee" * 64), "02" + KEY_B.hex() + "ee" * 64),
    (ServerAuthOk(), "03"),
    (Refused("full"), "04" + b"full".hex()),
    (SendPacket(PEER_B, b"\x00\x01\x02"), "05" + KEY_B.hex() + "000102"),
    (RecvPacket(PEER_A, b""), "06" + KEY_A.hex()),
    (PeerGone(PEER_B), "07" + KEY_B.hex()),
    (Ping(b"\x00" * 7 + b"\x2a"), "08" + "00" * 7 + "2a"),
    (Pong(b"\xff" * 8), "09" + "ff" * 8),
    (Health("héllo"), "0a" + "68c3a96c6c6f"),
    (Error(""), "0b"),
    (Unknown(0xC8, b"\x01"), "c801"),
]


@pytest.mark.parametrize(("frame", "hex_bytes"), SNAPSHOTS, ids=[type(f).__name__ for f, _ in SNAPSHOTS])
def test_snapshot(frame, hex_bytes):
    """Every frame encodes to exactly the documented bytes and decodes back to itself."""
    assert frame.encode().hex() == hex_bytes
    assert decode(bytes.fromhex(hex_bytes)) == frame


def test_every_frame_type_has_a_snapshot():
    """The snapshot table covers the whole FrameType enum, so a new frame cannot skip it."""
    assert {f.TYPE for f, _ in SNAPSHOTS if not isinstance(f, Unknown)} == set(FrameType)


def test_frame_type_numbers_are_fixed():
    """Type numbers are part of the wire format: none may change or be reused."""
    assert [(t.name, t.value) for t in FrameType] == [
        ("SERVER_CHALLENGE", 1), ("CLIENT_AUTH", 2), ("SERVER_AUTH_OK", 3), ("REFUSED", 4), ("SEND_PACKET", 5),
        ("RECV_PACKET", 6), ("PEER_GONE", 7), ("PING", 8), ("PONG", 9), ("HEALTH", 10), ("ERROR", 11),
    ]  # fmt: skip


def test_signed_message_is_domain_separated_and_bound_to_the_relay():
    """What a client signs names the protocol, the nonce and the relay's key, in that order."""
    challenge = ServerChallenge(NONCE, PEER_A)
    assert challenge.signed_message() == b"moeswarm-relay.v1 client auth\x00" + NONCE + KEY_A
    assert ServerChallenge(NONCE, PEER_B).signed_message() != challenge.signed_message()


# --- round trips and hostile input ----------------------------------------------------------------------------------

keys = st.binary(min_size=32, max_size=32).map(PeerId.from_public_bytes)
texts = st.text(max_size=80)
packets = st.binary(max_size=64) | st.binary(min_size=MAX_PACKET - 8, max_size=MAX_PACKET)
frames = st.one_of(
    st.builds(ServerChallenge, st.binary(min_size=32, max_size=32), keys),
    st.builds(ClientAuth, keys, st.binary(min_size=64, max_size=64)),
    st.just(ServerAuthOk()),
    st.builds(Refused, texts),
    st.builds(SendPacket, keys, packets),
    st.builds(RecvPacket, keys, packets),
    st.builds(PeerGone, keys),
    st.builds(Ping, st.binary(min_size=8, max_size=8)),
    st.builds(Pong, st.binary(min_size=8, max_size=8)),
    st.builds(Health, texts),
    st.builds(Error, texts),
    st.builds(Unknown, st.integers(12, 255) | st.just(0), st.binary(max_size=64)),
)


@FUZZ
@given(frames)
def test_round_trip(frame):
    """decode(encode(f)) == f for every frame, and no frame exceeds MAX_FRAME."""
    data = frame.encode()
    assert len(data) <= MAX_FRAME
    assert decode(data) == frame


def _decodes_or_frame_error(data: bytes) -> None:
    try:
        result = decode(data)
    except FrameError:
        return
    assert result.encode() == data  # what decodes re-encodes to the same bytes: one encoding per frame


@FUZZ
@given(st.binary(max_size=200))
def test_random_bytes_decode_or_raise_frame_error(data):
    """Random input yields a frame or a FrameError, never any other exception."""
    _decodes_or_frame_error(data)


@FUZZ
@given(frames, st.data())
def test_truncated_frames_raise_frame_error(frame, data):
    """Every proper prefix of a frame decodes to a frame or raises FrameError."""
    encoded = frame.encode()
    cut = data.draw(st.integers(0, max(0, len(encoded) - 1)))
    _decodes_or_frame_error(encoded[:cut])


@FUZZ
@given(frames, st.data())
def test_bit_flipped_frames_raise_frame_error(frame, data):
    """Flipping any bit of a frame yields a frame or a FrameError."""
    encoded = bytearray(frame.encode())
    bit = data.draw(st.integers(0, len(encoded) * 8 - 1))
    encoded[bit // 8] ^= 1 << (bit % 8)
    _decodes_or_frame_error(bytes(encoded))


@FUZZ
@given(frames, st.binary(min_size=1, max_size=16))
def test_extended_frames_raise_frame_error(frame, tail):
    """Bytes appended to a frame yield a frame (variable last field) or a FrameError."""
    _decodes_or_frame_error(frame.encode() + tail)


def test_oversized_message_is_refused_before_decoding():
    """A message above MAX_FRAME raises FrameTooLarge with its length, whatever its type."""
    with pytest.raises(FrameTooLarge) as info:
        decode(b"\x05" + KEY_A + bytes(MAX_PACKET + 1))
    assert (info.value.frame_len, info.value.limit) == (MAX_FRAME + 1, MAX_FRAME)


@pytest.mark.parametrize(
    ("data", "error"),
    [
        (b"", FrameTruncated),
        (b"\x01" + bytes(63), FrameTruncated),  # challenge one byte short
        (b"\x03\x00", FrameTruncated),  # auth-ok with a body
        (b"\x05" + bytes(31), FrameTruncated),  # packet without a whole key
        (b"\x08" + bytes(9), FrameTruncated),  # ping nonce too long
        (b"\x0a\xff\xfe", BadField),  # health text not UTF-8
        (b"\x04" + b"a" * (MAX_TEXT + 1), FrameTruncated),  # refusal text too long
    ],
)
def test_malformed_frames_raise_specific_errors(data, error):
    """Each kind of malformed frame raises its own FrameError subclass."""
    with pytest.raises(error):
        decode(data)


@pytest.mark.parametrize(
    "build",
    [
        lambda: ServerChallenge(b"short", PEER_A),
        lambda: ClientAuth(PEER_A, b"\x00" * 63),
        lambda: Ping(b"\x00" * 9),
        lambda: SendPacket(PEER_A, bytes(MAX_PACKET + 1)),
        lambda: Refused("x" * (MAX_TEXT + 1)),
        lambda: Health("\ud800"),
        lambda: Unknown(int(FrameType.PING), b""),
    ],
)
def test_invalid_frames_cannot_be_built(build):
    """Constructing a frame with a field of the wrong size or kind is a LocalProtocolError."""
    with pytest.raises(LocalProtocolError):
        build()


def test_decode_errors_are_remote_errors():
    """Decode failures blame the other side; construction failures blame this side."""
    assert issubclass(FrameError, protocol.RemoteProtocolError)
    assert not issubclass(LocalProtocolError, protocol.RemoteProtocolError)


# --- state machines -------------------------------------------------------------------------------------------------


def handshake(server: ServerSession, client: ClientSession, now: float = 0.0) -> tuple[list, list]:
    """Run the login by passing encoded frames between the two sessions; all events each side produced."""
    server_events, client_events = list(server.start()), []
    pending = [e.frame.encode() for e in server_events if isinstance(e, Send)]
    while pending:
        out = client.receive(pending.pop(0), now)
        client_events += out
        for msg in (e.frame.encode() for e in out if isinstance(e, Send)):
            back = server.receive(msg, now)
            server_events += back
            pending += [e.frame.encode() for e in back if isinstance(e, Send)]
    return server_events, client_events


def test_transition_table():
    """Only awaiting_auth -> authenticated -> closed (and awaiting_auth -> closed) exist."""
    assert TRANSITIONS == {
        (State.AWAITING_AUTH, State.AUTHENTICATED),
        (State.AWAITING_AUTH, State.CLOSED),
        (State.AUTHENTICATED, State.CLOSED),
    }


def test_login_in_memory():
    """A client signs the challenge; the server learns its peer id and both sides end authenticated."""
    server = ServerSession(RELAY.peer_id, NONCE, 0.0)
    client = ClientSession(ALICE, 0.0, expected_relay=RELAY.peer_id)
    server_events, client_events = handshake(server, client)
    assert Authenticated(ALICE.peer_id) in server_events
    assert Authenticated(RELAY.peer_id) in client_events
    assert (server.state, client.state, server.peer, client.relay) == (
        State.AUTHENTICATED, State.AUTHENTICATED, ALICE.peer_id, RELAY.peer_id,
    )  # fmt: skip


@pytest.mark.parametrize(
    "forge",
    [
        lambda ch: ClientAuth(ALICE.peer_id, MALLORY.sign(ch.signed_message())),  # someone else's id
        lambda ch: ClientAuth(ALICE.peer_id, ALICE.sign(ch.nonce + ch.relay.public_bytes)),  # no domain
        lambda ch: ClientAuth(ALICE.peer_id, ALICE.sign(ServerChallenge(ch.nonce, PEER_B).signed_message())),
        lambda ch: ClientAuth(ALICE.peer_id, ALICE.sign(ServerChallenge(bytes(32), ch.relay).signed_message())),
    ],
    ids=["others-id", "no-domain", "other-relay", "old-nonce"],
)
def test_forged_logins_are_refused(forge):
    """A signature by another key, without the domain, for another relay or another nonce is refused."""
    server = ServerSession(RELAY.peer_id, NONCE, 0.0)
    events = server.receive(forge(server.challenge).encode(), 0.0)
    assert events[0] == Send(Refused("signature does not prove the claimed peer id"))
    assert isinstance(events[1], Closed) and isinstance(events[1].error, AuthFailed)
    assert (server.state, server.peer) == (State.CLOSED, None)


def test_client_refuses_an_unexpected_relay_key():
    """A client that pinned the relay's key does not sign a challenge from another key."""
    client = ClientSession(ALICE, 0.0, expected_relay=PEER_B)
    events = client.receive(ServerChallenge(NONCE, RELAY.peer_id).encode(), 0.0)
    assert isinstance(events[-1], Closed) and isinstance(events[-1].error, WrongRelay)
    assert not any(isinstance(e, Send) and isinstance(e.frame, ClientAuth) for e in events)


def sample(frame_type: FrameType):
    """A well-formed frame of each type (signature validity aside)."""
    return {
        FrameType.SERVER_CHALLENGE: ServerChallenge(NONCE, RELAY.peer_id),
        FrameType.CLIENT_AUTH: ClientAuth(PEER_A, bytes(64)),
        FrameType.SERVER_AUTH_OK: ServerAuthOk(),
        FrameType.REFUSED: Refused("no"),
        FrameType.SEND_PACKET: SendPacket(PEER_B, b"x"),
        FrameType.RECV_PACKET: RecvPacket(PEER_B, b"x"),
        FrameType.PEER_GONE: PeerGone(PEER_B),
        FrameType.PING: Ping(bytes(8)),
        FrameType.PONG: Pong(bytes(8)),
        FrameType.HEALTH: Health("h"),
        FrameType.ERROR: Error("e"),
    }[frame_type]


def server_in(state: State) -> ServerSession:
    server = ServerSession(RELAY.peer_id, NONCE, 0.0)
    if state is State.AUTHENTICATED:
        handshake(server, ClientSession(ALICE, 0.0))
    return server


def client_in(state: State) -> ClientSession:
    client = ClientSession(ALICE, 0.0)
    if state is State.AUTHENTICATED:
        handshake(ServerSession(RELAY.peer_id, NONCE, 0.0), client)
    return client


@pytest.mark.parametrize("role", ["server", "client"])
@pytest.mark.parametrize("state", [State.AWAITING_AUTH, State.AUTHENTICATED])
@pytest.mark.parametrize("frame_type", list(FrameType))
def test_receive_table(role, state, frame_type):
    """A frame outside the role's RECEIVES table for the state closes with UnexpectedFrame; one inside does not."""
    session = server_in(state) if role == "server" else client_in(state)
    table = SERVER_RECEIVES if role == "server" else CLIENT_RECEIVES
    if (role, state, frame_type) == ("client", State.AWAITING_AUTH, FrameType.SERVER_AUTH_OK):
        session.receive(sample(FrameType.SERVER_CHALLENGE).encode(), 0.5)  # the order within the login
    events = session.receive(sample(frame_type).encode(), 1.0)
    errors = [e.error for e in events if isinstance(e, Closed)]
    if frame_type in table[state]:
        assert not any(isinstance(err, UnexpectedFrame) for err in errors)
    else:
        assert len(errors) == 1 and isinstance(errors[0], UnexpectedFrame)
        assert events[0] == Send(Error(str(errors[0])))
        assert session.state is State.CLOSED


@pytest.mark.parametrize("state", [State.AWAITING_AUTH, State.AUTHENTICATED])
def test_unknown_frames_are_ignored(state):
    """Unknown frame types produce no events and keep the state (newer peers may add frames)."""
    for session in (server_in(state), client_in(state)):
        assert session.receive(Unknown(200, b"future").encode(), 1.0) == []
        assert session.state is state


def test_malformed_and_text_messages_close_with_an_error():
    """A message that does not decode, or a text message, closes the session with the decode error."""
    for message, error in ((b"\x05short", FrameTruncated), ("hello", TextMessage)):
        server = server_in(State.AUTHENTICATED)
        events = server.receive(message, 1.0)
        assert isinstance(events[-1], Closed) and isinstance(events[-1].error, error)
        assert isinstance(events[0].frame, Error) and server.state is State.CLOSED


def test_closed_session_ignores_everything():
    """After closing, input and timers produce nothing."""
    server = server_in(State.AUTHENTICATED)
    server.close("bye")
    assert server.receive(SendPacket(PEER_B, b"x").encode(), 1.0) == []
    assert server.get_timer() is None and server.handle_timer(1e9) == []
    assert server.close("again") == []


def test_server_forwards_and_answers_pings():
    """SendPacket becomes Forward to the destination; Ping is answered by Pong with the same nonce."""
    server = server_in(State.AUTHENTICATED)
    assert server.receive(SendPacket(PEER_B, b"data").encode(), 1.0) == [Forward(PEER_B, b"data")]
    assert server.receive(Ping(b"12345678").encode(), 1.0) == [Send(Pong(b"12345678"))]


def test_client_events():
    """RecvPacket, PeerGone, Health and Ping become the client's events."""
    client = client_in(State.AUTHENTICATED)
    assert client.receive(RecvPacket(PEER_B, b"d").encode(), 1.0) == [PacketReceived(PEER_B, b"d")]
    assert client.receive(PeerGone(PEER_B).encode(), 1.0) == [PeerDeparted(PEER_B)]
    assert client.receive(Health("slow down").encode(), 1.0) == [Notice("slow down")]
    assert client.receive(Ping(b"abcdefgh").encode(), 1.0) == [Send(Pong(b"abcdefgh"))]
    assert client.receive(Error("bye").encode(), 1.0) == [Closed("relay closed the connection: bye")]


def test_rate_limit_drops_then_recovers():
    """Past the burst, packets are dropped (one Health notice per interval); the bucket refills with time."""
    limits = SessionLimits(rate_packets=10, burst_packets=5, rate_bytes=1e9, burst_bytes=1e9, ping_interval=30)
    server = ServerSession(RELAY.peer_id, NONCE, 0.0, limits)
    handshake(server, ClientSession(ALICE, 0.0))
    packet = SendPacket(PEER_B, b"x").encode()
    results = [server.receive(packet, 1.0) for _ in range(8)]
    assert results[:5] == [[Forward(PEER_B, b"x")]] * 5
    assert isinstance(results[5][0].frame, Health) and results[5][1] == Dropped(PEER_B, 1, "rate_limited")
    assert results[6:] == [[Dropped(PEER_B, 1, "rate_limited")]] * 2
    assert server.receive(packet, 1.1) == [Forward(PEER_B, b"x")]  # 0.1 s at 10/s refills one packet
    assert server.receive(packet, 1.1) == [Dropped(PEER_B, 1, "rate_limited")]


def test_byte_rate_limit():
    """A packet larger than the bytes left in the bucket is dropped even when packets are left."""
    limits = SessionLimits(rate_bytes=100, burst_bytes=1000, rate_packets=1e6, burst_packets=1e6)
    server = ServerSession(RELAY.peer_id, NONCE, 0.0, limits)
    handshake(server, ClientSession(ALICE, 0.0))
    assert server.receive(SendPacket(PEER_B, bytes(900)).encode(), 0.0) == [Forward(PEER_B, bytes(900))]
    assert Dropped(PEER_B, 200, "rate_limited") in server.receive(SendPacket(PEER_B, bytes(200)).encode(), 0.0)
    assert server.receive(SendPacket(PEER_B, bytes(200)).encode(), 1.0) == [Forward(PEER_B, bytes(200))]


def test_keepalive_pings_then_times_out():
    """After ping_interval of silence a Ping goes out; with no answer within ping_timeout the session closes."""
    limits = SessionLimits(ping_interval=10, ping_timeout=5)
    server = ServerSession(RELAY.peer_id, NONCE, 0.0, limits)
    handshake(server, ClientSession(ALICE, 0.0))
    assert server.get_timer() == 10.0
    assert server.handle_timer(9.9) == []
    assert server.handle_timer(10.0) == [Send(Ping((1).to_bytes(8, "big")))]
    assert server.get_timer() == 15.0
    events = server.handle_timer(15.0)
    assert isinstance(events[-1], Closed) and "keepalive timeout" in events[-1].reason
    assert server.state is State.CLOSED


def test_any_frame_proves_liveness():
    """A frame received after a Ping cancels the timeout and restarts the interval."""
    limits = SessionLimits(ping_interval=10, ping_timeout=5)
    client = ClientSession(ALICE, 0.0, limits)
    handshake(ServerSession(RELAY.peer_id, NONCE, 0.0), client)
    client.handle_timer(10.0)
    client.receive(RecvPacket(PEER_B, b"x").encode(), 12.0)
    assert client.get_timer() == 22.0 and client.handle_timer(15.0) == []


def test_authentication_timeout():
    """A connection that has not authenticated within auth_timeout is closed by either side."""
    for session in (ServerSession(RELAY.peer_id, NONCE, 0.0, SessionLimits(auth_timeout=3)),
                    ClientSession(ALICE, 0.0, SessionLimits(auth_timeout=3))):  # fmt: skip
        assert session.get_timer() == 3.0
        assert session.handle_timer(2.0) == []
        assert isinstance(session.handle_timer(3.0)[-1], Closed)


def test_client_rejects_out_of_order_handshake():
    """ServerAuthOk before a challenge, or a second challenge, is a violation."""
    client = ClientSession(ALICE, 0.0)
    assert isinstance(client.receive(ServerAuthOk().encode(), 0.0)[-1].error, UnexpectedFrame)
    client = ClientSession(ALICE, 0.0)
    client.receive(ServerChallenge(NONCE, RELAY.peer_id).encode(), 0.0)
    assert isinstance(client.receive(ServerChallenge(NONCE, RELAY.peer_id).encode(), 0.0)[-1].error, UnexpectedFrame)


def test_backoff_grows_caps_and_jitters():
    """Reconnect delays double from `first`, stop at `cap`, and are scaled into [0.5, 1] of that."""
    backoff = Backoff(first=0.1, factor=2, cap=5)
    rng = random.Random(7)
    for attempt in range(200):
        nominal = min(5.0, 0.1 * 2**attempt)
        assert nominal * 0.5 <= backoff.delay(attempt, rng) <= nominal
    assert len({backoff.delay(3, rng) for _ in range(20)}) > 1
