"""A worker's slice serving: the original quantized bytes of the experts it hosts, to peers fetching a slice.

A fetcher asks once for :class:`p2p.wire.SliceInfo` (the model's manifest and the hosted tensors' per-expert leaves)
and then for byte ranges of single experts (``PieceRequest``, at most ``wire.MAX_PIECE`` each). The worker proves
nothing here: the fetcher checks the manifest against the model digest and every expert against its leaf.

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
from p2p import wire
from p2p.identity import PeerId
from p2p.ratelimit import TokenBucket

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
        self._info: wire.SliceInfo | None = None
        now = time.monotonic()
        self._global = TokenBucket.full(limits.rate, limits.rate, now)  # a second's worth saved up, at most
        self._peers: dict[PeerId, TokenBucket] = {}
        self._in_flight: dict[PeerId, int] = {}
        self.bytes_served = 0

    def info(self, req: wire.SliceInfoRequest) -> wire.SliceInfo:
        self._check_model(req.model_id)
        if self._info is None:  # built once: the manifest reads every tensor's hash (cached beside the file)
            source = self.model.slice  # a slice file carries its model's manifest and leaves
            manifest = source.manifest if source else self.model.manifest
            leaves = source.leaves if source else self.model.leaves
            self._info = wire.SliceInfo(
                (self.layers.start, self.layers.stop),
                (self.experts.start, self.experts.stop),
                tuple(manifest),
                tuple((name, tuple(leaves[name])) for name in sorted(self._tensors)),
            )
        return self._info

    async def piece(self, peer: PeerId, req: wire.PieceRequest) -> wire.Piece:
        self._check_model(req.model_id)
        if req.name not in self._tensors:
            raise SliceRefused("name", f"tensor {req.name} is not a stacked expert tensor hosted here")
        if req.expert not in self.experts:
            raise SliceRefused("expert", f"expert {req.expert} is not hosted here (experts {self.experts.start}-{self.experts.stop - 1})")
        size = self.model.expert_rows(req.name, req.expert).nbytes
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
            rows = self.model.expert_rows(req.name, req.expert)
            data = await asyncio.to_thread(lambda: rows[req.offset : req.offset + length].tobytes())  # a page-in may hit the disk
        finally:
            if (left := self._in_flight.pop(peer) - 1) > 0:
                self._in_flight[peer] = left
        self.bytes_served += length
        log.debug("slice.piece_served", peer=str(peer), tensor=req.name, expert=req.expert, offset=req.offset, length=length)
        return wire.Piece(req.offset, data)

    def _check_model(self, model_id: bytes) -> None:
        if model_id != self._model_id:
            raise SliceRefused("model_id", f"this worker serves slices of model {self.model.digest[:16]}..., not {model_id.hex()[:16]}...")
