"""Events a remote peer can trigger at will cost a bounded number of log lines, against real processes: a relay
that evicts 1,000 idle unauthenticated connections writes a few lines and a summary with the count."""

from __future__ import annotations

import asyncio
import re
import time

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from node.launcher import Cluster
from relay.protocol import SUBPROTOCOL
from tests.support.idle_sockets import closed_by_peer
from tests.support.processes import wait_for_log

pytestmark = pytest.mark.slow
MAX_CLIENTS = 16
EVICTIONS = 1_000
MAX_LINES = 30  # the relay's start-up lines, 3 of each event in full, their summaries (one per 10 s window)


def test_a_thousand_evicted_relay_connections_write_a_bounded_log(tmp_path):
    """1,016 idle WebSocket upgrades at a relay that holds 16: 1,000 are evicted, and the relay's log holds at most
    3 lines per event and a `log.suppressed` summary whose counts add up to every eviction."""
    with Cluster(tmp_path) as cluster:
        relay = cluster.start("relay", "relay", "--listen", "127.0.0.1:0", "--max-clients", str(MAX_CLIENTS), "--max-per-ip", "0")
        url = relay.wait_ready()["url"]

        async def attack() -> int:
            idle: list = []
            deadline = time.monotonic() + 120
            try:
                for _ in range(MAX_CLIENTS + EVICTIONS):
                    try:
                        idle.append(await connect(url, subprotocols=[SUBPROTOCOL], open_timeout=10, ping_interval=None, max_queue=1))
                    except InvalidStatus as exc:  # a relay full of authenticated peers would say 503: not here
                        raise AssertionError(f"refused instead of evicting: {exc}") from None
                    if time.monotonic() > deadline:
                        break
                return await closed_by_peer(idle)
            finally:
                await asyncio.gather(*(ws.close() for ws in idle), return_exceptions=True)

        assert asyncio.run(attack()) >= EVICTIONS
        wait_for_log(relay.log_file, "log.suppressed", "of=relay.evicted", timeout=30)  # the 10 s window ended
        lines = relay.log_file.read_text().splitlines()
    evicted_lines = [line for line in lines if "relay.evicted" in line and "log.suppressed" not in line]
    summarised = sum(int(m.group(1)) for line in lines if "of=relay.evicted" in line and (m := re.search(r"suppressed=(\d+)", line)))
    assert len(evicted_lines) <= 3 * 2, evicted_lines  # at most two 10 s windows under heavy load
    assert len(evicted_lines) + summarised >= EVICTIONS  # every eviction is either a line or counted in a summary
    assert len(lines) <= MAX_LINES, "\n".join(lines[:60])
