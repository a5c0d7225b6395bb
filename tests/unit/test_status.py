"""The status core without sockets: coverage map, readiness, metrics exposition, the page, and the HTTP routes."""

from __future__ import annotations

import asyncio
from collections import Counter, deque
from types import SimpleNamespace

from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families

from node.backbone.dispatch import DispatchRecord, DispatchStats
from node.gateway.server import Gateway
from node.status.coverage import Phase, Seen, build_coverage, host_summaries, readiness
from node.status.metrics import RecordTail
from node.status.page import render
from node.status.server import ModelShape, NodeStatus, add_routes
from p2p.dht.records import HostedSlice, HostRecord, RelayAddress
from p2p.identity import Identity
from p2p.pathkind import Path

DIGEST = "ab" * 32
A, B = Identity.generate(), Identity.generate()


def record(ident: Identity, layer: int, ranges, *, quic="127.0.0.1:1", relay=None) -> HostRecord:
    return HostRecord(ident.peer_id, HostedSlice(DIGEST, layer, ranges, quic_addr=quic, relay=relay), 1000, 2000, 1)


def test_coverage_cuts_each_layer_at_every_announced_boundary_and_shows_gaps():
    """Hosts of 0-15 and 8-31 give cells 0-7, 8-15, 16-31 with their hosts; a layer nobody serves is one gap."""
    relay = RelayAddress("ws://127.0.0.1:3340/relay", B.peer_id)
    records = {0: [record(A, 0, ((0, 16),)), record(B, 0, ((8, 32),), quic=None, relay=relay)]}
    cov = build_coverage(DIGEST, 2, 32, records, 1500.0, {str(A.peer_id): Seen("direct", 1.5)})
    cells = [(c.layer, c.start, c.stop, sorted(h.peer for h in c.hosts)) for c in cov.cells]
    a, b = str(A.peer_id), str(B.peer_id)
    assert cells == [(0, 0, 8, [a]), (0, 8, 16, sorted([a, b])), (0, 16, 32, [b]), (1, 0, 32, [])]
    assert cov.lacking == [1]
    assert cov.peers[b].announced == "relay" and cov.peers[a].announced == "direct"
    assert cov.peers[a].seen == Seen("direct", 1.5)


def test_host_summaries_merge_the_cells_back_into_each_hosts_ranges():
    """A host cut into several cells by others' boundaries is shown with the ranges it announced, per layer."""
    records = {0: [record(A, 0, ((0, 16),)), record(B, 0, ((8, 32),))], 1: [record(A, 1, ((0, 4), (20, 32)))]}
    hosts = {h.view.peer: h for h in host_summaries(build_coverage(DIGEST, 2, 32, records, 1500.0))}
    assert hosts[str(A.peer_id)].ranges == {0: ((0, 16),), 1: ((0, 4), (20, 32))}
    assert hosts[str(B.peer_id)].ranges == {0: ((8, 32),)}
    assert hosts[str(A.peer_id)].to_json()["expert_ranges"] == {"0": [[0, 16]], "1": [[0, 4], [20, 32]]}


def test_one_lookup_that_misses_a_host_does_not_make_the_node_unready():
    """A lookup round that misses a host (a timeout on a busy node) keeps the last round's live record of it once:
    an empty round, or one that found only the other host of a layer. Missed twice, the host is dropped, and an
    expired record is never kept."""
    import time

    now = int(time.time())
    live = HostRecord(A.peer_id, HostedSlice(DIGEST, 0, ((0, 32),), quic_addr="127.0.0.1:1"), now - 10, now + 600, 1)
    answers = [[live], [], []]

    class Discovery:
        async def lookup(self, digest, layer, *, fresh=False):
            return answers.pop(0)

    status = NodeStatus("gateway", "p", Phase.SERVING, ModelShape(DIGEST, 1, 32, 0), Discovery(), needs_swarm=True)
    verdicts = []
    for _ in range(3):
        asyncio.run(status.refresh())
        verdicts.append(status.not_ready())
    assert verdicts == [None, None, "layers 0 lack hosts for some experts"]
    half = HostedSlice(DIGEST, 0, ((0, 16),), quic_addr="127.0.0.1:1")
    a, b = HostRecord(A.peer_id, half, now - 10, now + 600, 1), HostRecord(B.peer_id, HostedSlice(DIGEST, 0, ((16, 32),), quic_addr="127.0.0.1:2"), now - 10, now + 600, 1)
    answers[:] = [[a, b], [b], [b]]  # A answers no more: kept for the round that missed it, gone at the next
    hosts = []
    for _ in range(3):
        asyncio.run(status.refresh())
        hosts.append(({h.peer for c in status.coverage.cells for h in c.hosts}, status.not_ready()))
    both = {str(A.peer_id), str(B.peer_id)}
    assert hosts == [(both, None), (both, None), ({str(B.peer_id)}, "layers 0 lack hosts for some experts")]
    expired = HostRecord(A.peer_id, live.hosted, now - 700, now - 100, 1)
    answers[:] = [[expired], []]
    asyncio.run(status.refresh())
    asyncio.run(status.refresh())
    assert status.not_ready() == "layers 0 lack hosts for some experts"


