"""The gateway's per-minute summary line: what the interval served, its dispatches and the hosts that answered."""

from __future__ import annotations

import asyncio
import time

import structlog

from node.backbone.dispatch import DispatchRecord
from node.gateway.summary import Counts, log_summaries, summarize


def record(peer: str, at: float, ok: bool = True, probe: bool = False) -> DispatchRecord:
    return DispatchRecord(0, peer, "direct", 1, 10, 10, 1.0, ok, probe=probe, at=at)


def test_summary_counts_the_interval_only():
    """Counters are differences; dispatches before the interval and background probes are left out; hosts that answered are counted once."""
    records = [record("old", 1.0), record("a", 10.0), record("a", 11.0), record("b", 12.0, ok=False), record("c", 13.0, probe=True), record("d", 14.0)]
    got = summarize(Counts(3, 100, 0), Counts(5, 164, 1), records, since=10.0)
    assert got == {"requests": 2, "tokens": 64, "failed_requests": 1, "dispatches": 4, "failed_dispatches": 1, "hosts": 2}


def test_a_quiet_interval_has_no_line():
    """Nothing requested and nothing dispatched: no line (an idle gateway stays silent)."""
    assert summarize(Counts(5, 164, 1), Counts(5, 164, 1), [record("a", 1.0)], since=10.0) is None


def test_the_loop_logs_one_info_line_per_busy_interval():
    """`gateway.summary` is logged at info with the interval's figures, and nothing once the gateway is idle."""
    totals = [Counts()]
    records: list[DispatchRecord] = []

    async def run() -> list[dict]:
        with structlog.testing.capture_logs() as logs:
            task = asyncio.create_task(log_summaries(lambda: totals[-1], records, 0.01))
            await asyncio.sleep(0)  # the loop took its first reading
            totals.append(Counts(1, 12, 0))
            records.append(record("a", time.monotonic()))
            while not logs:
                await asyncio.sleep(0.01)
            for _ in range(3):  # idle intervals
                await asyncio.sleep(0.01)
            task.cancel()
        return logs

    logs = asyncio.run(run())
    assert [e["event"] for e in logs] == ["gateway.summary"] and logs[0]["log_level"] == "info"
    assert (logs[0]["requests"], logs[0]["tokens"], logs[0]["dispatches"], logs[0]["hosts"]) == (1, 12, 1, 1)
