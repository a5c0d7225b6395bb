"""Prometheus metrics of one node, read from the statistics its parts already keep (nothing on the hot path).

A custom collector turns, at scrape time, the backbone's ``RemoteMoE.stats`` (a bounded deque of dispatch
records), the worker's ``Worker.stats`` counters and the ledger's totals into metric families. The deque keeps
the last 100,000 dispatches only, so :class:`RecordTail` remembers the newest record it counted and adds only
those after it: the counters and histograms stay monotonic however long the node runs (a scrape gap longer than
the deque would undercount, never double count).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from p2p.identity import PeerId

LATENCY_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


@dataclass
class RecordTail:
    """The items appended to a bounded deque since the last call (by identity of the newest one seen)."""

    last: Any = None

    def new(self, items: Sequence[Any]) -> list[Any]:
        out = []
        for item in reversed(items):
            if item is self.last:
                break
            out.append(item)
        if out:
            self.last = out[0]
        out.reverse()
        return out


@dataclass
class Histogram:
    """Cumulative bucket counts, the exposition's form."""

    bounds: tuple[float, ...] = LATENCY_BUCKETS_S
    counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS_S) + 1))
    total: float = 0.0

    def observe(self, value: float) -> None:
        self.total += value
        for i, bound in enumerate(self.bounds):
            if value <= bound:
                self.counts[i] += 1
        self.counts[-1] += 1

    def buckets(self) -> list[tuple[str, int]]:
        return [*((repr(b), c) for b, c in zip(self.bounds, self.counts)), ("+Inf", self.counts[-1])]


@dataclass(frozen=True)
class LedgerTotals:
    entries: int
    receipts: int  # dispatches recorded (one receipt each), disputed ones included
    work_units: int
    credits: int


@dataclass
class BackboneTotals:
    """Running sums over the dispatch records seen so far, by label."""

    tail: RecordTail = field(default_factory=RecordTail)
    dispatches: dict[str, int] = field(default_factory=dict)  # path ->
    failures: dict[str, int] = field(default_factory=dict)
    tokens: int = 0
    wire_bytes: dict[tuple[str, ...], int] = field(default_factory=dict)  # (direction, codec, path) ->
    latency: dict[str, Histogram] = field(default_factory=dict)  # path ->
    last_path: dict[str, str] = field(default_factory=dict)  # peer -> path of its newest dispatch

    def add(self, records: Iterable[Any], codec: str) -> None:
        for r in records:
            path = str(r.path)
            self.last_path[r.peer] = path
            if not r.ok:
                self.failures[path] = self.failures.get(path, 0) + 1
                continue
            self.dispatches[path] = self.dispatches.get(path, 0) + 1
            self.tokens += r.n_tokens
            for direction, n in (("out", r.bytes_out), ("back", r.bytes_back)):
                key = (direction, codec, path)
                self.wire_bytes[key] = self.wire_bytes.get(key, 0) + n
            self.latency.setdefault(path, Histogram()).observe(r.latency_ms / 1e3)


