"""A worker's slice serving, without sockets: what it answers, what it refuses, how it paces and caps fetchers."""

from __future__ import annotations

import asyncio
import functools

import pytest

from experts.embedded import EMBEDDED_MODEL
from experts.gguf_model import ExpertRange, GGUFModel, model_digest
from experts.parts import TOKENIZER_ITEM, is_expert_tensor, parse_manifest
from experts.slices import ExpertStore, write_slice
from node.worker.service import Worker
from node.worker.slice_server import SliceBusy, SliceLimits, SliceRefused, SliceServer
from p2p.identity import Identity
from p2p.wire import messages as wire

MODEL = GGUFModel(EMBEDDED_MODEL)
MID = wire.model_id_of(bytes.fromhex(MODEL.digest))
UP = "blk.1.ffn_up_exps.weight"
PEER = Identity.generate().peer_id


def on_loop(test):
    """Run an async test body on a fresh event loop (the suite's way: asyncio.run, no plugin)."""

    @functools.wraps(test)
    def run(*args, **kwargs):
        return asyncio.run(test(*args, **kwargs))

    return run


def server(**limits) -> SliceServer:
    return SliceServer(MODEL, range(1, 3), range(4, 8), SliceLimits(**limits))


def test_info_names_the_hosted_part_and_proves_nothing_itself():
    """The info carries the model's manifest (it hashes to the digest), the leaves of the hosted expert tensors only,
    and (the full file holds them) every whole tensor and the tokenizer blob with its one manifest hash."""
    info = server().info(wire.SliceInfoRequest(MID))
    assert (info.layers, info.experts) == ((1, 3), (4, 8))
    assert model_digest(list(info.manifest)) == MODEL.digest
    stacked = {name for name, leaves in info.leaves if name in MODEL.leaves}
    assert stacked == {n for i in (1, 2) for n in MODEL.expert_tensors(i)}
    assert dict(info.leaves)[UP] == tuple(MODEL.leaves[UP])
    lines = parse_manifest(list(info.manifest))
    whole = {name: leaves for name, leaves in info.leaves if name not in MODEL.leaves}
    assert set(whole) == {n for n in MODEL.tensors if not is_expert_tensor(n)} | {TOKENIZER_ITEM}
    assert whole["token_embd.weight"] == (lines.tensors["token_embd.weight"].sha256,)
    assert whole[TOKENIZER_ITEM] == (lines.tokenizer_sha256,)


def test_a_slice_file_serves_its_model_manifest(tmp_path):
    """A worker started from a slice answers with the full model's manifest, not the slice file's own tensors."""
    sl = GGUFModel(write_slice(MODEL, range(1, 3), ExpertRange(4, 8), tmp_path / "s.gguf"))
    info = SliceServer(sl, range(1, 3), range(4, 8)).info(wire.SliceInfoRequest(MID))
    assert model_digest(list(info.manifest)) == MODEL.digest
    assert dict(info.leaves)[UP] == tuple(MODEL.leaves[UP])
    assert all(name in MODEL.leaves for name, _ in info.leaves)  # an expert slice holds no whole tensor


@on_loop
async def test_pieces_are_the_original_bytes():
    """Byte ranges of one expert, the last one cut at the expert's end."""
    s = server()
    rows = MODEL.expert_rows(UP, 5).tobytes()
    first = await s.piece(PEER, wire.PieceRequest(MID, UP, 5, 0, 1000))
    last = await s.piece(PEER, wire.PieceRequest(MID, UP, 5, 1000, wire.MAX_PIECE))
    assert first.data + last.data == rows and last.offset == 1000
    assert s.bytes_served == len(rows)


