"""The gateway's per-minute line: what the last interval served and which hosts did the work.

A person watching ``backbone serve`` at the default level wants to know it is doing
something and whether the swarm under it is healthy, without a line per request: tokens,
requests (finished and failed), dispatches and failed dispatches, and the workers that
answered. :func:`summarize` is pure (counters and dispatch records in, the line's fields
or None for a quiet interval out); :func:`log_summaries` is the loop that logs it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Reversible
from dataclasses import dataclass

import structlog

from node.backbone.dispatch import DispatchRecord

log = structlog.get_logger("node.gateway.summary")


@dataclass(frozen=True)
class Counts:
    """The engine's running totals at one moment (``EngineStats``)."""

    requests: int = 0
    completion_tokens: int = 0
    failed: int = 0


def summarize(before: Counts, now: Counts, records: Reversible[DispatchRecord], since: float) -> dict | None:
    """The fields of ``gateway.summary`` for the interval from *since* (``time.monotonic``), or None if nothing happened.

    *records* are the dispatcher's, oldest first; background probes of benched hosts are not the requests' dispatches
    and are left out. A request counts when it starts, its tokens and a failure when it ends."""
    recent = []
    for r in reversed(records):  # newest first: stop at the interval's start
        if r.at < since:
            break
        if not r.probe:
            recent.append(r)
    requests, tokens, failed = now.requests - before.requests, now.completion_tokens - before.completion_tokens, now.failed - before.failed
    if not (requests or tokens or failed or recent):
        return None
    return {
        "requests": requests,
        "tokens": tokens,
        "failed_requests": failed,
        "dispatches": len(recent),
        "failed_dispatches": sum(not r.ok for r in recent),
        "hosts": len({r.peer for r in recent if r.ok}),
    }


async def log_summaries(counts: Callable[[], Counts], records: Reversible[DispatchRecord], interval: float) -> None:
    """Every *interval* seconds, one ``gateway.summary`` line at info (none for a quiet interval); runs until cancelled."""
    before, since = counts(), time.monotonic()
    while True:
        await asyncio.sleep(interval)
        now, until = counts(), time.monotonic()
        if (fields := summarize(before, now, records, since)) is not None:
            log.info("gateway.summary", seconds=interval, **fields)
        before, since = now, until
