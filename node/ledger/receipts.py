"""Work receipts: what a worker did for one dispatch, signed by the worker (sans-IO).

Both sides know almost every field already (the backbone built the request, the
worker computed the answer), so the wire carries only the worker's clock reading
and signature (:class:`ReceiptStamp`, 72 bytes). Each side rebuilds the same
canonical :class:`Receipt` body from what it sent and received; the worker's
signature over it proves the work was accepted for exactly these inputs and
outputs, and binds the unique dispatch id to both peer ids so it can't be replayed
between other peers. The ledger stores full receipts (see :mod:`node.ledger.store`).
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import asdict, dataclass, replace

from experts.errors import RemoteProtocolError
from p2p.identity import Identity, IdentityError, PeerId
from p2p.pathkind import Path
from p2p.wire import DispatchReply, DispatchRequest

SIGNING_CONTEXT = b"moeswarm/receipt/v1\0"
STAMP = struct.Struct("<Q64s")


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
    """What travels in a dispatch reply: the worker's clock reading and its signature."""

    issued_at_us: int
    signature: bytes

    def encode(self) -> bytes:
        return STAMP.pack(self.issued_at_us, self.signature)

    @classmethod
    def decode(cls, data: bytes) -> ReceiptStamp:
        if len(data) != STAMP.size:
            raise ReceiptError(f"receipt stamp must be {STAMP.size} bytes, got {len(data)}")
        at, sig = STAMP.unpack(data)
        return cls(at, sig)


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

    The worker calls this before it signs (its reply may carry any stamp-sized placeholder), the backbone after
    it received the reply (with the real stamp): ``bytes_out`` is the reply's encoded length with a stamp of
    ``STAMP.size`` bytes in either case, so both get the same body by construction. The rest each side passes:
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
        bytes_out=replace(reply, receipt=bytes(STAMP.size)).encoded_len(),
        codec=req.codec.name.lower(),
        path=path.value,  # plain text: the ledger stores and checks exact str fields
        issued_at_us=issued_at_us,
        price=price,
        request_digest=digest(request),
        result_digest=digest(reply.partial),
    )


def sign(identity: Identity, receipt: Receipt) -> ReceiptStamp:
    if receipt.worker != str(identity.peer_id):
        raise ReceiptError("a worker signs only receipts naming itself as the worker")
    return ReceiptStamp(receipt.issued_at_us, identity.sign(receipt.body()))


def verify(receipt: Receipt, stamp: ReceiptStamp) -> None:
    """Raise ReceiptError unless the worker named in *receipt* signed exactly it."""
    if stamp.issued_at_us != receipt.issued_at_us:
        raise ReceiptError("receipt stamp time differs from the receipt's")
    try:
        worker = PeerId.from_string(receipt.worker)
    except IdentityError as exc:
        raise ReceiptError(f"receipt {receipt.dispatch_id} names no valid worker: {exc}") from None
    if not worker.verify(receipt.body(), stamp.signature):
        raise ReceiptError(f"receipt {receipt.dispatch_id} is not signed by worker {receipt.worker}")


def verify_on_either_path(receipt: Receipt, stamp: ReceiptStamp) -> Receipt:
    """Verify *receipt*, or the same receipt on the other path; return the one the worker signed.

    The one place where the two sides may disagree: each names the path its own endpoint uses to the other,
    and in the instant a punched direct path takes over from the relay (or dies back to it) between request
    and reply, one side still sees the old path. Either path is an honest answer for that dispatch; the
    error of the first attempt is the one raised.
    """
    try:
        verify(receipt, stamp)
        return receipt
    except ReceiptError as first:
        other = replace(receipt, path=Path(receipt.path).other.value)
        try:
            verify(other, stamp)
        except ReceiptError:
            raise first from None
        return other
