"""The dispatch wire protocol: the messages a backbone and a worker exchange, one request and one reply per QUIC stream.

This module is the protocol spec and its only implementation. It moves no bytes (the transport does) and interprets
no tensors (the codecs do): hidden states and partial sums are opaque payload bytes here. Every message is a frozen
dataclass that validates itself on construction, so a value that exists can be encoded, and ``decode(m.encode()) == m``.

Little-endian throughout. Every message is a header followed by a body of ``body_len`` bytes. The payload of a
dispatch message is its last field and has no length prefix: its length is the rest of the body, which ``body_len``
already gives::

    Header (11 bytes)
    off  size  field      value
    0    3     magic      b"MSW"
    3    1     version    u8; 1 is the only version this module speaks
    4    1     type       u8; MsgType (0 reserved; numbers are never reused)
    5    2     flags      u16; must be 0 for every type below (no flag is defined)
    7    4     body_len   u32; HEADER_LEN + body_len <= MAX_MESSAGE, and the data ends exactly there

    HELLO (1), HELLO_ACK (2): capabilities; a worker answers a Hello with a HelloAck, same layout
    size         field       value
    1            role        u8; Role
    1            n_versions  u8; >= 1
    n_versions   versions    u8 each; protocol versions spoken, each >= 1
    1            n_codecs    u8; >= 1
    n_codecs     codecs      u8 each; codec numbers spoken (may include ones the receiver does not know)
    1            n_models    u8; <= MAX_MODELS
    32*n_models  models      32-byte model digests served

    DISPATCH_REQUEST (3): one layer's routed tokens for one worker
    size         field           value
    16           dispatch_id     correlates the reply
    16           model_id        the first 16 bytes of the model's 32-byte sha256 digest (``model_id_of``)
    2            layer           u16
    1            codec           u8; Codec of `hidden`
    1            top_k           u8; 1..MAX_TOP_K
    2            n_tokens        u16; 1..MAX_TOKENS
    2*S          expert_ids      i16 each, S = n_tokens*top_k, token-major; -1 = slot not for this worker;
                                 no expert twice within one token
    4*S          router_weights  f32 each, finite
    rest         hidden          codec-encoded hidden states; the rest of the body, >= 1 byte

    A request names neither its sender nor its send time: the QUIC connection already authenticates the backbone,
    and the backbone measures the round trip on its own clock. ``model_id`` selects a model, it is no integrity check:
    a worker serves one model and compares ``model_id`` with the prefix of its own full digest. 128 bits make an
    accidental match between distinct models negligible (about n^2 / 2^129 for n models). A deliberate one (~2^64
    work) gains nothing: backbones choose workers by full digest (DHT records, Hello/HelloAck), the signed receipt
    names the full digest, and a dishonest worker needs no collision to return wrong sums.

    DISPATCH_REPLY (4): one weighted partial sum per token
    size         field           value
    16           dispatch_id
    1            codec           u8; Codec of `partial`
    2            n_tokens        u16; 1..MAX_TOKENS
    4            compute_us      u32; worker compute time
    2            receipt_len     u16; <= MAX_RECEIPT
    receipt_len  receipt         opaque (signed elsewhere); may be empty
    rest         partial         codec-encoded partial sums; the rest of the body, >= 1 byte

    ERROR_REPLY (5)
    size         field           value
    16           dispatch_id     all zero when the request's id is unknown; a StagePass's session for a stage's refusal
    1            code            u8; ErrorCode
    2            message_len     u16; <= MAX_ERROR_TEXT
    message_len  message         UTF-8
    4            held            u32; only when code is STAGE_GAP: the positions the stage holds for the session,
                                 where the client's replay starts (a structured field, never parsed from the text)

    PING (6), PONG (7): a Pong echoes its Ping, so the pinger needs no state to measure the round trip
    size  field       value
    8     nonce       u64
    8     sent_at_us  u64; the pinger's clock

    LEDGER_HEAD (8): the sender's signed ledger head, and what it knows of the receiver's; a backbone sends it, the
    worker answers with its own (see node.ledger.witness)
    size  field        value
    1     role         u8; Role of the sender's ledger
    8     seq          u64; the sender's head: last entry
    32    entry_hash   its hash
    64    signature    the sender's Ed25519 signature over node.ledger.entries.head_bytes
    8     ask_seq      u64; the receiver's head seq the sender last witnessed (0: none)
    32    ask_hash     the receiver's entry hash there as the sender holds it signed; in an answer: the sender's own
                       entry hash at the asker's ask_seq (all zero: not in its chain any more)

    SLICE_INFO_REQUEST (9): what a slice of the worker's experts needs (slice distribution, experts.slice_fetch)
    16           model_id        first 16 bytes of the model digest

    SLICE_INFO (10): the worker's hosted part, the model's manifest and the leaves of its stacked expert tensors
    2+2          layers          u16 start, u16 stop (half-open)
    2+2          experts         u16 start, u16 stop (half-open)
    4            manifest_len    u32
    manifest_len manifest        UTF-8, the manifest lines joined by "\n" (they hash to the model digest)
    rest         leaves          ASCII, one "NAME|" + concatenated 64-hex-character leaves line per tensor, "\n"-joined

    PIECE_REQUEST (11): length bytes at offset of one expert's rows of a stacked expert tensor
    16           model_id
    2            expert          u16
    4            offset          u32
    4            length          u32; 1..MAX_PIECE
    1            name_len        u8
    name_len     name            ASCII tensor name

    PIECE (12): the bytes asked for
    4            offset          u32
    rest         data            1..MAX_PIECE bytes

    RECEIPT_SIGN_REQUEST (13): a backbone asks a worker to sign, in one batch, the receipts of dispatches it answered
    (see node.ledger.receipts, "Batch signatures"); the reply is a RECEIPT_BATCH, or an ErrorReply
    2            count           u16; 1..MAX_RECEIPT_BATCH
    16*count     dispatch_ids    distinct

    RECEIPT_BATCH (14): the worker's one signature over the Merkle root of the receipts it signs, in request order
    2            count           u16; 1..MAX_RECEIPT_BATCH
    48*count     leaves          per dispatch: its 16-byte id and the 32-byte Merkle leaf of the receipt the worker
                                 signed for it (a subset of the request's ids, in its order: the rest are not signed)
    64           signature       Ed25519 over node.ledger.receipts.batch_message(root of the leaves)

    STAGE_PASS (15): hidden states for a stage (node.stage): the residual stream entering its first layer
    16           session         the client's session; the stage keeps one KV cache per session
    16           model_id        ``model_id_of`` the model's digest
    2+2          layers          u16 start, u16 stop (half-open): the layers the client expects the stage to run
    4            start           u32; position of the first row (before what the stage holds: its KV rolls back)
    2            n_rows          u16; 1..MAX_TOKENS
    4            width           u32; 1..MAX_STAGE_WIDTH, the model's n_embd
    rest         rows            f32 little-endian, row-major, exactly 4*n_rows*width bytes

    STAGE_REPLY (16): the residual stream after the stage's last layer, one row per row passed; a refusal is an
    ERROR_REPLY (a gap: STAGE_GAP with ``held``)
    16           session
    2            n_rows          u16; 1..MAX_TOKENS
    4            width           u32; 1..MAX_STAGE_WIDTH
    4            compute_us      u32; the stage's compute time
    rest         rows            f32 little-endian, exactly 4*n_rows*width bytes

    Stage rows are f32 and never codec-encoded: a chain of stages must give the bits of a local run.

A type this module does not know decodes to ``Unknown`` (flags and body kept), never an error: the receiver decides.
Hello and HelloAck are framed as version 1 forever, so peers of any version can negotiate; every other message uses
the negotiated version. In every version a DispatchRequest body starts with its dispatch id (``peek_dispatch_id``).

Limits: MAX_MESSAGE 64 MiB (header included), MAX_TOKENS 4096, MAX_TOP_K 64, MAX_ERROR_TEXT 1024 bytes, MAX_RECEIPT
4096 bytes, MAX_MODELS 64, MAX_PIECE 4 MiB, MAX_RECEIPT_BATCH 256, MAX_STAGE_WIDTH 65536. They are checked before anything is sliced or allocated. Every
violation raises a ``ProtocolError`` subclass that names the field and carries the ``ErrorCode`` to answer it with
(``error_reply_for``); ``peek_dispatch_id`` finds the id to put in that reply even in a request that did not decode.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from enum import IntEnum
from typing import ClassVar, Self

from experts.codecs import Codec  # one enum for the codecs and the wire's codec byte

from .fields import (
    MAX_MESSAGE,
    BadCodec,
    ErrorCode,
    InvalidField,
    ProtocolError,
    TooLarge,
    Truncated,
    UnsupportedVersion,
    as_wire,
    body_reader,
    bytes_field,
    count_field,
    enum_field,
    int_field,
    rest,
    set_frozen,
    sized,
)  # fmt: skip
from .frames import Reader

__all__ = [
    "DIGEST_LEN", "DISPATCH_ID_LEN", "HEADER_LEN", "MAGIC", "MAX_ERROR_TEXT", "MAX_MESSAGE", "MAX_MODELS",
    "MAX_RECEIPT", "MAX_RECEIPT_BATCH", "MAX_STAGE_WIDTH", "MAX_TOKENS", "MAX_TOP_K", "MODEL_ID_LEN", "SUPPORTED_VERSIONS", "VERSION", "ZERO_ID", "BadCodec",
    "Codec", "DispatchReply", "DispatchRequest", "ErrorCode", "ErrorReply", "Header", "Hello", "HelloAck",
    "InvalidField", "LedgerHead", "Message", "MsgType", "Ping", "Pong", "ProtocolError", "ReceiptBatch", "ReceiptSignRequest",
    "Role", "StagePass", "StageReply", "TooLarge", "Truncated",
    "Unknown", "UnsupportedVersion", "decode", "decode_header", "error_reply_for", "model_id_of", "negotiate",
    "peek_dispatch_id",
]

MAGIC = b"MSW"
VERSION = 1
SUPPORTED_VERSIONS = (1,)
HEADER_LEN = 11
DISPATCH_ID_LEN = 16
DIGEST_LEN = 32
MODEL_ID_LEN = 16
ZERO_ID = bytes(DISPATCH_ID_LEN)

MAX_TOKENS = 4096
MAX_TOP_K = 64
MAX_ERROR_TEXT = 1024  # UTF-8 bytes
MAX_RECEIPT = 4096
MAX_RECEIPT_BATCH = 256  # dispatches one batch signature covers (a Merkle path of at most 8 hashes)
LEAF_HASH_LEN = 32
SIGNATURE_LEN = 64
MAX_MODELS = 64
MAX_PIECE = 4 << 20  # bytes of one expert a Piece carries; a larger expert is fetched in several ranges
MAX_TENSOR_NAME = 255  # ASCII bytes
LEAF_LEN = 64  # a per-expert sha256, hex
MAX_STAGE_WIDTH = 1 << 16  # n_embd of a stage pass's rows (the largest models today use 7168-16384)
_HEX = frozenset("0123456789abcdef")

_HEADER = struct.Struct("<3sBBHI")


class MsgType(IntEnum):
    """Message types of this protocol; a number, once used, is never reused (0 is reserved)."""

    HELLO = 1
    HELLO_ACK = 2
    DISPATCH_REQUEST = 3
    DISPATCH_REPLY = 4
    ERROR_REPLY = 5
    PING = 6
    PONG = 7
    LEDGER_HEAD = 8
    SLICE_INFO_REQUEST = 9
    SLICE_INFO = 10
    PIECE_REQUEST = 11
    PIECE = 12
    RECEIPT_SIGN_REQUEST = 13
    RECEIPT_BATCH = 14
    STAGE_PASS = 15
    STAGE_REPLY = 16


class Role(IntEnum):
    """What a peer does in the swarm (0 reserved)."""

    BACKBONE = 1
    WORKER = 2


def _check_total(message: _Message) -> None:
    if message.encoded_len() > MAX_MESSAGE:
        raise TooLarge("message", message.encoded_len(), MAX_MESSAGE)


class _Message:
    """Header framing shared by every message; subclasses give the body."""

    TYPE: ClassVar[int]
    flags: int = 0  # only Unknown carries flags: no flag is defined for the known types

    def encode(self) -> bytes:
        header = _HEADER.pack(MAGIC, VERSION, self.TYPE, self.flags, self._body_len())
        return b"".join((header, *self._body_parts()))  # one copy of the payload, not two

    def encoded_len(self) -> int:
        return HEADER_LEN + self._body_len()

    def _body_parts(self) -> tuple[bytes, ...]:
        raise NotImplementedError

    def _body_len(self) -> int:
        raise NotImplementedError


# --- messages --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Capabilities(_Message):
    """What a peer speaks and serves; Hello and HelloAck share it."""

    role: Role
    versions: tuple[int, ...]
    codecs: tuple[int, ...]
    models: tuple[bytes, ...] = ()

    def __post_init__(self) -> None:
        set_frozen(self, "role", enum_field(Role, "role", self.role))
        set_frozen(self, "versions", self._small_ints("versions", self.versions, 1))
        set_frozen(self, "codecs", self._small_ints("codecs", self.codecs, 0))
        models = tuple(self.models)
        count_field("models", len(models), 0, MAX_MODELS)
        set_frozen(self, "models", tuple(bytes_field("models", m, DIGEST_LEN, DIGEST_LEN) for m in models))

    @staticmethod
    def _small_ints(field: str, values: object, lo: int) -> tuple[int, ...]:
        items: tuple[object, ...] = tuple(values)  # type: ignore[arg-type]  # not iterable: TypeError, as before
        count_field(field, len(items), 1, 255)
        return tuple(int(int_field(field, v, lo, 255)) for v in items)

    def _body_parts(self) -> tuple[bytes, ...]:
        lists = (len(self.versions), *self.versions, len(self.codecs), *self.codecs, len(self.models))
        return (bytes((self.role, *lists)), *self.models)

    def _body_len(self) -> int:
        return 4 + len(self.versions) + len(self.codecs) + DIGEST_LEN * len(self.models)

    @classmethod
    def _decode(cls, r: Reader) -> Self:
        role = enum_field(Role, "role", r.u8("role"))
        versions = r.array("B", count_field("versions", r.u8("versions"), 1, 255), "versions")
        codecs = r.array("B", count_field("codecs", r.u8("codecs"), 1, 255), "codecs")
        n_models = count_field("models", r.u8("models"), 0, MAX_MODELS)
        return cls(role, versions, codecs, tuple(r.take(DIGEST_LEN, "models") for _ in range(n_models)))


@dataclass(frozen=True)
class Hello(_Capabilities):
    """Opens a connection: the sender's role, protocol versions, codecs and served model digests."""

    TYPE: ClassVar[MsgType] = MsgType.HELLO


