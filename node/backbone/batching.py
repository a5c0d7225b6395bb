"""Continuous batching of MoE dispatches: one dispatch per layer for every sequence that is there.

Each sequence runs its own forward pass (its own KV cache) on its own thread and calls
its member hook once per MoE layer. :class:`BatchingMoE` holds those calls back for a
moment, concatenates the token rows of all sequences at the same layer and makes ONE
inner dispatch (:meth:`node.backbone.dispatch.RemoteMoE.dispatch_layer`, awaited right
on the loop, or a local compute function), then hands each sequence its own rows of the
answer. Over a WAN a dispatch costs a round trip whatever its size, so eight sequences
decode for the price of one.

Exactness: the forward and the MoE math are batch invariant (:mod:`experts.moe`): a
row's result never depends on the rows dispatched with it, so each sequence gets the
very bits it would get alone.

Theory of operation (:class:`LayerBatcher`, sans-IO; the clock is passed in). Every
member is in one phase:

* ``BETWEEN``: not inside a forward pass (just joined, or sampling its next token);
  its next call is at layer 0, the step start.
* ``COMPUTING``: inside a forward, its call for ``layer`` answered, computing its way
  to ``layer + 1``.
* ``PENDING``: its call waits in the open batch of a layer.
* ``IN_FLIGHT``: its batch was dispatched; the answer has not come back.

There is at most one open batch per layer. It closes (is dispatched) when:

* **layer 0 (step start)**: every member is in it; or no member is inside a forward
  pass and ``window`` has passed since the last arrival and since the last forward
  pass ended (the members still ``BETWEEN`` are sampling, give them that long). While
  any member is inside a forward, the step-start batch waits for it: this is the step
  barrier that admits new sequences between steps (a new request joins at the next
  step, a finished one leaves) and re-aligns any sequence a deadline left behind.
* **layer L > 0**: no member is ``COMPUTING`` its way to L (everyone who can come has
  come: the rest are waiting elsewhere or behind), or ``window`` has passed since the
  last arrival (a long prefill does not hold up the others' decode steps).

The window (default 2 ms) is an idle timeout: each arrival extends it, so a batch
waits at most (members x window) and gives up only on a sequence that has been
computing for a whole window while nobody else arrived. Members of an aligned step
contend for the GIL and two cores, so they arrive spread over several milliseconds
but rarely more than a window apart; they close as soon as the last one is there.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Hashable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import count
from typing import TypeVar, cast

import numpy as np
import structlog

from experts.errors import LocalProtocolError
from experts.forward import MoeCompute, MoeFfn
from experts.rows import split_rows
from node.backbone.dispatch import Pins, RemoteMoE, Taint

log = structlog.get_logger("node.backbone.batching")

K = TypeVar("K", bound=Hashable)  # what names a batch member (a sequence id; tests use strings)
DEFAULT_WINDOW_S = 0.002


class Phase(enum.Enum):
    BETWEEN = "between"
    COMPUTING = "computing"
    PENDING = "pending"
    IN_FLIGHT = "in_flight"


@dataclass
class MemberState:
    phase: Phase = Phase.BETWEEN
    layer: int = -1  # the layer of its last call (-1: none in this forward yet)

    @property
    def in_forward(self) -> bool:
        return self.phase in (Phase.COMPUTING, Phase.IN_FLIGHT) or (self.phase is Phase.PENDING and self.layer > 0)


@dataclass
class Batch:
    layer: int
    last_arrival: float
    members: list[Hashable] = field(default_factory=list)  # arrival order: the order of rows in the dispatch


class BatchingError(LocalProtocolError):
    """A member called out of turn (a layer other than the next one of its forward pass)."""


class LayerBatcher:
    """When each layer's batch closes; see the module docstring. Pure: no threads, no clock of its own.

    Every method that changes state returns the batches that closed as a result, in layer order.
    """

    def __init__(self, n_layers: int, window_s: float = DEFAULT_WINDOW_S) -> None:
        if n_layers < 1:
            raise ValueError("need at least one MoE layer")
        self.n_layers = n_layers
        self.window = window_s
        self.members: dict[Hashable, MemberState] = {}
        self.open: dict[int, Batch] = {}
        self._forward_end = float("-inf")  # when a forward pass last ended (or a member inside one left)

    def join(self, member: Hashable) -> None:
        if member in self.members:
            raise BatchingError(f"member {member!r} joined twice")
        self.members[member] = MemberState()

    def leave(self, member: Hashable, now: float) -> list[Batch]:
        state = self.members.pop(member, None)
        if state is None:
            return []
        if state.in_forward:
            self._forward_end = now
        if state.phase is Phase.PENDING:  # gave up waiting (its thread is gone): drop its rows
            batch = self.open[state.layer]
            batch.members.remove(member)
            if not batch.members:
                del self.open[state.layer]
        return self._due(now)

    def arrive(self, member: Hashable, layer: int, now: float) -> list[Batch]:
        state = self.members[member]
        expected = 0 if state.phase is Phase.BETWEEN else state.layer + 1
        if state.phase in (Phase.PENDING, Phase.IN_FLIGHT) or layer != expected:
            raise BatchingError(f"member {member!r} called layer {layer} while {state.phase.value} after layer {state.layer}")
        state.phase, state.layer = Phase.PENDING, layer
        batch = self.open.setdefault(layer, Batch(layer, now))
        batch.members.append(member)
        batch.last_arrival = now
        return self._due(now)

    def answered(self, members: Iterable[Hashable], now: float) -> list[Batch]:
        """The dispatch holding *members* came back: they compute on (or, after the last layer, sample)."""
        for m in members:
            state = self.members.get(m)
            if state is None:  # left while in flight
                continue
            if state.layer == self.n_layers - 1:
                state.phase = Phase.BETWEEN
                self._forward_end = now
            else:
                state.phase = Phase.COMPUTING
        return self._due(now)

    def poll(self, now: float) -> list[Batch]:
        return self._due(now)

    def next_deadline(self) -> float | None:
        """The earliest time at which a deadline may close an open batch (None: only an event will)."""
        times = [t for b in self.open.values() if (t := self._deadline(b)) is not None]
        return min(times, default=None)

    def _deadline(self, b: Batch) -> float | None:
        if b.layer > 0:
            return b.last_arrival + self.window
        if any(s.in_forward for s in self.members.values()):
            return None
        return max(b.last_arrival, self._forward_end) + self.window

    def _closes(self, b: Batch, now: float) -> bool:
        if b.layer == 0 and len(b.members) == len(self.members):
            return True
        if b.layer > 0 and not any(s.phase is Phase.COMPUTING and s.layer == b.layer - 1 for s in self.members.values()):
            return True
        deadline = self._deadline(b)
        return deadline is not None and now >= deadline

    def _due(self, now: float) -> list[Batch]:
        due = [b for _, b in sorted(self.open.items()) if self._closes(b, now)]
        for b in due:
            del self.open[b.layer]
            for m in b.members:
                self.members[m].phase = Phase.IN_FLIGHT
        return due


@dataclass
class BatchStats:
    dispatches: int = 0  # inner calls (one per closed batch, or per affinity sub-batch)
    member_calls: int = 0  # hook calls by sequences (what unbatched decoding would have dispatched)
    rows: int = 0

    def summary(self) -> dict:
        return {
            "layer_dispatches": self.dispatches,
            "member_calls": self.member_calls,
            "rows": self.rows,
            "members_per_dispatch": round(self.member_calls / self.dispatches, 3) if self.dispatches else 0.0,
        }


@dataclass
class _Call:
    x: np.ndarray
    ids: np.ndarray
    w: np.ndarray
    future: Future


class BatchingMoE:
    """Batches the MoE calls of concurrent sequences, one dispatch per layer; the asyncio edge of :class:`LayerBatcher`.

    *inner* is a :class:`RemoteMoE` (its dispatch awaited on *loop*, which must own its
    endpoint) or a local compute function (run in the loop's default executor). All
    batching state lives on the loop thread; sequence threads only post to it and wait
    on the Future their member hook returns. *moe_layers* are the model's layers with
    experts, in forward order (``cfg.moe_layers``: dense layers call no hook), which the
    batcher counts as its layers 0, 1, ...
    """

    def __init__(self, inner: RemoteMoE | MoeCompute, moe_layers: Sequence[int], loop: asyncio.AbstractEventLoop, *, window_s: float = DEFAULT_WINDOW_S) -> None:
        self.inner = inner
        self.loop = loop
        self.layers = tuple(moe_layers)
        self._step = {layer: i for i, layer in enumerate(self.layers)}
        self.core = LayerBatcher(len(self.layers), window_s)
        self.stats = BatchStats()
        self._calls: dict[int, _Call] = {}
        self._pins: dict[int, Pins | None] = {}
        self._provenance: dict[int, Taint] = {}
        self._ids = count()
        self._timer: asyncio.TimerHandle | None = None
        self._inflight: set[asyncio.Task] = set()  # the loop keeps only weak references to tasks

    @contextmanager
    def member(self, pins: Pins | None = None, provenance: Taint | None = None) -> Iterator[MoeFfn]:
        """A sequence's ``moe_ffn`` for the duration of the block (enter and use it on the sequence's thread).

        *pins* (slot affinity) is the session's record of which host answered each layer's
        expert group; dispatches prefer those hosts and record new choices in it. It is
        read and written on the loop thread only. *provenance* learns which of this
        sequence's rows used unchecked remote sums (:class:`RowSplit` hands each member its rows).
        """
        m = next(self._ids)
        self.loop.call_soon_threadsafe(self._join, m, pins, provenance)

        def hook(layer: int, x: np.ndarray, ids: np.ndarray, w: np.ndarray) -> Future:
            fut: Future = Future()
            self.loop.call_soon_threadsafe(self._arrive, m, layer, _Call(x, ids, w, fut))
            return fut

        try:
            yield hook
        finally:
            self.loop.call_soon_threadsafe(self._leave, m)

    # --- on the loop thread ---------------------------------------------------------------------

    def _join(self, m: int, pins: Pins | None, provenance: Taint | None) -> None:
        self.core.join(m)
        self._pins[m] = pins
        if provenance is not None:
            self._provenance[m] = provenance

    def _leave(self, m: int) -> None:
        self._pins.pop(m, None)
        self._provenance.pop(m, None)
        call = self._calls.pop(m, None)
        if call is not None:
            call.future.cancel()
        self._launch(self.core.leave(m, self.loop.time()))

    def _arrive(self, m: int, layer: int, call: _Call) -> None:
        self.stats.member_calls += 1
        self._calls[m] = call
        try:
            if layer not in self._step:
                raise BatchingError(f"member {m!r} called layer {layer}, which has no experts")
            due = self.core.arrive(m, self._step[layer], self.loop.time())
        except BatchingError as exc:
            self._calls.pop(m)
            call.future.set_exception(exc)
            return
        self._launch(due)

    def _on_timer(self) -> None:
        self._timer = None
        self._launch(self.core.poll(self.loop.time()))

    def _launch(self, batches: list[Batch]) -> None:
        for b in batches:
            for members, pins in self._affinity_groups(b):
                calls = [self._calls.pop(m) for m in members]
                task = self.loop.create_task(self._dispatch(self.layers[b.layer], members, calls, pins))
                self._inflight.add(task)
                task.add_done_callback(self._inflight.discard)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        deadline = self.core.next_deadline()
        if deadline is not None:
            self._timer = self.loop.call_at(deadline, self._on_timer)

    def _affinity_groups(self, b: Batch) -> list[tuple[list[int], Pins | None]]:
        members = cast("list[int]", b.members)  # the core batches any hashable; this batcher's members are sequence ids
        if not isinstance(self.inner, RemoteMoE):  # nothing to pin
            return [(list(members), None)]
        return [(group, pins) for group, pins in affinity_groups(self.layers[b.layer], members, self._pins)]

    async def _dispatch(self, layer: int, members: list[int], calls: list[_Call], pins: Pins | None) -> None:
        x = np.concatenate([c.x for c in calls])
        ids = np.concatenate([c.ids for c in calls])
        w = np.concatenate([c.w for c in calls])
        self.stats.dispatches += 1
        self.stats.rows += x.shape[0]
        t0 = time.perf_counter()
        try:
            if isinstance(self.inner, RemoteMoE):
                taint = RowSplit([(self._provenance.get(m), c.x.shape[0]) for m, c in zip(members, calls, strict=True)])
                out = await self.inner.dispatch_layer(layer, x, ids, w, pins, taint if taint.any else None)
            else:
                out = await self.loop.run_in_executor(None, self.inner, layer, x, ids, w)
        except BaseException as exc:  # every waiting sequence gets the failure, a cancellation too; none hangs
            log.warning("batch.failed", layer=layer, members=len(members), error=repr(exc))
            self._launch(self.core.answered(members, self.loop.time()))
            err = exc if isinstance(exc, Exception) else RuntimeError(f"layer {layer} dispatch cancelled")
            for c in calls:
                if not c.future.done():
                    c.future.set_exception(err)
            if err is not exc:
                raise
            return
        log.debug("batch.done", layer=layer, members=len(members), rows=x.shape[0], ms=round((time.perf_counter() - t0) * 1e3, 3))
        if pins is not None:
            for m in members:
                if (mine := self._pins.get(m)) is not None:
                    mine.update(pins)
        due = self.core.answered(members, self.loop.time())  # phases first: a woken sequence's next call sees them
        for c, rows in zip(calls, split_rows(out, [c.x.shape[0] for c in calls]), strict=True):
            if not c.future.done():
                c.future.set_result(rows)
        self._launch(due)


class RowSplit:
    """A batch's :class:`~node.backbone.dispatch.Taint`: the rows of a host's unchecked answer, cut at the members'
    boundaries, each member told of its own (a sequence's first row is its pass's first position)."""

    def __init__(self, members: list[tuple[Taint | None, int]]) -> None:
        self._members = members
        self.any = any(t is not None for t, _ in members)

    def used(self, peer: str, rows: np.ndarray) -> None:
        start = 0
        for taint, n in self._members:
            if taint is not None:
                taint.used(peer, rows[start : start + n])
            start += n


def affinity_groups(layer: int, members: Iterable[K], pins: Mapping[K, Pins | None]) -> list[tuple[list[K], Pins]]:
    """Split a layer's batch so that no dispatch has to honour two different pinned hosts for one expert group.

    Returns (members, their pins for *layer* merged) per dispatch, first-fit in member
    order. Sessions usually pin the same (best) hosts, so this is one dispatch; after a
    failover, or with replicas that load spreading gave to different sessions, a few.
    """
    groups: list[tuple[list, Pins]] = []
    for m in members:
        mine = {k: v for k, v in (pins.get(m) or {}).items() if k[0] == layer}
        for group, merged in groups:
            if all(merged.get(k, v) == v for k, v in mine.items()):
                group.append(m)
                merged.update(mine)
                break
        else:
            groups.append(([m], dict(mine)))
    return groups
