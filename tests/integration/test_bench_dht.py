"""`moeswarm bench dht` on a tiny swarm: real py-libp2p nodes in several processes, the report's shape and sense."""

from __future__ import annotations

import json

import pytest

from tests.support import moeswarm

pytestmark = pytest.mark.slow


def test_bench_dht_finds_every_announcer_and_reports_hops_latency_and_churn():
    """7 nodes in 3 processes: before churn every lookup finds every live announcer of its layer; the report has
    hops, latency percentiles and the killed count."""
    p = moeswarm("bench", "dht", "--nodes", "7", "--procs", "2", "--layers", "2", "--lookups", "6", "--churn", "0.34", "--upkeep", "120", "--in-flight", "2", "--lookup-timeout", "30", "--json", timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    r = json.loads(p.stdout)
    before, after = r["before_churn"], r["after_churn"]
    assert r["nodes"] == 7 and r["processes"] == 3 and r["churn"]["killed"] == 2 and r["upkeep_s"] == 120 and r["lookups_in_flight"] == 2 and r["lookup_timeout_s"] == 30
    assert r["live_nodes"] == 7 and r["start_failures"] == 0  # a quiet loopback swarm: every node joined at once
    assert before["lookups"] == 6 and before["found_fraction"]["all_found"] == 1.0 and before["dead_hosts_named"] == 0, before
    assert before["timed_out"] == 0 and before["found_fraction_finished"] == 1.0
    assert before["providers_named_fraction"]["min"] == 1.0  # every announcer named by the provider walks...
    assert before["record_walks"] == {"walks": 0, "found": 0}  # ...and every record fetched from its live owner
    assert after["record_walks"]["walks"] >= 1  # the killed announcers' records: asked of their replicas
    assert before["hops"]["median"] >= 1 and before["latency_ms"]["p50"] > 0
    assert after["lookups"] == 6 and 0 <= after["found_fraction"]["mean"] <= 1