@dataclass(frozen=True)
class HelloAck(_Capabilities):
    """Answers a Hello with the receiver's own capabilities; both sides then ``negotiate``."""

    TYPE: ClassVar[MsgType] = MsgType.HELLO_ACK


@dataclass(frozen=True)
class DispatchRequest(_Message):
    """One MoE layer's routed tokens for one worker: which experts, with which router weights, on which states."""

    TYPE: ClassVar[MsgType] = MsgType.DISPATCH_REQUEST
    _FIXED: ClassVar[int] = DISPATCH_ID_LEN + MODEL_ID_LEN + 2 + 1 + 1 + 2

    dispatch_id: bytes
    model_id: bytes  # model_id_of(the model's sha256 digest)
    layer: int
    codec: Codec
    n_tokens: int
    top_k: int
    expert_ids: tuple[int, ...]  # n_tokens*top_k, token-major; -1 = slot not for this worker
    router_weights: tuple[float, ...]  # n_tokens*top_k, as float32 (normalised on construction)
    hidden: bytes  # last on the wire: the rest of the body

    def __post_init__(self) -> None:
        set_frozen(self, "dispatch_id", bytes_field("dispatch_id", self.dispatch_id, DISPATCH_ID_LEN, DISPATCH_ID_LEN))
        set_frozen(self, "model_id", bytes_field("model_id", self.model_id, MODEL_ID_LEN, MODEL_ID_LEN))
        int_field("layer", self.layer, 0, 0xFFFF)
        set_frozen(self, "codec", enum_field(Codec, "codec", self.codec, BadCodec))
        count_field("n_tokens", self.n_tokens, 1, MAX_TOKENS)
        count_field("top_k", self.top_k, 1, MAX_TOP_K)
        slots = self.n_tokens * self.top_k
        set_frozen(self, "expert_ids", self._check_experts(self.expert_ids, self.top_k, slots))
        set_frozen(self, "router_weights", self._check_weights(self.router_weights, slots))
        set_frozen(self, "hidden", bytes_field("hidden", self.hidden, 1, MAX_MESSAGE))
        _check_total(self)

    @staticmethod
    def _check_experts(values: object, top_k: int, slots: int) -> tuple[int, ...]:
        ids = as_wire("expert_ids", "h", values)
        if len(ids) != slots:
            raise InvalidField("expert_ids", f"{len(ids)} ids for n_tokens*top_k = {slots} slots")
        if min(ids) < -1:
            raise InvalidField("expert_ids", f"expert id {min(ids)} is below -1")
        for start in range(0, slots, top_k):
            chosen = [e for e in ids[start : start + top_k] if e != -1]
            if len(set(chosen)) != len(chosen):
                raise InvalidField("expert_ids", f"token {start // top_k} names an expert twice: {chosen}")
        return ids

    @staticmethod
    def _check_weights(values: object, slots: int) -> tuple[float, ...]:
        weights = as_wire("router_weights", "f", values)
        if len(weights) != slots:
            raise InvalidField("router_weights", f"{len(weights)} weights for n_tokens*top_k = {slots} slots")
        for i, w in enumerate(weights):
            if not math.isfinite(w):
                raise InvalidField("router_weights", f"weight {i} is {w}")
        return weights

    def _body_parts(self) -> tuple[bytes, ...]:
        slots = len(self.expert_ids)
        return (
            self.dispatch_id,
            self.model_id,
            struct.pack("<HBBH", self.layer, self.codec, self.top_k, self.n_tokens),
            struct.pack(f"<{slots}h", *self.expert_ids),
            struct.pack(f"<{slots}f", *self.router_weights),
            self.hidden,
        )

    def _body_len(self) -> int:
        return self._FIXED + 6 * len(self.expert_ids) + len(self.hidden)

    @classmethod
    def _decode(cls, r: Reader) -> Self:
        dispatch_id = r.take(DISPATCH_ID_LEN, "dispatch_id")
        model_id = r.take(MODEL_ID_LEN, "model_id")
        layer = r.u16("layer")
        codec = enum_field(Codec, "codec", r.u8("codec"), BadCodec)
        top_k = count_field("top_k", r.u8("top_k"), 1, MAX_TOP_K)
        n_tokens = count_field("n_tokens", r.u16("n_tokens"), 1, MAX_TOKENS)
        expert_ids = r.array("h", n_tokens * top_k, "expert_ids")
        router_weights = r.array("f", n_tokens * top_k, "router_weights")
        hidden = rest(r, 1, "hidden")
        return cls(dispatch_id, model_id, layer, codec, n_tokens, top_k, expert_ids, router_weights, hidden)


