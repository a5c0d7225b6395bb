"""Signed host records: which peer hosts which experts of which (model, layer), and where to reach it.

A worker publishes one record per hosted slice under the DHT key ``/moeswarm/<hash>``, the hash
binding the key to (peer id, model, layer); every node validates records with `decode_and_validate`
before storing or returning them. The expiry travels inside the signed bytes because libp2p 0.8.1 keeps
every value for 24 h regardless of what it says: validity is decided here, never by the store.

Sans-IO: no libp2p, no asyncio; the clock is a parameter. The encoding is canonical binary
(fixed field order, big-endian integers, length-prefixed strings, no optional padding), so the
signed bytes are exactly the transmitted bytes and any changed byte fails verification.

Layout of a value (all integers big-endian)::

    magic "MSR3" | peer id (u8 len + bytes) | model digest (32 bytes) | layer u16
    | n ranges u8, n x (start u16, stop u16) | quic addr (u8 len + ASCII, empty = none)
    | relay url (u16 len + ASCII) | relay peer id (u8 len + bytes; both empty = no relay)
    | kernel identity (u8 len + ASCII, empty = not said) | flags u8 (bit 0: serves slices) | capacity u32 | price u64 | issued_at u64 | expires_at u64 | seq u64 | Ed25519 signature (64)

The signature covers ``SIGNING_CONTEXT + everything before it``.

A second record type lives in the same namespace: a ``HelperRecord`` says "this public node answers reachability
probes (``p2p.nat.reachability``) on UDP at this address". Its key hashes the peer id under another domain, so it never
collides with a host record; its value starts with its own magic and has its own signing context::

    magic "MSH1" | peer id (u8 len + bytes) | quic addr (u8 len + ASCII, empty = withdrawn)
    | issued_at u64 | expires_at u64 | seq u64 | Ed25519 signature (64)

``validate`` accepts either type (the DHT's namespace validator uses it); ``decode_and_validate`` only host records.
"""

from __future__ import annotations

import base64
import hashlib
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol
from urllib.parse import urlsplit

from experts.errors import RemoteProtocolError
from p2p.identity import Identity, IdentityError, PeerId
from p2p.wire import frames

NAMESPACE = "moeswarm"
MAGIC = b"MSR3"  # v2: the kernel identity joined the record; v3: the flags byte (serves slices)
SIGNING_CONTEXT = b"moeswarm/host-record/v1\n"
HELPER_MAGIC = b"MSH1"
HELPER_SIGNING_CONTEXT = b"moeswarm/helper-record/v1\n"
SIGNATURE_BYTES = 64
MAX_RANGES = 64
MAX_QUIC_ADDR_BYTES = 255
MAX_RELAY_URL_BYTES = 512
MAX_KERNEL_BYTES = 255
# The largest record the limits above allow is 1500 bytes; anything bigger is refused unread.
MAX_RECORD_BYTES = 1536
MAX_LIFETIME = 24 * 3600  # libp2p stores values for 24 h; a longer promise could not be kept
MAX_CLOCK_SKEW = 60  # seconds a record's issued_at may lie in the future of our clock
FLAG_SERVES_SLICES = 0x01
_U16, _U32, _U64 = 0xFFFF, 0xFFFF_FFFF, 0xFFFF_FFFF_FFFF_FFFF
_TAIL = struct.Struct(">IQQQQ")  # capacity, price, issued_at, expires_at, seq
_HELPER_TAIL = struct.Struct(">QQQ")  # issued_at, expires_at, seq
_HEX = frozenset("0123456789abcdef")


class RecordError(RemoteProtocolError):
    """A record (or its DHT key) is not acceptable; the subclass says why."""


class RecordTooLarge(RecordError):
    """The value exceeds MAX_RECORD_BYTES (checked before parsing)."""


class MalformedRecord(RecordError):
    """The bytes do not decode to a well-formed record, or a field is out of range."""


