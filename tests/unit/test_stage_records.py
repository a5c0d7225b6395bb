"""Stage records (issue 26): signed like host records under their own magic and context; a forged, tampered,
replayed, foreign-model or out-of-shape stage record is refused; the DHT's validators accept all three types."""

from __future__ import annotations

import hashlib

import pytest

from p2p.dht.records import BadSignature, KeyMismatch, MalformedRecord, OutsideModel, RecordError, RecordExpired, RelayAddress, issue
from p2p.dht.records import HostedSlice as Slice
from p2p.dht.stage_records import (
    SIGNING_CONTEXT,
    HostedStage,
    StageRecord,
    StageShape,
    decode_and_validate_stage,
    issue_stage,
    live_stages,
    select_best,
    signer_of,
    stage_key,
    validate,
)  # fmt: skip
from p2p.identity import Identity

MODEL = hashlib.sha256(b"model-a").hexdigest()
OTHER = hashlib.sha256(b"model-b").hexdigest()
NOW = 1_800_000_000.0
ALICE, BOB = Identity.generate(), Identity.generate()
SHAPE = StageShape(MODEL, 24)


def stage(layers: range = range(0, 12), model: str = MODEL, **kw: object) -> HostedStage:
    kw.setdefault("quic_addr", "127.0.0.1:4433")
    return HostedStage(model, layers, capacity=8, price=3, kernel="numpy-f32", **kw)  # type: ignore[arg-type]


def test_a_stage_record_round_trips_and_validates_under_its_key():
    """Signed, decoded and validated back to the same record, relay and all; the key binds peer and model."""
    relay = RelayAddress("wss://relay.example:443/v1", BOB.peer_id)
    record, value = issue_stage(ALICE, stage(relay=relay), now=NOW, ttl=600, seq=9)
    assert decode_and_validate_stage(record.key, value, NOW + 1) == record
    assert validate(record.key, value, NOW + 1) == record and signer_of(value) == ALICE.peer_id
    assert record.key == stage_key(ALICE.peer_id, MODEL) != stage_key(BOB.peer_id, MODEL) != stage_key(ALICE.peer_id, OTHER)
    assert record.stage.layers == range(0, 12) and record.is_live(NOW)


def test_every_flipped_byte_and_a_forged_signature_are_refused():
    """Any changed bit fails; a record naming Alice signed by Bob is BadSignature."""
    record, value = issue_stage(ALICE, stage(), now=NOW, ttl=600, seq=1)
    for i in range(len(value)):
        tampered = value[:i] + bytes([value[i] ^ 0x01]) + value[i + 1 :]
        with pytest.raises(RecordError):
            validate(record.key, tampered, NOW + 1)
    forged = record.body() + BOB.sign(SIGNING_CONTEXT + record.body())
    with pytest.raises(BadSignature):
        validate(record.key, forged, NOW + 1)


def test_a_host_record_signature_cannot_pass_as_a_stage_record():
    """The contexts differ: a host record's signature over the same peer verifies nowhere as a stage's."""
    record, _ = issue_stage(ALICE, stage(), now=NOW, ttl=600, seq=1)
    replay = record.body() + ALICE.sign(b"moeswarm/host-record/v1\n" + record.body())
    with pytest.raises(BadSignature):
        validate(record.key, replay, NOW + 1)
    host, host_value = issue(ALICE, Slice(MODEL, 3, ((0, 8),), "127.0.0.1:1"), now=NOW, ttl=600, seq=1)
    assert validate(host.key, host_value, NOW + 1) == host  # the host records still validate through it


def test_wrong_key_expiry_and_bad_fields_are_refused():
    """Under another peer's key; past its expiry; an addressless stage; layers that are no range."""
    record, value = issue_stage(ALICE, stage(), now=NOW, ttl=600, seq=1)
    with pytest.raises(KeyMismatch):
        validate(stage_key(BOB.peer_id, MODEL), value, NOW + 1)
    with pytest.raises(RecordExpired):
        validate(record.key, value, NOW + 601)
    with pytest.raises(MalformedRecord, match="QUIC address, a relay"):
        HostedStage(MODEL, range(0, 4))
    with pytest.raises(MalformedRecord, match="contiguous"):
        stage(range(0, 8, 2))


def test_foreign_model_and_out_of_shape_stages_are_refused_and_the_newest_wins():
    """StageShape refuses another model's and past-the-trunk records; a lookup keeps the newest live one per peer."""
    foreign, _ = issue_stage(BOB, stage(model=OTHER), now=NOW, ttl=600, seq=1)
    deep, _ = issue_stage(BOB, stage(range(12, 30)), now=NOW, ttl=600, seq=2)
    with pytest.raises(OutsideModel, match="another model"):
        SHAPE.check(foreign)
    with pytest.raises(OutsideModel, match="layers 0..23"):
        SHAPE.check(deep)
    old, old_value = issue_stage(ALICE, stage(range(0, 12)), now=NOW, ttl=600, seq=1)
    new, new_value = issue_stage(ALICE, stage(range(12, 24)), now=NOW, ttl=600, seq=2)
    good, _ = issue_stage(BOB, stage(range(0, 12)), now=NOW, ttl=600, seq=1)
    assert live_stages([old, new, foreign, deep, good], SHAPE, NOW + 1) == [good, new]
    assert select_best(old.key, [old_value, new_value], NOW + 1) == 1
    tomb, _ = issue_stage(ALICE, HostedStage(MODEL, range(0)), now=NOW, ttl=600, seq=3)
    assert live_stages([new, tomb], SHAPE, NOW + 1) == []
    assert isinstance(tomb, StageRecord) and tomb.stage.is_tombstone
