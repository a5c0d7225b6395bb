"""One receipt builder: the worker and the backbone, each from what it holds, build the same signed receipt."""

from __future__ import annotations

import asyncio
import dataclasses
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from experts.codecs import Codec
from experts.gguf_model import GGUFModel
from experts.slices import ExpertStore
from node.ledger.receipts import Receipt, ReceiptStamp, build_receipt, decode_issued, verify
from node.worker.service import Worker
from p2p.identity import Identity
from p2p.pathkind import Path
from p2p.wire import messages as wire
from relay.client import virtual_address

from ..conftest import make_model

N_EXPERT = 8


@pytest.fixture(scope="module")
def model(model_dir) -> GGUFModel:
    return GGUFModel(make_model(model_dir, "qwen3moe", n_expert=N_EXPERT, n_layer=2))


@st.composite
def dispatches(draw, n_layer: int, n_embd: int, model_id: bytes) -> wire.DispatchRequest:
    """A valid request: 1-4 tokens, top-1..3 slots each, some slots not for this worker (-1), random states."""
    n, k = draw(st.integers(1, 4)), draw(st.integers(1, 3))
    ids: list[int] = []
    for _ in range(n):
        chosen = draw(st.lists(st.integers(0, N_EXPERT - 1), min_size=k, max_size=k, unique=True))
        ids += [e if draw(st.booleans()) else -1 for e in chosen]
    if all(e < 0 for e in ids):
        ids[0] = draw(st.integers(0, N_EXPERT - 1))
    weights = draw(st.lists(st.floats(0.0625, 1.0, width=32), min_size=n * k, max_size=n * k))
    x = np.random.default_rng(draw(st.integers(0, 2**32 - 1))).standard_normal((n, n_embd)).astype(np.float32)
    layer = draw(st.integers(0, n_layer - 1))
    return wire.DispatchRequest(os.urandom(16), model_id, layer, Codec.F32, n, k, tuple(ids), tuple(weights), x.tobytes())


class Captured:
    """The worker's ledger, reduced to the last receipt it was handed."""

    def receipt(self, receipt: Receipt, stamp: ReceiptStamp) -> None:
        self.last = (receipt, stamp)


async def serve_and_sign(worker: Worker, backbone: Identity, request: bytes) -> tuple[bytes, wire.Message]:
    """One dispatch, then the backbone's request for its batch signature: (the reply's bytes, the signature answer)."""
    raw = await worker.handle(backbone.peer_id, request)
    ask = wire.ReceiptSignRequest((wire.decode(request).dispatch_id,)).encode()  # type: ignore[union-attr]
    answer = wire.decode(await worker.handle(backbone.peer_id, ask))
    await asyncio.sleep(0)  # the ledger hand-off runs after the answer
    return raw, answer


@settings(max_examples=60, deadline=None)
@given(data=st.data(), price=st.integers(0, 1000), path=st.sampled_from(Path))
def test_worker_and_backbone_build_identical_signed_receipts(model, data, price, path):
    """For random requests the worker's receipt (from its reply) and the backbone's (from the bytes it got) are the same
    body, its reply size is the real reply's length, and the worker's batch signature, asked for after the reply,
    verifies it; only then does the receipt reach the worker's ledger."""
    cfg = model.cfg
    req = data.draw(dispatches(cfg.n_layer, cfg.n_embd, wire.model_id_of(bytes.fromhex(model.digest))))
    worker_id, backbone_id = Identity.generate(), Identity.generate()
    ledger = Captured()
    worker = Worker(worker_id, ExpertStore(model), price=price, path_of=lambda peer: path, ledger=ledger)
    try:
        request = req.encode()
        raw, answer = asyncio.run(serve_and_sign(worker, backbone_id, request))
    finally:
        worker.close()
    mine, stamp = ledger.last
    reply = wire.decode(raw)
    assert isinstance(reply, wire.DispatchReply) and isinstance(answer, wire.ReceiptBatch)
    theirs = build_receipt(
        request,
        wire.decode(request),
        reply,
        backbone=str(backbone_id.peer_id),
        worker=str(worker_id.peer_id),
        model_digest=model.digest,
        n_embd=cfg.n_embd,
        n_ff_exp=cfg.n_ff_exp,
        path=path,
        price=price,
        issued_at_us=decode_issued(reply.receipt),
    )
    assert theirs.body() == mine.body()
    assert all(type(getattr(mine, f.name)) in (int, str, tuple) for f in dataclasses.fields(Receipt))  # the ledger's exact types
    assert theirs.bytes_out == len(raw)
    verify(theirs, stamp)


REQUEST = wire.DispatchRequest(b"\1" * 16, b"\2" * 16, 0, Codec.F32, 1, 2, (3, -1), (1.0, 0.0), b"\0" * 256)
REPLY = wire.DispatchReply(REQUEST.dispatch_id, Codec.F32, 1, b"\0" * 256, 10)


def receipt_of(worker: Identity, path: Path, price: int = 3) -> Receipt:
    return build_receipt(
        REQUEST.encode(),
        REQUEST,
        REPLY,
        backbone=str(Identity.generate().peer_id),
        worker=str(worker.peer_id),
        model_digest="ab" * 32,
        n_embd=64,
        n_ff_exp=32,
        path=path,
        price=price,
        issued_at_us=5,
    )


def test_path_of_an_address_and_the_receipt_text():
    """A relay's virtual address means RELAY, an IP address DIRECT, no connection RELAY; a receipt holds the plain text."""
    assert Path.of_address(virtual_address(Identity.generate().peer_id)) is Path.RELAY
    assert Path.of_address(("127.0.0.1", 4433)) is Path.DIRECT
    assert Path.of_address(None) is Path.RELAY
    assert Path.DIRECT.other is Path.RELAY and Path.RELAY.other is Path.DIRECT
    receipt = receipt_of(Identity.generate(), Path.RELAY)
    assert b'"path":"relay"' in receipt.body() and type(receipt.path) is str  # the ledger takes exact str fields
