"""Signed stage records: which peer runs which contiguous layers of which model as a stage, and where (issue 26).

A stage (``moeswarm stage``) runs the dense part of layers A..B and keeps their KV cache; a client chains stages.
It announces itself as a worker does (``p2p.dht.records``): one signed record under a DHT key bound to (peer id, model),
found through provider keys of the model's stages. The record reuses the host record's machinery (the field readers,
the signature, key and time checks, the relay address), under its own magic and signing context, so a host record's
signature can never be replayed as a stage's or the reverse::

    magic "MSG1" | peer id (u8 len + bytes) | model digest (32 bytes) | layer start u16 | layer stop u16 (half-open)
    | quic addr (u8 len + ASCII, empty = none) | relay url (u16 len + ASCII) | relay peer id (u8 len + bytes)
    | kernel identity (u8 len + ASCII) | capacity u32 | price u64 | issued_at u64 | expires_at u64 | seq u64
    | Ed25519 signature (64) over SIGNING_CONTEXT + everything before it

A record that names no layers (start == stop) is a tombstone. :class:`StageShape` is what a node that knows the model
refuses: another model's digest, layers past the model's. ``validate`` here accepts all three record types (the DHT
namespace validator and lookups use it); ``p2p.dht.records`` stays unaware of stages.
"""

from __future__ import annotations

import base64
import hashlib
import struct
from dataclasses import dataclass, field

from p2p.dht import records as rec
from p2p.dht.records import (
    MAX_LIFETIME,
    MalformedRecord,
    OutsideModel,
    RelayAddress,
)  # fmt: skip
from p2p.identity import Identity, PeerId

STAGE_MAGIC = b"MSG1"
SIGNING_CONTEXT = b"moeswarm/stage-record/v1\n"
_U16, _U32, _U64 = 0xFFFF, 0xFFFF_FFFF, 0xFFFF_FFFF_FFFF_FFFF
_TAIL = struct.Struct(">IQQQQ")  # capacity, price, issued_at, expires_at, seq


@dataclass(frozen=True)
class HostedStage:
    """What a stage offers: layers ``layers`` of a model, where to reach it, at what capacity and price."""

    model_digest: str
    layers: range
    quic_addr: str | None = None
    relay: RelayAddress | None = None
    capacity: int = 0  # sessions it keeps a KV cache for
    price: int = 0  # per pass-token, in the ledger's smallest unit
    kernel: str = ""

    def __post_init__(self) -> None:
        # the checks of a hosted slice, on the fields both have (digest, addresses, kernel, capacity, price)
        rec.HostedSlice(self.model_digest, 0, ((0, 1),) if self.layers else (), self.quic_addr, self.relay, self.capacity, self.price, self.kernel)
        if not isinstance(self.layers, range) or self.layers.step != 1:
            raise MalformedRecord(f"a stage's layers must be a contiguous range, got {self.layers!r}")
        if not 0 <= self.layers.start <= self.layers.stop <= _U16:
            raise MalformedRecord(f"layers {self.layers} must be within 0..{_U16}")

    @property
    def is_tombstone(self) -> bool:
        return not self.layers


def stage_key(peer_id: PeerId, model_digest: str) -> str:
    """The DHT key of peer_id's stage record for the model: ``/moeswarm/`` + 200 bits of hash (see ``value_key``)."""
    digest = hashlib.sha256(b"moeswarm/stage\0" + peer_id.raw + bytes.fromhex(model_digest)).digest()[:25]
    return f"/{rec.NAMESPACE}/" + base64.b32encode(digest).decode("ascii").lower()


def stage_provider_key(model_digest: str, epoch: int, shard: int) -> bytes:
    """The provider key of the model's stages for one epoch and shard: a sha2-256 multihash."""
    material = b"moeswarm/stage-providers/v1\0" + bytes.fromhex(model_digest)
    return b"\x12\x20" + hashlib.sha256(material + epoch.to_bytes(8, "big") + bytes([shard])).digest()


