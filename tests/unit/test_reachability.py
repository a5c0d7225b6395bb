"""Reachability (p2p/nat/reachability.py, p2p/nat/envelope.py): frames, the verdict, and the protocol over simulated NATs."""

from __future__ import annotations

import os

import pytest
import structlog
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import given, settings
from hypothesis import strategies as st

from p2p.identity import Identity
from p2p.nat.envelope import ENVELOPE_LEN, FRAME_MARK, MAX_FRAME, BadSignature, FrameError, FrameTooLarge, Unknown
from p2p.nat.reachability import (
    CODEC,
    MIN_REQUEST,
    DialBack,
    DialBackAsk,
    DialBackResult,
    DialBackStatus,
    DialStatus,
    NatKind,
    Observation,
    Observe,
    Observed,
    Outcome,
    Probe,
    Reachability,
    ReachabilityConfig,
    Send,
    choose_observers,
    classify,
)
from tests.support.simnet import Nat, Net

Address = tuple[str, int]


def fixed_identity(n: int) -> Identity:
    return Identity(Ed25519PrivateKey.from_private_bytes(bytes([n]) * 32))


ALICE, BOB, CAROL, DAVE = (fixed_identity(n) for n in (1, 2, 3, 4))
NONCE = bytes(range(16))
V6 = ("2001:db8::ffff:1", 65535)

# --- frames ---------------------------------------------------------------------------------------------------------


def test_observe_bytes_have_the_documented_layout():
    """An Observe is mark+magic, version, type, pad length, sender key, nonce, zero padding, signature; 176 bytes."""
    data = CODEC.encode(Observe(NONCE), ALICE)
    assert data[0] == FRAME_MARK and data[:3] == b"\x0dRC"
    assert data[3:5] == b"\x01\x01"
    pad = int.from_bytes(data[5:7], "big")
    assert len(data) == MIN_REQUEST == ENVELOPE_LEN + 16 + pad
    assert data[7:39] == ALICE.public_bytes and data[39:55] == NONCE
    assert data[55 : 55 + pad] == bytes(pad)
    assert ALICE.peer_id.verify(b"moeswarm/reachability/v1\n" + data[:-64], data[-64:])
    assert CODEC.decode(data) == (ALICE.peer_id, Observe(NONCE))


def _frames() -> list:
    return [
        Observe(NONCE),
        Observed(NONCE, ("203.0.113.7", 4433)),
        Observed(NONCE, V6),
        DialBack(NONCE, ("10.0.0.1", "2001:db8::1")),
        DialBackStatus(NONCE, DialStatus.ACCEPTED, CAROL.peer_id),
        DialBackStatus(NONCE, DialStatus.NO_HELPER),
        DialBackAsk(NONCE, V6, ALICE.peer_id),
        Probe(NONCE, V6, ALICE.peer_id),
    ]


@pytest.mark.parametrize("frame", _frames(), ids=lambda f: type(f).__name__)
def test_every_frame_round_trips_with_its_sender(frame):
    """decode(encode(f)) gives back the frame and the key that signed it."""
    assert CODEC.decode(CODEC.encode(frame, BOB)) == (BOB.peer_id, frame)


def test_no_reply_or_probe_is_larger_than_the_request_that_causes_it():
    """Replies fit in MIN_REQUEST (the padded request size) and a probe is no larger than its ask (IPv6 worst case)."""
    for frame in _frames():
        size = len(CODEC.encode(frame, BOB))
        if isinstance(frame, (Observe, DialBack)):
            assert size >= MIN_REQUEST
        else:
            assert size <= MIN_REQUEST or isinstance(frame, (DialBackAsk, Probe))
    ask, probe = DialBackAsk(NONCE, V6, ALICE.peer_id), Probe(NONCE, V6, ALICE.peer_id)
    assert len(CODEC.encode(probe, CAROL)) <= len(CODEC.encode(ask, BOB))


def test_a_short_request_is_refused():
    """An Observe re-signed without its padding does not decode, so it is never answered."""
    data = bytearray(CODEC.encode(Observe(NONCE), ALICE))
    head = bytes(data[:5]) + b"\x00\x00" + bytes(data[7:55])
    short = head + ALICE.sign(b"moeswarm/reachability/v1\n" + head)
    with pytest.raises(FrameError, match="minimum"):
        CODEC.decode(short)


