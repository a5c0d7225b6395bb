"""node.bench.common: the figures every benchmark derives from dispatch records."""

from __future__ import annotations

from node.backbone.dispatch import DispatchRecord
from node.bench.common import overhead_ms_p50


def test_overhead_is_the_median_of_each_dispatch_round_trip_minus_its_worker_time():
    """`overhead_ms_p50` pairs each answered dispatch's round trip with its own worker time; failures and probes are left out."""
    def rec(latency: float, worker: float, *, ok: bool = True, probe: bool = False) -> DispatchRecord:
        return DispatchRecord(1, "peer", "direct", 1, 100, 100, latency, ok, worker, probe)

    records = [rec(3.0, 2.0), rec(10.0, 8.5), rec(4.0, 1.0), rec(50.0, 0.0, ok=False), rec(90.0, 1.0, probe=True)]
    assert overhead_ms_p50(records) == 1.5  # gaps 1.0, 1.5, 3.0 (the medians' difference would be 4.0 - 2.0 = 2.0)
    assert overhead_ms_p50([]) == 0.0