class BadSignature(RecordError):
    """The signature does not verify against the peer id the record names."""


class RecordExpired(RecordError):
    """The record's expires_at has passed."""


class RecordNotYetValid(RecordError):
    """The record claims to be issued further in the future than clock skew explains."""


class KeyMismatch(RecordError):
    """The DHT key is outside our namespace or names another peer, model or layer than the record."""


class OutsideModel(RecordError):
    """The record names a layer or experts its model does not have, or another model than the one asked for."""


@dataclass(frozen=True)
class ModelShape:
    """What a node that loaded a model knows of it: enough to refuse records no honest host could sign.

    Layers ``0 .. n_dense_lead - 1`` have a dense FFN and no experts, and with ``moe_step`` > 0 (llama4's
    interleave_moe_layer_step) so has every layer i with ``(i + 1) % moe_step != 0``: no record may name them.
    """

    digest: str
    n_layer: int
    n_expert: int
    n_dense_lead: int = 0
    moe_step: int = 0

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """The layers with experts: the only ones a host can announce."""
        return tuple(i for i in range(self.n_dense_lead, self.n_layer) if not self.moe_step or (i + 1) % self.moe_step == 0)

    def check(self, record: HostRecord) -> None:
        """An OutsideModel unless record is for this model and within its MoE layers and experts."""
        h = record.hosted
        if h.model_digest != self.digest:
            raise OutsideModel(f"{record.describe()} names another model than {self.digest[:12]}..")
        if not self.n_dense_lead <= h.layer < self.n_layer:
            raise OutsideModel(
                f"{record.describe()}: the model's MoE layers are {self.n_dense_lead}..{self.n_layer - 1}"
            )
        if self.moe_step and (h.layer + 1) % self.moe_step:
            raise OutsideModel(f"{record.describe()}: layer {h.layer} is dense (experts only on every {self.moe_step}th layer)")
        if h.expert_ranges and h.expert_ranges[-1][1] > self.n_expert:
            raise OutsideModel(
                f"{record.describe()} offers experts up to {h.expert_ranges[-1][1] - 1}; the model has {self.n_expert}"
            )


@dataclass(frozen=True)
class RelayAddress:
    """A WebSocket relay through which a NAT-bound worker is reachable, and the relay's own peer id."""

    url: str
    peer_id: PeerId

    def __post_init__(self) -> None:
        if not isinstance(self.url, str) or not isinstance(self.peer_id, PeerId):
            raise MalformedRecord("a relay address needs a URL string and the relay's PeerId")
        check_relay_url(self.url)


def check_relay_url(url: str) -> None:
    """A MalformedRecord unless ``url`` is a relay URL a record can carry (the CLI checks ``--relay`` with it too)."""
    raw = url.encode("utf-8", "surrogatepass")
    if not 0 < len(raw) <= MAX_RELAY_URL_BYTES:
        raise MalformedRecord(f"relay url must have 1..{MAX_RELAY_URL_BYTES} bytes, got {len(raw)}")
    if not url.isascii() or not url.isprintable() or " " in url:
        raise MalformedRecord(f"relay url {url!r} must be printable ASCII without spaces")
    try:
        parts = urlsplit(url)
    except ValueError as exc:
        raise MalformedRecord(f"relay url {url!r} does not parse: {exc}") from None
    if parts.scheme not in ("ws", "wss") or not parts.netloc:
        raise MalformedRecord(f"relay url {url!r} must be ws://host[:port]/... or wss://...")