@on_loop
async def test_whole_tensors_and_the_tokenizer_blob_are_the_original_bytes(tmp_path):
    """A full file serves any non-expert tensor whole (as expert 0) and the tokenizer blob; an expert slice neither."""
    s = server()
    embd = MODEL.raw("token_embd.weight").tobytes()
    first = await s.piece(PEER, wire.PieceRequest(MID, "token_embd.weight", 0, 0, 4096))
    rest = await s.piece(PEER, wire.PieceRequest(MID, "token_embd.weight", 0, 4096, wire.MAX_PIECE))
    assert first.data + rest.data == embd
    blob = await s.piece(PEER, wire.PieceRequest(MID, TOKENIZER_ITEM, 0, 0, wire.MAX_PIECE))
    assert blob.data == MODEL.tokenizer_blob
    norm = await s.piece(PEER, wire.PieceRequest(MID, "blk.3.attn_norm.weight", 0, 0, wire.MAX_PIECE))  # not a hosted layer: the file has it
    assert norm.data == MODEL.raw("blk.3.attn_norm.weight").tobytes()
    sl = GGUFModel(write_slice(MODEL, range(1, 3), ExpertRange(4, 8), tmp_path / "s.gguf"))
    with pytest.raises(SliceRefused, match="nor a tensor this file holds whole"):
        await SliceServer(sl, range(1, 3), range(4, 8)).piece(PEER, wire.PieceRequest(MID, "token_embd.weight", 0, 0, 10))


@pytest.mark.parametrize(
    ("req", "match"),
    [
        (wire.PieceRequest(MID, "blk.0.ffn_up_exps.weight", 5, 0, 10), "not a stacked expert tensor hosted"),
        (wire.PieceRequest(MID, "token_embd.weight", 5, 0, 10), "served whole: ask for expert 0"),
        (wire.PieceRequest(MID, "blk.9.attn_norm.weight", 0, 0, 10), "nor a tensor this file holds whole"),
        (wire.PieceRequest(MID, UP, 8, 0, 10), "expert 8 is not hosted"),
        (wire.PieceRequest(bytes(16), UP, 5, 0, 10), "serves slices of model"),
        (wire.PieceRequest(MID, UP, 5, 1 << 30, 10), "past the expert"),
    ],
)
@on_loop
async def test_requests_outside_the_hosted_part_are_refused(req, match):
    with pytest.raises(wire.ProtocolError, match=match):
        await server().piece(PEER, req)


@on_loop
async def test_the_rate_paces_and_the_in_flight_caps_refuse():
    """Past the per-peer rate a request waits for its tokens; past the per-peer in-flight cap it is refused."""
    s = server(rate_per_peer=40_000.0, max_in_flight_per_peer=2)  # a 32 KiB expert at once, the next ~0.6 s later
    size = MODEL.expert_rows(UP, 4).nbytes
    first = asyncio.ensure_future(s.piece(PEER, wire.PieceRequest(MID, UP, 4, 0, size)))  # the burst: at once
    await asyncio.sleep(0)
    second = asyncio.ensure_future(s.piece(PEER, wire.PieceRequest(MID, UP, 5, 0, size)))  # waits for tokens
    await asyncio.sleep(0)
    with pytest.raises(SliceBusy, match="per-peer limit"):
        await s.piece(PEER, wire.PieceRequest(MID, UP, 6, 0, size))
    other = await s.piece(Identity.generate().peer_id, wire.PieceRequest(MID, UP, 6, 0, 10))  # its own budget
    assert len(other.data) == 10 and not second.done()
    assert len((await first).data) == size
    second.cancel()


@on_loop
async def test_a_worker_without_slice_serving_answers_not_hosted():
    """--no-serve-slices: the request gets an ErrorReply (NOT_HOSTED), never an exception; with it, the piece."""
    off = Worker(Identity.generate(), ExpertStore(MODEL, cache=False))
    on = Worker(Identity.generate(), ExpertStore(MODEL, cache=False), slices=server())
    try:
        reply = wire.decode(await off.handle(PEER, wire.SliceInfoRequest(MID).encode()))
        assert isinstance(reply, wire.ErrorReply) and reply.code is wire.ErrorCode.NOT_HOSTED
        piece = wire.decode(await on.handle(PEER, wire.PieceRequest(MID, UP, 4, 0, 16).encode()))
        assert isinstance(piece, wire.Piece) and piece.data == MODEL.expert_rows(UP, 4).tobytes()[:16]
        refused = wire.decode(await on.handle(PEER, wire.PieceRequest(MID, UP, 9, 0, 16).encode()))
        assert isinstance(refused, wire.ErrorReply) and refused.code is SliceRefused.error_code
    finally:
        off.close()
        on.close()
