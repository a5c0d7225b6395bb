"""Discovery: which peers host a (model, layer) right now, behind one narrow interface.

`Discovery` is what workers and the backbone use; the libp2p Kademlia backend (`p2p.dht.kademlia`) and the
in-memory one below implement it, so the backend can change without touching callers. Workers
`announce()` the slices they host (the backend signs, publishes and refreshes the records);
the backbone `lookup()`s hosts, through `CachedDiscovery` so dispatch rarely waits on the network.

`Announcer` and `live_hosts` are the backend-independent, sans-IO parts: what to (re)publish when,
and how raw records become a lookup answer.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Generic, Protocol, TypeVar

import structlog

from experts.errors import MoeSwarmError
from p2p.dht.records import (
    MAX_LIFETIME,
    HelperRecord,
    HostedSlice,
    HostRecord,
    ModelShape,
    RecordError,
    decode_and_validate,
    issue,
    select_best,
    value_key,
)
from p2p.dht.stage_records import StageRecord
from p2p.identity import Identity, PeerId
from p2p.lograte_edge import ThrottledLog

log = structlog.get_logger(__name__)
peer_log = ThrottledLog(log)  # records anyone can sign and publish: a few lines per interval, then a count


class DiscoveryError(MoeSwarmError):
    """A discovery backend cannot do what was asked (not started, closed, unreachable network)."""


class DiscoveryClosed(DiscoveryError):
    """The discovery backend was closed."""


class Discovery(Protocol):
    async def announce(self, slices: Sequence[HostedSlice]) -> None:
        """Publish exactly these slices for this node (replacing earlier ones) and keep them fresh."""

    async def withdraw(self) -> None:
        """Replace every announced record with a tombstone, so lookups drop this node at once."""

    async def lookup(self, model_digest: str, layer: int, *, fresh: bool = False) -> list[HostRecord]:
        """Live, validated hosts of (model, layer): one record per peer (the newest), sorted by peer id.

        ``fresh``: answer from the network, not from a cache (a backend without a cache ignores it).
        """

    async def close(self) -> None:
        """Release the backend. Does not withdraw: call withdraw() first on a graceful shutdown."""


def live_hosts(
    records: Iterable[HostRecord], model_digest: str, layer: int, now: float, shape: ModelShape | None = None
) -> list[HostRecord]:
    """The lookup answer from raw validated records: newest per peer first, then tombstones and expired dropped.

    The order matters: a peer whose newest record is a tombstone is gone, even if a replica
    somewhere still holds its older live record. With the model's ``shape`` (a node that loaded it), records
    naming experts or layers it does not have are refused (and logged), as are records for other models.
    """
    newest: dict[PeerId, HostRecord] = {}
    for record in records:
        if record.hosted.model_digest != model_digest or record.hosted.layer != layer:
            log.debug("discovery.record_refused", peer=str(record.peer_id), reason="another model or layer")
            continue
        if shape is not None:
            try:
                shape.check(record)
            except RecordError as exc:
                peer_log.info("discovery.record_refused", peer=str(record.peer_id), reason=str(exc))
                continue
        held = newest.get(record.peer_id)
        if held is None or (record.seq, record.expires_at) > (held.seq, held.expires_at):
            newest[record.peer_id] = record
    return sorted((r for r in newest.values() if r.is_live(now)), key=lambda r: r.peer_id)


R = TypeVar("R", HostRecord, HelperRecord, StageRecord)


@dataclass(frozen=True)
class Publication(Generic[R]):
    """A signed record (a host's or a helper's) to put under its key."""

    record: R
    value: bytes

    @property
    def key(self) -> str:
        return self.record.key


class Announcer:
    """What this node announces, the records signed for it, and when each needs re-signing.

    Records live ``ttl`` seconds and are re-issued after ``refresh_fraction`` of that, so a record
    is replaced well before anyone could see it expire. ``seq`` is the issue time in milliseconds
    (bumped to stay strictly increasing), so a restarted node's records still beat its old ones.
    """

    def __init__(self, identity: Identity, *, ttl: float, refresh_fraction: float = 0.5) -> None:
        if not 0 < refresh_fraction < 1:
            raise ValueError(f"refresh_fraction must be in (0, 1), got {refresh_fraction}")
        if not 1 <= ttl <= MAX_LIFETIME:
            raise ValueError(f"record ttl must be 1..{MAX_LIFETIME} seconds, got {ttl}")
        self._identity = identity
        self._ttl = ttl
        self._refresh_after = ttl * refresh_fraction
        self._wanted: dict[str, HostedSlice] = {}
        self._current: dict[str, HostRecord] = {}  # key -> last published record, tombstones included
        self._last_seq = 0

    def replace(self, slices: Sequence[HostedSlice], now: float) -> list[Publication]:
        """Announce exactly slices from now on: records for new or changed ones, tombstones for dropped ones."""
        wanted: dict[str, HostedSlice] = {}
        for hosted in slices:
            if hosted.is_tombstone:
                raise ValueError(f"cannot announce a tombstone for layer {hosted.layer}; call withdraw() instead")
            key = value_key(self._identity.peer_id, hosted.model_digest, hosted.layer)
            if key in wanted:
                raise ValueError(f"two slices for model {hosted.model_digest[:12]}.. layer {hosted.layer}: merge them")
            wanted[key] = hosted
        dropped = [k for k in self._wanted if k not in wanted]
        self._wanted = wanted
        pubs = [p for k in dropped if (p := self._tombstone(k, now)) is not None]
        for key, hosted in wanted.items():
            held = self._current.get(key)
            if held is None or held.hosted != hosted or now >= held.issued_at + self._refresh_after:
                pubs.append(self._issue(hosted, now, self._ttl))
        return pubs

    def due(self, now: float, *, everything: bool = False) -> list[Publication]:
        """Fresh records for announced slices whose refresh time has come (all of them if everything,
        e.g. after a failed publication); forgets expired tombstones."""
        self._current = {k: r for k, r in self._current.items() if k in self._wanted or now < r.expires_at}
        return [
            self._issue(hosted, now, self._ttl)
            for key, hosted in self._wanted.items()
            if everything or now >= self._current[key].issued_at + self._refresh_after
        ]

    def live(self, now: float) -> list[HostRecord]:
        """The records currently published for announced slices that have not expired."""
        return [r for k in self._wanted if (r := self._current.get(k)) is not None and r.is_live(now)]

    def withdraw(self, now: float) -> list[Publication]:
        """Tombstones for every announced slice; nothing is announced afterwards."""
        keys, self._wanted = list(self._wanted), {}
        return [p for k in keys if (p := self._tombstone(k, now)) is not None]

    def next_refresh_at(self) -> float | None:
        """Unix time of the next due() that will return something, or None when nothing is announced."""
        times = [self._current[k].issued_at + self._refresh_after for k in self._wanted]
        return min(times, default=None)

    def _next_seq(self, now: float) -> int:
        self._last_seq = max(self._last_seq + 1, int(now * 1000))
        return self._last_seq

    def _issue(self, hosted: HostedSlice, now: float, ttl: float) -> Publication:
        record, value = issue(self._identity, hosted, now=now, ttl=ttl, seq=self._next_seq(now))
        self._current[record.key] = record
        return Publication(record, value)

    def _tombstone(self, key: str, now: float) -> Publication | None:
        """A tombstone living as long as the record it replaces (none needed once that expired)."""
        held = self._current.get(key)
        if held is None or now >= held.expires_at:
            self._current.pop(key, None)
            return None
        tomb = HostedSlice.tombstone(held.hosted.model_digest, held.hosted.layer)
        return self._issue(tomb, now, held.expires_at - int(now))


class InMemoryBoard:
    """A shared dict standing in for the DHT: validates every put and keeps the best value per key."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}

    def put(self, key: str, value: bytes, now: float) -> None:
        decode_and_validate(key, value, now)  # raises RecordError, as a DHT node would refuse it
        held = self.values.get(key)
        if held is None or select_best(key, [held, value], now) == 1:
            self.values[key] = value

    def records(self, now: float) -> list[HostRecord]:
        found = []
        for key, value in self.values.items():
            try:
                found.append(decode_and_validate(key, value, now))
            except RecordError:
                continue  # expired since it was stored
        return found