def check_quic_addr(addr: str) -> None:
    """A MalformedRecord unless ``addr`` is a ``host:port`` a record can carry (the CLI checks ``--advertise`` too)."""
    if not isinstance(addr, str):
        raise MalformedRecord(f"quic address must be a 'host:port' string, got {type(addr).__name__}")
    raw = addr.encode("utf-8", "surrogatepass")
    if not 0 < len(raw) <= MAX_QUIC_ADDR_BYTES or not addr.isascii() or not addr.isprintable() or " " in addr:
        raise MalformedRecord(f"quic address {addr!r} must be 1..{MAX_QUIC_ADDR_BYTES} printable ASCII bytes")
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) <= _U16:
        raise MalformedRecord(f"quic address {addr!r} must be host:port with port 1..65535")
    if ":" in host and not (host.startswith("[") and host.endswith("]")):
        raise MalformedRecord(f"quic address {addr!r}: write IPv6 hosts in brackets, e.g. [::1]:4433")


def _check_uint(name: str, value: int, limit: int) -> None:
    frames.int_in(name, value, 0, limit, frames.prefixed(MalformedRecord))


@dataclass(frozen=True)
class HostedSlice:
    """What a worker offers for one (model, layer): the content of a record, without peer and timing.

    ``expert_ranges`` are half-open ``(start, stop)`` expert index ranges, sorted and disjoint.
    A slice with no ranges is a tombstone: it replaces an earlier record to say "no longer hosted".
    ``price`` is per work unit in the ledger's smallest unit (an integer, so signed bytes are exact).
    ``kernel`` is the worker's compute kernel identity (``experts.kernels.KernelIdentity`` as text): a backbone
    expects bit-identical sums only from a worker whose kernel is the same as its own, and compares the others'
    within the quantized-weights tolerance.
    """

    model_digest: str
    layer: int
    expert_ranges: tuple[tuple[int, int], ...]
    quic_addr: str | None = None
    relay: RelayAddress | None = None
    capacity: int = 0
    price: int = 0
    kernel: str = ""
    serves_slices: bool = False  # answers SliceInfoRequest/PieceRequest for its experts (p2p.wire.messages, slice distribution)

    def __post_init__(self) -> None:
        digest = self.model_digest
        if not isinstance(digest, str) or len(digest) != 64 or not set(digest) <= _HEX:
            raise MalformedRecord(f"model digest must be 64 lowercase hex characters (sha256), got {digest!r}")
        _check_uint("layer", self.layer, _U16)
        _check_uint("capacity", self.capacity, _U32)
        _check_uint("price", self.price, _U64)
        if not isinstance(self.expert_ranges, tuple) or len(self.expert_ranges) > MAX_RANGES:
            raise MalformedRecord(f"expert_ranges must be a tuple of at most {MAX_RANGES} (start, stop) pairs")
        previous_stop = 0
        for pair in self.expert_ranges:
            if not isinstance(pair, tuple) or len(pair) != 2:
                raise MalformedRecord(f"expert range {pair!r} must be a (start, stop) tuple")
            start, stop = pair
            _check_uint("expert range start", start, _U16)
            _check_uint("expert range stop", stop, _U16)
            if not previous_stop <= start < stop:
                raise MalformedRecord(f"expert ranges {self.expert_ranges} must be non-empty, sorted and disjoint")
            previous_stop = stop
        if self.quic_addr is not None:
            check_quic_addr(self.quic_addr)
        if self.relay is not None and not isinstance(self.relay, RelayAddress):
            raise MalformedRecord(f"relay must be a RelayAddress, got {type(self.relay).__name__}")
        if not isinstance(self.kernel, str) or len(self.kernel) > MAX_KERNEL_BYTES or not self.kernel.isascii() or not self.kernel.isprintable():
            raise MalformedRecord(f"kernel identity must be at most {MAX_KERNEL_BYTES} printable ASCII characters, got {self.kernel!r}")
        if self.expert_ranges and self.quic_addr is None and self.relay is None:
            raise MalformedRecord("a hosted slice needs a QUIC address, a relay address, or both")

    @classmethod
    def tombstone(cls, model_digest: str, layer: int) -> HostedSlice:
        return cls(model_digest, layer, ())

    @property
    def is_tombstone(self) -> bool:
        return not self.expert_ranges

    def experts(self) -> frozenset[int]:
        return frozenset(e for start, stop in self.expert_ranges for e in range(start, stop))


