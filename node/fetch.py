"""`moeswarm fetch`, the asyncio edge: find a model's slice holders on the DHT and fetch from several at once.

What to ask whom and whether an answer is the model's is decided in :mod:`experts.slice_fetch`; this module moves
the bytes: a throwaway DHT client finds the workers whose records say they serve slices, one QUIC client endpoint
(a throwaway identity, authenticated like a backbone's) asks each for its SliceInfo, then ``PER_HOLDER`` lanes per
holder pull experts piece by piece until every expert is verified and staged.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from experts.errors import MoeSwarmError, SliceError
from experts.gguf_model import ExpertRange
from experts.slice_fetch import ExpertRows, FetchPlan, Holder, OutsideModel, SliceLayout, Staging
from p2p import wire
from p2p.dht import LibP2PDiscovery
from p2p.identity import Identity, PeerId
from p2p.quic import Endpoint
from p2p.quic_errors import Address, TransportError

log = structlog.get_logger("node.fetch")
PER_HOLDER = 2  # experts asked of one holder at once (a worker admits 4 piece requests per peer by default)
BUSY_BACKOFF_S = 0.5  # after an OVERLOADED answer, before asking that holder again


@dataclass(frozen=True)
class FetchOptions:
    model_digest: str
    layers: range
    experts: ExpertRange
    out: Path
    bootstrap: Sequence[str]
    dht_listen: str = "127.0.0.1:0"
    listen: tuple[str, int] = ("127.0.0.1", 0)
    max_datagram: int = 1200
    timeout: float = 30.0  # seconds one piece may take
    per_holder: int = PER_HOLDER


@dataclass
class FetchResult:
    out: Path
    total_bytes: int
    fetched_bytes: int  # verified bytes received this run
    resumed_bytes: int  # verified bytes found staged by an earlier, interrupted run
    seconds: float  # the whole fetch: DHT lookups, SliceInfo, pieces, the write
    transfer_seconds: float  # from the first piece request to the last expert verified
    by_holder: dict[str, int] = field(default_factory=dict)
    dropped: dict[str, str] = field(default_factory=dict)


class _Busy(MoeSwarmError):
    """The holder answered OVERLOADED: ask again later, no strike."""


class _Refused(MoeSwarmError):
    """The holder answered with an error reply."""


@dataclass(frozen=True)
class _Peer:
    peer_id: PeerId
    addr: Address


async def find_holders(identity: Identity, opts: FetchOptions) -> dict[str, _Peer]:
    """Workers whose records say they serve slices of the model, for any layer of the range (direct address only)."""
    async with LibP2PDiscovery(identity, listen=opts.dht_listen, bootstrap=opts.bootstrap, client_mode=True) as dht:
        found = await asyncio.gather(*(dht.lookup(opts.model_digest, layer) for layer in opts.layers))
    holders = {}
    for records in found:
        for r in records:
            if r.hosted.serves_slices and r.hosted.quic_addr is not None:
                host, _, port = r.hosted.quic_addr.rpartition(":")
                holders[str(r.peer_id)] = _Peer(r.peer_id, (host.strip("[]"), int(port)))
    return holders


class _Fetch:
    """One fetch over one endpoint: SliceInfo from every holder, then the lanes."""

    def __init__(self, endpoint: Endpoint, opts: FetchOptions, peers: dict[str, _Peer], progress: Callable[[int, int], None] | None) -> None:
        self.endpoint, self.opts, self.peers, self.progress = endpoint, opts, peers, progress
        self.model_id = wire.model_id_of(bytes.fromhex(opts.model_digest))
        self.changed = asyncio.Condition()
        self.by_holder: dict[str, int] = {}

    async def ask(self, peer: str, msg: wire.SliceInfoRequest | wire.PieceRequest) -> wire.Message:
        p = self.peers[peer]
        reply = wire.decode(await self.endpoint.request(p.addr, p.peer_id, msg.encode(), timeout=self.opts.timeout))
        if isinstance(reply, wire.ErrorReply):
            if reply.code is wire.ErrorCode.OVERLOADED:
                raise _Busy(reply.message)
            raise _Refused(f"{reply.code.name}: {reply.message}")
        return reply

    async def layout(self) -> tuple[SliceLayout, dict[str, wire.SliceInfo]]:
        """The layout from the first manifest that hashes to the digest, and the holders whose info checks out."""
        peers = list(self.peers)
        answers = await asyncio.gather(*(self.ask(p, wire.SliceInfoRequest(self.model_id)) for p in peers), return_exceptions=True)
        infos: dict[str, wire.SliceInfo] = {}
        layout = None
        for peer, answer in zip(peers, answers, strict=True):
            if not isinstance(answer, wire.SliceInfo):
                log.warning("fetch.holder_skipped", peer=peer, reason=repr(answer))
                continue
            if layout is None:
                try:
                    layout = SliceLayout.from_manifest(self.opts.model_digest, answer.manifest, self.opts.layers, self.opts.experts)
                except OutsideModel:
                    raise  # the request is wrong, not the holder (its manifest is the digest's)
                except SliceError as exc:
                    log.warning("fetch.holder_dropped", peer=peer, reason=str(exc))
                    continue
            elif answer.manifest != tuple(layout.manifest):
                log.warning("fetch.holder_dropped", peer=peer, reason="its manifest is not the model's")
                continue
            if all(layout.accept_leaves(name, leaves) for name, leaves in answer.leaves if name in layout.names):
                infos[peer] = answer
            else:
                log.warning("fetch.holder_dropped", peer=peer, reason="its leaves do not hash to the model's manifest")
        if layout is None:
            raise SliceError(f"no holder answered with the manifest of model {self.opts.model_digest[:16]}... ({len(peers)} asked)")
        return layout, infos

    async def rows(self, peer: str, item: ExpertRows) -> bytes:
        parts, offset = [], 0
        while offset < item.nbytes:
            reply = await self.ask(peer, wire.PieceRequest(self.model_id, item.name, item.expert, offset, min(wire.MAX_PIECE, item.nbytes - offset)))
            if not isinstance(reply, wire.Piece) or reply.offset != offset:
                raise wire.InvalidField("type", f"answered a piece request with {type(reply).__name__}")
            parts.append(reply.data)
            offset += len(reply.data)
        return b"".join(parts)

    async def lane(self, peer: str, plan: FetchPlan, staging: Staging) -> None:
        while not plan.finished:
            item = plan.take(peer)
            if item is None:
                if not plan.could_serve(peer):
                    return
                async with self.changed:
                    try:
                        await asyncio.wait_for(self.changed.wait(), 0.5)  # another lane's failure may free work for us
                    except TimeoutError:
                        pass
                continue
            try:
                data = await self.rows(peer, item)
            except _Busy as exc:
                plan.failed(peer, item, str(exc), strike=False)
                await asyncio.sleep(BUSY_BACKOFF_S)
            except (TransportError, _Refused) as exc:
                plan.failed(peer, item, str(exc))
            except wire.ProtocolError as exc:
                plan.drop(peer, f"sent a malformed reply: {exc}")
            else:
                if plan.received(peer, item, data):
                    await asyncio.to_thread(staging.write, item, data)
                    self.by_holder[peer] = self.by_holder.get(peer, 0) + len(data)
                    if self.progress:
                        self.progress(plan.done_bytes, plan.total_bytes)
            async with self.changed:
                self.changed.notify_all()


async def fetch_slice(identity: Identity, opts: FetchOptions, progress: Callable[[int, int], None] | None = None) -> FetchResult:
    """Fetch the slice into ``opts.out`` (resuming from ``OUT.parts/``); SliceError if no set of holders covers it."""
    t0 = time.perf_counter()
    peers = await find_holders(identity, opts)
    if not peers:
        raise SliceError(f"no worker on the DHT serves slices of model {opts.model_digest[:16]}... for layers {opts.layers.start}-{opts.layers.stop - 1}")
    endpoint = await Endpoint.bind(identity, opts.listen[0], opts.listen[1], handler=None, max_datagram_size=opts.max_datagram)
    try:
        fetch = _Fetch(endpoint, opts, peers, progress)
        layout, infos = await fetch.layout()
        items = layout.items()
        staging = Staging(opts.out.with_name(opts.out.name + ".parts"))
        done = await asyncio.to_thread(staging.verified, items)
        plan = FetchPlan(items, done=set(done))
        resumed = plan.done_bytes
        log.info("fetch.started", model=opts.model_digest[:16], holders=len(infos), experts=len(items), total_mb=round(plan.total_bytes / 1e6, 2), resumed_mb=round(resumed / 1e6, 2))
        for peer, info in infos.items():
            plan.add_holder(Holder(peer, range(*info.layers), range(*info.experts)))
        if progress:
            progress(plan.done_bytes, plan.total_bytes)
        t_transfer = time.perf_counter()
        await asyncio.gather(*(fetch.lane(peer, plan, staging) for peer in list(plan.holders) for _ in range(opts.per_holder)))
        if not plan.finished:
            missing = plan.stuck()
            what = f"expert {missing.expert} of {missing.name}" if missing else "some experts"
            raise SliceError(f"no live holder serves {what}; dropped holders: {plan.dropped or 'none'}. Run fetch again to resume")
        transfer = time.perf_counter() - t_transfer
        await asyncio.to_thread(layout.write, opts.out, staging)
        staging.remove()
    finally:
        await endpoint.close()
    result = FetchResult(opts.out, plan.total_bytes, plan.fetched_bytes, resumed, time.perf_counter() - t0, transfer, fetch.by_holder, plan.dropped)
    log.info("fetch.done", out=str(opts.out), fetched_mb=round(result.fetched_bytes / 1e6, 2), resumed_mb=round(resumed / 1e6, 2), holders=len(result.by_holder), dropped=len(result.dropped), seconds=round(result.seconds, 2))
    return result
