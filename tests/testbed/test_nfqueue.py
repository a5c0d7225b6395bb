"""The delay daemon's netlink messages, its schedule and the topology tables, without root or sockets."""

from __future__ import annotations

import random
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from node.testbed.errors import NetlinkError, NetlinkFormatError, TestbedError
from node.testbed.nfqueue import Ack, DelayLine, Packet, QueueMsg, Verdict, batch_verdict, bind_request, params_request, parse, verdict
from node.testbed.topology import Kind, Nat, iptables_rules, link_commands, link_delays, normalize_prefix, plan


def kernel_packet(queue: int, packet_id: int, extra_attrs: bytes = b"") -> bytes:
    """A queued-packet message as the kernel sends it (packet header attribute plus others)."""
    hdr = struct.pack("!IHB", packet_id, 0x0800, 1) + b"\0"  # 7 bytes + 1 pad
    attrs = struct.pack("=HH", 4 + 7, 1) + hdr + extra_attrs
    body = struct.pack("!BBH", 2, 0, queue) + attrs
    return struct.pack("=IHHII", 16 + len(body), (3 << 8) | QueueMsg.PACKET, 0, 0, 0) + body


def kernel_error(seq: int, errno: int) -> bytes:
    return struct.pack("=IHHII", 16 + 20, 2, 0, seq, 0) + struct.pack("=i", -errno) + b"\0" * 16


def test_parse_packets_and_acks_in_one_datagram():
    """Several messages in one read come out in order: packets with their queue and id, acks with their seq."""
    mark = struct.pack("=HHI", 8, 3, 7)  # NFQA_MARK, ignored
    data = kernel_packet(5, 41, mark) + kernel_error(9, 0) + kernel_packet(5, 42)
    assert parse(data) == [Packet(5, 41), Ack(9), Packet(5, 42)]


def test_parse_kernel_refusal_raises_netlink_error():
    """A non-zero error code is the kernel refusing a request (e.g. EBUSY: queue already bound)."""
    with pytest.raises(NetlinkError) as info:
        parse(kernel_error(3, 16))
    assert info.value.errno == 16 and info.value.seq == 3


def test_parse_rejects_truncated_message():
    """A length that overruns the datagram is a format error, not an IndexError."""
    with pytest.raises(NetlinkFormatError):
        parse(kernel_packet(0, 1)[:-3])


def test_parse_rejects_packet_without_header():
    """A queued-packet message must carry its packet header attribute."""
    body = struct.pack("!BBH", 2, 0, 0)
    msg = struct.pack("=IHHII", 16 + len(body), (3 << 8) | QueueMsg.PACKET, 0, 0, 0) + body
    with pytest.raises(NetlinkFormatError):
        parse(msg)


@given(st.binary(max_size=200))
def test_parse_never_crashes(data):
    """Arbitrary bytes give events or a netlink error, never another exception."""
    try:
        parse(data)
    except (NetlinkError, NetlinkFormatError):
        pass


def test_requests_are_well_formed():
    """Builders produce netlink messages whose length field is their size, for the right queue and type."""
    for msg, kind in ((bind_request(7, 1), QueueMsg.CONFIG), (params_request(7, 2, 1024), QueueMsg.CONFIG),
                      (verdict(7, 99, Verdict.DROP), QueueMsg.VERDICT), (batch_verdict(7, 99, Verdict.ACCEPT), QueueMsg.VERDICT_BATCH)):  # fmt: skip
        length, mtype, _flags, _seq, _pid = struct.unpack_from("=IHHII", msg)
        assert length == len(msg) and len(msg) % 4 == 0
        assert mtype == (3 << 8) | kind
        assert struct.unpack_from("!H", msg, 18)[0] == 7
    assert struct.unpack_from("!II", batch_verdict(7, 99, Verdict.ACCEPT), 24) == (Verdict.ACCEPT, 99)
    with pytest.raises(ValueError):
        bind_request(70000, 1)


def test_params_never_enable_fail_open():
    """Fail-open would pass packets undelayed when the queue is full: the mask names it and the flags clear it."""
    msg = params_request(0, 1, 64)
    mask, flags = struct.unpack_from("!I", msg, len(msg) - 12)[0], struct.unpack_from("!I", msg, len(msg) - 4)[0]
    assert mask & 1 and not flags & 1


