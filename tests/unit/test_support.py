"""tests.support: the polling helpers wait for the condition and fail when it never holds; the fake clock moves by hand."""

from __future__ import annotations

import asyncio

import pytest

from tests.support import (
    FakeClock,
    async_poll,
    async_until,
    log_offset,
    run_bounded,
    until,
    wait_for_log,
)


def test_until_returns_the_first_truthy_value():
    """until polls until the predicate holds and hands back what it returned."""
    calls = iter([0, None, "", "found", "later"])
    assert until(lambda: next(calls), timeout=5, interval=0) == "found"


def test_until_fails_the_test_naming_what_never_happened():
    """A predicate that never holds is an AssertionError that says what was awaited."""
    with pytest.raises(AssertionError, match="the door opened"):
        until(lambda: False, timeout=0.05, interval=0.01, what="the door opened")


def test_async_until_takes_plain_and_async_predicates():
    """async_until awaits an async predicate, calls a plain one, and lets the loop run meanwhile."""

    async def scenario() -> tuple[int, str]:
        flag = asyncio.Event()
        asyncio.get_running_loop().call_soon(flag.set)
        first = await async_until(flag.is_set, timeout=5, interval=0)
        answers = iter([False, "yes"])

        async def probe() -> bool | str:
            return next(answers)

        return first, await async_until(probe, timeout=5, interval=0)

    assert run_bounded(scenario(), timeout=10) == (True, "yes")


def test_async_until_fails_when_the_condition_never_holds():
    """async_until raises AssertionError at its timeout."""
    with pytest.raises(AssertionError, match="not within"):
        run_bounded(async_until(lambda: False, timeout=0.05, interval=0.01), timeout=10)


def test_async_poll_returns_the_last_result_either_way():
    """async_poll stops at the first accepted result, or returns the last one probed at its timeout."""
    seen = iter(range(100))

    async def probe() -> int:
        return next(seen)

    assert run_bounded(async_poll(probe, lambda n: n == 3, timeout=5, interval=0), timeout=10) == 3
    last = run_bounded(async_poll(probe, lambda n: False, timeout=0.05, interval=0.01), timeout=10)
    assert last > 3


def test_run_bounded_cancels_a_hang():
    """A coroutine that never finishes fails with TimeoutError at the bound."""
    with pytest.raises(TimeoutError):
        run_bounded(asyncio.Event().wait(), timeout=0.05)


def test_fake_clock_moves_only_by_hand():
    """FakeClock returns now until advanced or set."""
    clock = FakeClock(100.0)
    assert clock() == clock() == 100.0
    assert clock.advance(2.5) == 102.5 == clock()
    clock.now = 7.0
    assert clock() == 7.0


def test_wait_for_log_looks_past_the_offset(tmp_path):
    """wait_for_log finds a line holding every needle after `since`, and fails with the log's tail otherwise."""
    log = tmp_path / "node.log"
    assert log_offset(log) == 0
    log.write_text("relay.connected peer=A\n")
    mark = log_offset(log)
    with log.open("a") as f:
        f.write("relay.connected peer=B\n")
    assert wait_for_log(log, "relay.connected", timeout=5) == "relay.connected peer=A"
    assert wait_for_log(log, "relay.connected", timeout=5, since=mark) == "relay.connected peer=B"
    with pytest.raises(AssertionError, match="peer=B"):
        wait_for_log(log, "relay.connected", "peer=A", timeout=0.05, since=mark, interval=0.01)