@dataclass(frozen=True)
class StageRecord:
    """A hosted stage as signed by its peer, valid in [issued_at, expires_at); the higher ``seq`` replaces."""

    peer_id: PeerId
    stage: HostedStage
    issued_at: int
    expires_at: int
    seq: int
    _body: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.peer_id, PeerId) or not isinstance(self.stage, HostedStage):
            raise MalformedRecord("a stage record needs a PeerId and a HostedStage")
        for name in ("issued_at", "expires_at", "seq"):
            if not isinstance(getattr(self, name), int) or not 0 <= getattr(self, name) <= _U64:
                raise MalformedRecord(f"{name} must be a u64")
        if not 0 < self.expires_at - self.issued_at <= MAX_LIFETIME:
            raise MalformedRecord(f"lifetime {self.expires_at - self.issued_at}s must be in 1..{MAX_LIFETIME}s")
        object.__setattr__(self, "_body", self._encode_body())

    @property
    def key(self) -> str:
        return stage_key(self.peer_id, self.stage.model_digest)

    def is_live(self, now: float) -> bool:
        return not self.stage.is_tombstone and now < self.expires_at

    def describe(self) -> str:
        s = self.stage
        return f"stage record of peer {self.peer_id} for model {s.model_digest[:12]}.. layers {s.layers.start}-{s.layers.stop - 1}"

    def body(self) -> bytes:
        return self._body

    def _encode_body(self) -> bytes:
        s = self.stage
        return b"".join(
            [
                STAGE_MAGIC,
                bytes([len(self.peer_id.raw)]),
                self.peer_id.raw,
                bytes.fromhex(s.model_digest),
                struct.pack(">HH", s.layers.start, s.layers.stop),
                *rec.address_parts(s.quic_addr, s.relay, s.kernel),
                _TAIL.pack(s.capacity, s.price, self.issued_at, self.expires_at, self.seq),
            ]
        )


def issue_stage(identity: Identity, stage: HostedStage, *, now: float, ttl: float, seq: int) -> tuple[StageRecord, bytes]:
    """The stage record for [now, now + ttl) with seq, and its signed value."""
    issued_at = int(now)
    record = StageRecord(identity.peer_id, stage, issued_at, issued_at + max(1, int(ttl)), seq)
    return record, record.body() + identity.sign(SIGNING_CONTEXT + record.body())


def decode_stage(value: bytes) -> tuple[StageRecord, bytes]:
    """Parse a stage record value into its record and signature (structure and field ranges only)."""
    r, peer_id = rec._open(value, STAGE_MAGIC, "stage")
    digest = r.take(32, "model digest").hex()
    start, stop = r.u16("layer start"), r.u16("layer stop")
    if start > stop:
        raise MalformedRecord(f"layers {start}..{stop} are not a range")
    quic, relay, kernel = rec.read_address(r)
    capacity, price, issued_at, expires_at, seq = _TAIL.unpack(r.take(_TAIL.size, "fixed fields"))
    signature = r.take(rec.SIGNATURE_BYTES, "signature")
    r.finish("signature")
    stage = HostedStage(digest, range(start, stop), quic, relay, capacity, price, kernel)
    return StageRecord(peer_id, stage, issued_at, expires_at, seq), signature


def decode_and_validate_stage(key: str, value: bytes, now: float) -> StageRecord:
    """The stage record stored under key, if acceptable at time now (size, structure, signature, key, time)."""
    rec._check_size_and_namespace(key, value)
    record, signature = decode_stage(value)
    rec._check_signed(key, value, record, signature, SIGNING_CONTEXT, now)
    return record


def _is_stage(value: bytes) -> bool:
    return bytes(value[: len(STAGE_MAGIC)]) == STAGE_MAGIC


def validate(key: str, value: bytes, now: float) -> rec.HostRecord | rec.HelperRecord | StageRecord:
    """Any record type of the namespace stored under key, with every check of its type."""
    return decode_and_validate_stage(key, value, now) if _is_stage(value) else rec.validate(key, value, now)


def expires_at_of(value: bytes) -> int:
    return decode_stage(value)[0].expires_at if _is_stage(value) else rec.expires_at_of(value)


def signer_of(value: bytes) -> PeerId:
    return decode_stage(value)[0].peer_id if _is_stage(value) else rec.signer_of(value)


def select_best(key: str, values: list[bytes], now: float) -> int:
    """``records.select_best`` over every record type (a newer stage record replaces an older one)."""
    return rec.select_best(key, values, now, validate)


@dataclass(frozen=True)
class StageShape:
    """What a node that knows the model refuses in a stage record: another model, layers past its trunk."""

    digest: str
    n_layer: int

    def check(self, record: StageRecord) -> None:
        s = record.stage
        if s.model_digest != self.digest:
            raise OutsideModel(f"{record.describe()} names another model than {self.digest[:12]}..")
        if s.layers.stop > self.n_layer:
            raise OutsideModel(f"{record.describe()}: the model has layers 0..{self.n_layer - 1}")


def live_stages(records: list[object], shape: StageShape, now: float) -> list[StageRecord]:
    """The newest record per peer among *records* that is a live stage of the model (others refused), by layers."""
    newest: dict[PeerId, StageRecord] = {}
    for record in records:
        if not isinstance(record, StageRecord):
            continue
        try:
            shape.check(record)
        except OutsideModel:
            continue
        held = newest.get(record.peer_id)
        if held is None or (record.seq, record.expires_at) > (held.seq, held.expires_at):
            newest[record.peer_id] = record
    return sorted((r for r in newest.values() if r.is_live(now)), key=lambda r: (r.stage.layers.start, str(r.peer_id)))
