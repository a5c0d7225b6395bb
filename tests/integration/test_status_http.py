"""`--http` on real processes: /readyz before and after workers exist, and /metrics agreeing across the swarm."""

from __future__ import annotations

import re

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from experts.embedded import EMBEDDED_MODEL
from node.launcher import Cluster
from tests.support import until, wait_for_log

pytestmark = pytest.mark.slow
LOOPBACK_DATAGRAM = "16384"


def scrape(http_addr: str) -> dict[str, float]:
    """``/metrics`` parsed with prometheus_client's own text parser: sample name + sorted labels -> value."""
    text = httpx.get(f"http://{http_addr}/metrics").text
    return {s.name + str(sorted(s.labels.items())): s.value for f in text_string_to_metric_families(text) for s in f.samples}


def dispatches(http_addr: str) -> float:
    return sum(v for k, v in scrape(http_addr).items() if k.startswith("moeswarm_dispatches_total["))


def test_readyz_is_503_until_workers_exist_and_dispatch_counters_agree(tmp_path):
    """The gateway binds HTTP before any worker exists and says why it is not ready (503, on /v1 too); once two
    workers host every expert it is ready (200), and so is the bootstrap that was told the model. After a
    generation, the gateway's dispatch counter equals the sum of the workers', and each node's counter its ledger's receipts
    (every sample parses with prometheus_client's parser)."""
    model = str(EMBEDDED_MODEL)
    with Cluster(tmp_path) as cluster:
        boot = cluster.start("bootstrap", "bootstrap", "--listen", "127.0.0.1:0", "--http", "127.0.0.1:0", "--model", model).wait_ready()
        assert httpx.get(f"http://{boot['http_addr']}/healthz").status_code == 200
        gateway = cluster.start("gateway", "backbone", "serve", "--bootstrap", boot["dht_addrs"][0], "--http", "127.0.0.1:0", "--max-datagram", LOOPBACK_DATAGRAM, "--wait-timeout", "300")
        line = wait_for_log(gateway.log_file, "gateway.listening", timeout=60)
        gw = re.search(r"http_addr=(\S+)", line).group(1)
        ready = httpx.get(f"http://{gw}/readyz")
        assert ready.status_code == 503 and "not ready" in ready.text
        refused = httpx.post(f"http://{gw}/v1/completions", json={"model": "embedded", "prompt": "x", "max_tokens": 1})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "not_ready"
        assert httpx.get(f"http://{boot['http_addr']}/readyz").status_code == 503  # told the model, it lacks hosts

        workers = [cluster.start(f"w{i}", "worker", "--model", model, "--experts", experts, "--bootstrap", boot["dht_addrs"][0], "--http", "127.0.0.1:0", "--max-datagram", LOOPBACK_DATAGRAM) for i, experts in enumerate(("0-15", "16-31"))]
        worker_http = [w.wait_ready()["http_addr"] for w in workers]
        gateway.wait_ready(timeout=300)
        until(lambda: httpx.get(f"http://{gw}/readyz").status_code == 200, timeout=60, what="the gateway sees every expert hosted")
        until(lambda: httpx.get(f"http://{boot['http_addr']}/readyz").status_code == 200, timeout=60, what="the bootstrap sees every layer hosted")

        r = httpx.post(f"http://{gw}/v1/completions", json={"model": "embedded", "prompt": "And God said", "max_tokens": 8, "temperature": 0}, timeout=120)
        assert r.status_code == 200, r.text
        sent = dispatches(gw)
        assert sent > 0 and sent == sum(dispatches(w) for w in worker_http)
        metrics = scrape(gw)
        assert metrics["moeswarm_ready[('role', 'gateway')]"] == 1
        assert sum(v for k, v in metrics.items() if k.startswith("moeswarm_dispatch_latency_seconds_count")) == sent
        assert sum(v for k, v in metrics.items() if k.startswith("moeswarm_wire_bytes_total")) > 0
        # The ledgers commit off the dispatch path: their receipts catch up with the counters.
        for node, want in ((gw, sent), *((w, dispatches(w)) for w in worker_http)):
            until(lambda node=node, want=want: scrape(node).get("moeswarm_ledger_receipts[]") == want, timeout=30, what=f"{node}'s ledger holds {want} receipts")