@dataclass(frozen=True)
class DispatchReply(_Message):
    """A worker's answer: per token, the router-weighted sum of its hosted experts' outputs."""

    TYPE: ClassVar[MsgType] = MsgType.DISPATCH_REPLY
    _FIXED: ClassVar[int] = DISPATCH_ID_LEN + 1 + 2 + 4 + 2

    dispatch_id: bytes
    codec: Codec
    n_tokens: int
    partial: bytes  # last on the wire: the rest of the body
    compute_us: int
    receipt: bytes = b""

    def __post_init__(self) -> None:
        set_frozen(self, "dispatch_id", bytes_field("dispatch_id", self.dispatch_id, DISPATCH_ID_LEN, DISPATCH_ID_LEN))
        set_frozen(self, "codec", enum_field(Codec, "codec", self.codec, BadCodec))
        count_field("n_tokens", self.n_tokens, 1, MAX_TOKENS)
        set_frozen(self, "partial", bytes_field("partial", self.partial, 1, MAX_MESSAGE))
        int_field("compute_us", self.compute_us, 0, 0xFFFFFFFF)
        set_frozen(self, "receipt", bytes_field("receipt", self.receipt, 0, MAX_RECEIPT))
        _check_total(self)

    def _body_parts(self) -> tuple[bytes, ...]:
        return (
            self.dispatch_id,
            struct.pack("<BHIH", self.codec, self.n_tokens, self.compute_us, len(self.receipt)),
            self.receipt,
            self.partial,
        )

    def _body_len(self) -> int:
        return self._FIXED + len(self.partial) + len(self.receipt)

    @classmethod
    def _decode(cls, r: Reader) -> Self:
        dispatch_id = r.take(DISPATCH_ID_LEN, "dispatch_id")
        codec = enum_field(Codec, "codec", r.u8("codec"), BadCodec)
        n_tokens = count_field("n_tokens", r.u16("n_tokens"), 1, MAX_TOKENS)
        compute_us = r.u32("compute_us")
        receipt = sized(r, 2, 0, MAX_RECEIPT, "receipt")
        partial = rest(r, 1, "partial")
        return cls(dispatch_id, codec, n_tokens, partial, compute_us, receipt)


