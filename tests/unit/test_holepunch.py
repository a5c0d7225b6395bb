"""Hole punching (p2p/nat/holepunch.py) and path state (p2p/nat/paths.py): frames, table, and punches over simulated NATs."""

from __future__ import annotations

import itertools

import pytest
import structlog
from hypothesis import given, settings
from hypothesis import strategies as st

from p2p.identity import PeerId
from p2p.nat.envelope import FrameError
from p2p.nat.holepunch import (
    CODEC,
    PATH_LEN,
    Dial,
    Downgraded,
    HolePunch,
    PathKind,
    PathPacket,
    PunchAccept,
    PunchConfig,
    PunchReject,
    PunchRequest,
    RejectReason,
    Role,
    SendRelay,
    SendUdp,
    Upgraded,
    session_id,
)
from p2p.nat.paths import TRANSITIONS, Backoff, InvalidTransition, PathEvent, PathState, PathTable
from p2p.nat.reachability import NatKind, Verdict
from tests.support.simnet import Nat, Net
from tests.unit.test_reachability import NONCE, fixed_identity

ALICE, BOB, CAROL = fixed_identity(1), fixed_identity(2), fixed_identity(3)
A_PUB, B_PUB = ("203.0.113.1", 40000), ("203.0.113.2", 40000)

# --- the path table -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("start", "event"), list(TRANSITIONS), ids=lambda v: str(v))
def test_every_row_of_the_table_moves_and_logs(start, event):
    """Each (state, event) row leads to its target state and logs its event with the reason."""
    table = PathTable()
    peer = BOB.peer_id
    route = {PathState.RELAY: [], PathState.PUNCHING: [PathEvent.PUNCH_STARTED],
             PathState.DIRECT: [PathEvent.PUNCH_STARTED, PathEvent.PUNCH_SUCCEEDED]}  # fmt: skip
    for step in route[start]:
        table.apply(peer, step, 0.0, direct=B_PUB)
    with structlog.testing.capture_logs() as logs:
        path = table.apply(peer, event, 1.0, "because", direct=B_PUB)
    target, _, log_event = TRANSITIONS[(start, event)]
    assert path.state is target
    assert [(e["event"], e["reason"], e["peer"]) for e in logs] == [(log_event, "because", str(peer))]
    assert (path.direct is not None) == (target is PathState.DIRECT)


def test_pairs_outside_the_table_are_refused():
    """Every (state, event) pair not in TRANSITIONS raises InvalidTransition and changes nothing."""
    route = {PathState.RELAY: [], PathState.PUNCHING: [PathEvent.PUNCH_STARTED],
             PathState.DIRECT: [PathEvent.PUNCH_STARTED, PathEvent.PUNCH_SUCCEEDED]}  # fmt: skip
    refused = 0
    for state, event in itertools.product(PathState, PathEvent):
        if (state, event) in TRANSITIONS:
            continue
        table = PathTable()
        for step in route[state]:
            table.apply(BOB.peer_id, step, 0.0)
        with pytest.raises(InvalidTransition):
            table.apply(BOB.peer_id, event, 1.0)
        assert table.state(BOB.peer_id) is state
        refused += 1
    assert refused == len(PathState) * len(PathEvent) - len(TRANSITIONS)


def test_failures_back_off_exponentially_up_to_the_cap():
    """Each failed punch doubles the wait, up to the cap; may_punch is false until retry_at."""
    table = PathTable(Backoff(first=10, factor=2, cap=50))
    peer, now, waits = BOB.peer_id, 0.0, []
    for _ in range(5):
        assert table.may_punch(peer, now)
        table.apply(peer, PathEvent.PUNCH_STARTED, now)
        path = table.apply(peer, PathEvent.PUNCH_FAILED, now)
        waits.append(path.retry_at - now)
        assert not table.may_punch(peer, path.retry_at - 0.001)
        now = path.retry_at
    assert waits == [10, 20, 40, 50, 50]


def test_a_stable_direct_path_resets_the_backoff_and_a_flapping_one_grows_it():
    """A direct path that lived stable_after seconds counts as the first failure when lost; a short one adds one."""
    table = PathTable(Backoff(first=10, factor=2, cap=1000, stable_after=100))
    peer = BOB.peer_id

    def direct_for(start: float, lived: float) -> float:
        table.apply(peer, PathEvent.PUNCH_STARTED, start)
        table.apply(peer, PathEvent.PUNCH_SUCCEEDED, start, direct=B_PUB)
        return table.apply(peer, PathEvent.DIRECT_LOST, start + lived).retry_at - (start + lived)

    assert direct_for(0, 5) == 10  # flapped: first failure
    assert direct_for(100, 5) == 20  # flapped again: the wait doubles
    assert direct_for(200, 500) == 10  # lived long: back to the first wait


