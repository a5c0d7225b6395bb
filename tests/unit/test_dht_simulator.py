"""The DHT simulator at 500 nodes: our lookup and upkeep code finds the live hosts before and under churn.

`node/bench/dhtsim.py` runs real `p2p.dht._Node`s over a simulated network on trio's virtual clock, so this runs the
scale code (walks, provider entries, re-provides, record validation, churn) on every suite run in ~30 CPU s;
`moeswarm bench dht --simulate --nodes 10000` is the benchmark."""

from __future__ import annotations

import math

from node.bench.dhtsim import Options, run
from p2p.dht.kademlia import _Node


def test_500_simulated_nodes_find_their_hosts_before_and_under_churn(monkeypatch):
    """Grown from one node, 30% NAT-bound, 1% loss, 20% churn per hour: lookups find >= 97% of live hosts in at
    most log2 N rounds, churn really replaced nodes, and the upkeep traffic is counted."""
    made: list[_Node] = []
    init = _Node.__init__

    def spy(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(_Node, "__init__", spy)
    opts = Options(nodes=500, layers=8, lookups=40, grow_s=300, settle_s=120, churn_s=900, seed=3)
    result = run(opts)
    assert len(made) >= opts.nodes  # every simulated node is the product's node class
    assert result["hosts"] >= 0.1 * opts.nodes
    for phase in ("before_churn", "under_churn"):
        r = result[phase]
        assert r["lookups"] >= 30, r
        assert r["found_fraction"]["mean"] >= 0.97, r
        assert r["rounds"]["median"] <= math.log2(opts.nodes), r
    assert result["under_churn"]["departures_per_node_hour"] > 0.05, result["under_churn"]
    assert len(made) > opts.nodes  # newcomers replaced the departed
    assert 1 < result["messages_per_node_hour"] < 10_000, result