def test_delay_line_releases_in_order_after_the_delay():
    """Nothing is due before arrival + delay; at the due time one id covers everything due."""
    line = DelayLine(0.040)
    assert line.arrive(1, now=10.000) and line.arrive(2, now=10.010) and line.arrive(3, now=10.030)
    assert line.next_deadline() == pytest.approx(10.040)
    assert line.release(10.039) is None
    assert line.release(10.051) == 2
    assert len(line) == 1 and line.next_deadline() == pytest.approx(10.070)
    assert line.release(11.0) == 3 and line.next_deadline() is None and line.accepted == 3


def test_delay_line_loss_drops_about_that_share():
    """With loss 0.3, roughly 30% of packets are refused and never queued."""
    line = DelayLine(0.0, loss=0.3, rng=random.Random(1))
    kept = sum(line.arrive(i, 0.0) for i in range(2000))
    assert 1200 < kept < 1600 and line.dropped == 2000 - kept == 2000 - len(line)


def test_delay_line_rejects_bad_parameters():
    """Negative delay and loss of 1 or more are refused."""
    with pytest.raises(ValueError):
        DelayLine(-1)
    with pytest.raises(ValueError):
        DelayLine(0.0, loss=1.0)


def test_plan_addresses_and_names():
    """Every host gets a distinct address; names are prefix + role; workers route via their router."""
    p = plan("mswab12-", (Nat.CONE, Nat.SYMMETRIC, Nat.CONE))
    addrs = [h.addr for h in p.hosts if h.addr]
    assert len(addrs) == len(set(addrs)) == 10
    assert p.netns("worker-c") == "mswab12-worker-c"
    worker = p.host("worker-c")
    assert worker.behind == "router-c" and worker.gateway == p.host("router-c").lan_addr
    assert "route add default via 10.231.3.1" in link_commands(worker)
    assert p.role_of("mswab12-pub-relay") == "pub-relay"
    with pytest.raises(TestbedError):
        p.netns("nope")


def test_router_rules_filter_like_a_home_router():
    """Routers drop unsolicited WAN input, forward only established traffic inward, and masquerade by kind."""
    p = plan("mswab12-")
    cone, sym = iptables_rules(p.host("router-a"), False), iptables_rules(p.host("router-b"), True)
    for rules in (cone, sym):
        assert "-A INPUT -i wan -j DROP" in rules and ":FORWARD DROP" in rules
        assert "-A FORWARD -i wan -o lan -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT" in rules
    assert "MASQUERADE\n" in cone and "--random-fully" not in cone and "NFQUEUE" not in cone
    assert "MASQUERADE --random-fully" in sym and "NFQUEUE --queue-num 0" in sym and "bypass" not in sym
    assert iptables_rules(p.host("pub-relay"), False) is None
    assert iptables_rules(p.host("worker-a"), True) is None
    assert [h.kind for h in p.hosts].count(Kind.PUBLIC) == 4


def test_link_delays_default_to_half_the_rtt_and_take_per_host_overrides():
    """Each WAN ingress gets RTT/2 unless named; a worker's entry sets its router's link; bad entries are refused."""
    p = plan("mswab12-", public_workers=3)
    assert [h.role for h in p.hosts if h.role.startswith("pub-worker")] == ["pub-worker", "pub-worker-2", "pub-worker-3"]
    delays = link_delays(p, 80, {"backbone": 0, "pub-worker-3": 80, "worker-a": 10})
    assert delays["backbone"] == 0 and delays["pub-worker-3"] == 80 and delays["router-a"] == 10
    assert delays["pub-relay"] == delays["router-b"] == 40 and "worker-a" not in delays and "inet" not in delays
    for bad in ({"inet": 1}, {"nope": 1}, {"backbone": -1}):
        with pytest.raises(TestbedError):
            link_delays(p, 80, bad)
    with pytest.raises(TestbedError):
        plan("mswab12-", public_workers=0)


def test_normalize_prefix():
    """Short names get the msw prefix and dash; anything that could match other namespaces is refused."""
    assert normalize_prefix("ab12") == normalize_prefix("mswab12-") == "mswab12-"
    for bad in ("", "AB", "a-b", "x" * 11, "../x"):
        with pytest.raises(TestbedError):
            normalize_prefix(bad)
