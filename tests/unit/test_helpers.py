"""Reachability helpers: their signed DHT record (p2p/dht/records.py), choosing whom to ask (p2p/nat/helpers.py), and what
a node announces from its verdict (p2p/nat/traversal.py). No sockets."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2p.dht.records import (
    MAX_LIFETIME,
    BadSignature,
    HelperRecord,
    HostedSlice,
    KeyMismatch,
    MalformedRecord,
    RecordError,
    RecordExpired,
    decode_and_validate,
    decode_helper,
    expires_at_of,
    helper_key,
    issue,
    issue_helper,
    select_best,
    validate,
)
from p2p.identity import Identity
from p2p.nat.helpers import HelperDirectory, distinct_ips, helper_address, helper_peers
from p2p.nat.reachability import NatKind, Verdict
from p2p.nat.traversal import announced_address

NOW = 1_800_000_000.0
ALICE, BOB, CAROL = (Identity.generate() for _ in range(3))
MODEL = "ab" * 32


def helper(identity: Identity, addr: str | None = "10.0.0.1:4001", *, now: float = NOW, ttl: float = 600, seq: int = 1):
    return issue_helper(identity, addr, now=now, ttl=ttl, seq=seq)


# --- the record -----------------------------------------------------------------------------------------------------


def test_helper_record_round_trips_and_validates_under_its_key():
    """A signed helper record decodes to the same record and validates under helper_key(peer)."""
    record, value = helper(ALICE)
    assert decode_helper(value)[0] == record
    assert validate(helper_key(ALICE.peer_id), value, NOW) == record
    assert record.is_live(NOW) and record.address() == ("10.0.0.1", 4001)
    assert expires_at_of(value) == record.expires_at


def test_helper_record_keys_never_collide_with_host_records():
    """A helper record is refused under any other key, and a host validator refuses a helper value."""
    _, value = helper(ALICE)
    with pytest.raises(KeyMismatch):
        validate(helper_key(BOB.peer_id), value, NOW)
    host, host_value = issue(ALICE, HostedSlice(MODEL, 0, ((0, 4),), quic_addr="10.0.0.1:4433"), now=NOW, ttl=600, seq=1)
    with pytest.raises(KeyMismatch):
        validate(host.key, value, NOW)
    with pytest.raises(KeyMismatch):
        validate(helper_key(ALICE.peer_id), host_value, NOW)
    with pytest.raises(MalformedRecord, match="MSR3"):
        decode_and_validate(helper_key(ALICE.peer_id), value, NOW)
    assert validate(host.key, host_value, NOW) == host


def test_helper_record_signed_by_another_key_or_expired_is_refused():
    """A changed byte breaks the signature; an expired record is refused."""
    record, value = helper(ALICE, "10.0.0.1:4001")
    forged = value.replace(b"10.0.0.1", b"10.0.0.9")
    with pytest.raises(BadSignature):
        validate(record.key, forged, NOW)
    with pytest.raises(RecordExpired):
        validate(record.key, value, record.expires_at)


def test_helper_tombstone_is_valid_but_not_live_and_wins_by_seq():
    """A withdrawal (no address) replaces the older record in the DHT's selection and is not live."""
    _, old = helper(ALICE, seq=1)
    tomb, new = helper(ALICE, None, seq=2)
    assert not tomb.is_live(NOW)
    assert select_best(tomb.key, [old, new], NOW) == 1
    with pytest.raises(ValueError):
        tomb.address()


def test_helper_record_fields_are_checked():
    """Bad addresses and lifetimes are refused before anything is signed."""
    with pytest.raises(MalformedRecord):
        helper(ALICE, "no-port")
    with pytest.raises(MalformedRecord):
        HelperRecord(ALICE.peer_id, "10.0.0.1:1", 10, 10 + MAX_LIFETIME + 1, 1)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200), st.integers(min_value=0, max_value=120))