@dataclass(frozen=True)
class ErrorReply(_Message):
    """A refusal: which request (zero id if unknown), why (code) and a bounded human-readable message."""

    TYPE: ClassVar[MsgType] = MsgType.ERROR_REPLY

    dispatch_id: bytes
    code: ErrorCode
    message: str
    held: int = 0  # STAGE_GAP only (on the wire only then): the positions the stage holds, where a replay starts

    def __post_init__(self) -> None:
        set_frozen(self, "dispatch_id", bytes_field("dispatch_id", self.dispatch_id, DISPATCH_ID_LEN, DISPATCH_ID_LEN))
        set_frozen(self, "code", enum_field(ErrorCode, "code", self.code))
        if not isinstance(self.message, str):
            raise InvalidField("message", f"expected str, got {type(self.message).__name__}")
        try:
            count_field("message", len(self.message.encode()), 0, MAX_ERROR_TEXT)
        except UnicodeEncodeError:
            raise InvalidField("message", "is not encodable as UTF-8") from None
        int_field("held", self.held, 0, 0xFFFFFFFF)
        if self.held and self.code is not ErrorCode.STAGE_GAP:
            raise InvalidField("held", f"only a STAGE_GAP reply carries held, not {self.code.name}")

    def _body_parts(self) -> tuple[bytes, ...]:
        text = self.message.encode()
        held = struct.pack("<I", self.held) if self.code is ErrorCode.STAGE_GAP else b""
        return self.dispatch_id, struct.pack("<BH", self.code, len(text)), text, held

    def _body_len(self) -> int:
        return DISPATCH_ID_LEN + 3 + len(self.message.encode()) + 4 * (self.code is ErrorCode.STAGE_GAP)

    @classmethod
    def _decode(cls, r: Reader) -> Self:
        dispatch_id = r.take(DISPATCH_ID_LEN, "dispatch_id")
        code = enum_field(ErrorCode, "code", r.u8("code"))
        try:
            message = sized(r, 2, 0, MAX_ERROR_TEXT, "message").decode()
        except UnicodeDecodeError:
            raise InvalidField("message", "is not valid UTF-8") from None
        return cls(dispatch_id, code, message, r.u32("held") if code is ErrorCode.STAGE_GAP else 0)


