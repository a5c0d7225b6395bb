"""Wait for a condition instead of sleeping a guessed time: fast when things are fast, patient under load.

``until`` (threads, processes) and ``async_until`` (inside an event loop) poll a predicate and return its first
truthy value, or fail the test naming what never happened. ``async_poll`` returns the last probed value either way,
for tests whose own assertion should show what was found. ``run_bounded`` runs a coroutine under a deadline so a
hang fails one test instead of the suite's timeout.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")


def _describe(predicate: Callable[..., Any], what: str) -> str:
    return what or getattr(predicate, "__qualname__", repr(predicate))


def until(predicate: Callable[[], T], timeout: float = 10.0, interval: float = 0.05, what: str = "") -> T:
    """Call ``predicate`` every ``interval`` s until it returns something truthy, and return that.

    Raises ``AssertionError`` (a test failure, naming ``what``) if it has not within ``timeout`` s.
    """
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() >= deadline:
            raise AssertionError(f"not within {timeout} s: {_describe(predicate, what)}")
        time.sleep(interval)


async def async_until(
    predicate: Callable[[], T | Awaitable[T]], timeout: float = 10.0, interval: float = 0.05, what: str = ""
) -> T:
    """``until`` for an event loop: the predicate may be a plain or an async function; the loop keeps running."""
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return result  # type: ignore[return-value]
        if time.monotonic() >= deadline:
            raise AssertionError(f"not within {timeout} s: {_describe(predicate, what)}")
        await asyncio.sleep(interval)


async def async_poll(
    probe: Callable[[], Awaitable[T]], accept: Callable[[T], bool], timeout: float, interval: float = 0.2
) -> T:
    """Await ``probe()`` until ``accept(result)`` or ``timeout`` s; return the last result for the caller's assertion."""
    deadline = time.monotonic() + timeout
    while True:
        result = await probe()
        if accept(result) or time.monotonic() >= deadline:
            return result
        await asyncio.sleep(interval)


def run_bounded(coro: Awaitable[T], timeout: float) -> T:
    """``asyncio.run(coro)``, cancelled with ``TimeoutError`` after ``timeout`` s."""

    async def bounded() -> T:
        async with asyncio.timeout(timeout):
            return await coro

    return asyncio.run(bounded())