def test_readiness_names_the_phase_or_the_layers_lacking_hosts():
    """Only a serving node is ready; one that needs the swarm also needs every layer fully hosted."""
    full = build_coverage(DIGEST, 1, 32, {0: [record(A, 0, ((0, 32),))]}, 0.0)
    half = build_coverage(DIGEST, 1, 32, {0: [record(A, 0, ((0, 16),))]}, 0.0)
    assert readiness(Phase.LOADING, full, needs_swarm=False) == "loading"
    assert readiness(Phase.SERVING, None, needs_swarm=False) is None
    assert readiness(Phase.SERVING, None, needs_swarm=True) == "no DHT lookup finished yet"
    assert readiness(Phase.SERVING, half, needs_swarm=True) == "layers 0 lack hosts for some experts"
    assert readiness(Phase.SERVING, full, needs_swarm=True) is None
    assert readiness(Phase.DRAINING, full, needs_swarm=True) == "draining"


def test_record_tail_counts_each_record_once_across_a_full_bounded_deque():
    """After the deque wrapped, only the records appended since the last call are new."""
    items: deque[object] = deque(maxlen=3)
    tail = RecordTail()
    first = [object(), object()]
    items.extend(first)
    assert tail.new(items) == first
    later = [object(), object(), object()]
    items.extend(later)
    assert tail.new(items) == later
    assert tail.new(items) == []


def _remote(records) -> SimpleNamespace:
    stats = DispatchStats()
    stats.records.extend(records)
    return SimpleNamespace(stats=stats, codec=SimpleNamespace(name="F16"))


def _metrics(status: NodeStatus) -> dict[str, list]:
    from node.status.metrics import exposition

    return {f.name: f.samples for f in text_string_to_metric_families(exposition(status.registry).decode())}


def test_backbone_metrics_parse_and_count_dispatches_bytes_and_latency_by_path():
    """The exposition parses with prometheus_client's parser; counters add each record once, by path and codec."""
    recs = [DispatchRecord(0, "p1", Path.DIRECT, 4, 100, 50, 2.0, True), DispatchRecord(1, "p2", Path.RELAY, 4, 100, 50, 20.0, True), DispatchRecord(1, "p2", Path.RELAY, 4, 100, 0, 5000.0, False)]
    status = NodeStatus("gateway", "me", phase=Phase.SERVING, remote=_remote(recs))
    m = _metrics(status)
    assert {(s.labels["path"], s.value) for s in m["moeswarm_dispatches"] if s.name.endswith("_total")} == {("direct", 1), ("relay", 1)}
    assert [s.value for s in m["moeswarm_dispatch_failures"] if s.name.endswith("_total")] == [1]
    wire = {(s.labels["direction"], s.labels["codec"], s.labels["path"]): s.value for s in m["moeswarm_wire_bytes"] if s.name.endswith("_total")}
    assert wire == {("out", "f16", "direct"): 100, ("back", "f16", "direct"): 50, ("out", "f16", "relay"): 100, ("back", "f16", "relay"): 50}
    count = {s.labels["path"]: s.value for s in m["moeswarm_dispatch_latency_seconds"] if s.name.endswith("_count")}
    assert count == {"direct": 1, "relay": 1}
    assert {s.labels["path"]: s.value for s in m["moeswarm_peers"]} == {"relay": 1, "direct": 1}
    again = _metrics(status)  # a second scrape adds nothing new
    assert {s.value for s in again["moeswarm_dispatches"] if s.name.endswith("_total")} == {1}