@dataclass(frozen=True)
class _Echo(_Message):
    """A nonce and the pinger's clock; Ping and Pong share it."""

    nonce: int
    sent_at_us: int

    def __post_init__(self) -> None:
        int_field("nonce", self.nonce, 0, 2**64 - 1)
        int_field("sent_at_us", self.sent_at_us, 0, 2**64 - 1)

    def _body_parts(self) -> tuple[bytes, ...]:
        return (struct.pack("<QQ", self.nonce, self.sent_at_us),)

    def _body_len(self) -> int:
        return 16

    @classmethod
    def _decode(cls, r: Reader) -> Self:
        return cls(r.u64("nonce"), r.u64("sent_at_us"))


@dataclass(frozen=True)
class Ping(_Echo):
    """Asks for a Pong; ``sent_at_us`` is the pinger's clock."""

    TYPE: ClassVar[MsgType] = MsgType.PING


@dataclass(frozen=True)
class Pong(_Echo):
    """Echoes a Ping's nonce and clock, so the round trip is ``now - pong.sent_at_us`` on the pinger's clock."""

    TYPE: ClassVar[MsgType] = MsgType.PONG

    @classmethod
    def answering(cls, ping: Ping) -> Pong:
        return cls(ping.nonce, ping.sent_at_us)


@dataclass(frozen=True)
class LedgerHead(_Message):
    """A signed ledger head, and the sender's view of the receiver's chain at the seq it last witnessed."""

    TYPE: ClassVar[MsgType] = MsgType.LEDGER_HEAD

    role: Role
    seq: int
    entry_hash: bytes
    signature: bytes
    ask_seq: int = 0
    ask_hash: bytes = bytes(32)

    def __post_init__(self) -> None:
        set_frozen(self, "role", enum_field(Role, "role", self.role))
        for name in ("seq", "ask_seq"):
            int_field(name, getattr(self, name), 0, 2**63 - 1)
        for name, n in (("entry_hash", 32), ("signature", 64), ("ask_hash", 32)):
            set_frozen(self, name, bytes_field(name, getattr(self, name), n, n))

    def _body_parts(self) -> tuple[bytes, ...]:
        return struct.pack("<BQ", self.role, self.seq), self.entry_hash, self.signature, struct.pack("<Q", self.ask_seq), self.ask_hash

    def _body_len(self) -> int:
        return 145

    @classmethod
    def _decode(cls, r: Reader) -> Self:
        role = enum_field(Role, "role", r.u8("role"))
        return cls(role, r.u64("seq"), r.take(32, "entry_hash"), r.take(64, "signature"), r.u64("ask_seq"), r.take(32, "ask_hash"))


@dataclass(frozen=True)
class SliceInfoRequest(_Message):
    """Asks a worker what a slice file of its experts needs: the model's manifest and the hosted tensors' leaves."""

    TYPE: ClassVar[MsgType] = MsgType.SLICE_INFO_REQUEST

    model_id: bytes

    def __post_init__(self) -> None:
        set_frozen(self, "model_id", bytes_field("model_id", self.model_id, MODEL_ID_LEN, MODEL_ID_LEN))

    def _body_parts(self) -> tuple[bytes, ...]:
        return (self.model_id,)

    def _body_len(self) -> int:
        return MODEL_ID_LEN

    @classmethod
    def _decode(cls, r: Reader) -> Self:
        return cls(r.take(MODEL_ID_LEN, "model_id"))


@dataclass(frozen=True)
class SliceInfo(_Message):
    """What a worker serves of a model: its layers and experts (half-open), the model's manifest (one line per
    tensor, hashing to the model digest) and, for each stacked expert tensor it holds, every expert's leaf hash.

    Nothing here is trusted by the fetcher: the manifest must hash to the digest it asked for and each tensor's
    leaves to the manifest's line (:mod:`experts.slice_fetch`).
    """

    TYPE: ClassVar[MsgType] = MsgType.SLICE_INFO

    layers: tuple[int, int]
    experts: tuple[int, int]
    manifest: tuple[str, ...]
    leaves: tuple[tuple[str, tuple[str, ...]], ...]  # (tensor name, per-expert sha256 hex)

    def __post_init__(self) -> None:
        for field_name in ("layers", "experts"):
            start, stop = getattr(self, field_name)
            set_frozen(self, field_name, (int_field(field_name, start, 0, 0xFFFF), int_field(field_name, stop, 0, 0xFFFF)))
            if not start < stop:
                raise InvalidField(field_name, f"range {start}-{stop} is empty")
        lines = tuple(self.manifest)
        count_field("manifest", len(lines), 1, 1 << 20)
        for line in lines:
            if not isinstance(line, str) or "\n" in line:
                raise InvalidField("manifest", "a manifest line is a str without newlines")
        set_frozen(self, "manifest", lines)
        leaves = tuple((self._name(name), tuple(hashes)) for name, hashes in self.leaves)
        for name, hashes in leaves:
            count_field("leaves", len(hashes), 1, 0xFFFF)
            if any(not isinstance(h, str) or len(h) != LEAF_LEN or not set(h) <= _HEX for h in hashes):
                raise InvalidField("leaves", f"the leaves of {name} are not {LEAF_LEN}-character lowercase hex")
        set_frozen(self, "leaves", leaves)
        _check_total(self)

    @staticmethod
    def _name(name: object) -> str:
        if not isinstance(name, str) or not name.isascii() or not name.isprintable() or "|" in name or not 0 < len(name) <= MAX_TENSOR_NAME:
            raise InvalidField("leaves", f"tensor name {name!r} is not 1-{MAX_TENSOR_NAME} printable ASCII characters without '|'")
        return name

    def _texts(self) -> tuple[bytes, bytes]:
        leaves = "\n".join(f"{name}|{''.join(hashes)}" for name, hashes in self.leaves)
        return "\n".join(self.manifest).encode(), leaves.encode()

    def _body_parts(self) -> tuple[bytes, ...]:
        manifest, leaves = self._texts()
        return struct.pack("<HHHHI", *self.layers, *self.experts, len(manifest)), manifest, leaves

    def _body_len(self) -> int:
        manifest, leaves = self._texts()
        return 12 + len(manifest) + len(leaves)

    @classmethod
    def _decode(cls, r: Reader) -> Self:
        layers = (r.u16("layers"), r.u16("layers"))
        experts = (r.u16("experts"), r.u16("experts"))
        try:
            manifest = sized(r, 4, 1, MAX_MESSAGE, "manifest").decode().split("\n")
            text = rest(r, 0, "leaves").decode()
        except UnicodeDecodeError:
            raise InvalidField("manifest", "is not valid UTF-8") from None
        leaves = []
        for line in text.split("\n") if text else ():
            name, sep, hashes = line.partition("|")
            if not sep or len(hashes) % LEAF_LEN:
                raise InvalidField("leaves", f"line {line[:40]!r}... is not NAME|HASHES")
            leaves.append((name, tuple(hashes[i : i + LEAF_LEN] for i in range(0, len(hashes), LEAF_LEN))))
        return cls(layers, experts, tuple(manifest), tuple(leaves))


