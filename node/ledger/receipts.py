"""Work receipts: what a worker did for one dispatch, signed by the worker (sans-IO).

Both sides know almost every field already (the backbone built the request, the
worker computed the answer), so a dispatch reply carries only the worker's clock
reading (:data:`ISSUED`, 8 bytes). Each side rebuilds the same canonical
:class:`Receipt` body from what it sent and received; the worker's signature over it
proves the work was accepted for exactly these inputs and outputs, and binds the
unique dispatch id to both peer ids so it can't be replayed between other peers.
The ledger stores full receipts (see :mod:`node.ledger.store`).

Batch signatures. An Ed25519 signature and its check cost ~0.35 ms, paid at every MoE
layer of every token if each reply carried one. So the reply leaves unsigned, and the
worker later signs many receipts at once: the Merkle root (RFC 9162's tree: leaves
``sha256(0x00 || body)``, nodes ``sha256(0x01 || left || right)``) of the receipts a
backbone asks it to sign (``wire.ReceiptSignRequest``). Each receipt's evidence -- what
the ledgers store as its worker signature -- is the batch signature with the receipt's
position and Merkle path (:class:`BatchProof`): it verifies alone, without the rest of
the batch. A 64-byte evidence is a receipt signed alone (:func:`sign`, as ledgers written
before batch signatures hold them); both verify with :func:`verify`.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace

from experts.errors import RemoteProtocolError
from p2p.identity import Identity, IdentityError, PeerId
from p2p.pathkind import Path
from p2p.wire.messages import MAX_RECEIPT_BATCH, DispatchReply, DispatchRequest

SIGNING_CONTEXT = b"moeswarm/receipt/v1\0"
BATCH_CONTEXT = b"moeswarm/receipt-batch/v1\0"
ISSUED = struct.Struct("<Q")  # what a dispatch reply carries in its receipt field: the worker's clock, microseconds
SIG_LEN = 64
HASH_LEN = 32
_POSITION = struct.Struct("<HH")  # a leaf's index and the batch's size, after the batch signature
MAX_DEPTH = (MAX_RECEIPT_BATCH - 1).bit_length()  # hashes in the longest Merkle path
MAX_EVIDENCE = SIG_LEN + _POSITION.size + HASH_LEN * MAX_DEPTH


class ReceiptError(RemoteProtocolError):
    """A receipt stamp is malformed or its signature does not match the receipt body."""


def work_units(n_expert_tokens: int, n_embd: int, n_ff_exp: int) -> int:
    """Expert-token FLOPs: three (d x ff) matmuls of 2 FLOPs per multiply-add, per held (token, expert)."""
    return n_expert_tokens * 6 * n_embd * n_ff_exp


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class Receipt:
    dispatch_id: str  # hex
    backbone: str  # peer id text
    worker: str
    model_digest: str
    layer: int
    expert_ids: tuple[int, ...]  # distinct experts computed, ascending
    n_tokens: int
    work_units: int
    bytes_in: int
    bytes_out: int
    codec: str
    path: str  # the value of a p2p.pathkind.Path: "direct" | "relay"
    issued_at_us: int  # worker clock when it answered
    price: int  # per work unit, from the worker's record
    request_digest: str
    result_digest: str

    def body(self) -> bytes:
        """Canonical bytes the signature covers (sorted-key compact JSON after a context string)."""
        return SIGNING_CONTEXT + json.dumps(asdict(self), sort_keys=True, separators=(",", ":")).encode()

    @property
    def credits(self) -> int:
        return self.work_units * self.price


@dataclass(frozen=True)
class ReceiptStamp:
    """The worker's clock reading and its signature evidence for one receipt (what a ledger entry keeps of it).

    *signature* is 64 bytes for a receipt signed alone, or a batch signature followed by the receipt's position
    and Merkle path (:class:`BatchProof`): the ledgers store and countersign these bytes as they are.
    """

    issued_at_us: int
    signature: bytes


def encode_issued(issued_at_us: int) -> bytes:
    return ISSUED.pack(issued_at_us)


def decode_issued(data: bytes) -> int:
    """The worker's clock reading from a dispatch reply's receipt field."""
    if len(data) != ISSUED.size:
        raise ReceiptError(f"a dispatch reply's receipt field must be {ISSUED.size} bytes (the issue time), got {len(data)}")
    return ISSUED.unpack(data)[0]


# -- Merkle tree over receipt bodies (RFC 9162, section 2.1)


def leaf_hash(receipt: Receipt) -> bytes:
    return hashlib.sha256(b"\0" + receipt.body()).digest()


def _node(left: bytes, right: bytes) -> bytes:
    return hashlib.sha256(b"\1" + left + right).digest()


def _split(n: int) -> int:
    """The largest power of two below *n* (n >= 2): the size of the left subtree."""
    return 1 << ((n - 1).bit_length() - 1)


def merkle_root(leaves: Sequence[bytes]) -> bytes:
    if len(leaves) == 1:
        return leaves[0]
    k = _split(len(leaves))
    return _node(merkle_root(leaves[:k]), merkle_root(leaves[k:]))


def merkle_path(leaves: Sequence[bytes], index: int) -> tuple[bytes, ...]:
    """The sibling hashes from leaf *index* up to the root, nearest first."""
    if len(leaves) == 1:
        return ()
    k = _split(len(leaves))
    if index < k:
        return (*merkle_path(leaves[:k], index), merkle_root(leaves[k:]))
    return (*merkle_path(leaves[k:], index - k), merkle_root(leaves[:k]))


def _path_len(index: int, count: int) -> int:
    depth = 0
    while count > 1:
        k = _split(count)
        index, count = (index, k) if index < k else (index - k, count - k)
        depth += 1
    return depth


def root_from_path(leaf: bytes, index: int, count: int, path: Sequence[bytes]) -> bytes:
    """The root a leaf at *index* of *count* leaves and its *path* lead to (the inverse of :func:`merkle_path`)."""
    if count == 1:
        return leaf
    k = _split(count)
    if index < k:
        return _node(root_from_path(leaf, index, k, path[:-1]), path[-1])
    return _node(path[-1], root_from_path(leaf, index - k, count - k, path[:-1]))


def batch_message(root: bytes, count: int) -> bytes:
    """What a batch signature covers: the root and the number of receipts under it."""
    return BATCH_CONTEXT + _POSITION.pack(0, count) + root


@dataclass(frozen=True)
class BatchProof:
    """One receipt's share of a batch signature: the signature, the receipt's index among *count*, its Merkle path."""

    signature: bytes
    index: int
    count: int
    path: tuple[bytes, ...]

    def encode(self) -> bytes:
        return self.signature + _POSITION.pack(self.index, self.count) + b"".join(self.path)

    @classmethod
    def decode(cls, data: bytes) -> BatchProof:
        """Parse batch evidence; ReceiptError unless its length is exactly what its position needs (checked first)."""
        if not SIG_LEN + _POSITION.size <= len(data) <= MAX_EVIDENCE:
            raise ReceiptError(f"batch evidence must be {SIG_LEN + _POSITION.size}..{MAX_EVIDENCE} bytes, got {len(data)}")
        index, count = _POSITION.unpack_from(data, SIG_LEN)
        if not 1 <= count <= MAX_RECEIPT_BATCH or index >= count:
            raise ReceiptError(f"batch evidence names receipt {index} of {count} (at most {MAX_RECEIPT_BATCH} per batch)")
        rest = data[SIG_LEN + _POSITION.size :]
        if len(rest) != HASH_LEN * _path_len(index, count):
            raise ReceiptError(f"receipt {index} of {count} needs a Merkle path of {_path_len(index, count)} hashes, got {len(rest)} bytes")
        return cls(data[:SIG_LEN], index, count, tuple(rest[i : i + HASH_LEN] for i in range(0, len(rest), HASH_LEN)))


def evidence_ok(data: object) -> bool:
    """Is *data* a worker signature of one of the two shapes (the ledger checks it before storing)?"""
    if type(data) is not bytes:
        return False
    if len(data) == SIG_LEN:
        return True
    try:
        BatchProof.decode(data)
    except ReceiptError:
        return False
    return True


def sign_batch(identity: Identity, receipts: Sequence[Receipt]) -> tuple[bytes, list[ReceiptStamp]]:
    """One signature over *receipts* (in this order): (the signature, each receipt's stamp with its batch proof)."""
    if not 1 <= len(receipts) <= MAX_RECEIPT_BATCH:
        raise ReceiptError(f"a batch holds 1..{MAX_RECEIPT_BATCH} receipts, not {len(receipts)}")
    if any(r.worker != str(identity.peer_id) for r in receipts):
        raise ReceiptError("a worker signs only receipts naming itself as the worker")
    leaves = [leaf_hash(r) for r in receipts]
    signature = identity.sign(batch_message(merkle_root(leaves), len(leaves)))
    return signature, [batch_stamp(r, signature, i, leaves) for i, r in enumerate(receipts)]


def batch_stamp(receipt: Receipt, signature: bytes, index: int, leaves: Sequence[bytes]) -> ReceiptStamp:
    """The stamp of the receipt at *index* of a batch whose leaves are *leaves*, signed with *signature*."""
    return ReceiptStamp(receipt.issued_at_us, BatchProof(signature, index, len(leaves), merkle_path(leaves, index)).encode())


def verify_batch(worker: str, leaves: Sequence[bytes], signature: bytes) -> None:
    """Raise ReceiptError unless *worker* signed the root of *leaves* (one check for the whole batch)."""
    if not 1 <= len(leaves) <= MAX_RECEIPT_BATCH:
        raise ReceiptError(f"a batch holds 1..{MAX_RECEIPT_BATCH} receipts, not {len(leaves)}")
    try:
        peer = PeerId.from_string(worker)
    except IdentityError as exc:
        raise ReceiptError(f"batch names no valid worker: {exc}") from None
    if not peer.verify(batch_message(merkle_root(leaves), len(leaves)), signature):
        raise ReceiptError(f"batch of {len(leaves)} receipts is not signed by worker {worker}")


def build_receipt(
    request: bytes,
    req: DispatchRequest,
    reply: DispatchReply,
    *,
    backbone: str,
    worker: str,
    model_digest: str,
    n_embd: int,
    n_ff_exp: int,
    path: Path,
    price: int,
    issued_at_us: int,
) -> Receipt:
    """The receipt of one dispatch, from what both sides hold: the request (its bytes and fields) and the reply.

    The worker calls this for the reply it sends, the backbone for the reply it received: ``bytes_out`` is the
    reply's encoded length with a receipt field of ``ISSUED.size`` bytes in either case, so both get the same body
    by construction. The rest each side passes:
    the two peer ids, the model's digest and expert shape, the path, the price and the worker's clock reading.
    """
    held = [e for e in req.expert_ids if e >= 0]
    return Receipt(
        dispatch_id=req.dispatch_id.hex(),
        backbone=backbone,
        worker=worker,
        model_digest=model_digest,
        layer=req.layer,
        expert_ids=tuple(sorted(set(held))),
        n_tokens=req.n_tokens,
        work_units=work_units(len(held), n_embd, n_ff_exp),
        bytes_in=len(request),
        bytes_out=replace(reply, receipt=bytes(ISSUED.size)).encoded_len(),
        codec=req.codec.name.lower(),
        path=path.value,  # plain text: the ledger stores and checks exact str fields
        issued_at_us=issued_at_us,
        price=price,
        request_digest=digest(request),
        result_digest=digest(reply.partial),
    )


def sign(identity: Identity, receipt: Receipt) -> ReceiptStamp:
    """A receipt signed alone (64-byte evidence): the form of ledgers written before batch signatures."""
    if receipt.worker != str(identity.peer_id):
        raise ReceiptError("a worker signs only receipts naming itself as the worker")
    return ReceiptStamp(receipt.issued_at_us, identity.sign(receipt.body()))


def verify(receipt: Receipt, stamp: ReceiptStamp) -> None:
    """Raise ReceiptError unless the worker named in *receipt* signed exactly it, alone or in a batch."""
    if stamp.issued_at_us != receipt.issued_at_us:
        raise ReceiptError("receipt stamp time differs from the receipt's")
    try:
        worker = PeerId.from_string(receipt.worker)
    except IdentityError as exc:
        raise ReceiptError(f"receipt {receipt.dispatch_id} names no valid worker: {exc}") from None
    if len(stamp.signature) == SIG_LEN:
        signed = worker.verify(receipt.body(), stamp.signature)
    else:
        proof = BatchProof.decode(stamp.signature)
        root = root_from_path(leaf_hash(receipt), proof.index, proof.count, proof.path)
        signed = worker.verify(batch_message(root, proof.count), proof.signature)
    if not signed:
        raise ReceiptError(f"receipt {receipt.dispatch_id} is not signed by worker {receipt.worker}")