class InMemoryDiscovery:
    """Discovery over an InMemoryBoard shared by the nodes of a unit test. Records are not refreshed."""

    def __init__(
        self,
        identity: Identity,
        board: InMemoryBoard,
        *,
        ttl: float = 600.0,
        clock: Callable[[], float] = time.time,
        models: Sequence[ModelShape] = (),
    ) -> None:
        self._board = board
        self._models = {m.digest: m for m in models}
        self._announcer = Announcer(identity, ttl=ttl)
        self._clock = clock
        self._closed = False

    def _check_open(self) -> None:
        if self._closed:
            raise DiscoveryClosed("this InMemoryDiscovery was closed")

    async def announce(self, slices: Sequence[HostedSlice]) -> None:
        self._check_open()
        now = self._clock()
        for pub in self._announcer.replace(slices, now):
            self._board.put(pub.key, pub.value, now)

    async def withdraw(self) -> None:
        self._check_open()
        now = self._clock()
        for pub in self._announcer.withdraw(now):
            self._board.put(pub.key, pub.value, now)

    async def lookup(self, model_digest: str, layer: int, *, fresh: bool = False) -> list[HostRecord]:
        self._check_open()
        now = self._clock()
        return live_hosts(self._board.records(now), model_digest, layer, now, self._models.get(model_digest))

    async def close(self) -> None:
        self._closed = True