@dataclass(frozen=True)
class PieceRequest(_Message):
    """Asks for ``length`` bytes at ``offset`` of one expert's rows of the stacked tensor ``name``: the original
    quantized bytes, exactly as a slice file holds them."""

    TYPE: ClassVar[MsgType] = MsgType.PIECE_REQUEST

    model_id: bytes
    name: str
    expert: int
    offset: int
    length: int

    def __post_init__(self) -> None:
        set_frozen(self, "model_id", bytes_field("model_id", self.model_id, MODEL_ID_LEN, MODEL_ID_LEN))
        SliceInfo._name(self.name)
        int_field("expert", self.expert, 0, 0xFFFF)
        int_field("offset", self.offset, 0, 0xFFFFFFFF)
        count_field("length", self.length, 1, MAX_PIECE)

    def _body_parts(self) -> tuple[bytes, ...]:
        name = self.name.encode()
        return self.model_id, struct.pack("<HIIB", self.expert, self.offset, self.length, len(name)), name

    def _body_len(self) -> int:
        return MODEL_ID_LEN + 11 + len(self.name)

    @classmethod
    def _decode(cls, r: Reader) -> Self:
        model_id = r.take(MODEL_ID_LEN, "model_id")
        expert, offset, length = r.u16("expert"), r.u32("offset"), r.u32("length")
        try:
            name = sized(r, 1, 1, MAX_TENSOR_NAME, "name").decode("ascii")
        except UnicodeDecodeError:
            raise InvalidField("name", "is not ASCII") from None
        return cls(model_id, name, expert, offset, length)


@dataclass(frozen=True)
class Piece(_Message):
    """The bytes a PieceRequest asked for (fewer only at the end of the expert's rows)."""

    TYPE: ClassVar[MsgType] = MsgType.PIECE

    offset: int
    data: bytes  # last on the wire: the rest of the body

    def __post_init__(self) -> None:
        int_field("offset", self.offset, 0, 0xFFFFFFFF)
        set_frozen(self, "data", bytes_field("data", self.data, 1, MAX_PIECE))

    def _body_parts(self) -> tuple[bytes, ...]:
        return struct.pack("<I", self.offset), self.data

    def _body_len(self) -> int:
        return 4 + len(self.data)

    @classmethod
    def _decode(cls, r: Reader) -> Self:
        return cls(r.u32("offset"), rest(r, 1, "data"))


def _dispatch_ids(values: object, lo: int) -> tuple[bytes, ...]:
    items: tuple[object, ...] = tuple(values)  # type: ignore[arg-type]  # not iterable: TypeError, as for the other tuples
    count_field("count", len(items), lo, MAX_RECEIPT_BATCH)
    ids = tuple(bytes_field("dispatch_ids", i, DISPATCH_ID_LEN, DISPATCH_ID_LEN) for i in items)
    if len(set(ids)) != len(ids):
        raise InvalidField("dispatch_ids", "a dispatch id is named twice")
    return ids


@dataclass(frozen=True)
class ReceiptSignRequest(_Message):
    """Asks a worker for one batch signature over the receipts of these dispatches (answered before, unsigned)."""

    TYPE: ClassVar[MsgType] = MsgType.RECEIPT_SIGN_REQUEST

    dispatch_ids: tuple[bytes, ...]

    def __post_init__(self) -> None:
        set_frozen(self, "dispatch_ids", _dispatch_ids(self.dispatch_ids, 1))

    def _body_parts(self) -> tuple[bytes, ...]:
        return (struct.pack("<H", len(self.dispatch_ids)), *self.dispatch_ids)

    def _body_len(self) -> int:
        return 2 + DISPATCH_ID_LEN * len(self.dispatch_ids)

    @classmethod
    def _decode(cls, r: Reader) -> Self:
        n = count_field("count", r.u16("count"), 1, MAX_RECEIPT_BATCH)  # checked before reading the ids
        return cls(tuple(r.take(DISPATCH_ID_LEN, "dispatch_ids") for _ in range(n)))