def value_key(peer_id: PeerId, model_digest: str, layer: int) -> str:
    """The DHT key of peer_id's record for (model, layer): ``/moeswarm/`` + 200 bits of hash, base32.

    The peer id is hashed in rather than spelled out because py-libp2p 0.8.1 servers refuse a
    FIND_NODE for any key over 50 bytes that is not a multihash, and its put/get look keys up
    with FIND_NODE: longer keys would only ever reach the peers already in our routing table.
    """
    material = b"moeswarm/record\0" + peer_id.raw + bytes.fromhex(model_digest) + layer.to_bytes(2, "big")
    digest = hashlib.sha256(material).digest()[:25]
    return f"/{NAMESPACE}/" + base64.b32encode(digest).decode("ascii").lower()


@dataclass(frozen=True)
class HostRecord:
    """A hosted slice as signed by its peer, valid in [issued_at, expires_at) (unix seconds).

    ``seq`` orders records of one key: the higher one replaces the lower (a refresh or a tombstone).
    """

    peer_id: PeerId
    hosted: HostedSlice
    issued_at: int
    expires_at: int
    seq: int
    _body: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.peer_id, PeerId) or not isinstance(self.hosted, HostedSlice):
            raise MalformedRecord("a host record needs a PeerId and a HostedSlice")
        _check_uint("issued_at", self.issued_at, _U64)
        _check_uint("expires_at", self.expires_at, _U64)
        _check_uint("seq", self.seq, _U64)
        if not 0 < self.expires_at - self.issued_at <= MAX_LIFETIME:
            raise MalformedRecord(
                f"lifetime {self.expires_at - self.issued_at}s must be in 1..{MAX_LIFETIME}s (expires_at > issued_at)"
            )
        object.__setattr__(self, "_body", self._encode_body())

    @property
    def key(self) -> str:
        return value_key(self.peer_id, self.hosted.model_digest, self.hosted.layer)

    def is_live(self, now: float) -> bool:
        return not self.hosted.is_tombstone and now < self.expires_at

    def describe(self) -> str:
        return f"record of peer {self.peer_id} for model {self.hosted.model_digest[:12]}.. layer {self.hosted.layer}"

    def body(self) -> bytes:
        """The canonical unsigned encoding (what the signature covers, after SIGNING_CONTEXT)."""
        return self._body

    def _encode_body(self) -> bytes:
        h = self.hosted
        parts = [
            MAGIC,
            bytes([len(self.peer_id.raw)]),
            self.peer_id.raw,
            bytes.fromhex(h.model_digest),
            struct.pack(">HB", h.layer, len(h.expert_ranges)),
            b"".join(struct.pack(">HH", start, stop) for start, stop in h.expert_ranges),
            *address_parts(h.quic_addr, h.relay, h.kernel),
            bytes([FLAG_SERVES_SLICES if h.serves_slices else 0]),
            _TAIL.pack(h.capacity, h.price, self.issued_at, self.expires_at, self.seq),
        ]
        return b"".join(parts)


def address_parts(quic_addr: str | None, relay: RelayAddress | None, kernel: str) -> list[bytes]:
    """How a host or stage record carries where and how it serves: QUIC address, relay (url, peer id), kernel
    identity, each length-prefixed; :func:`read_address` reads them back."""
    quic = (quic_addr or "").encode()
    relay_url = relay.url.encode() if relay else b""
    relay_peer = relay.peer_id.raw if relay else b""
    return [bytes([len(quic)]), quic, struct.pack(">H", len(relay_url)), relay_url, bytes([len(relay_peer)]), relay_peer, bytes([len(kernel)]), kernel.encode("ascii")]


