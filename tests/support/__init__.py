"""Shared test helpers: wait on a condition (never a fixed sleep), a hand-moved clock, `moeswarm` processes, and
an in-memory datagram network (:mod:`tests.support.simnet`) and memory cgroups (:mod:`tests.support.cgroups`), both imported by name.

Re-exported here so tests write ``from tests.support import until, FakeClock``; each lives in a small module named
for what it holds.
"""

from tests.support.clock import FakeClock
from tests.support.polling import async_poll, async_until, run_bounded, until
from tests.support.processes import MOESWARM, log_offset, moeswarm, wait_for_log

__all__ = [
    "MOESWARM",
    "FakeClock",
    "async_poll",
    "async_until",
    "log_offset",
    "moeswarm",
    "run_bounded",
    "until",
    "wait_for_log",
]