@dataclass(frozen=True)
class ReceiptBatch(_Message):
    """A worker's batch signature: the dispatches it signs, each with its receipt's Merkle leaf, and the signature
    over their root (``node.ledger.receipts.batch_message``). The backbone rebuilds each leaf from what it sent and
    received; the leaves sent here only tell it *which* receipt differs when one does."""

    TYPE: ClassVar[MsgType] = MsgType.RECEIPT_BATCH

    dispatch_ids: tuple[bytes, ...]
    leaves: tuple[bytes, ...]
    signature: bytes

    def __post_init__(self) -> None:
        set_frozen(self, "dispatch_ids", _dispatch_ids(self.dispatch_ids, 1))
        leaves = tuple(self.leaves)
        if len(leaves) != len(self.dispatch_ids):
            raise InvalidField("leaves", f"{len(leaves)} leaves for {len(self.dispatch_ids)} dispatch ids")
        set_frozen(self, "leaves", tuple(bytes_field("leaves", v, LEAF_HASH_LEN, LEAF_HASH_LEN) for v in leaves))
        set_frozen(self, "signature", bytes_field("signature", self.signature, SIGNATURE_LEN, SIGNATURE_LEN))

    def _body_parts(self) -> tuple[bytes, ...]:
        pairs = (part for pair in zip(self.dispatch_ids, self.leaves) for part in pair)
        return (struct.pack("<H", len(self.dispatch_ids)), *pairs, self.signature)

    def _body_len(self) -> int:
        return 2 + (DISPATCH_ID_LEN + LEAF_HASH_LEN) * len(self.dispatch_ids) + SIGNATURE_LEN

    @classmethod
    def _decode(cls, r: Reader) -> Self:
        n = count_field("count", r.u16("count"), 1, MAX_RECEIPT_BATCH)  # checked before reading the pairs
        pairs = [(r.take(DISPATCH_ID_LEN, "dispatch_ids"), r.take(LEAF_HASH_LEN, "leaves")) for _ in range(n)]
        return cls(tuple(i for i, _ in pairs), tuple(v for _, v in pairs), r.take(SIGNATURE_LEN, "signature"))


def _rows_len(n_rows: object, width: object) -> int:
    """Bytes of n_rows x width f32 rows, both counts checked first (so a decoder allocates nothing for bad ones)."""
    return 4 * count_field("n_rows", n_rows, 1, MAX_TOKENS) * count_field("width", width, 1, MAX_STAGE_WIDTH)


def _rows(field: str, rows: object, n_rows: object, width: object) -> bytes:
    size = _rows_len(n_rows, width)
    data = bytes_field(field, rows, 1, MAX_MESSAGE)
    if len(data) != size:
        raise InvalidField(field, f"{len(data)} bytes for {n_rows} rows of {width} f32 ({size} bytes)")
    return data


def _take_rows(r: Reader, n_rows: int, width: int) -> bytes:
    size = _rows_len(n_rows, width)
    if r.left != size:
        raise InvalidField("rows", f"{r.left} bytes for {n_rows} rows of {width} f32 ({size} bytes)")
    return r.take(size, "rows")


@dataclass(frozen=True)
class StagePass(_Message):
    """Rows of the residual stream for a stage's layers at positions ``start ..`` of a session (node.stage).

    The rows are opaque f32 bytes here, as hidden states are for dispatches; ``layers`` lets a stage refuse a client
    that expects other layers (NOT_HOSTED) instead of returning states of the wrong depth.
    """

    TYPE: ClassVar[MsgType] = MsgType.STAGE_PASS

    session: bytes
    model_id: bytes
    layers: tuple[int, int]  # half-open
    start: int
    n_rows: int
    width: int
    rows: bytes  # last on the wire: the rest of the body

    def __post_init__(self) -> None:
        set_frozen(self, "session", bytes_field("session", self.session, DISPATCH_ID_LEN, DISPATCH_ID_LEN))
        set_frozen(self, "model_id", bytes_field("model_id", self.model_id, MODEL_ID_LEN, MODEL_ID_LEN))
        start, stop = self.layers
        set_frozen(self, "layers", (int_field("layers", start, 0, 0xFFFF), int_field("layers", stop, 0, 0xFFFF)))
        if not start < stop:
            raise InvalidField("layers", f"range {start}-{stop} is empty")
        int_field("start", self.start, 0, 0xFFFFFFFF)
        set_frozen(self, "rows", _rows("rows", self.rows, self.n_rows, self.width))
        _check_total(self)

    def _body_parts(self) -> tuple[bytes, ...]:
        fixed = struct.pack("<HHIHI", *self.layers, self.start, self.n_rows, self.width)
        return self.session, self.model_id, fixed, self.rows

    def _body_len(self) -> int:
        return DISPATCH_ID_LEN + MODEL_ID_LEN + 14 + len(self.rows)

    @classmethod
    def _decode(cls, r: Reader) -> Self:
        session, model_id = r.take(DISPATCH_ID_LEN, "session"), r.take(MODEL_ID_LEN, "model_id")
        layers = (r.u16("layers"), r.u16("layers"))
        start, n_rows, width = r.u32("start"), r.u16("n_rows"), r.u32("width")
        return cls(session, model_id, layers, start, n_rows, width, _take_rows(r, n_rows, width))


@dataclass(frozen=True)
class StageReply(_Message):
    """A stage's answer to a StagePass: the residual stream after its last layer, one row per row passed."""

    TYPE: ClassVar[MsgType] = MsgType.STAGE_REPLY

    session: bytes
    n_rows: int
    width: int
    rows: bytes  # last on the wire: the rest of the body
    compute_us: int = 0

    def __post_init__(self) -> None:
        set_frozen(self, "session", bytes_field("session", self.session, DISPATCH_ID_LEN, DISPATCH_ID_LEN))
        int_field("compute_us", self.compute_us, 0, 0xFFFFFFFF)
        set_frozen(self, "rows", _rows("rows", self.rows, self.n_rows, self.width))
        _check_total(self)

    def _body_parts(self) -> tuple[bytes, ...]:
        return self.session, struct.pack("<HII", self.n_rows, self.width, self.compute_us), self.rows

    def _body_len(self) -> int:
        return DISPATCH_ID_LEN + 10 + len(self.rows)

    @classmethod
    def _decode(cls, r: Reader) -> Self:
        session = r.take(DISPATCH_ID_LEN, "session")
        n_rows, width, compute_us = r.u16("n_rows"), r.u32("width"), r.u32("compute_us")
        return cls(session, n_rows, width, _take_rows(r, n_rows, width), compute_us)


