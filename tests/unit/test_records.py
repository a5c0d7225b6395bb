"""Signed host records (p2p/dht/records.py) and the sans-IO parts of discovery (p2p/dht/discovery.py)."""

from __future__ import annotations

import asyncio
import hashlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2p.dht.discovery import Announcer, CachedDiscovery, InMemoryBoard, InMemoryDiscovery, live_hosts
from p2p.dht.records import (
    _TAIL,
    MAX_CLOCK_SKEW,
    MAX_KERNEL_BYTES,
    MAX_QUIC_ADDR_BYTES,
    MAX_RANGES,
    MAX_RECORD_BYTES,
    MAX_RELAY_URL_BYTES,
    SIGNING_CONTEXT,
    BadSignature,
    HostedSlice,
    HostRecord,
    KeyMismatch,
    MalformedRecord,
    ModelShape,
    OutsideModel,
    RecordError,
    RecordExpired,
    RecordNotYetValid,
    RecordTooLarge,
    RelayAddress,
    decode,
    decode_and_validate,
    issue,
    select_best,
    sign,
    value_key,
)
from p2p.identity import Identity
from tests.support import FakeClock, async_until

MODEL = hashlib.sha256(b"model-a").hexdigest()
OTHER_MODEL = hashlib.sha256(b"model-b").hexdigest()
NOW = 1_800_000_000.0
ALICE = Identity.generate()
BOB = Identity.generate()
RELAY = RelayAddress("wss://relay.example:443/v1", BOB.peer_id)


def hosted(layer: int = 3, ranges: tuple[tuple[int, int], ...] = ((0, 8),), **kw: object) -> HostedSlice:
    kw.setdefault("quic_addr", "127.0.0.1:4433")
    return HostedSlice(MODEL, layer, ranges, capacity=16, price=250, **kw)  # type: ignore[arg-type]


def signed(identity: Identity = ALICE, slice_: HostedSlice | None = None, *, ttl: float = 600, seq: int = 7):
    return issue(identity, slice_ or hosted(relay=RELAY), now=NOW, ttl=ttl, seq=seq)


# --- records: sign / verify ------------------------------------------------------------------


def test_signed_record_round_trips():
    """A signed record decodes to an equal record under its own key."""
    record, value = signed()
    assert decode_and_validate(record.key, value, NOW + 1) == record
    assert record.hosted.relay == RELAY and record.hosted.experts() == frozenset(range(8))


def test_the_serves_slices_flag_round_trips_and_unknown_flags_are_malformed():
    """A worker that serves slices says so in its signed record; a flag bit this version does not define is refused."""
    record, value = signed(slice_=hosted(serves_slices=True))
    assert decode_and_validate(record.key, value, NOW + 1).hosted.serves_slices
    plain, plain_value = signed()
    assert not decode_and_validate(plain.key, plain_value, NOW + 1).hosted.serves_slices
    flags_at = len(plain.body()) - _TAIL.size - 1
    body = bytearray(plain.body())
    body[flags_at] = 0x02
    with pytest.raises(MalformedRecord, match="flags 0x02"):
        decode(bytes(body) + ALICE.sign(SIGNING_CONTEXT + bytes(body)))


def test_every_single_byte_change_is_rejected():
    """Flipping any bit of any byte of a signed value makes it invalid (never silently accepted)."""
    record, value = signed()
    for i in range(len(value)):
        for flip in (0x01, 0x80):
            tampered = value[:i] + bytes([value[i] ^ flip]) + value[i + 1 :]
            with pytest.raises(RecordError):
                decode_and_validate(record.key, tampered, NOW + 1)


def test_signature_by_another_key_is_rejected():
    """A record naming Alice but signed by Bob fails with BadSignature."""
    record, value = signed()
    body = record.body()
    forged = body + BOB.sign(b"moeswarm/host-record/v1\n" + body)
    with pytest.raises(BadSignature):
        decode_and_validate(record.key, forged, NOW + 1)


def test_sign_refuses_a_record_of_another_peer():
    """sign() will not sign a record that names a different peer than the identity."""
    record, _ = signed(ALICE)
    with pytest.raises(ValueError, match="signing identity"):
        sign(BOB, record)


def test_expiry_is_enforced_at_the_second():
    """A record is valid until just before expires_at and expired from expires_at on."""
    record, value = signed(ttl=600)
    assert decode_and_validate(record.key, value, record.expires_at - 0.001) == record
    with pytest.raises(RecordExpired):
        decode_and_validate(record.key, value, record.expires_at)
    with pytest.raises(RecordExpired):
        decode_and_validate(record.key, value, record.expires_at + 3600)