def sign(identity: Identity, record: HostRecord) -> bytes:
    """The value to publish: the record's canonical bytes followed by identity's signature over them."""
    if record.peer_id != identity.peer_id:
        raise ValueError(f"record names peer {record.peer_id}, but the signing identity is {identity.peer_id}")
    body = record.body()
    return body + identity.sign(SIGNING_CONTEXT + body)


def issue(identity: Identity, hosted: HostedSlice, *, now: float, ttl: float, seq: int) -> tuple[HostRecord, bytes]:
    """Stamp hosted with identity's peer id, [now, now + ttl) and seq; return the record and its signed value."""
    issued_at = int(now)
    record = HostRecord(identity.peer_id, hosted, issued_at, issued_at + max(1, int(ttl)), seq)
    return record, sign(identity, record)


# --- reachability helpers -------------------------------------------------------------------------------------------


def helper_key(peer_id: PeerId) -> str:
    """The DHT key of peer_id's helper record: ``/moeswarm/`` + 200 bits of hash (50 bytes, see ``value_key``)."""
    digest = hashlib.sha256(b"moeswarm/helper\0" + peer_id.raw).digest()[:25]
    return f"/{NAMESPACE}/" + base64.b32encode(digest).decode("ascii").lower()


@dataclass(frozen=True)
class HelperRecord:
    """A public node that answers reachability probes on its UDP (QUIC) socket at ``quic_addr``, signed by it and
    valid in [issued_at, expires_at). ``quic_addr`` None is a tombstone: the node withdrew."""

    peer_id: PeerId
    quic_addr: str | None
    issued_at: int
    expires_at: int
    seq: int
    _body: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.peer_id, PeerId):
            raise MalformedRecord("a helper record needs a PeerId")
        if self.quic_addr is not None:
            check_quic_addr(self.quic_addr)
        for name in ("issued_at", "expires_at", "seq"):
            _check_uint(name, getattr(self, name), _U64)
        if not 0 < self.expires_at - self.issued_at <= MAX_LIFETIME:
            raise MalformedRecord(f"lifetime {self.expires_at - self.issued_at}s must be in 1..{MAX_LIFETIME}s")
        quic = (self.quic_addr or "").encode()
        body = HELPER_MAGIC + bytes([len(self.peer_id.raw)]) + self.peer_id.raw + bytes([len(quic)]) + quic
        object.__setattr__(self, "_body", body + _HELPER_TAIL.pack(self.issued_at, self.expires_at, self.seq))

    @property
    def key(self) -> str:
        return helper_key(self.peer_id)

    def is_live(self, now: float) -> bool:
        return self.quic_addr is not None and now < self.expires_at

    def describe(self) -> str:
        return f"helper record of peer {self.peer_id}"

    def body(self) -> bytes:
        """The canonical unsigned encoding (what the signature covers, after HELPER_SIGNING_CONTEXT)."""
        return self._body

    def address(self) -> tuple[str, int]:
        """``quic_addr`` as (host, port), IPv6 brackets removed."""
        if self.quic_addr is None:
            raise ValueError(f"the helper record of {self.peer_id} is a tombstone")
        host, _, port = self.quic_addr.rpartition(":")
        return host.strip("[]"), int(port)


def issue_helper(
    identity: Identity, quic_addr: str | None, *, now: float, ttl: float, seq: int
) -> tuple[HelperRecord, bytes]:
    """identity's helper record at quic_addr (None: a tombstone) for [now, now + ttl), and its signed value."""
    issued_at = int(now)
    record = HelperRecord(identity.peer_id, quic_addr, issued_at, issued_at + max(1, int(ttl)), seq)
    return record, record.body() + identity.sign(HELPER_SIGNING_CONTEXT + record.body())


