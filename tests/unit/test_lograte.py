"""The rate limit on peer-triggerable log events, with a hand-moved clock: a few in full per interval, then one
summary with the exact count; the asyncio edge writes that summary by itself once the interval ends."""

from __future__ import annotations

import asyncio

import pytest

from p2p.lograte import EventRate, Summary
from p2p.lograte_edge import SUMMARY_EVENT, ThrottledLog


class Recorder:
    """A structlog-shaped logger that keeps (level, event, fields)."""

    def __init__(self) -> None:
        self.lines: list[tuple[str, str, dict]] = []

    def __getattr__(self, level: str):
        return lambda event, **fields: self.lines.append((level, event, fields))


def test_a_flood_logs_the_burst_then_one_summary_with_the_count():
    """1,037 occurrences in 0.4 s: the first 3 are admitted, and once the 10 s window ended one summary says 1,034."""
    rate = EventRate(interval=10.0, burst=3)
    admitted = [rate.admit("relay.evicted", i * 0.0004) for i in range(1037)]
    assert admitted[:3] == [True] * 3 and not any(admitted[3:])
    assert rate.due(9.9) == [] and rate.next_due() == 10.0
    assert rate.due(10.0) == [Summary("relay.evicted", 1034, 10.0)]
    assert rate.due(30.0) == [] and rate.next_due() is None  # handed out once


def test_a_quiet_event_is_never_summarised_and_keys_are_independent():
    """Three in a window are all logged and leave nothing to summarise; another key has its own window."""
    rate = EventRate(interval=10.0, burst=3)
    assert all(rate.admit("a", t) for t in (0.0, 1.0, 2.0))
    assert rate.admit("b", 2.5)
    assert not rate.admit("a", 3.0)
    assert rate.due(12.0) == [Summary("a", 1, 10.0)]
    assert rate.admit("a", 12.0)  # a new window opens with the next occurrence


def test_an_occurrence_after_the_window_summarises_it_before_opening_the_next():
    """Without a call to due in between, the ended window's count is not lost."""
    rate = EventRate(interval=10.0, burst=1)
    rate.admit("a", 0.0), rate.admit("a", 1.0), rate.admit("a", 2.0)
    assert rate.admit("a", 15.0)
    assert rate.next_due() == 0.0
    assert rate.due(15.0) == [Summary("a", 2, 10.0)]


def test_keys_beyond_the_cap_summarise_the_oldest_early_and_drain_empties_everything():
    """max_keys bounds the windows held; drain hands out the open windows' counts at shutdown."""
    rate = EventRate(interval=10.0, burst=0, max_keys=2)
    for key in ("a", "b", "c"):
        assert not rate.admit(key, 1.0)
    assert rate.due(1.0) == [Summary("a", 1, 0.0)]
    assert sorted(rate.drain(4.0), key=lambda s: s.key) == [Summary("b", 1, 3.0), Summary("c", 1, 3.0)]
    assert rate.drain(5.0) == [] and rate.next_due() is None


def test_bad_parameters_are_refused():
    with pytest.raises(ValueError):
        EventRate(interval=0)


def test_the_edge_writes_a_few_lines_and_a_summary_at_the_events_level():
    """Through ThrottledLog with an injected clock: 1,000 warnings give 3 lines and one warning summary."""
    now = [0.0]
    rec = Recorder()
    log = ThrottledLog(rec, interval=10.0, burst=3, clock=lambda: now[0])
    for i in range(1000):
        now[0] = i * 0.001
        log.warning("relay.evicted", remote=f"10.0.0.{i % 250}:1")
    assert [line[1] for line in rec.lines] == ["relay.evicted"] * 3
    now[0] = 10.5
    log.flush()
    assert rec.lines[3] == ("warning", SUMMARY_EVENT, {"of": "relay.evicted", "suppressed": 997, "seconds": 10.0})
    assert len(rec.lines) == 4


def test_each_cause_of_an_event_has_its_own_window():
    """A flood refused for one reason does not hide the first line of another reason of the same event."""
    rec = Recorder()
    log = ThrottledLog(rec, interval=10.0, burst=1, clock=lambda: 0.0)
    for _ in range(100):
        log.info("dht.provider_refused", per="peer_limit", reason="peer_limit")
    log.info("dht.provider_refused", per="group_full", reason="group_full")
    assert [line[2]["reason"] for line in rec.lines] == ["peer_limit", "group_full"]
    log.close()
    assert rec.lines[2] == ("info", SUMMARY_EVENT, {"of": "dht.provider_refused/peer_limit", "suppressed": 99, "seconds": 0.0})


def test_in_a_loop_the_summary_comes_by_itself_when_the_interval_ends():
    """No later event and no flush: the loop's timer writes the summary once the (short) interval ended."""
    rec = Recorder()

    async def flood() -> None:
        log = ThrottledLog(rec, interval=0.2, burst=1)
        for _ in range(50):
            log.info("quic.overloaded")
        for _ in range(100):  # bounded wait for the timer
            if len(rec.lines) == 2:
                break
            await asyncio.sleep(0.02)
        log.close()

    asyncio.run(flood())
    assert rec.lines[0][1] == "quic.overloaded"
    assert rec.lines[1][:2] == ("info", SUMMARY_EVENT) and rec.lines[1][2]["suppressed"] == 49
    assert len(rec.lines) == 2  # close found nothing left to write