def test_record_from_the_future_is_rejected():
    """A record issued further ahead than MAX_CLOCK_SKEW is not yet valid; within the skew it is."""
    record, value = signed()
    assert decode_and_validate(record.key, value, NOW - MAX_CLOCK_SKEW) == record
    with pytest.raises(RecordNotYetValid):
        decode_and_validate(record.key, value, NOW - MAX_CLOCK_SKEW - 1)


def test_key_must_match_peer_model_and_layer():
    """A valid value under another peer's, model's or layer's key, or outside the namespace, is refused."""
    record, value = signed()
    for key in (
        value_key(BOB.peer_id, MODEL, 3),
        value_key(ALICE.peer_id, OTHER_MODEL, 3),
        value_key(ALICE.peer_id, MODEL, 4),
    ):
        with pytest.raises(KeyMismatch):
            decode_and_validate(key, value, NOW + 1)
    with pytest.raises(KeyMismatch, match="namespace"):
        decode_and_validate("/pk/" + record.key, value, NOW + 1)


def test_keys_fit_libp2p_find_node_limit():
    """Value keys stay within the 50 bytes py-libp2p servers accept in FIND_NODE."""
    assert len(value_key(ALICE.peer_id, MODEL, 65535).encode()) <= 50


def test_size_limit_is_checked_before_parsing():
    """Oversized input fails with RecordTooLarge even when it is garbage; the largest legal record fits."""
    with pytest.raises(RecordTooLarge):
        decode_and_validate(value_key(ALICE.peer_id, MODEL, 3), b"\xff" * (MAX_RECORD_BYTES + 1), NOW)
    biggest = HostedSlice(
        MODEL,
        65535,
        tuple((2 * i, 2 * i + 1) for i in range(MAX_RANGES)),
        quic_addr="h" * (MAX_QUIC_ADDR_BYTES - 6) + ":65535",
        relay=RelayAddress("wss://" + "r" * (MAX_RELAY_URL_BYTES - 6), BOB.peer_id),
        capacity=2**32 - 1,
        price=2**64 - 1,
        kernel="k" * MAX_KERNEL_BYTES,
    )
    record, value = issue(ALICE, biggest, now=NOW, ttl=600, seq=2**64 - 1)
    assert len(value) == 1500 <= MAX_RECORD_BYTES
    assert decode_and_validate(record.key, value, NOW) == record


def test_truncated_and_padded_values_are_malformed():
    """Cutting bytes off or appending bytes gives MalformedRecord, not a crash."""
    record, value = signed()
    with pytest.raises(MalformedRecord, match="truncated"):
        decode_and_validate(record.key, value[:-1], NOW)
    with pytest.raises(MalformedRecord, match="trailing"):
        decode_and_validate(record.key, value + b"\0", NOW)
    with pytest.raises(MalformedRecord, match="MSR3"):
        decode_and_validate(record.key, b"XXXX" + value[4:], NOW)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"model_digest": "AB" * 32}, "64 lowercase hex"),
        ({"expert_ranges": ((4, 8), (6, 10))}, "sorted and disjoint"),
        ({"expert_ranges": ((8, 8),)}, "sorted and disjoint"),
        ({"expert_ranges": ((0, 1),) * (MAX_RANGES + 1)}, "at most"),
        ({"quic_addr": "::1:4433"}, "brackets"),
        ({"quic_addr": "host:0"}, "port 1..65535"),
        ({"quic_addr": None}, "needs a QUIC address"),
        ({"layer": 70000}, "layer"),
        ({"price": -1}, "price"),
        ({"kernel": "k" * (MAX_KERNEL_BYTES + 1)}, "kernel identity"),
        ({"kernel": "ggml\n"}, "kernel identity"),
    ],
)
def test_bad_fields_are_rejected_at_construction(kwargs, message):
    """Every field is range-checked when a slice is built, locally or by the decoder."""
    fields = dict(model_digest=MODEL, layer=1, expert_ranges=((0, 4),), quic_addr="[::1]:4433")
    fields.update(kwargs)
    with pytest.raises(MalformedRecord, match=message):
        HostedSlice(**fields)  # type: ignore[arg-type]


def test_relay_url_must_be_websocket():
    """A relay address needs a ws:// or wss:// URL."""
    with pytest.raises(MalformedRecord, match="ws://"):
        RelayAddress("https://relay.example/", BOB.peer_id)