@dataclass(frozen=True)
class _Entry:
    fetched_at: float
    records: list[HostRecord]


class CachedDiscovery:
    """A Discovery with a per-(model, layer) lookup cache, so the dispatch path rarely waits on the DHT.

    An entry younger than ``ttl`` is answered from memory; once older than ``refresh_after`` it is
    still answered from memory while one background lookup refreshes it. A missing or stale entry
    waits for a lookup that concurrent callers share. Records expiring while cached are dropped
    when read. ``lookup(..., fresh=True)`` skips the cache (e.g. after a host stopped answering).
    A libp2p lookup costs ~60-90 ms of CPU (py-libp2p RPCs are slow), hence the long default ttl.
    """

    def __init__(
        self,
        inner: Discovery,
        *,
        ttl: float = 60.0,
        refresh_after: float | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._inner = inner
        self._ttl = ttl
        self._refresh_after = ttl / 2 if refresh_after is None else refresh_after
        self._clock = clock
        self._entries: dict[tuple[str, int], _Entry] = {}
        self._inflight: dict[tuple[str, int], asyncio.Task[list[HostRecord]]] = {}
        self._background: set[asyncio.Task[None]] = set()

    async def announce(self, slices: Sequence[HostedSlice]) -> None:
        await self._inner.announce(slices)

    async def withdraw(self) -> None:
        await self._inner.withdraw()

    async def lookup(self, model_digest: str, layer: int, *, fresh: bool = False) -> list[HostRecord]:
        slot = (model_digest, layer)
        now = self._clock()
        entry = None if fresh else self._entries.get(slot)
        if entry is None or now - entry.fetched_at >= self._ttl:
            records = await asyncio.shield(self._fetch(slot))
            now = self._clock()
        else:
            records = entry.records
            if now - entry.fetched_at >= self._refresh_after and slot not in self._inflight:
                task = asyncio.create_task(self._refresh_quietly(slot))
                self._background.add(task)
                task.add_done_callback(self._background.discard)
        return [r for r in records if r.is_live(now)]

    async def close(self) -> None:
        tasks = [*self._inflight.values(), *self._background]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._inner.close()

    def _fetch(self, slot: tuple[str, int]) -> asyncio.Task[list[HostRecord]]:
        task = self._inflight.get(slot)
        if task is None:
            task = asyncio.create_task(self._fetch_and_store(slot))
            self._inflight[slot] = task
            task.add_done_callback(partial(self._fetched, slot))
        return task

    def _fetched(self, slot: tuple[str, int], task: asyncio.Task[list[HostRecord]]) -> None:
        self._inflight.pop(slot, None)
        if not task.cancelled():
            task.exception()  # each waiter got the error already (or all left); don't log it as lost

    async def _fetch_and_store(self, slot: tuple[str, int]) -> list[HostRecord]:
        started = self._clock()
        records = await self._inner.lookup(*slot)
        self._entries[slot] = _Entry(started, records)
        return records

    async def _refresh_quietly(self, slot: tuple[str, int]) -> None:
        try:
            await self._fetch(slot)
        except Exception as exc:  # the cached answer stays in use; the failure is logged, not hidden
            log.warning("discovery.refresh_failed", model=slot[0][:12], layer=slot[1], error=repr(exc))
