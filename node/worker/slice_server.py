"""A worker's slice serving: the original quantized bytes of the experts it hosts, to peers fetching a slice.

A fetcher asks once for :class:`p2p.wire.messages.SliceInfo` (the model's manifest and the hosted tensors' per-expert leaves)
and then for byte ranges of single experts (``PieceRequest``, at most ``wire.MAX_PIECE`` each). A file that holds
whole tensors (the full model, or a dense or head slice) serves them too, as "expert 0" of their name, and the
tokenizer keys as the blob ``@tokenizer``: its SliceInfo lists each with one leaf, the manifest's hash, which is how
it advertises them for `moeswarm fetch --dense/--head`. The worker proves nothing here: the fetcher checks the
manifest against the model digest and every expert or tensor against its hash.

Limits, so a fetch cannot starve dispatches or memory: a global and a per-peer byte rate (token buckets; a request
beyond the rate waits for its tokens, it is not refused), and caps on the piece requests in flight, globally and per
peer (past them: OVERLOADED). A piece is read from the memory map only after its wait, so what the worker holds for
fetchers is at most ``max_in_flight x MAX_PIECE`` bytes of replies being handed to QUIC.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import structlog

from experts.gguf_model import GGUFModel
from experts.parts import TOKENIZER_ITEM, TOKENIZER_PREFIX, Part, is_expert_tensor, parse_manifest
from p2p.identity import PeerId
from p2p.ratelimit import TokenBucket
from p2p.wire import messages as wire

log = structlog.get_logger("node.worker.slice_server")
MAX_PEERS = 4096  # per-peer buckets remembered (a flood of identities cannot grow them)


@dataclass(frozen=True)
class SliceLimits:
    """What fetchers may take of a serving worker (bytes per second; pieces in flight)."""

    rate: float = 64e6  # all fetchers together
    rate_per_peer: float = 32e6
    max_in_flight: int = 16
    max_in_flight_per_peer: int = 4


class SliceRefused(wire.ProtocolError):
    error_code = wire.ErrorCode.NOT_HOSTED


class SliceBusy(wire.ProtocolError):
    error_code = wire.ErrorCode.OVERLOADED


class SliceServer:
    """Answers SliceInfoRequest and PieceRequest for the hosted (layers x experts) of *model* (a full model or a slice)."""

    def __init__(self, model: GGUFModel, layers: range, experts: range, limits: SliceLimits = SliceLimits()) -> None:
        self.model, self.limits = model, limits
        self.layers, self.experts = layers, experts
        self._model_id = wire.model_id_of(bytes.fromhex(model.digest))
        self._tensors = {name for i in layers if model.cfg.is_moe(i) for name in model.expert_tensors(i)}
        self._whole = self._whole_tensors(model)
        self._info: wire.SliceInfo | None = None
        now = time.monotonic()
        self._global = TokenBucket.full(limits.rate, limits.rate, now)  # a second's worth saved up, at most
        self._peers: dict[PeerId, TokenBucket] = {}
        self._in_flight: dict[PeerId, int] = {}
        self.bytes_served = 0

    @staticmethod
    def _whole_tensors(model: GGUFModel) -> set[str]:
        """What *model*'s file holds whole: every tensor that is not stacked by expert, and the tokenizer blob where
        the file has the keys (an expert slice holds neither)."""
        if model.kind is Part.EXPERTS:
            return set()
        names = {n for n in model.tensors if not is_expert_tensor(n)}
        if any(k.startswith(TOKENIZER_PREFIX) for k in model.reader.fields):
            names.add(TOKENIZER_ITEM)
        return names

    def info(self, req: wire.SliceInfoRequest) -> wire.SliceInfo:
        self._check_model(req.model_id)
        if self._info is None:  # built once: the manifest reads every tensor's hash (cached beside the file)
            source = self.model.slice  # a slice file carries its model's manifest and leaves
            manifest = source.manifest if source else self.model.manifest
            leaves = source.leaves if source else self.model.leaves
            parsed = parse_manifest(manifest)
            hashes = {name: line.sha256 for name, line in parsed.tensors.items()} | {TOKENIZER_ITEM: parsed.tokenizer_sha256}
            self._info = wire.SliceInfo(
                (self.layers.start, self.layers.stop),
                (self.experts.start, self.experts.stop),
                tuple(manifest),
                tuple((name, tuple(leaves[name])) for name in sorted(self._tensors))
                + tuple((name, (hashes[name],)) for name in sorted(self._whole) if name in hashes),
            )
        return self._info

    def _bytes(self, req: wire.PieceRequest):
        """The expert's rows, or the whole tensor (or tokenizer blob) *req* names, as a zero-copy buffer."""
        if req.name in self._whole:
            if req.expert != 0:
                raise wire.InvalidField("expert", f"{req.name} is served whole: ask for expert 0, not {req.expert}")
            return memoryview(self.model.tokenizer_blob) if req.name == TOKENIZER_ITEM else self.model.raw(req.name).reshape(-1)
        if req.name not in self._tensors:
            raise SliceRefused("name", f"tensor {req.name} is not a stacked expert tensor hosted here nor a tensor this file holds whole")
        if req.expert not in self.experts:
            raise SliceRefused("expert", f"expert {req.expert} is not hosted here (experts {self.experts.start}-{self.experts.stop - 1})")
        return self.model.expert_rows(req.name, req.expert)

    async def piece(self, peer: PeerId, req: wire.PieceRequest) -> wire.Piece:
        self._check_model(req.model_id)
        size = self._bytes(req).nbytes
        if req.offset >= size:
            raise wire.InvalidField("offset", f"{req.offset} is past the expert's {size} bytes")
        total = sum(self._in_flight.values())
        mine = self._in_flight.get(peer, 0)
        if mine >= self.limits.max_in_flight_per_peer:
            raise SliceBusy("type", f"{mine} of your piece requests are in flight here (the per-peer limit)")
        if total >= self.limits.max_in_flight:
            raise SliceBusy("type", f"{total} piece requests in flight (limit {self.limits.max_in_flight}); retry later or ask another holder")
        length = min(req.length, size - req.offset)
        self._in_flight[peer] = mine + 1
        try:
            now = time.monotonic()
            bucket = self._peers.pop(peer, None) or TokenBucket.full(self.limits.rate_per_peer, self.limits.rate_per_peer, now)
            self._peers[peer] = bucket  # most recent last: past MAX_PEERS the least recent is forgotten
            if len(self._peers) > MAX_PEERS:
                del self._peers[next(iter(self._peers))]
            delay = max(bucket.borrow(length, now), self._global.borrow(length, now))
            if delay:
                await asyncio.sleep(delay)
            rows = self._bytes(req)
            data = await asyncio.to_thread(lambda: bytes(rows[req.offset : req.offset + length]))  # a page-in may hit the disk
        finally:
            if (left := self._in_flight.pop(peer) - 1) > 0:
                self._in_flight[peer] = left
        self.bytes_served += length
        log.debug("slice.piece_served", peer=str(peer), tensor=req.name, expert=req.expert, offset=req.offset, length=length)
        return wire.Piece(req.offset, data)

    def _check_model(self, model_id: bytes) -> None:
        if model_id != self._model_id:
            raise SliceRefused("model_id", f"this worker serves slices of model {self.model.digest[:16]}..., not {model_id.hex()[:16]}...")