class _Reader(frames.Reader):
    """The shared frame reader over a record value (big-endian, ``MalformedRecord``s), plus text and peer id fields."""

    __slots__ = ()

    def __init__(self, data: bytes) -> None:
        super().__init__(data, truncated=_truncated, trailing=_trailing)

    def text(self, n: int, what: str) -> str:
        try:
            return self.take(n, what).decode("ascii")
        except UnicodeDecodeError:
            raise MalformedRecord(f"{what} is not ASCII") from None

    def peer_id(self, n: int, what: str) -> PeerId:
        peer = PeerId(self.take(n, what))
        try:
            canonical = PeerId.from_public_bytes(peer.public_bytes)
        except IdentityError as exc:
            raise MalformedRecord(f"{what}: {exc}") from None
        if canonical != peer:
            raise MalformedRecord(f"{what} is not an Ed25519 libp2p peer id")
        return peer


def _truncated(field: str, detail: str) -> MalformedRecord:
    return MalformedRecord(f"record truncated in {field} ({detail})")


def _trailing(field: str, detail: str) -> MalformedRecord:
    return MalformedRecord(f"trailing bytes after the {field}: {detail}")


def _open(value: bytes, magic: bytes, kind: str) -> tuple[_Reader, PeerId]:
    """A reader past a record's magic and peer id, once its size is known to be within the limit."""
    if len(value) > MAX_RECORD_BYTES:
        raise RecordTooLarge(f"record has {len(value)} bytes, the limit is {MAX_RECORD_BYTES}")
    r = _Reader(bytes(value))
    if r.take(len(magic), "magic") != magic:
        raise MalformedRecord(f"record does not start with {magic!r} (not a moeswarm {kind} record of this version)")
    return r, r.peer_id(r.u8("peer id length"), "peer id")


def decode(value: bytes) -> tuple[HostRecord, bytes]:
    """Parse a value into its record and signature, checking structure and field ranges only."""
    r, peer_id = _open(value, MAGIC, "host")
    digest = r.take(32, "model digest").hex()
    layer = r.u16("layer")
    ranges = tuple((r.u16("range start"), r.u16("range stop")) for _ in range(r.u8("range count")))
    quic, relay, kernel = read_address(r)
    flags = r.u8("flags")
    if flags & ~FLAG_SERVES_SLICES:
        raise MalformedRecord(f"flags {flags:#04x} set bits this version does not define")
    capacity, price, issued_at, expires_at, seq = _TAIL.unpack(r.take(_TAIL.size, "fixed fields"))
    signature = r.take(SIGNATURE_BYTES, "signature")
    r.finish("signature")
    hosted = HostedSlice(digest, layer, ranges, quic, relay, capacity, price, kernel, bool(flags & FLAG_SERVES_SLICES))
    return HostRecord(peer_id, hosted, issued_at, expires_at, seq), signature


def read_address(r: _Reader) -> tuple[str | None, RelayAddress | None, str]:
    """The fields :func:`address_parts` wrote: QUIC address (None if empty), relay (both parts or neither), kernel."""
    quic = r.text(r.u8("quic address length"), "quic address") or None
    relay_url = r.text(r.u16("relay url length"), "relay url")
    relay_peer_len = r.u8("relay peer id length")
    if bool(relay_url) != bool(relay_peer_len):
        raise MalformedRecord("relay url and relay peer id must be both present or both absent")
    relay = RelayAddress(relay_url, r.peer_id(relay_peer_len, "relay peer id")) if relay_url else None
    return quic, relay, r.text(r.u8("kernel identity length"), "kernel identity")


def decode_helper(value: bytes) -> tuple[HelperRecord, bytes]:
    """Parse a helper record value into its record and signature (structure and field ranges only)."""
    r, peer_id = _open(value, HELPER_MAGIC, "helper")
    quic = r.text(r.u8("quic address length"), "quic address") or None
    issued_at, expires_at, seq = _HELPER_TAIL.unpack(r.take(_HELPER_TAIL.size, "fixed fields"))
    signature = r.take(SIGNATURE_BYTES, "signature")
    r.finish("signature")
    return HelperRecord(peer_id, quic, issued_at, expires_at, seq), signature