@dataclass(frozen=True)
class Unknown(_Message):
    """A message of a type this side does not know, kept whole so the caller can ignore, log or refuse it."""

    msg_type: int
    body: bytes
    flags: int = 0

    def __post_init__(self) -> None:
        int_field("msg_type", self.msg_type, 0, 255)
        if self.msg_type in _TYPES:
            raise InvalidField("msg_type", f"{MsgType(self.msg_type).name} is a known type")
        int_field("flags", self.flags, 0, 0xFFFF)
        set_frozen(self, "body", bytes_field("body", self.body, 0, MAX_MESSAGE - HEADER_LEN))

    @property
    def TYPE(self) -> int:  # type: ignore[override]  # noqa: N802 - the per-instance counterpart of the class constant
        return self.msg_type

    def _body_parts(self) -> tuple[bytes, ...]:
        return (self.body,)

    def _body_len(self) -> int:
        return len(self.body)


_Known = Hello | HelloAck | DispatchRequest | DispatchReply | ErrorReply | Ping | Pong | LedgerHead | SliceInfoRequest | SliceInfo | PieceRequest | Piece | ReceiptSignRequest | ReceiptBatch | StagePass | StageReply
Message = _Known | Unknown

_KNOWN = (Hello, HelloAck, DispatchRequest, DispatchReply, ErrorReply, Ping, Pong, LedgerHead, SliceInfoRequest, SliceInfo, PieceRequest, Piece, ReceiptSignRequest, ReceiptBatch, StagePass, StageReply)
_TYPES: dict[int, type[_Known]] = {
    cls.TYPE: cls for cls in _KNOWN
}


# --- decoding --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Header:
    """A checked message header; a transport may read it first to refuse an oversized message before buffering it."""

    version: int
    msg_type: int
    flags: int
    body_len: int

    @property
    def total_len(self) -> int:
        return HEADER_LEN + self.body_len


def decode_header(data: bytes | bytearray | memoryview) -> Header:
    """Checks the first HEADER_LEN bytes of ``data``: magic, version and the size limit (not the type or flags)."""
    view = memoryview(data).cast("B")
    if len(view) < HEADER_LEN:
        raise Truncated("header", f"needs {HEADER_LEN} bytes, got {len(view)}")
    magic, version, msg_type, flags, body_len = _HEADER.unpack_from(view)
    if magic != MAGIC:
        raise InvalidField("magic", f"{magic!r} is not {MAGIC!r}")
    if version not in SUPPORTED_VERSIONS:
        raise UnsupportedVersion("version", f"{version} is not spoken here (this side speaks {SUPPORTED_VERSIONS})")
    if HEADER_LEN + body_len > MAX_MESSAGE:
        raise TooLarge("body_len", HEADER_LEN + body_len, MAX_MESSAGE)
    return Header(version, msg_type, flags, body_len)


def decode(data: bytes | bytearray | memoryview) -> Message:
    """Decodes exactly one message that fills ``data``; raises a ProtocolError subclass for anything malformed."""
    view = memoryview(data).cast("B")
    header = decode_header(view)
    if len(view) < header.total_len:
        raise Truncated("body", f"body_len is {header.body_len}, {len(view) - HEADER_LEN} bytes present")
    if len(view) > header.total_len:
        raise InvalidField("body_len", f"{len(view) - header.total_len} bytes follow the body")
    body = view[HEADER_LEN:]
    cls = _TYPES.get(header.msg_type)
    if cls is None:
        return Unknown(header.msg_type, bytes(body), header.flags)
    if header.flags:
        raise InvalidField("flags", f"{header.flags:#06x} set on {cls.__name__}; no flag is defined")
    reader = body_reader(body)
    message = cls._decode(reader)
    reader.finish()
    return message


def peek_dispatch_id(data: bytes | bytearray | memoryview) -> bytes:
    """Best effort: the dispatch id of anything that starts like a DispatchRequest (any version), else ZERO_ID.

    Lets a worker correlate its ErrorReply with a request it could not decode.
    """
    view = memoryview(data).cast("B")
    if (
        len(view) >= HEADER_LEN + DISPATCH_ID_LEN
        and view[: len(MAGIC)] == MAGIC
        and view[4] == MsgType.DISPATCH_REQUEST
    ):
        return bytes(view[HEADER_LEN : HEADER_LEN + DISPATCH_ID_LEN])
    return ZERO_ID


def model_id_of(digest: bytes) -> bytes:
    """The ``model_id`` a DispatchRequest carries for the model with this 32-byte sha256 digest: its first 16 bytes."""
    return bytes_field("digest", digest, DIGEST_LEN, DIGEST_LEN)[:MODEL_ID_LEN]


def error_reply_for(exc: BaseException, dispatch_id: bytes = ZERO_ID) -> ErrorReply:
    """The ErrorReply that answers ``exc``.

    An exception with an ``ErrorCode`` in ``error_code`` (every ProtocolError; worker errors such as an unknown model
    may carry one too) is answered with that code and its text, clipped to MAX_ERROR_TEXT. Anything else is INTERNAL
    and only its class name is sent: an unexpected failure's text may reveal local details. A STAGE_GAP exception
    gives its ``held`` too.
    """
    code = getattr(exc, "error_code", None)
    if isinstance(code, ErrorCode):
        text = str(exc).encode(errors="replace")[:MAX_ERROR_TEXT].decode(errors="ignore")  # drops a cut character
    else:
        code, text = ErrorCode.INTERNAL, f"internal error ({type(exc).__name__})"
    held = getattr(exc, "held", 0) if code is ErrorCode.STAGE_GAP else 0
    return ErrorReply(dispatch_id, code, text, held if isinstance(held, int) else 0)


def negotiate(ours: Hello | HelloAck, theirs: Hello | HelloAck) -> tuple[int, tuple[int, ...]]:
    """The highest version both sides speak and the codecs both speak, in our order of preference.

    Both sides compute the same version from the same Hello/HelloAck pair. Raises UnsupportedVersion when no version
    is shared and BadCodec when no codec is.
    """
    versions = set(ours.versions) & set(theirs.versions)
    if not versions:
        raise UnsupportedVersion("versions", f"we speak {ours.versions}, the peer speaks {theirs.versions}")
    codecs = tuple(c for c in dict.fromkeys(ours.codecs) if c in theirs.codecs)
    if not codecs:
        raise BadCodec("codecs", f"we speak {ours.codecs}, the peer speaks {theirs.codecs}")
    return max(versions), codecs