def test_lifetime_is_bounded():
    """A record may not promise more than 24 h, nor expire before it is issued."""
    with pytest.raises(MalformedRecord, match="lifetime"):
        HostRecord(ALICE.peer_id, hosted(), 100, 100 + 24 * 3600 + 1, 1)
    with pytest.raises(MalformedRecord, match="lifetime"):
        HostRecord(ALICE.peer_id, hosted(), 100, 100, 1)


def test_select_best_prefers_newer_valid_records():
    """select_best picks the highest seq among valid values and ignores invalid ones; ties keep the first."""
    old, old_value = signed(seq=5)
    _, new_value = signed(seq=6)
    _, expired_value = issue(ALICE, hosted(relay=RELAY), now=NOW - 10_000, ttl=600, seq=99)
    assert select_best(old.key, [old_value, new_value], NOW) == 1
    assert select_best(old.key, [new_value, old_value], NOW) == 0
    assert select_best(old.key, [old_value, expired_value], NOW) == 0
    assert select_best(old.key, [b"junk", old_value], NOW) == 1
    assert select_best(old.key, [old_value, old_value], NOW) == 0


# --- records: fuzzing -----------------------------------------------------------------------

_slices = st.builds(
    HostedSlice,
    model_digest=st.sampled_from([MODEL, OTHER_MODEL]),
    layer=st.integers(0, 65535),
    expert_ranges=st.lists(st.integers(0, 65535), min_size=2, max_size=2 * MAX_RANGES, unique=True)
    .map(sorted)
    .map(lambda xs: tuple(zip(xs[0::2], xs[1::2]))),
    quic_addr=st.sampled_from(["127.0.0.1:1", "[::1]:65535", "worker.example:4433"]),
    relay=st.none() | st.just(RELAY),
    capacity=st.integers(0, 2**32 - 1),
    price=st.integers(0, 2**64 - 1),
)


@given(slice_=_slices, ttl=st.integers(1, 24 * 3600), seq=st.integers(0, 2**64 - 1))
def test_any_valid_record_round_trips(slice_, ttl, seq):
    """Every well-formed slice signs and decodes back to the same record."""
    record, value = issue(ALICE, slice_, now=NOW, ttl=ttl, seq=seq)
    assert decode_and_validate(record.key, value, NOW) == record


@settings(max_examples=500)
@given(key=st.text(max_size=80), value=st.binary(max_size=MAX_RECORD_BYTES + 64))
def test_decoder_raises_only_record_errors_on_random_input(key, value):
    """Arbitrary bytes under an arbitrary key raise RecordError (subclasses) and nothing else."""
    with pytest.raises(RecordError):
        decode_and_validate(key, value, NOW)


@given(text=st.text(max_size=300) | st.from_regex(r"wss?://[\[\]:.a-z0-9/%@?#-]{0,40}", fullmatch=True))
def test_address_checks_raise_only_malformed_record(text):
    """Any string as a QUIC address or relay URL is accepted or refused with MalformedRecord, nothing else."""
    for build in (lambda: hosted(quic_addr=text), lambda: RelayAddress(text, BOB.peer_id)):
        try:
            build()
        except MalformedRecord:
            pass


_VALID_RECORD, _VALID_VALUE = signed()


@settings(max_examples=500)
@given(
    edits=st.lists(
        st.tuples(st.sampled_from(["flip", "insert", "delete"]), st.integers(0, 2000), st.integers(0, 255)),
        min_size=1,
        max_size=4,
    )
)
def test_mutated_records_are_never_accepted(edits):
    """Inserting, deleting or changing bytes of a valid value never yields an accepted, different value."""
    data = bytearray(_VALID_VALUE)
    for op, pos, byte in edits:
        pos %= len(data) + (op == "insert")
        if op == "flip" and data:
            data[pos % len(data)] ^= byte or 1
        elif op == "insert":
            data.insert(pos, byte)
        elif data:
            del data[pos % len(data)]
    try:
        record = decode_and_validate(_VALID_RECORD.key, bytes(data), NOW)
    except RecordError:
        return
    assert bytes(data) == _VALID_VALUE and record == _VALID_RECORD


# --- discovery: sans-IO parts and the in-memory backend ---------------------------------------


def test_live_hosts_keeps_the_newest_record_per_peer_before_dropping_tombstones():
    """A peer whose newest record is a tombstone is gone even if an older live copy is around."""
    live_a, _ = signed(ALICE, seq=1)
    tomb_a, _ = signed(ALICE, HostedSlice.tombstone(MODEL, 3), seq=2)
    old_b, _ = signed(BOB, hosted(ranges=((0, 4),)), seq=1)
    new_b, _ = signed(BOB, hosted(ranges=((4, 8),)), seq=3)
    other_layer, _ = signed(BOB, hosted(layer=9), seq=9)
    hosts = live_hosts([live_a, old_b, tomb_a, new_b, other_layer], MODEL, 3, NOW)
    assert hosts == [new_b]
    assert live_hosts([live_a, new_b], MODEL, 3, new_b.expires_at) == []