def decode_and_validate(key: str, value: bytes, now: float) -> HostRecord:
    """The host record stored under key, if value is acceptable there at time now; else a RecordError.

    Checks, in order: size (before parsing), structure, signature, key (namespace, peer, slot), time.
    A tombstone is a valid record: callers drop it from results but let it replace older records.
    """
    _check_size_and_namespace(key, value)
    record, signature = decode(value)
    _check_signed(key, value, record, signature, SIGNING_CONTEXT, now)
    return record


def validate(key: str, value: bytes, now: float) -> HostRecord | HelperRecord:
    """Either record type stored under key (told apart by its magic), with every check of its type."""
    _check_size_and_namespace(key, value)
    if bytes(value[: len(HELPER_MAGIC)]) != HELPER_MAGIC:
        return decode_and_validate(key, value, now)
    record, signature = decode_helper(value)
    _check_signed(key, value, record, signature, HELPER_SIGNING_CONTEXT, now)
    return record


def expires_at_of(value: bytes) -> int:
    """When a value of either type expires (structure checked, signature not)."""
    if bytes(value[: len(HELPER_MAGIC)]) == HELPER_MAGIC:
        return decode_helper(value)[0].expires_at
    return decode(value)[0].expires_at


def signer_of(value: bytes) -> PeerId:
    """The peer a value of either type names as its signer (structure checked, signature not)."""
    if bytes(value[: len(HELPER_MAGIC)]) == HELPER_MAGIC:
        return decode_helper(value)[0].peer_id
    return decode(value)[0].peer_id


def _check_size_and_namespace(key: str, value: bytes) -> None:
    if len(value) > MAX_RECORD_BYTES:
        raise RecordTooLarge(f"record has {len(value)} bytes, the limit is {MAX_RECORD_BYTES}")
    if not key.startswith(f"/{NAMESPACE}/"):
        raise KeyMismatch(f"key {key[:80]!r} is outside the /{NAMESPACE}/ namespace")


class SignedRecord(Protocol):
    """What every record type (host, helper, stage: ``p2p.stage_records``) gives the shared checks."""

    @property
    def peer_id(self) -> PeerId: ...
    @property
    def key(self) -> str: ...
    @property
    def issued_at(self) -> int: ...
    @property
    def expires_at(self) -> int: ...
    @property
    def seq(self) -> int: ...
    def describe(self) -> str: ...


def _check_signed(key: str, value: bytes, record: SignedRecord, signature: bytes, context: bytes, now: float) -> None:
    if not record.peer_id.verify(context + value[:-SIGNATURE_BYTES], signature):
        raise BadSignature(f"signature does not verify for peer {record.peer_id}")
    if key != record.key:
        raise KeyMismatch(
            f"key {key[:120]!r} does not match the {record.describe()} (expected {record.key!r})"
        )
    if now >= record.expires_at:
        raise RecordExpired(f"record of peer {record.peer_id} expired {now - record.expires_at:.0f}s ago")
    if record.issued_at > now + MAX_CLOCK_SKEW:
        raise RecordNotYetValid(
            f"record of peer {record.peer_id} is issued {record.issued_at - now:.0f}s in the future "
            f"(more than the {MAX_CLOCK_SKEW}s clock skew we allow)"
        )


def select_best(key: str, values: Sequence[bytes], now: float, check: Callable[[str, bytes, float], SignedRecord] | None = None) -> int:
    """Index of the value that should win for key: a valid one (by *check*, default :func:`validate`) with the
    highest (seq, expires_at).

    Invalid values lose to any valid one; ties keep the earliest index (so a store keeps what it has).
    """
    best, best_rank = 0, None
    for index, value in enumerate(values):
        try:
            record = (check or validate)(key, value, now)
        except RecordError:
            continue
        rank = (record.seq, record.expires_at)
        if best_rank is None or rank > best_rank:
            best, best_rank = index, rank
    return best
