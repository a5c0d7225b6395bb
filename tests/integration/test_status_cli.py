"""`moeswarm status` on real processes: the coverage map of a bootstrap and two workers, as JSON and as tables."""

from __future__ import annotations

import json

import pytest

from node.launcher import Cluster
from tests.support import moeswarm, until

from ..conftest import make_model

pytestmark = pytest.mark.slow


def test_status_lists_every_worker_range_in_json_and_tables(tmp_path, model_dir):
    """Two workers with different expert (and layer) ranges: the JSON lists each one's ranges per layer and the
    gap they leave; the table shows both hosts with their ranges and marks the gap."""
    model = str(make_model(model_dir, "qwen3moe", n_expert=32, n_layer=3))
    with Cluster(tmp_path) as cluster:
        boot = cluster.start("bootstrap", "bootstrap", "--listen", "127.0.0.1:0").wait_ready()["dht_addrs"][0]
        a = cluster.start("a", "worker", "--model", model, "--experts", "0-15", "--bootstrap", boot)
        b = cluster.start("b", "worker", "--model", model, "--experts", "16-31", "--layers", "0-1", "--bootstrap", boot)
        ready = {w["peer_id"]: w for w in (a.wait_ready(), b.wait_ready())}
        a_id, b_id = a.wait_ready()["peer_id"], b.wait_ready()["peer_id"]

        def status_json() -> dict | None:
            r = moeswarm("status", "--bootstrap", boot, "--model", model, "--json")
            assert r.returncode == 0, r.stderr
            got = json.loads(r.stdout)
            return got if len(got["hosts"]) == 2 else None

        got = until(status_json, timeout=60, what="both workers in the DHT")
        hosts = {h["peer"]: h for h in got["hosts"]}
        assert set(hosts) == set(ready)
        assert hosts[a_id]["expert_ranges"] == {"0": [[0, 16]], "1": [[0, 16]], "2": [[0, 16]]}
        assert hosts[b_id]["expert_ranges"] == {"0": [[16, 32]], "1": [[16, 32]]}
        assert hosts[a_id]["addr"] == ready[a_id]["quic_addr"] and hosts[a_id]["announced"] == "direct"
        assert got["lacking_layers"] == [2]

        table = moeswarm("status", "--bootstrap", boot, "--model", model)
        assert table.returncode == 0, table.stderr
        text = table.stdout
        assert "experts 0-15" in text and "experts 16-31" in text and "2 hosts" in text
        for peer, addr in ((a_id, ready[a_id]["quic_addr"]), (b_id, ready[b_id]["quic_addr"])):
            assert peer[-8:] in text and addr in text
        rows = {line.split("│")[1].strip(): line for line in text.splitlines() if line.count("│") >= 3 and line.split("│")[1].strip().isdigit()}
        assert "none" in rows["2"] and a_id[-8:] in rows["2"] and b_id[-8:] in rows["0"]
        assert "layers lacking hosts for some experts: 2" in text
