"""The swarm as one node sees it: for each layer, which hosts serve which expert range, over which path.

Built from the DHT's records (one lookup per layer) and, on a backbone, what its own dispatches measured (path
used, round-trip time). Pure: no I/O, the caller passes the records and the clock. ``readiness`` turns a node's
phase and the coverage into the one reason ``/readyz`` gives for a 503.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from enum import StrEnum

from p2p.dht.records import HostRecord


class Phase(StrEnum):
    """Where a node is in its life, as ``/readyz`` reports it; only SERVING is ready."""

    STARTING = "starting"
    LOADING = "loading"
    WAITING = "waiting for hosts"
    SERVING = "serving"
    DRAINING = "draining"


@dataclass(frozen=True)
class Seen:
    """What this node's own dispatches measured for a peer."""

    path: str
    rtt_ms: float | None


@dataclass(frozen=True)
class HostView:
    peer: str
    announced: str  # the paths its record offers: "direct", "relay" or "direct+relay"
    addr: str | None
    price: int
    seen: Seen | None = None  # set on a node that dispatched to this host

    @property
    def short(self) -> str:
        return self.peer[-8:]


@dataclass(frozen=True)
class Cell:
    """One layer's expert range [start, stop) and the hosts that serve all of it (none: a gap)."""

    layer: int
    start: int
    stop: int
    hosts: tuple[HostView, ...]


@dataclass(frozen=True)
class Coverage:
    model: str
    n_layer: int
    n_expert: int
    cells: tuple[Cell, ...]
    at: float  # unix seconds of the lookups

    @property
    def lacking(self) -> list[int]:
        """Layers with at least one expert that no host serves."""
        return sorted({c.layer for c in self.cells if not c.hosts})

    @property
    def peers(self) -> dict[str, HostView]:
        return {h.peer: h for c in self.cells for h in c.hosts}

    def to_json(self) -> dict:
        return {"model": self.model, "n_layer": self.n_layer, "n_expert": self.n_expert, "at": self.at, "lacking_layers": self.lacking, "cells": [asdict(c) for c in self.cells]}


@dataclass(frozen=True)
class HostSummary:
    """One host as the coverage map shows it: the layers it serves and, on each, its expert ranges."""

    view: HostView
    ranges: dict[int, tuple[tuple[int, int], ...]]  # layer -> merged [start, stop) ranges

    def to_json(self) -> dict:
        return {**asdict(self.view), "layers": sorted(self.ranges), "expert_ranges": {str(layer): [list(r) for r in rs] for layer, rs in sorted(self.ranges.items())}}


def host_summaries(coverage: Coverage) -> list[HostSummary]:
    """Per host (by peer id), the pieces of the map it serves merged back into ranges."""
    pieces: dict[str, dict[int, list[tuple[int, int]]]] = {}
    for cell in coverage.cells:
        for h in cell.hosts:
            pieces.setdefault(h.peer, {}).setdefault(cell.layer, []).append((cell.start, cell.stop))
    out = []
    for peer, by_layer in sorted(pieces.items()):
        merged: dict[int, tuple[tuple[int, int], ...]] = {}
        for layer, spans in by_layer.items():
            runs: list[tuple[int, int]] = []
            for start, stop in sorted(spans):
                if runs and runs[-1][1] == start:
                    runs[-1] = (runs[-1][0], stop)
                else:
                    runs.append((start, stop))
            merged[layer] = tuple(runs)
        out.append(HostSummary(coverage.peers[peer], merged))
    return out


def announced_paths(record: HostRecord) -> str:
    h = record.hosted
    return "+".join(name for name, present in (("direct", h.quic_addr), ("relay", h.relay)) if present) or "none"


def build_coverage(
    model: str, n_layer: int, n_expert: int, records: Mapping[int, Sequence[HostRecord]], now: float, seen: Mapping[str, Seen] | None = None, *, layers: Sequence[int] | None = None
) -> Coverage:
    """Cut each layer at every range boundary any host announces, and list the hosts of each piece.

    *layers*: the model's MoE layers (default all): dense ones have no experts to host, so they are no gap."""
    seen = seen or {}
    cells = []
    for layer in range(n_layer) if layers is None else layers:
        hosts = [r for r in records.get(layer, ()) if r.hosted.expert_ranges]
        cuts = sorted({0, n_expert} | {b for r in hosts for rng in r.hosted.expert_ranges for b in rng if 0 <= b <= n_expert})
        for start, stop in zip(cuts, cuts[1:]):
            views = tuple(
                HostView(str(r.peer_id), announced_paths(r), r.hosted.quic_addr, r.hosted.price, seen.get(str(r.peer_id)))
                for r in sorted(hosts, key=lambda r: str(r.peer_id))
                if any(a <= start and stop <= b for a, b in r.hosted.expert_ranges)
            )
            cells.append(Cell(layer, start, stop, views))
    return Coverage(model, n_layer, n_expert, tuple(cells), now)


def readiness(phase: Phase, coverage: Coverage | None, *, needs_swarm: bool) -> str | None:
    """Why this node is not ready (None: it is). A node that needs the swarm (a gateway, or a bootstrap told
    the model) is not ready while a layer lacks hosts."""
    if phase is not Phase.SERVING:
        return phase.value
    if needs_swarm:
        if coverage is None:
            return "no DHT lookup finished yet"
        if coverage.lacking:
            return f"layers {', '.join(map(str, coverage.lacking))} lack hosts for some experts"
    return None