def test_announcer_publishes_changes_refreshes_and_tombstones():
    """The announcer signs new slices, re-signs due ones with a higher seq, and tombstones dropped ones."""
    ann = Announcer(ALICE, ttl=600)
    first = ann.replace([hosted(layer=1), hosted(layer=2)], NOW)
    assert [p.record.hosted.layer for p in first] == [1, 2]
    assert ann.replace([hosted(layer=1), hosted(layer=2)], NOW + 10) == []  # unchanged: nothing to do
    assert ann.next_refresh_at() == int(NOW) + 300
    assert ann.due(NOW + 299) == []
    refreshed = ann.due(NOW + 300)
    assert {p.record.hosted.layer for p in refreshed} == {1, 2}
    assert all(r.record.seq > f.record.seq for r, f in zip(refreshed, first))
    dropped = ann.replace([hosted(layer=1)], NOW + 301)
    assert [(p.record.hosted.layer, p.record.hosted.is_tombstone) for p in dropped] == [(2, True)]
    assert dropped[0].record.expires_at == refreshed[1].record.expires_at
    tombs = ann.withdraw(NOW + 302)
    assert [(p.record.hosted.layer, p.record.hosted.is_tombstone) for p in tombs] == [(1, True)]
    assert ann.next_refresh_at() is None
    for pub in [*first, *refreshed, *dropped, *tombs]:
        assert decode_and_validate(pub.key, pub.value, NOW + 302 if pub in tombs else NOW + 300)


def test_announcer_rejects_two_slices_for_one_layer():
    """Two slices of the same (model, layer) must be merged into one record by the caller."""
    with pytest.raises(ValueError, match="merge"):
        Announcer(ALICE, ttl=600).replace([hosted(ranges=((0, 2),)), hosted(ranges=((4, 6),))], NOW)


def test_in_memory_discovery_announce_lookup_withdraw():
    """Nodes sharing a board find each other's live slices and lose them on withdraw or expiry."""

    async def scenario() -> None:
        board = InMemoryBoard()
        clock = FakeClock(NOW)
        alice = InMemoryDiscovery(ALICE, board, ttl=60, clock=clock)
        bob = InMemoryDiscovery(BOB, board, ttl=600, clock=clock)
        await alice.announce([hosted(layer=1)])
        await bob.announce([hosted(layer=1, ranges=((8, 16),)), hosted(layer=2)])
        assert [h.peer_id for h in await alice.lookup(MODEL, 1)] == sorted([ALICE.peer_id, BOB.peer_id])
        await bob.withdraw()
        assert [h.peer_id for h in await alice.lookup(MODEL, 1)] == [ALICE.peer_id]
        assert await alice.lookup(MODEL, 2) == []
        clock.advance(61)
        assert await bob.lookup(MODEL, 1) == []

    asyncio.run(scenario())


def test_board_refuses_invalid_values_like_a_dht_node():
    """The in-memory board validates puts and keeps the newer record."""
    board = InMemoryBoard()
    record, value = signed(seq=5)
    _, older = signed(seq=4)
    board.put(record.key, value, NOW)
    board.put(record.key, older, NOW)
    assert board.values[record.key] == value
    with pytest.raises(BadSignature):
        board.put(record.key, value[:-1] + bytes([value[-1] ^ 1]), NOW)


class _CountingDiscovery(InMemoryDiscovery):
    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.lookups = 0
        self.gate = asyncio.Event()
        self.gate.set()

    async def lookup(self, model_digest: str, layer: int):
        self.lookups += 1
        await self.gate.wait()
        return await super().lookup(model_digest, layer)


def test_cached_discovery_shares_lookups_and_refreshes_in_background():
    """Concurrent lookups share one backend call; a fresh entry is served from memory, a half-stale one is refreshed."""

    async def scenario() -> None:
        clock = FakeClock(NOW)
        inner = _CountingDiscovery(ALICE, InMemoryBoard(), clock=clock)
        cached = CachedDiscovery(inner, ttl=10, clock=clock)
        await inner.announce([hosted(layer=1)])
        inner.gate.clear()
        waiting = [asyncio.create_task(cached.lookup(MODEL, 1)) for _ in range(5)]
        await async_until(lambda: inner.lookups == 1, what="the shared backend lookup has begun")
        inner.gate.set()
        results = await asyncio.gather(*waiting)
        assert inner.lookups == 1 and all(len(r) == 1 for r in results)
        clock.advance(4)
        assert len(await cached.lookup(MODEL, 1)) == 1 and inner.lookups == 1
        clock.advance(2)  # past refresh_after (ttl / 2): answered from memory, refreshed behind
        assert len(await cached.lookup(MODEL, 1)) == 1
        await async_until(lambda: inner.lookups >= 2, what="the background refresh")
        assert inner.lookups == 2
        await cached.lookup(MODEL, 1, fresh=True)
        assert inner.lookups == 3
        await cached.close()

    asyncio.run(scenario())