def test_worker_and_relay_metrics_read_their_counters():
    """A worker's counters come from Worker.stats (under each backbone's path); a relay's from RelayStats."""
    worker = SimpleNamespace(stats=SimpleNamespace(dispatches=3, errors=1, batches=2, tokens=12, by_peer={str(A.peer_id): 3}), path_of=lambda peer: Path.RELAY, in_flight=0)
    relay = SimpleNamespace(stats=SimpleNamespace(forwarded=7, dropped=Counter({"queue_full": 2}), refused=1), clients=lambda: [A.peer_id])
    m = _metrics(NodeStatus("worker", "me", worker=worker))
    assert [(s.labels, s.value) for s in m["moeswarm_dispatches"] if s.name.endswith("_total")] == [({"role": "worker", "path": "relay"}, 3)]
    assert [s.value for s in m["moeswarm_ready"]] == [0]  # still starting
    r = _metrics(NodeStatus("relay", "me", relay=relay))
    assert [s.value for s in r["moeswarm_relay_forwarded"] if s.name.endswith("_total")] == [7]
    assert [(s.labels, s.value) for s in r["moeswarm_relay_dropped"] if s.name.endswith("_total")] == [({"reason": "queue_full"}, 2)]


def test_page_escapes_what_peers_announce_and_refreshes_itself():
    """Record fields are peer-controlled: the page escapes them; the meta refresh carries the interval."""
    cov = build_coverage(DIGEST, 1, 32, {0: [record(A, 0, ((0, 32),), quic="<b>x</b>:1")]}, 0.0)
    status = NodeStatus("bootstrap", "me", phase=Phase.SERVING, refresh_s=3)
    status.coverage = cov
    html = render(status.snapshot(), 3)
    assert '<meta http-equiv="refresh" content="3">' in html
    assert "<b>x</b>" not in html and "&lt;b&gt;x&lt;/b&gt;" in html
    assert f'data-peer="{A.peer_id}"' in html and 'data-layer="0" data-experts="0-31"' in html


def _get(app, *steps) -> list[tuple[int, str]]:
    """GET each path in *steps* (a callable among them runs in between), on one test server."""

    async def scenario() -> list[tuple[int, str]]:
        async with TestClient(TestServer(app)) as client:
            out = []
            for step in steps:
                if callable(step):
                    step()
                    continue
                resp = await client.get(step)
                out.append((resp.status, await resp.text()))
            return out

    return asyncio.run(scenario())


def test_routes_answer_liveness_readiness_and_the_page():
    """/healthz is 200 at once; /readyz is 503 with the reason until the node serves, then 200."""
    from aiohttp import web

    status = NodeStatus("worker", "me", phase=Phase.LOADING, model=ModelShape(DIGEST, 1, 32))
    app = web.Application()
    add_routes(app, status)
    (h, _), (r, why), (s, page), (j, _), after = _get(app, "/healthz", "/readyz", "/status", "/status.json", lambda: setattr(status, "phase", Phase.SERVING), "/readyz")
    assert (h, r, s, j) == (200, 503, 200, 200) and "loading" in why and "<table id=node>" in page
    assert after == (200, "ready\n")


def test_gateway_answers_503_until_it_has_an_engine():
    """Before attach(), /v1 requests get 503 with the readiness reason, and /readyz says the same."""
    status = NodeStatus("gateway", "me", phase=Phase.WAITING, needs_swarm=True)
    gateway = Gateway(None, "tiny", "0" * 64, status)
    (v1, body), (ready, why) = _get(gateway.app, "/v1/stats", "/readyz")
    assert v1 == 503 and "waiting for hosts" in body and "not_ready" in body
    assert ready == 503 and "waiting for hosts" in why


def test_coverage_of_a_model_with_dense_layers_lists_only_its_moe_layers():
    """llama4 with experts on layers 1 and 3: the dense layers 0 and 2 are no gap; an unhosted MoE layer is."""
    cov = build_coverage(DIGEST, 4, 32, {1: [record(A, 1, ((0, 32),))]}, 0.0, layers=(1, 3))
    assert sorted({c.layer for c in cov.cells}) == [1, 3] and cov.lacking == [3]
