"""`--http` on real processes: /readyz before and after workers exist."""

from __future__ import annotations

import re

import httpx
import pytest

from experts.embedded import EMBEDDED_MODEL
from node.launcher import Cluster
from tests.support import until, wait_for_log

pytestmark = pytest.mark.slow
LOOPBACK_DATAGRAM = "16384"


def test_readyz_is_503_until_workers_exist(tmp_path):
    """The gateway binds HTTP before any worker exists and says why it is not ready (503, on /v1 too); once two
    workers host every expert it is ready (200), and so is the bootstrap that was told the model."""
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
        for w in workers:
            w.wait_ready()
        gateway.wait_ready(timeout=300)
        until(lambda: httpx.get(f"http://{gw}/readyz").status_code == 200, timeout=60, what="the gateway sees every expert hosted")
        until(lambda: httpx.get(f"http://{boot['http_addr']}/readyz").status_code == 200, timeout=60, what="the bootstrap sees every layer hosted")
