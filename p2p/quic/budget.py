"""What peers may make a serving endpoint hold: request bytes and open request streams, sans-IO.

Theory of operation. One ``ServeBudget`` per endpoint is shared by the ``p2p.quic.streams.RequestStreams`` of all
its connections. A request stream is charged from its first byte until it is answered, refused, reset, timed out or
its connection closes: one stream slot and every byte of it (what ``RequestStreams`` buffers, then what the handler
holds while it computes). Two scopes, two answers:

- per connection (one peer's share): a stream or a byte beyond ``max_streams_per_conn`` / ``max_bytes_per_conn`` is
  refused — the peer is told OVERLOADED and the others are not affected;
- the whole endpoint: beyond ``max_streams`` / ``max_bytes``, the stalest *incomplete* streams of any connection
  (least recent data first) are evicted to make room. A slow-loris stream holds memory only until a request that
  actually arrives needs it, so valid requests keep being served while attackers hold every slot. Complete
  requests (being computed) are never evicted: when they alone fill the budget, the new stream is refused.

The budget only counts: it returns what to refuse and what to evict, and ``RequestStreams`` / the endpoint act on
it. Owners are opaque keys (``RequestStreams`` passes itself). Time is a parameter (``now``), as in aioquic.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ServeLimits:
    """Caps on what peers may make a serving endpoint hold (see the module docstring for who gets refused)."""

    max_bytes: int = 64 << 20  # request bytes held for all connections together
    max_bytes_per_conn: int = 16 << 20  # ... for one connection (so also the largest request it accepts)
    max_streams: int = 1024  # request streams open (arriving or being served), all connections
    max_streams_per_conn: int = 64  # ... on one connection
    request_deadline: float = 30.0  # seconds from a request's first byte to its FIN, whatever its pace

    def __post_init__(self) -> None:
        if min(self.max_bytes, self.max_bytes_per_conn, self.max_streams, self.max_streams_per_conn) < 1:
            raise ValueError("every serve limit must be at least 1")
        if self.request_deadline <= 0:
            raise ValueError("request_deadline must be positive")


Key = tuple[Hashable, int]  # (owner, stream id)


@dataclass(frozen=True)
class Charge:
    """The budget's answer to ``charge``: ``refused`` (why, or "" if admitted) and the streams it evicted to make
    room (already forgotten by the budget; their owners must drop them)."""

    refused: str = ""
    evicted: tuple[Key, ...] = ()


@dataclass(eq=False)
class _Held:
    size: int
    last: float
    complete: bool = False


@dataclass
class _Owner:
    streams: int = 0
    size: int = 0
    keys: set[int] = field(default_factory=set)


class ServeBudget:
    """The shared account of request streams and bytes; see the module docstring."""

    def __init__(self, limits: ServeLimits | None = None) -> None:
        self.limits = limits or ServeLimits()
        self._held: dict[Key, _Held] = {}
        self._owners: dict[Hashable, _Owner] = {}
        self.size = 0  # bytes held, all owners
        self.evictions = 0  # streams evicted since start (a counter for logs and tests)

    @property
    def streams(self) -> int:
        return len(self._held)

    def held(self, owner: Hashable) -> tuple[int, int]:
        """(streams, bytes) charged to ``owner``."""
        o = self._owners.get(owner)
        return (o.streams, o.size) if o else (0, 0)

    def charge(self, owner: Hashable, stream_id: int, size: int, now: float) -> Charge:
        """Charge ``size`` more bytes to a stream (opening it on first sight). Refused: nothing was charged, and the
        caller drops the stream (``release``)."""
        limits, key = self.limits, (owner, stream_id)
        o = self._owners.setdefault(owner, _Owner())
        held = self._held.get(key)
        if held is None and o.streams >= limits.max_streams_per_conn:
            return Charge(f"{o.streams} request streams open on this connection (limit {limits.max_streams_per_conn})")
        if o.size + size > limits.max_bytes_per_conn:
            return Charge(f"{o.size + size} request bytes on this connection (limit {limits.max_bytes_per_conn})")
        need_slot = held is None and len(self._held) >= limits.max_streams
        victims = self._victims(key, size, need_slot)
        if victims is None:
            return Charge(f"the endpoint holds {len(self._held)} requests, {self.size} bytes, all complete")
        for victim in victims:
            self.release(*victim)
        self.evictions += len(victims)
        if held is None:
            held = self._held[key] = _Held(0, now)
            o.streams += 1
            o.keys.add(stream_id)
        held.size += size
        held.last = now
        o.size += size
        self.size += size
        return Charge(evicted=tuple(victims))

    def complete(self, owner: Hashable, stream_id: int) -> None:
        """The stream's request is whole (FIN): it is being served now and is never evicted."""
        if (held := self._held.get((owner, stream_id))) is not None:
            held.complete = True

    def release(self, owner: Hashable, stream_id: int) -> None:
        """Forget a stream (answered, refused, reset, timed out, evicted); unknown streams are ignored."""
        held = self._held.pop((owner, stream_id), None)
        if held is None:
            return
        o = self._owners[owner]
        o.streams -= 1
        o.size -= held.size
        o.keys.discard(stream_id)
        self.size -= held.size
        if not o.streams:
            del self._owners[owner]

    def release_all(self, owner: Hashable) -> None:
        """Forget every stream of ``owner`` (its connection closed)."""
        if (o := self._owners.get(owner)) is not None:
            for stream_id in list(o.keys):
                self.release(owner, stream_id)

    def _victims(self, key: Key, size: int, need_slot: bool) -> list[Key] | None:
        """The stalest incomplete streams (never ``key``) to evict so that ``size`` bytes (and a slot) fit; None if
        even evicting every one would not make room."""
        over = self.size + size - self.limits.max_bytes
        if over <= 0 and not need_slot:
            return []
        candidates = sorted((k for k, h in self._held.items() if not h.complete and k != key), key=lambda k: self._held[k].last)
        victims: list[Key] = []
        freed = 0
        for k in candidates:
            if freed >= over and (victims or not need_slot):
                break
            victims.append(k)
            freed += self._held[k].size
        if freed < over or (need_slot and not victims):
            return None
        return victims