def test_helper_decoder_never_crashes(data, flip):
    """Arbitrary or bit-flipped bytes raise a RecordError, never anything else."""
    _, value = helper(ALICE)
    mutated = bytearray(value)
    mutated[flip % len(mutated)] ^= 0xFF
    for candidate in (b"MSH1" + data, bytes(mutated), value[: len(data) % len(value)]):
        try:
            validate(helper_key(ALICE.peer_id), candidate, NOW)
        except RecordError:
            pass


# --- whom to ask ----------------------------------------------------------------------------------------------------


def test_helper_peers_keeps_live_others_at_ip_addresses_newest_first():
    """Our own, withdrawn, expired and named-host helpers are dropped; one record per peer, the newest first."""
    records = [
        helper(ALICE, "10.0.0.1:1", now=NOW - 10)[0],  # ourselves
        helper(BOB, "10.0.0.2:2", now=NOW - 100, seq=1)[0],
        helper(BOB, "10.0.0.3:3", now=NOW - 50, seq=2)[0],  # Bob's newer address
        helper(CAROL, "10.0.0.4:4", now=NOW - 20)[0],
        helper(Identity.generate(), None, now=NOW - 5)[0],  # withdrawn
        helper(Identity.generate(), "10.0.0.5:5", now=NOW - 700, ttl=600)[0],  # expired
        helper(Identity.generate(), "relay.example:443", now=NOW - 1)[0],  # a name: no DNS on the probe path
        helper(Identity.generate(), "[::1]:6", now=NOW - 30)[0],
    ]
    found = helper_peers(records, ALICE.peer_id, NOW)
    assert [addr for _, addr in found] == [("10.0.0.4", 4), ("::1", 6), ("10.0.0.3", 3)]
    assert found[0][0] == CAROL.peer_id
    assert distinct_ips(found) == 3


def test_helper_address_names_only_concrete_ips():
    """Wildcards and host names cannot be announced: others could not send to them."""
    assert helper_address("10.1.2.3", 4001) == "10.1.2.3:4001"
    assert helper_address("::1", 7) == "[::1]:7"
    assert helper_address("0.0.0.0", 4001) is None
    assert helper_address("::", 1) is None
    assert helper_address("example.org", 1) is None


def test_directory_waits_for_enough_helpers_and_keeps_extra_ones():
    """wait_enough returns once the source lists three IPs; extra helpers are merged in, never ourselves."""

    class Source:
        def __init__(self) -> None:
            self.calls = 0

        async def lookup_helpers(self) -> list[HelperRecord]:
            self.calls += 1
            ids = (BOB, CAROL, Identity.generate())[: min(self.calls, 3)]
            return [helper(i, f"10.0.0.{n}:4001", now=NOW)[0] for n, i in enumerate(ids, 1)]

    async def main():
        extra = [(ALICE.peer_id, ("10.9.9.9", 1)), (BOB.peer_id, ("10.8.8.8", 1))]
        directory = HelperDirectory(Source(), ALICE.peer_id, extra=extra, fast=0.01, clock=lambda: NOW)
        try:
            found = await directory.wait_enough(5)
        finally:
            await directory.close()
        return found

    found = asyncio.run(main())
    assert distinct_ips(found) == 3
    assert ALICE.peer_id not in {p for p, _ in found}
    assert [p for p, _ in found].count(BOB.peer_id) == 1


# --- what to announce -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "configured", "want"),
    [
        (NatKind.PUBLIC, None, "203.0.113.5:4433"),
        (NatKind.PUBLIC, "198.51.100.1:9", "198.51.100.1:9"),
        (NatKind.NAT, "198.51.100.1:9", None),
        (NatKind.SYMMETRIC, None, None),
        (NatKind.UNKNOWN, "198.51.100.1:9", None),
    ],
)
def test_only_a_public_verdict_announces_a_direct_address(kind, configured, want):
    """PUBLIC announces the configured address, else the observed one; anything else announces none."""
    verdict = Verdict(kind, (("203.0.113.5", 4433),), "test")
    assert announced_address(verdict, configured) == want