class NodeCollector(Collector):
    """Everything ``/metrics`` shows; ``status`` is a :class:`node.status.server.NodeStatus` (duck-typed here so
    this module needs neither the backbone nor the worker)."""

    def __init__(self, status: Any) -> None:
        self.status = status
        self.backbone = BackboneTotals()
        self.ledger: LedgerTotals | None = None

    def collect(self) -> Iterator[Metric]:
        s = self.status
        ready = GaugeMetricFamily("moeswarm_ready", "1 when /readyz answers 200.", labels=["role"])
        ready.add_metric([s.role], 0 if s.not_ready() else 1)
        yield ready
        if s.remote is not None:
            yield from self._backbone(s.remote)
        if s.worker is not None:
            yield from self._worker(s.worker)
        if s.relay is not None:
            yield from self._relay(s.relay)
        if s.coverage is not None:
            hosts = GaugeMetricFamily("moeswarm_swarm_hosts", "Hosts the DHT lists for a layer (any expert range).", labels=["layer"])
            for layer in sorted({c.layer for c in s.coverage.cells}):
                hosts.add_metric([str(layer)], len({h.peer for c in s.coverage.cells if c.layer == layer for h in c.hosts}))
            yield hosts
        if self.ledger is not None:
            yield GaugeMetricFamily("moeswarm_ledger_entries", "Entries in this node's ledger.", value=self.ledger.entries)
            yield GaugeMetricFamily("moeswarm_ledger_receipts", "Dispatches with a receipt in this node's ledger.", value=self.ledger.receipts)
            yield GaugeMetricFamily("moeswarm_ledger_work_units", "Undisputed work units recorded (a work unit: one FLOP of expert compute, 6 x n_embd x n_ff per token and expert).", value=self.ledger.work_units)
            yield GaugeMetricFamily("moeswarm_ledger_credits", "Undisputed credits recorded (work units x the price per work unit).", value=self.ledger.credits)

    def _backbone(self, remote: Any) -> Iterator[Metric]:
        t = self.backbone
        t.add(t.tail.new(remote.stats.records), remote.codec.name.lower())
        role = "backbone"
        yield _counter("moeswarm_dispatches", "Dispatch requests answered, by path.", ["role", "path"], {(role, p): n for p, n in t.dispatches.items()})
        yield _counter("moeswarm_dispatch_failures", "Dispatch requests that failed or timed out, by path.", ["role", "path"], {(role, p): n for p, n in t.failures.items()})
        yield _counter("moeswarm_dispatch_tokens", "Token rows sent to workers.", ["role"], {(role,): t.tokens})
        yield _counter("moeswarm_local_groups", "Expert groups computed locally (no host answered).", ["role"], {(role,): remote.stats.local_groups})
        yield _counter("moeswarm_wire_bytes", "Dispatch payload bytes, by direction, codec and path.", ["direction", "codec", "path"], t.wire_bytes)
        lat = HistogramMetricFamily("moeswarm_dispatch_latency_seconds", "Round trip of a dispatch, by path.", labels=["path"])
        for path, h in sorted(t.latency.items()):
            lat.add_metric([path], h.buckets(), h.total)
        yield lat
        peers: dict[str, int] = {}
        for path in t.last_path.values():
            peers[path] = peers.get(path, 0) + 1
        yield _gauge("moeswarm_peers", "Workers dispatched to, by the path of the newest dispatch.", ["path"], peers)

    def _worker(self, worker: Any) -> Iterator[Metric]:
        st, role = worker.stats, "worker"
        yield _counter("moeswarm_dispatches", "Dispatch requests answered, by path.", ["role", "path"], _by_path(worker, st.by_peer, role))
        yield _counter("moeswarm_dispatch_failures", "Dispatch requests answered with an error.", ["role", "path"], {(role, "any"): st.errors})
        yield _counter("moeswarm_dispatch_tokens", "Token rows computed.", ["role"], {(role,): st.tokens})
        yield _counter("moeswarm_batches", "Expert compute batches run.", ["role"], {(role,): st.batches})
        peers: dict[str, int] = {}
        for peer in st.by_peer:
            path = _path(worker, peer)
            peers[path] = peers.get(path, 0) + 1
        yield _gauge("moeswarm_peers", "Backbones served, by their current path.", ["path"], peers)
        yield GaugeMetricFamily("moeswarm_in_flight", "Dispatch requests accepted and not yet answered.", value=worker.in_flight)

    def _relay(self, relay: Any) -> Iterator[Metric]:
        st = relay.stats
        yield _counter("moeswarm_relay_forwarded", "Packets forwarded between peers.", [], {(): st.forwarded})
        yield _counter("moeswarm_relay_dropped", "Packets dropped, by reason.", ["reason"], {(r,): n for r, n in st.dropped.items()})
        yield _counter("moeswarm_relay_refused", "Connections refused.", [], {(): st.refused})
        yield _gauge("moeswarm_peers", "Peers connected to this relay.", ["path"], {"relay": len(relay.clients())})


def _by_path(worker: Any, by_peer: dict[str, int], role: str) -> dict[tuple[str, ...], int]:
    """The worker counts per peer; a peer's dispatches go under its current path (the path it used is not kept)."""
    out: dict[tuple[str, ...], int] = {}
    for peer, n in by_peer.items():
        key = (role, _path(worker, peer))
        out[key] = out.get(key, 0) + n
    return out or {(role, "direct"): 0}


def _path(worker: Any, peer: str) -> str:
    return str(worker.path_of(PeerId.from_string(peer)))


def _counter(name: str, doc: str, labels: list[str], values: Mapping[tuple[str, ...], int]) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=labels)
    for key, n in sorted(values.items()):
        family.add_metric(list(key), n)
    return family


def _gauge(name: str, doc: str, labels: list[str], values: dict[str, int]) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=labels)
    for key, n in sorted(values.items()):
        family.add_metric([key], n)
    return family


def registry_for(collector: NodeCollector) -> CollectorRegistry:
    """A registry of this node only (no process-global default registry: tests run several nodes in one process)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return registry


def exposition(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
