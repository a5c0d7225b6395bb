"""The client of `--stages auto` (issue 26): stage records from the DHT, their round trips measured, a chain chosen.

A :class:`StagePlanner` runs on the client's event loop with its QUIC endpoint and DHT client. ``survey()`` looks
the model's stage records up (``LibP2PDiscovery.lookup_stages``: signed, this model's, within its trunk) and pings each
stage a few times over QUIC (a stage answers Ping): the least round trip is its estimate, and a stage that does not
answer, or answers as another peer, is left out. ``chain(wait_s)`` repeats that until :func:`choose_chain` finds a
chain covering every layer (stages announce asynchronously) or the wait is over (:class:`NoChain`, the caller falls
back to per-layer dispatch).

Its links are :class:`RemoteStage` s, called from the generation's thread; when one is lost (``StageLost``) the
chain calls :meth:`StagePlanner.replace` on that thread, which surveys again on the loop and takes the fastest other
stage running exactly the lost one's layers (the chain then replays the hop's inputs into it). Only stages that
announce a direct QUIC address are used: a stage reached through a relay is later work.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import structlog

from experts.gguf_model import GGUFModel
from experts.stage_forward import StageLink, StageLost
from node.backbone.options import BackboneOptions
from node.status.server import model_shape
from p2p.dht.kademlia import LibP2PDiscovery
from p2p.dht.stage_records import StageRecord
from p2p.identity import Identity
from p2p.quic.endpoint import Endpoint
from p2p.quic.errors import TransportError
from p2p.wire import messages as wire

from .chooser import HOP_MS, Candidate, NoChain, choose_chain, choose_replacement, estimated_ms
from .link import RemoteStage

log = structlog.get_logger("node.stage.client")
PINGS = 3  # per stage and survey: the least is its round trip (the first includes the QUIC handshake)
PING_TIMEOUT_S = 5.0
SURVEY_EVERY_S = 0.5  # between surveys while waiting for a chain


def parse_addr(quic_addr: str) -> tuple[str, int]:
    host, _, port = quic_addr.rpartition(":")
    return host.strip("[]"), int(port)


@dataclass
class StagePlanner:
    """Finds, measures and chooses stages of *model_digest* (a model of *n_layer* layers) for one client."""

    dht: LibP2PDiscovery
    endpoint: Endpoint
    model_digest: str
    n_layer: int
    hop_timeout: float = 30.0  # a pass's deadline at one stage before it counts as lost
    hop_ms: float = HOP_MS
    pings: int = PINGS
    clock: Callable[[], float] = time.perf_counter
    records: dict[str, StageRecord] = field(default_factory=dict)  # peer text -> the record last surveyed
    candidates: list[Candidate] = field(default_factory=list)  # the stages that answered the last survey
    lost: set[str] = field(default_factory=set)  # peers whose stage was lost in this client's chain: never again
    loop: asyncio.AbstractEventLoop | None = None

    async def survey(self) -> list[Candidate]:
        """Look the stages up and measure every one announcing a QUIC address (in parallel); the ones that answered."""
        self.loop = asyncio.get_running_loop()
        found = [r for r in await self.dht.lookup_stages(self.model_digest, self.n_layer) if r.stage.quic_addr and str(r.peer_id) not in self.lost]
        rtts = await asyncio.gather(*(self._rtt_ms(r) for r in found))
        self.records = {str(r.peer_id): r for r in found}
        self.candidates = [Candidate(str(r.peer_id), r.stage.layers, rtt, r.stage.price) for r, rtt in zip(found, rtts, strict=True) if rtt is not None]
        log.debug("stages.surveyed", found=len(found), answered=len(self.candidates))
        return self.candidates

    async def _rtt_ms(self, record: StageRecord) -> float | None:
        assert record.stage.quic_addr is not None  # survey() keeps only these
        addr, best = parse_addr(record.stage.quic_addr), None
        for _ in range(self.pings):
            ping = wire.Ping(secrets.randbits(64), int(time.time() * 1e6))
            t0 = self.clock()
            try:
                reply = await self.endpoint.request(addr, record.peer_id, ping.encode(), timeout=PING_TIMEOUT_S)
                ok = wire.decode(reply) == wire.Pong.answering(ping)
            except (TransportError, wire.ProtocolError) as exc:
                log.info("stages.unreachable", peer=str(record.peer_id), addr=record.stage.quic_addr, error=str(exc))
                return None
            if not ok:
                log.info("stages.bad_pong", peer=str(record.peer_id), addr=record.stage.quic_addr)
                return None
            rtt = (self.clock() - t0) * 1e3
            best = rtt if best is None else min(best, rtt)
        return best

    async def chain(self, wait_s: float) -> list[Candidate]:
        """The best chain once the stages cover every layer; :class:`NoChain` (the last reason) after *wait_s*."""
        deadline = self.clock() + wait_s
        while True:
            try:
                chain = choose_chain(await self.survey(), self.n_layer, self.hop_ms)
            except NoChain:
                if self.clock() >= deadline:
                    raise
                await asyncio.sleep(SURVEY_EVERY_S)
                continue
            log.info("stages.chosen", chain=[f"{c.span}@{c.peer[-8:]}:{c.rtt_ms:.1f}ms" for c in chain], estimated_ms=round(estimated_ms(chain, self.hop_ms), 2))
            return chain

    def link(self, candidate: Candidate) -> RemoteStage:
        """The RemoteStage of a surveyed candidate."""
        record = self.records[candidate.peer]
        assert record.stage.quic_addr is not None and self.loop is not None  # surveyed
        return RemoteStage(self.endpoint, self.loop, parse_addr(record.stage.quic_addr), record.peer_id, self.model_digest, record.stage.layers, self.hop_timeout)

    def replace(self, hop: int, lost: StageLink) -> StageLink:
        """A link for hop *hop* whose stage was lost (called by the chain, on the generation's thread)."""
        assert self.loop is not None  # surveyed before any chain ran
        if isinstance(lost, RemoteStage):
            self.lost.add(str(lost.peer))
        future = asyncio.run_coroutine_threadsafe(self.survey(), self.loop)
        found = choose_replacement(future.result(), lost.layers, self.lost)
        span = f"{lost.layers.start}-{lost.layers.stop - 1}"
        if found is None:
            log.warning("stages.no_replacement", hop=hop, layers=span)
            raise StageLost(f"the stage of layers {span} was lost and no other stage runs exactly those layers")
        log.warning("stages.replaced", hop=hop, layers=span, lost=str(getattr(lost, "peer", "?")), peer=found.peer, rtt_ms=round(found.rtt_ms, 2))
        return self.link(found)


@asynccontextmanager
async def stage_planner(identity: Identity, model: GGUFModel, bootstrap: Sequence[str], options: BackboneOptions) -> AsyncIterator[StagePlanner]:
    """A planner on its own client endpoint and DHT client (``options``' listen addresses and datagram size),
    both closed on exit."""
    async with contextlib.AsyncExitStack() as stack:
        endpoint = await Endpoint.bind(identity, options.listen[0], options.listen[1], handler=None, max_datagram_size=options.max_datagram)
        stack.push_async_callback(endpoint.close)
        dht = LibP2PDiscovery(identity, listen=options.dht_listen, bootstrap=bootstrap, client_mode=True, models=[model_shape(model)])
        stack.push_async_callback(dht.close)
        await dht.start()
        yield StagePlanner(dht, endpoint, model.digest, model.cfg.n_layer, hop_timeout=options.timeout)
