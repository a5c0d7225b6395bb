"""`moeswarm fetch`, the asyncio edge: find a model's slice holders on the DHT and fetch from several at once.

What to ask whom and whether an answer is the model's is decided in :mod:`experts.slice_fetch`; this module moves
the bytes. A :class:`FetchSession` holds a DHT client and one QUIC endpoint under a throwaway identity (authenticated
like a backbone's) with the backbone's connector (:mod:`node.outbound`): a holder that announces a direct address is
dialled, a NAT-bound one is reached through its relay and hole-punched to a direct path where its NAT allows. The
session asks each holder for its SliceInfo, then ``PER_HOLDER`` lanes per holder pull experts piece by piece until
every expert is verified and staged. `moeswarm join --fetch` uses the same session to learn the model's shape and the
swarm's coverage before it chooses what to fetch.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from experts.errors import MoeSwarmError, SliceError
from experts.gguf_model import ExpertRange
from experts.parts import TOKENIZER_ITEM, Part
from experts.slice_fetch import ExpertRows, FetchPlan, Holder, OutsideModel, SliceLayout, Staging
from node.backbone.routing import Host
from node.outbound import connector_on
from p2p.connector import Connector
from p2p.dht.kademlia import LibP2PDiscovery
from p2p.dht.records import HostRecord
from p2p.identity import Identity
from p2p.pathkind import Path as PathKind
from p2p.quic.endpoint import Endpoint
from p2p.quic.errors import TransportError
from p2p.wire import messages as wire
from relay.client import RelaySettings

log = structlog.get_logger("node.fetch")
PER_HOLDER = 2  # experts asked of one holder at once (a worker admits 4 piece requests per peer by default)
BUSY_BACKOFF_S = 0.5  # after an OVERLOADED answer, before asking that holder again
# Records exist per MoE layer; a dense or head fetch also asks the holders of the first layers, since any worker
# holding the full model serves every whole tensor whatever layers it hosts.
WHOLE_LOOKUP_LAYERS = range(4)


@dataclass(frozen=True)
class FetchOptions:
    model_digest: str
    layers: range  # a head fetch: ignored
    experts: ExpertRange | None  # None for a dense or head fetch
    out: Path
    bootstrap: Sequence[str]
    dht_listen: str = "127.0.0.1:0"
    listen: tuple[str, int] = ("127.0.0.1", 0)
    max_datagram: int = 1200
    timeout: float = 30.0  # seconds one piece may take
    per_holder: int = PER_HOLDER
    relay: RelaySettings = RelaySettings()  # how links to NAT-bound holders' relays trust wss:// and keep alive
    part: Part = Part.EXPERTS

    @property
    def lookup_layers(self) -> list[int]:
        """The layers whose records name the holders to ask."""
        if self.part is Part.EXPERTS:
            return list(self.layers)
        return sorted(set(WHOLE_LOOKUP_LAYERS) | (set(self.layers) if self.part is Part.DENSE else set()))

    def describe(self) -> str:
        if self.part is Part.HEAD:
            return "the head"
        return f"{'dense weights of ' if self.part is Part.DENSE else ''}layers {self.layers.start}-{self.layers.stop - 1}"


@dataclass
class FetchResult:
    out: Path
    total_bytes: int
    fetched_bytes: int  # verified bytes received this run
    resumed_bytes: int  # verified bytes found staged by an earlier, interrupted run
    seconds: float  # the whole fetch: DHT lookups, SliceInfo, pieces, the write
    transfer_seconds: float  # from the first piece request to the last expert verified
    by_holder: dict[str, int] = field(default_factory=dict)
    by_path: dict[str, dict[str, int]] = field(default_factory=dict)  # holder -> "direct"/"relay" -> verified bytes
    dropped: dict[str, str] = field(default_factory=dict)


class _Busy(MoeSwarmError):
    """The holder answered OVERLOADED: ask again later, no strike."""


class _Refused(MoeSwarmError):
    """The holder answered with an error reply."""


def slice_holders(found: Iterable[list[HostRecord]]) -> dict[str, Host]:
    """The hosts among *found* (lookups' records) that serve slices, by peer id: dialled directly or via their relay."""
    holders = {}
    for records in found:
        for r in records:
            if r.hosted.serves_slices and (host := Host.from_record(r)) is not None:
                holders[str(r.peer_id)] = host
    return holders


class FetchSession:
    """A DHT client and an endpoint with a connector, for lookups and requests to slice holders (``async with``)."""

    def __init__(self, identity: Identity, bootstrap: Sequence[str], *, dht_listen: str = "127.0.0.1:0", listen: tuple[str, int] = ("127.0.0.1", 0), max_datagram: int = 1200, relay: RelaySettings = RelaySettings()) -> None:
        self.identity, self.bootstrap, self.dht_listen, self.listen, self.max_datagram, self.relay = identity, bootstrap, dht_listen, listen, max_datagram, relay
        self._stack = contextlib.AsyncExitStack()

    @classmethod
    def for_options(cls, identity: Identity, opts: FetchOptions) -> FetchSession:
        return cls(identity, opts.bootstrap, dht_listen=opts.dht_listen, listen=opts.listen, max_datagram=opts.max_datagram, relay=opts.relay)

    async def __aenter__(self) -> FetchSession:
        stack = self._stack
        try:
            self.dht = await stack.enter_async_context(LibP2PDiscovery(self.identity, listen=self.dht_listen, bootstrap=self.bootstrap, client_mode=True))
            self.endpoint = await Endpoint.bind(self.identity, self.listen[0], self.listen[1], handler=None, max_datagram_size=self.max_datagram)
            stack.push_async_callback(self.endpoint.close)
            self.connector: Connector = await stack.enter_async_context(connector_on(self.identity, self.endpoint, self.dht, self.relay))
        except BaseException:
            await stack.aclose()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._stack.aclose()

    async def lookup(self, digest: str, layers: Iterable[int]) -> list[list[HostRecord]]:
        """The DHT's records of *digest* for each of *layers*, in order."""
        return list(await asyncio.gather(*(self.dht.lookup(digest, layer) for layer in layers)))

    async def ask(self, host: Host, msg: wire.SliceInfoRequest | wire.PieceRequest, timeout: float) -> tuple[wire.Message, PathKind]:
        """*host*'s answer to *msg* and the path it came on; _Busy or _Refused for an error reply."""
        reply = await self.connector.request(host.peer_id, host.addr, host.relay, msg.encode(), timeout=timeout)
        answer = wire.decode(reply.data)
        if isinstance(answer, wire.ErrorReply):
            if answer.code is wire.ErrorCode.OVERLOADED:
                raise _Busy(answer.message)
            raise _Refused(f"{answer.code.name}: {answer.message}")
        return answer, reply.path

    async def manifest(self, digest: str, holders: dict[str, Host], timeout: float = 30.0) -> SliceLayout:
        """The whole model's layout from the first of *holders* whose manifest hashes to *digest* (asked one at a
        time: one good answer is enough); SliceError if none does."""
        for peer, host in holders.items():
            try:
                answer, _ = await self.ask(host, wire.SliceInfoRequest(wire.model_id_of(bytes.fromhex(digest))), timeout)
                if isinstance(answer, wire.SliceInfo):
                    return SliceLayout.whole(digest, answer.manifest)
                reason = f"answered with {type(answer).__name__}"
            except MoeSwarmError as exc:  # unreachable, an error reply, a malformed or forged manifest
                reason = str(exc)
            log.warning("fetch.holder_skipped", peer=peer, reason=reason)
        raise SliceError(f"no holder answered with the manifest of model {digest[:16]}... ({len(holders)} asked)")

    async def fetch(self, opts: FetchOptions, progress: Callable[[int, int], None] | None = None) -> FetchResult:
        """Fetch the slice into ``opts.out`` (resuming from ``OUT.parts/``); SliceError if no set of holders covers it."""
        t0 = time.perf_counter()
        peers = slice_holders(await self.lookup(opts.model_digest, opts.lookup_layers))
        if not peers:
            raise SliceError(f"no worker on the DHT serves slices of model {opts.model_digest[:16]}... for {opts.describe()}")
        fetch = _Fetch(self, opts, peers, progress)
        layout, infos = await fetch.layout()
        items = layout.items()
        staging = Staging(opts.out.with_name(opts.out.name + ".parts"))
        done = await asyncio.to_thread(staging.verified, items)
        plan = FetchPlan(items, done=set(done))
        resumed = plan.done_bytes
        log.info("fetch.started", model=opts.model_digest[:16], holders=len(infos), experts=len(items), total_mb=round(plan.total_bytes / 1e6, 2), resumed_mb=round(resumed / 1e6, 2))
        for peer, (info, whole) in infos.items():
            plan.add_holder(Holder(peer, range(*info.layers), range(*info.experts), whole=whole))
        if progress:
            progress(plan.done_bytes, plan.total_bytes)
        t_transfer = time.perf_counter()
        await asyncio.gather(*(fetch.lane(peer, plan, staging) for peer in list(plan.holders) for _ in range(opts.per_holder)))
        if not plan.finished:
            missing = plan.stuck()
            what = (f"tensor {missing.name}" if missing.whole else f"expert {missing.expert} of {missing.name}") if missing else "some experts"
            raise SliceError(f"no live holder serves {what}; dropped holders: {plan.dropped or 'none'}. Run fetch again to resume")
        transfer = time.perf_counter() - t_transfer
        await asyncio.to_thread(layout.write, opts.out, staging)
        staging.remove()
        by_holder = {peer: sum(paths.values()) for peer, paths in fetch.by_path.items()}
        result = FetchResult(opts.out, plan.total_bytes, plan.fetched_bytes, resumed, time.perf_counter() - t0, transfer, by_holder, fetch.by_path, plan.dropped)
        log.info("fetch.done", out=str(opts.out), fetched_mb=round(result.fetched_bytes / 1e6, 2), resumed_mb=round(resumed / 1e6, 2), holders=len(by_holder), dropped=len(result.dropped), seconds=round(result.seconds, 2))
        return result


class _Fetch:
    """One fetch over one session: SliceInfo from every holder, then the lanes."""

    def __init__(self, session: FetchSession, opts: FetchOptions, peers: dict[str, Host], progress: Callable[[int, int], None] | None) -> None:
        self.session, self.opts, self.peers, self.progress = session, opts, peers, progress
        self.model_id = wire.model_id_of(bytes.fromhex(opts.model_digest))
        self.changed = asyncio.Condition()
        self.by_path: dict[str, dict[str, int]] = {}

    async def ask(self, peer: str, msg: wire.SliceInfoRequest | wire.PieceRequest) -> tuple[wire.Message, PathKind]:
        return await self.session.ask(self.peers[peer], msg, self.opts.timeout)

    async def layout(self) -> tuple[SliceLayout, dict[str, tuple[wire.SliceInfo, frozenset[str]]]]:
        """The layout from the first manifest that hashes to the digest, and the holders whose info checks out (each
        with the whole tensors it advertises that the slice needs)."""
        peers = list(self.peers)
        answers = await asyncio.gather(*(self.ask(p, wire.SliceInfoRequest(self.model_id)) for p in peers), return_exceptions=True)
        infos: dict[str, tuple[wire.SliceInfo, frozenset[str]]] = {}
        layout = None
        for peer, asked in zip(peers, answers, strict=True):
            answer = asked[0] if isinstance(asked, tuple) else asked
            if not isinstance(answer, wire.SliceInfo):
                log.warning("fetch.holder_skipped", peer=peer, reason=repr(answer))
                continue
            if layout is None:
                try:
                    layout = SliceLayout.from_manifest(self.opts.model_digest, answer.manifest, self.opts.layers, self.opts.experts, self.opts.part)
                except OutsideModel:
                    raise  # the request is wrong, not the holder (its manifest is the digest's)
                except SliceError as exc:
                    log.warning("fetch.holder_dropped", peer=peer, reason=str(exc))
                    continue
            elif answer.manifest != tuple(layout.manifest):
                log.warning("fetch.holder_dropped", peer=peer, reason="its manifest is not the model's")
                continue
            wanted = [(name, leaves) for name, leaves in answer.leaves if name in layout.names or (name == TOKENIZER_ITEM and layout.part is Part.HEAD)]
            if all(layout.accept_leaves(name, leaves) for name, leaves in wanted):
                infos[peer] = (answer, frozenset(name for name, _ in wanted) if layout.part is not Part.EXPERTS else frozenset())
            else:
                log.warning("fetch.holder_dropped", peer=peer, reason="its leaves do not hash to the model's manifest")
        if layout is None:
            raise SliceError(f"no holder answered with the manifest of model {self.opts.model_digest[:16]}... ({len(peers)} asked)")
        return layout, infos

    async def rows(self, peer: str, item: ExpertRows) -> tuple[bytes, PathKind]:
        """The expert's bytes from *peer*, and the path its last piece came on."""
        parts, offset, path = [], 0, PathKind.DIRECT
        while offset < item.nbytes:
            reply, path = await self.ask(peer, wire.PieceRequest(self.model_id, item.name, item.expert, offset, min(wire.MAX_PIECE, item.nbytes - offset)))
            if not isinstance(reply, wire.Piece) or reply.offset != offset:
                raise wire.InvalidField("type", f"answered a piece request with {type(reply).__name__}")
            parts.append(reply.data)
            offset += len(reply.data)
        return b"".join(parts), path

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
                data, path = await self.rows(peer, item)
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
                    paths = self.by_path.setdefault(peer, {})
                    paths[path.value] = paths.get(path.value, 0) + len(data)
                    if self.progress:
                        self.progress(plan.done_bytes, plan.total_bytes)
            async with self.changed:
                self.changed.notify_all()


async def fetch_slice(identity: Identity, opts: FetchOptions, progress: Callable[[int, int], None] | None = None) -> FetchResult:
    """`moeswarm fetch`: one session, one slice (see :meth:`FetchSession.fetch`)."""
    async with FetchSession.for_options(identity, opts) as session:
        return await session.fetch(opts, progress)