def test_cached_discovery_drops_records_that_expire_while_cached():
    """A cached answer never contains a record past its expiry."""

    async def scenario() -> None:
        clock = FakeClock(NOW)
        inner = InMemoryDiscovery(ALICE, InMemoryBoard(), ttl=5, clock=clock)
        cached = CachedDiscovery(inner, ttl=30, clock=clock)
        await inner.announce([hosted(layer=1)])
        assert len(await cached.lookup(MODEL, 1)) == 1
        clock.advance(5)
        assert await cached.lookup(MODEL, 1) == []

    asyncio.run(scenario())


# --- records against the model's shape --------------------------------------------------------

SHAPE = ModelShape(MODEL, n_layer=4, n_expert=32, n_dense_lead=1)


@pytest.mark.parametrize(
    ("layer", "ranges", "fits"),
    [
        (1, ((0, 32),), True),  # every expert of the first MoE layer
        (3, ((0, 4), (30, 32)), True),
        (3, (), True),  # a tombstone of a real layer
        (3, ((0, 65535),), False),  # experts 0-65534 of a 32-expert model (the reported record)
        (3, ((31, 33),), False),  # one past the last expert
        (0, ((0, 8),), False),  # the dense lead layer has no experts
        (4, ((0, 8),), False),  # past the last layer
    ],
)
def test_model_shape_refuses_layers_and_experts_the_model_lacks(layer, ranges, fits):
    """A record fits the shape only within the MoE layers and n_expert; past them it is OutsideModel."""
    record, _ = signed(slice_=hosted(layer, ranges))
    if fits:
        SHAPE.check(record)
    else:
        with pytest.raises(OutsideModel):
            SHAPE.check(record)


def test_model_shape_refuses_the_dense_layers_between_interleaved_moe_ones():
    """llama4 with interleave_moe_layer_step 2: layers 1 and 3 have experts, a record for layer 2 does not fit."""
    shape = ModelShape(MODEL, n_layer=4, n_expert=32, moe_step=2)
    for layer in (1, 3):
        shape.check(signed(slice_=hosted(layer, ((0, 8),)))[0])
    assert shape.moe_layers == (1, 3) and SHAPE.moe_layers == (1, 2, 3)
    with pytest.raises(OutsideModel, match="layer 2 is dense"):
        shape.check(signed(slice_=hosted(2, ((0, 8),)))[0])


def test_model_shape_refuses_records_of_another_model():
    """A record naming another model's digest does not fit this model's shape."""
    record, _ = signed(slice_=HostedSlice(OTHER_MODEL, 1, ((0, 8),), quic_addr="127.0.0.1:4433"))
    with pytest.raises(OutsideModel, match="another model"):
        SHAPE.check(record)


def test_lookup_of_a_known_model_drops_records_outside_its_shape():
    """live_hosts with the shape returns the fitting record only; without it, both (a node that lacks the model)."""
    good, _ = signed(ALICE, hosted(3, ((0, 32),)))
    bad, _ = signed(BOB, hosted(3, ((0, 65535),)))
    assert live_hosts([good, bad], MODEL, 3, NOW, SHAPE) == [good]
    assert {r.peer_id for r in live_hosts([good, bad], MODEL, 3, NOW)} == {ALICE.peer_id, BOB.peer_id}


def test_in_memory_discovery_told_the_model_refuses_out_of_shape_hosts():
    """InMemoryDiscovery with models= answers a lookup without the record offering experts the model lacks."""
    board, clock = InMemoryBoard(), FakeClock(NOW)

    async def main():
        await InMemoryDiscovery(ALICE, board, clock=clock).announce([hosted(2, ((0, 16),))])
        await InMemoryDiscovery(BOB, board, clock=clock).announce([hosted(2, ((16, 40),))])
        knows = InMemoryDiscovery(Identity.generate(), board, clock=clock, models=[SHAPE])
        return await knows.lookup(MODEL, 2)

    assert [r.peer_id for r in asyncio.run(main())] == [ALICE.peer_id]