def test_unknown_type_decodes_to_unknown():
    """A signed frame of a future type decodes to Unknown instead of failing."""
    data = bytearray(CODEC.encode(Observed(NONCE, ("10.0.0.1", 1)), BOB))
    data[4] = 99
    head = bytes(data[:-64])
    sender, frame = CODEC.decode(head + BOB.sign(b"moeswarm/reachability/v1\n" + head))
    assert sender == BOB.peer_id and isinstance(frame, Unknown) and frame.type == 99


def test_oversized_datagram_is_refused_before_parsing():
    """More than MAX_FRAME bytes raise FrameTooLarge."""
    with pytest.raises(FrameTooLarge):
        CODEC.decode(b"\x0dRC" + bytes(MAX_FRAME))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=600))
def test_random_bytes_never_crash_the_decoder(data):
    """Arbitrary datagrams raise a FrameError or decode; nothing else escapes."""
    try:
        CODEC.decode(data)
    except FrameError:
        pass


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(_frames()), st.data())
def test_any_changed_bit_or_cut_is_caught(frame, data):
    """A valid frame with one bit flipped or its tail cut never decodes to a frame."""
    raw = bytearray(CODEC.encode(frame, BOB))
    if data.draw(st.booleans()):
        i = data.draw(st.integers(0, len(raw) * 8 - 1))
        raw[i // 8] ^= 1 << (i % 8)
    else:
        raw = raw[: data.draw(st.integers(0, len(raw) - 1))]
    with pytest.raises(FrameError):
        CODEC.decode(bytes(raw))


@settings(max_examples=100, deadline=None)
@given(
    st.binary(min_size=16, max_size=16),
    st.ip_addresses().map(str),
    st.integers(1, 65535),
    st.lists(st.ip_addresses().map(str), max_size=8),
)
def test_fields_round_trip(nonce, host, port, avoid):
    """Any nonce, IPv4/IPv6 address, port and avoid list survive encoding."""
    frames = Observed(nonce, (host, port)), DialBack(nonce, tuple(avoid)), Probe(nonce, (host, port), ALICE.peer_id)
    for frame in frames:
        assert CODEC.decode(CODEC.encode(frame, DAVE)) == (DAVE.peer_id, frame)


def test_bad_values_are_refused_at_construction():
    """A frame that could not be sent is never built: bad nonce, port 0, a name instead of an IP, too many IPs."""
    with pytest.raises(ValueError):
        Observe(b"short")
    with pytest.raises(ValueError):
        Observed(NONCE, ("10.0.0.1", 0))
    with pytest.raises(ValueError):
        Observed(NONCE, ("example.com", 1))
    with pytest.raises(ValueError):
        DialBack(NONCE, tuple(f"10.0.0.{i}" for i in range(9)))
    with pytest.raises(ValueError):
        DialBackStatus(NONCE, DialStatus.ACCEPTED)


# --- the verdict ----------------------------------------------------------------------------------------------------

B_ADDR, C_ADDR = ("198.51.100.2", 4433), ("198.51.100.3", 4433)
MAPPED = ("203.0.113.1", 40000)
OTHER_PORT, OTHER_IP = (MAPPED[0], 40001), ("203.0.113.9", 40000)


def obs(observer: Identity, where: Address, seen: Address, at: float = 100.0) -> Observation:
    return Observation(observer.peer_id, where, seen, at)


def dial(outcome: Outcome, at: float = 100.0) -> DialBackResult:
    return DialBackResult(BOB.peer_id, CAROL.peer_id, outcome, at, f"dial-back {outcome}")


@pytest.mark.parametrize(
    ("observations", "dial_backs", "kind"),
    [
        ([], [], NatKind.UNKNOWN),
        ([obs(BOB, B_ADDR, MAPPED)], [dial(Outcome.FAILED)], NatKind.UNKNOWN),
        ([obs(BOB, B_ADDR, MAPPED), obs(CAROL, C_ADDR, MAPPED)], [], NatKind.UNKNOWN),
        ([obs(BOB, B_ADDR, MAPPED), obs(CAROL, C_ADDR, MAPPED)], [dial(Outcome.INCONCLUSIVE)], NatKind.UNKNOWN),
        ([obs(BOB, B_ADDR, MAPPED), obs(CAROL, C_ADDR, MAPPED)], [dial(Outcome.FAILED)], NatKind.NAT),
        ([obs(BOB, B_ADDR, MAPPED), obs(CAROL, C_ADDR, OTHER_PORT)], [dial(Outcome.FAILED)], NatKind.SYMMETRIC),
        ([obs(BOB, B_ADDR, MAPPED), obs(CAROL, C_ADDR, OTHER_IP)], [], NatKind.SYMMETRIC),
        ([obs(BOB, B_ADDR, MAPPED)], [dial(Outcome.ARRIVED)], NatKind.PUBLIC),
        ([obs(BOB, B_ADDR, MAPPED), obs(CAROL, C_ADDR, MAPPED)], [dial(Outcome.ARRIVED), dial(Outcome.FAILED, 101)],
         NatKind.PUBLIC),
        ([obs(BOB, B_ADDR, MAPPED), obs(CAROL, (B_ADDR[0], 9), OTHER_PORT)], [dial(Outcome.FAILED)], NatKind.UNKNOWN),
    ],
    ids=["nothing", "one-observer", "no-dial-back", "inconclusive", "cone", "port-differs", "ip-differs",
         "public", "arrived-beats-later-loss", "same-observer-ip"],  # fmt: skip
)
def test_classify(observations, dial_backs, kind):
    """The table of evidence -> verdict kind; two observers at one IP count once."""
    verdict = classify(observations, dial_backs, now=110.0, max_age=300.0)
    assert verdict.kind is kind, verdict.reason
    assert verdict.reason


def test_old_evidence_ages_out():
    """Observations and dial-backs older than max_age no longer count."""
    evidence = [obs(BOB, B_ADDR, MAPPED, at=0.0), obs(CAROL, C_ADDR, MAPPED, at=0.0)], [dial(Outcome.ARRIVED, at=0.0)]
    assert classify(*evidence, now=300.0, max_age=300.0).kind is NatKind.PUBLIC
    assert classify(*evidence, now=300.1, max_age=300.0).kind is NatKind.UNKNOWN


def test_the_newest_observation_of_an_ip_wins_and_addresses_are_newest_first():
    """A remapped NAT is judged on its current mapping, and the verdict lists the current address first."""
    moved = ("203.0.113.1", 40002)
    verdict = classify(
        [obs(BOB, B_ADDR, MAPPED, 10.0), obs(BOB, B_ADDR, moved, 20.0), obs(CAROL, C_ADDR, moved, 15.0)],
        [dial(Outcome.FAILED, 20.0)],
        now=30.0,
        max_age=300.0,
    )
    assert verdict.kind is NatKind.NAT and verdict.addresses == (moved,)


def test_choose_observers_takes_one_peer_per_ip():
    """Two peers on one IP are one observer."""
    peers = [(BOB.peer_id, B_ADDR), (DAVE.peer_id, (B_ADDR[0], 5)), (CAROL.peer_id, C_ADDR)]
    assert choose_observers(peers, 3) == [(BOB.peer_id, B_ADDR), (CAROL.peer_id, C_ADDR)]


# --- a simulated network with NATs ----------------------------------------------------------------------------------


class ReachNode:
    """A ``Reachability`` core on the simulated network."""

    def __init__(self, net: Net, identity: Identity, addr: Address, nat: Nat | None = None, **config) -> None:
        self.net, self.addr = net, addr
        self.core = Reachability(identity, ReachabilityConfig(**config))
        net.add(addr, self, nat)

    @property
    def peer(self):
        return self.core.peer_id

    def send(self, sends: list[Send]) -> None:
        for send in sends:
            self.net.send(self.addr, send.addr, send.data)

    def deliver(self, data: bytes, src: Address, now: float) -> None:
        self.send(self.core.datagram_received(data, src, now))

    def timer(self) -> float | None:
        return self.core.get_timer()

    def fire(self, now: float) -> None:
        self.send(self.core.handle_timer(now))


PUBLIC_ADDRS = [("198.51.100.2", 4433), ("198.51.100.3", 4433), ("198.51.100.4", 4433), ("198.51.100.5", 4433)]


def swarm(nat: Nat | None, **config) -> tuple[Net, ReachNode, list[ReachNode]]:
    """Node A (behind ``nat``, or public) and four public peers that know each other as helpers."""
    net = Net()
    a_addr = ("192.168.1.2", 5000) if nat else ("198.51.100.9", 4433)
    a = ReachNode(net, ALICE, a_addr, nat, **config)
    publics = [ReachNode(net, fixed_identity(10 + i), addr, **config) for i, addr in enumerate(PUBLIC_ADDRS)]
    for node in publics:
        node.core.helpers = [(p.peer, p.addr) for p in publics]
    return net, a, publics


def check(net: Net, a: ReachNode, observers: list[ReachNode]):
    for node in observers:
        a.send(a.core.observe(node.peer, node.addr, net.now))
    net.run(net.now + 5)
    a.send(a.core.dial_back(observers[0].peer, observers[0].addr, net.now))
    net.run(net.now + 10)
    assert not a.core.busy
    return a.core.verdict(net.now)


def test_public_node_is_public():
    """Without a NAT, the helper's probe arrives: PUBLIC at the node's own address."""
    net, a, publics = swarm(None)
    verdict = check(net, a, publics[:2])
    assert verdict.kind is NatKind.PUBLIC, verdict.reason
    assert verdict.addresses == (a.addr,)
    helper = a.core.dial_backs()[0].helper
    assert helper not in (publics[0].peer, publics[1].peer)  # B chose a peer A had not contacted


def test_cone_nat_is_nat_with_its_mapped_address():
    """Behind a cone NAT both observers see one mapping and the probe is filtered: NAT, punchable."""
    router = Nat("203.0.113.1")
    net, a, publics = swarm(router)
    verdict = check(net, a, publics[:2])
    assert verdict.kind is NatKind.NAT, verdict.reason
    assert verdict.addresses == (("203.0.113.1", 40000),)
    assert a.core.dial_backs()[0].outcome is Outcome.FAILED


def test_symmetric_nat_is_symmetric():
    """Behind a symmetric NAT the two observers see two ports: SYMMETRIC."""
    net, a, publics = swarm(Nat("203.0.113.1", symmetric=True))
    verdict = check(net, a, publics[:2])
    assert verdict.kind is NatKind.SYMMETRIC, verdict.reason
    assert len(verdict.addresses) == 2


def test_lost_requests_are_retransmitted():
    """The first two copies of every request are lost; the third gets through and the verdict is still right."""
    net, a, publics = swarm(None)
    seen: dict[bytes, int] = {}

    def lose_first_two(src, dst, data):
        if src != a.addr:
            return False
        seen[data] = seen.get(data, 0) + 1
        return seen[data] <= 2

    net.drop = lose_first_two
    assert check(net, a, publics[:2]).kind is NatKind.PUBLIC


def test_silent_observers_leave_the_verdict_unknown():
    """No answers at all: after the retries, no observation and an inconclusive dial-back, so UNKNOWN."""
    net, a, publics = swarm(None)
    net.drop = lambda src, dst, data: src != a.addr
    verdict = check(net, a, publics[:2])
    assert verdict.kind is NatKind.UNKNOWN
    assert [d.outcome for d in a.core.dial_backs()] == [Outcome.INCONCLUSIVE]


def test_no_helper_means_no_conclusion():
    """A server that knows no qualifying helper says so; A concludes nothing from it."""
    net, a, publics = swarm(Nat("203.0.113.1"))
    for node in publics:
        node.core.helpers = [(publics[0].peer, publics[0].addr), (publics[1].peer, publics[1].addr)]
    verdict = check(net, a, publics[:2])  # both helpers were contacted by A: avoided
    assert verdict.kind is NatKind.UNKNOWN
    assert "no helper" in a.core.dial_backs()[0].detail


def _accepted_dial_back(core: Reachability) -> bytes:
    """Start a dial-back from ``core`` via Bob, have Bob name Carol as the helper; the nonce."""
    (request,) = core.dial_back(BOB.peer_id, B_ADDR, 0.0)
    nonce = CODEC.decode(request.data)[1].nonce
    status = DialBackStatus(nonce, DialStatus.ACCEPTED, CAROL.peer_id)
    core.datagram_received(CODEC.encode(status, BOB), B_ADDR, 0.1)
    return nonce


@pytest.mark.parametrize(
    ("signer", "src", "why"),
    [
        (CAROL, C_ADDR, "we sent to"),  # C's IP was contacted: our NAT would admit it anyway
        (BOB, ("198.51.100.77", 1), "the peer we asked"),
        (CAROL, (B_ADDR[0], 9999), "the peer we asked"),
        (DAVE, ("198.51.100.77", 1), "was named"),
    ],
    ids=["contacted-ip", "server-itself", "server-ip", "unnamed-helper"],
)
def test_probes_that_prove_nothing_are_ignored(signer, src, why):
    """A probe from a contacted IP, from the server (or its IP) or from another helper than named is no evidence."""
    core = Reachability(ALICE)
    core.note_contacted(C_ADDR[0], 0.0)
    nonce = _accepted_dial_back(core)
    with structlog.testing.capture_logs() as logs:
        core.datagram_received(CODEC.encode(Probe(nonce, MAPPED, ALICE.peer_id), signer), src, 0.2)
    assert [e["event"] for e in logs] == ["reachability.probe_ignored"] and why in logs[0]["reason"]
    core.handle_timer(5.0)
    assert [d.outcome for d in core.dial_backs()] == [Outcome.FAILED]


def test_the_named_helpers_probe_from_a_new_ip_is_public():
    """The helper Bob named probes from an IP we never sent to: ARRIVED."""
    core = Reachability(ALICE)
    nonce = _accepted_dial_back(core)
    core.datagram_received(CODEC.encode(Probe(nonce, MAPPED, ALICE.peer_id), CAROL), C_ADDR, 0.2)
    assert [d.outcome for d in core.dial_backs()] == [Outcome.ARRIVED] and not core.busy


def test_answers_that_do_not_match_a_request_are_ignored():
    """An Observed with an unknown nonce, from the wrong address, or signed by another peer changes nothing."""
    core = Reachability(ALICE)
    sent = core.observe(BOB.peer_id, B_ADDR, 0.0)
    nonce = CODEC.decode(sent[0].data)[1].nonce
    for data, src in [
        (CODEC.encode(Observed(os.urandom(16), MAPPED), BOB), B_ADDR),
        (CODEC.encode(Observed(nonce, MAPPED), BOB), C_ADDR),
        (CODEC.encode(Observed(nonce, MAPPED), CAROL), B_ADDR),
    ]:
        assert core.datagram_received(data, src, 0.1) == []
    assert core.observations() == [] and core.busy
    core.datagram_received(CODEC.encode(Observed(nonce, MAPPED), BOB), B_ADDR, 0.2)
    assert [o.observed for o in core.observations()] == [MAPPED]


def test_a_forged_signature_is_dropped():
    """An Observe whose signature does not match its sender key gets no answer."""
    server = Reachability(BOB)
    data = bytearray(CODEC.encode(Observe(NONCE), ALICE))
    data[-1] ^= 1
    assert server.datagram_received(bytes(data), MAPPED, 0.0) == []
    with pytest.raises(BadSignature):
        CODEC.decode(bytes(data))


def test_requests_from_one_source_are_rate_limited():
    """A flood of Observes from one address gets at most the burst answered; another source is still served."""
    server = Reachability(BOB, ReachabilityConfig(source_rate=1.0, source_burst=5))
    request = CODEC.encode(Observe(NONCE), ALICE)
    answered = sum(len(server.datagram_received(request, MAPPED, 0.0)) for _ in range(50))
    assert answered == 5
    assert len(server.datagram_received(request, ("203.0.113.99", 1), 0.0)) == 1


def test_dial_back_probes_only_the_observed_address():
    """B asks its helper to probe the address the request came from, with the requester's nonce; one probe each."""
    server = Reachability(BOB)
    server.helpers = [(CAROL.peer_id, C_ADDR)]
    request = CODEC.encode(DialBack(NONCE, ("10.9.9.9",)), ALICE)
    ask, status = server.datagram_received(request, MAPPED, 0.0)
    assert ask.addr == C_ADDR and status.addr == MAPPED
    assert CODEC.decode(ask.data) == (BOB.peer_id, DialBackAsk(NONCE, MAPPED, ALICE.peer_id))
    assert CODEC.decode(status.data)[1] == DialBackStatus(NONCE, DialStatus.ACCEPTED, CAROL.peer_id)
    helper = Reachability(CAROL)
    (probe,) = helper.datagram_received(ask.data, B_ADDR, 0.0)
    assert probe.addr == MAPPED and CODEC.decode(probe.data) == (CAROL.peer_id, Probe(NONCE, MAPPED, ALICE.peer_id))
    assert len(probe.data) <= len(ask.data)