def test_a_skip_waits_the_skip_delay():
    """A symmetric NAT skip is not retried for Backoff.skip seconds."""
    table = PathTable(Backoff(skip=600))
    path = table.apply(BOB.peer_id, PathEvent.PUNCH_SKIPPED, 5.0, "symmetric")
    assert path.state is PathState.RELAY and path.retry_at == 605.0


# --- frames ---------------------------------------------------------------------------------------------------------


def _frames() -> list:
    v6 = ("2001:db8::2", 1)
    return [
        PunchRequest(NONCE, BOB.peer_id, NatKind.NAT, (A_PUB, v6)),
        PunchRequest(NONCE, BOB.peer_id, NatKind.UNKNOWN, ()),
        PunchAccept(NONCE, NatKind.PUBLIC, (B_PUB,), 300),
        PunchReject(NONCE, RejectReason.SYMMETRIC),
    ]


@pytest.mark.parametrize("frame", _frames(), ids=lambda f: type(f).__name__)
def test_coordination_frames_round_trip(frame):
    """decode(encode(f)) gives back the frame and its signer."""
    assert CODEC.decode(CODEC.encode(frame, ALICE)) == (ALICE.peer_id, frame)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=600))
def test_random_bytes_never_crash_either_decoder(data):
    """Arbitrary bytes raise a FrameError or decode, for coordination frames and path packets alike."""
    for decode in (CODEC.decode, PathPacket.decode):
        try:
            decode(data)
        except FrameError:
            pass


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(_frames()), st.integers(min_value=0))
def test_a_flipped_bit_breaks_a_coordination_frame(frame, bit):
    """Any single changed bit in a signed frame is detected."""
    raw = bytearray(CODEC.encode(frame, ALICE))
    raw[(bit // 8) % len(raw)] ^= 1 << (bit % 8)
    with pytest.raises(FrameError):
        CODEC.decode(bytes(raw))


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(PathKind), st.sampled_from(Role), st.integers(0, 2**32 - 1), st.integers(0, PATH_LEN * 8 - 1))
def test_path_packets_round_trip_and_their_mac_catches_any_change(kind, role, seq, bit):
    """A path packet is 34 bytes, decodes to itself, verifies with its key only, and fails after any bit flip."""
    packet = PathPacket(session_id(NONCE), kind, role, seq)
    data = packet.encode(NONCE)
    assert len(data) == PATH_LEN and data[:3] == b"\x0dPP"
    assert PathPacket.decode(data) == packet
    assert PathPacket.verify(data, NONCE) and not PathPacket.verify(data, bytes(16))
    flipped = bytearray(data)
    flipped[bit // 8] ^= 1 << (bit % 8)
    try:
        assert not PathPacket.verify(bytes(flipped), NONCE)
    except FrameError:
        pass


# --- punching over simulated NATs -----------------------------------------------------------------------------------

RELAY_DELAY = 0.04
_rng_counter = itertools.count()


def counter_rng(n: int) -> bytes:
    return next(_rng_counter).to_bytes(n, "big")


class PunchNode:
    """A ``HolePunch`` core on the simulated network. A QUIC dial is one datagram there and one back."""

    def __init__(self, net: Net, identity, addr, verdict: Verdict, nat: Nat | None = None, **config) -> None:
        self.net, self.addr, self.verdict = net, addr, verdict
        self.core = HolePunch(identity, PunchConfig(**config), backoff=Backoff(first=30), rng=counter_rng)
        self.log: list = []
        self.dials: dict[PeerId, float] = {}
        net.add(addr, self, nat)

    @property
    def peer(self) -> PeerId:
        return self.core.peer_id

    def start(self, other: PunchNode) -> None:
        self.perform(self.core.start(other.peer, self.verdict, self.net.now))

    def perform(self, actions) -> None:
        for action in actions:
            self.log.append(action)
            if isinstance(action, SendUdp):
                self.net.send(self.addr, action.addr, action.data)
            elif isinstance(action, SendRelay):
                target = next(a for a, n in self.net.nodes.items() if getattr(n, "peer", None) == action.peer)
                self.net.deliver_later(target, ("relay", self.peer), action.data, RELAY_DELAY)
            elif isinstance(action, Dial):
                self.net.send(self.addr, action.addr, b"DIAL" + self.peer.raw)
                self.dials[action.peer] = self.net.now + self.core.config.dial_timeout

    def deliver(self, data: bytes, src, now: float) -> None:
        if src[0] == "relay":
            self.perform(self.core.relay_received(src[1], data, self.verdict, now))
        elif data.startswith(b"DIALOK"):
            peer = PeerId(data[6:])
            if self.dials.pop(peer, None) is not None:
                self.perform(self.core.connected(peer, src, now))
        elif data.startswith(b"DIAL"):
            self.net.send(self.addr, src, b"DIALOK" + self.peer.raw)
            self.perform(self.core.connected(PeerId(data[4:]), src, now))
        else:
            self.perform(self.core.udp_received(data, src, now))

    def timer(self) -> float | None:
        return min([t for t in (self.core.get_timer(), *self.dials.values()) if t is not None], default=None)

    def fire(self, now: float) -> None:
        for peer, deadline in list(self.dials.items()):
            if deadline <= now:
                del self.dials[peer]
                self.perform(self.core.dial_failed(peer, "handshake timed out", now))
        self.perform(self.core.handle_timer(now))

    def sent(self, kind: type) -> list:
        return [a for a in self.log if isinstance(a, kind)]


def pair(a_kind: NatKind, b_kind: NatKind, **config) -> tuple[Net, PunchNode, PunchNode]:
    """Alice and Bob, each public or behind a NAT of the given kind (NAT: cone; SYMMETRIC: symmetric)."""
    net = Net()
    nodes = []
    for identity, kind, public, inside in ((ALICE, a_kind, A_PUB, ("192.168.1.2", 5000)),
                                           (BOB, b_kind, B_PUB, ("192.168.2.2", 5000))):  # fmt: skip
        if kind is NatKind.PUBLIC:
            nodes.append(PunchNode(net, identity, public, Verdict(kind, (public,), "test"), **config))
        else:
            nat = Nat(public[0], symmetric=kind is NatKind.SYMMETRIC)
            nodes.append(PunchNode(net, identity, inside, Verdict(kind, (public,), "test"), nat, **config))
    return net, nodes[0], nodes[1]


@pytest.mark.parametrize(
    ("a_kind", "b_kind"),
    [(NatKind.NAT, NatKind.PUBLIC), (NatKind.PUBLIC, NatKind.NAT), (NatKind.NAT, NatKind.NAT),
     (NatKind.UNKNOWN, NatKind.NAT), (NatKind.PUBLIC, NatKind.PUBLIC)],  # fmt: skip
)
def test_punch_goes_direct_on_both_sides(a_kind, b_kind):
    """Cone and public peers (either initiating) end DIRECT at each other's public address, logged as upgraded."""
    net, alice, bob = pair(a_kind, b_kind)
    with structlog.testing.capture_logs() as logs:
        alice.start(bob)
        net.run(5.0)
    assert alice.core.direct() == {bob.peer: B_PUB}
    assert bob.core.direct() == {alice.peer: A_PUB}
    assert alice.sent(Upgraded) == [Upgraded(bob.peer, B_PUB)] and bob.sent(Upgraded) == [Upgraded(alice.peer, A_PUB)]
    assert [e["event"] for e in logs].count("path.upgraded") == 2
    assert alice.sent(Dial) == [Dial(bob.peer, B_PUB)]


@pytest.mark.parametrize(("a_kind", "b_kind"), [(NatKind.SYMMETRIC, NatKind.NAT), (NatKind.NAT, NatKind.SYMMETRIC)])
def test_symmetric_nat_on_either_side_skips_without_punching(a_kind, b_kind):
    """No punch packet is sent when either side is SYMMETRIC; both stay on the relay with the skip backoff."""
    net, alice, bob = pair(a_kind, b_kind)
    with structlog.testing.capture_logs() as logs:
        alice.start(bob)
        net.run(5.0)
    assert not alice.sent(SendUdp) and not bob.sent(SendUdp)
    assert alice.core.paths.state(bob.peer) is PathState.RELAY
    assert not alice.core.paths.may_punch(bob.peer, net.now)
    assert "path.punch_skipped" in [e["event"] for e in logs]
    if b_kind is NatKind.SYMMETRIC:
        assert CODEC.decode(bob.sent(SendRelay)[0].data)[1].reason is RejectReason.SYMMETRIC


def test_blocked_path_fails_and_is_not_retried_before_the_backoff():
    """No punch gets through: punch_failed with a reason, then start() does nothing until the backoff expires."""
    net, alice, bob = pair(NatKind.NAT, NatKind.NAT)
    net.drop = lambda src, dst, data: data[:3] == b"\x0dPP"
    with structlog.testing.capture_logs() as logs:
        alice.start(bob)
        net.run(10.0)
    failed = [e for e in logs if e["event"] == "path.punch_failed"]
    assert {e["peer"] for e in failed} == {str(bob.peer), str(alice.peer)}
    assert any("no punch packet arrived" in e["reason"] for e in failed)
    retry_at = alice.core.paths.get(bob.peer).retry_at
    requests = len(alice.sent(SendRelay))
    alice.start(bob)
    net.run(retry_at - 0.01)
    alice.start(bob)
    assert len(alice.sent(SendRelay)) == requests  # nothing sent during the backoff
    net.run(retry_at)
    alice.start(bob)
    assert len(alice.sent(SendRelay)) == requests + 1


def test_no_answer_through_the_relay_fails_the_attempt():
    """A request the peer never answers ends as punch_failed after request_timeout."""
    net, alice, bob = pair(NatKind.NAT, NatKind.NAT, request_timeout=2.0)
    net.nodes[bob.addr] = type("Deaf", (), {"deliver": lambda *a: None, "timer": lambda s: None, "peer": bob.peer})()
    alice.start(bob)
    net.run(3.0)
    assert alice.core.paths.state(bob.peer) is PathState.RELAY
    assert "no answer through the relay" in alice.core.paths.get(bob.peer).reason


def test_failed_dial_fails_the_attempt():
    """Punches get through but the QUIC handshake does not: punch_failed naming the dial."""
    net, alice, bob = pair(NatKind.PUBLIC, NatKind.PUBLIC, dial_timeout=1.0)
    net.drop = lambda src, dst, data: data.startswith(b"DIAL")
    alice.start(bob)
    net.run(10.0)
    assert alice.core.paths.state(bob.peer) is PathState.RELAY
    assert "handshake timed out" in alice.core.paths.get(bob.peer).reason
    assert bob.core.paths.state(alice.peer) is PathState.RELAY


def test_both_starting_at_once_still_makes_one_direct_path():
    """Alice and Bob start together: the lower peer id initiates, exactly one dial happens, both end DIRECT."""
    net, alice, bob = pair(NatKind.NAT, NatKind.NAT)
    alice.start(bob)
    bob.start(alice)
    net.run(5.0)
    assert alice.core.direct() == {bob.peer: B_PUB} and bob.core.direct() == {alice.peer: A_PUB}
    dials = alice.sent(Dial) + bob.sent(Dial)
    assert len(dials) == 1
    lower = min(alice, bob, key=lambda n: n.peer)
    assert dials[0] in lower.sent(Dial)


def test_keepalives_hold_the_path_and_their_loss_downgrades_it():
    """On a direct path keepalives flow every interval and are answered; when the path goes dark it is downgraded."""
    net, alice, bob = pair(NatKind.NAT, NatKind.NAT, keepalive_interval=15.0, keepalive_misses=3)
    alice.start(bob)
    net.run(5.0)
    net.run(120.0)
    keepalives = [a for a in alice.sent(SendUdp) if PathPacket.decode(a.data).kind is PathKind.KEEPALIVE]
    assert len(keepalives) >= 7 and all(a.addr == B_PUB for a in keepalives)
    assert alice.core.direct() == {bob.peer: B_PUB}
    net.drop = lambda src, dst, data: True
    with structlog.testing.capture_logs() as logs:
        net.run(200.0)
    assert alice.sent(Downgraded) and alice.sent(Downgraded)[0].addr == B_PUB
    down = [e for e in logs if e["event"] == "path.downgraded" and e["peer"] == str(bob.peer)]
    assert down and "keepalives unanswered" in down[0]["reason"]
    assert alice.core.paths.state(bob.peer) is PathState.RELAY


def test_lost_direct_connection_downgrades_with_backoff():
    """path_lost moves DIRECT to RELAY, returns Downgraded, and blocks a new punch until the backoff expires."""
    net, alice, bob = pair(NatKind.NAT, NatKind.PUBLIC)
    alice.start(bob)
    net.run(5.0)
    assert alice.core.path_lost(bob.peer, "the direct QUIC connection closed", net.now) == [
        Downgraded(bob.peer, B_PUB, "the direct QUIC connection closed")
    ]
    assert alice.core.path_lost(bob.peer, "again", net.now) == []
    assert alice.core.start(bob.peer, alice.verdict, net.now) == []


def test_a_request_from_a_direct_peer_restarts_the_punch():
    """The peer lost the direct path and asks again: we downgrade ours and answer."""
    net, alice, bob = pair(NatKind.PUBLIC, NatKind.PUBLIC)
    alice.start(bob)
    net.run(5.0)
    alice.core.path_lost(bob.peer, "test", net.now)
    alice.core.paths.get(bob.peer).retry_at = net.now  # let Alice retry at once
    alice.start(bob)
    net.run(10.0)
    assert bob.sent(Downgraded) and alice.core.direct() == {bob.peer: B_PUB}


def test_frames_that_are_not_for_us_are_ignored():
    """A request for someone else, a frame not signed by the relay's sender, and a bad-MAC punch change nothing."""
    core = HolePunch(BOB)
    verdict = Verdict(NatKind.NAT, (B_PUB,), "test")
    other = CODEC.encode(PunchRequest(NONCE, CAROL.peer_id, NatKind.NAT, (A_PUB,)), ALICE)
    assert core.relay_received(ALICE.peer_id, other, verdict, 0.0) == []
    mine = CODEC.encode(PunchRequest(NONCE, BOB.peer_id, NatKind.NAT, (A_PUB,)), ALICE)
    assert core.relay_received(CAROL.peer_id, mine, verdict, 0.0) == []
    assert core.paths.state(ALICE.peer_id) is PathState.RELAY
    (accept,) = core.relay_received(ALICE.peer_id, mine, verdict, 0.0)
    assert isinstance(CODEC.decode(accept.data)[1], PunchAccept)
    forged = PathPacket(session_id(NONCE), PathKind.PUNCH, Role.INITIATOR, 0).encode(bytes(16))
    assert core.udp_received(forged, A_PUB, 1.0) == []
    genuine = PathPacket(session_id(NONCE), PathKind.PUNCH, Role.INITIATOR, 0).encode(NONCE)
    assert core.udp_received(genuine, A_PUB, 1.0) == [
        SendUdp(A_PUB, PathPacket(session_id(NONCE), PathKind.PUNCH, Role.RESPONDER, 0).encode(NONCE))
    ]


def test_keepalives_are_answered_only_on_the_direct_path():
    """A valid keepalive replayed from another address gets no answer; from the direct address it gets an ack."""
    net, alice, bob = pair(NatKind.PUBLIC, NatKind.PUBLIC)
    alice.start(bob)
    net.run(5.0)
    nonce = CODEC.decode(alice.sent(SendRelay)[0].data)[1].nonce
    sid = session_id(nonce)
    keepalive = PathPacket(sid, PathKind.KEEPALIVE, Role.INITIATOR, 7).encode(nonce)
    assert bob.core.udp_received(keepalive, ("198.51.100.66", 1), net.now) == []
    ack = PathPacket(sid, PathKind.KEEPALIVE_ACK, Role.RESPONDER, 7).encode(nonce)
    assert bob.core.udp_received(keepalive, A_PUB, net.now) == [SendUdp(A_PUB, ack)]


def test_a_flood_of_requests_is_refused_busy():
    """A peer that keeps asking gets BUSY once its request budget is spent."""
    core = HolePunch(BOB, PunchConfig(request_rate=0.0, request_burst=2))
    verdict = Verdict(NatKind.NAT, (B_PUB,), "test")
    replies = []
    for i in range(4):
        request = CODEC.encode(PunchRequest(bytes([i]) * 16, BOB.peer_id, NatKind.NAT, (A_PUB,)), ALICE)
        replies += core.relay_received(ALICE.peer_id, request, verdict, float(i * 100))
        core.handle_timer(i * 100 + 50.0)  # each session times out before the next request
    kinds = [type(CODEC.decode(r.data)[1]) for r in replies]
    assert kinds == [PunchAccept, PunchAccept, PunchReject, PunchReject]


def test_without_an_observed_address_nothing_is_started():
    """A node that does not know its address yet sends no request and keeps its path untouched."""
    core = HolePunch(ALICE)
    assert core.start(BOB.peer_id, Verdict(NatKind.UNKNOWN, (), "no observations yet"), 0.0) == []
    assert core.paths.state(BOB.peer_id) is PathState.RELAY and core.paths.may_punch(BOB.peer_id, 0.0)
