"""p2p.backoff: one exponential schedule, each caller with its own constants."""

from __future__ import annotations

import math
import random

import pytest

from experts.errors import LocalProtocolError
from node.backbone import routing, spotcheck
from p2p.backoff import Backoff
from p2p.nat import paths
from relay import client


def test_delays_double_from_first_and_stop_at_cap():
    """Attempt n waits first * factor**n, never more than cap, and never less than first for negative n."""
    b = Backoff(first=1.5, cap=20.0, factor=3.0)
    assert [b.delay(n) for n in range(5)] == [1.5, 4.5, 13.5, 20.0, 20.0]
    assert b.delay(-3) == 1.5
    assert b.delay(10**6) == 20.0  # no overflow however many failures pile up


def test_each_former_copy_keeps_its_schedule():
    """Relay reconnects, punch retries, host benching, spot-check bans and the NAT RTO keep their old delays."""
    assert [routing.BENCH.delay(f - 1) for f in range(1, 9)] == [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0]
    assert [spotcheck.BAN.delay(n - 1) for n in range(1, 9)] == [60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 3600.0, 3600.0]
    punch = paths.Backoff()
    assert (punch.first, punch.cap, punch.factor, punch.skip, punch.stable_after) == (30.0, 1800.0, 2.0, 600.0, 300.0)
    assert [punch.delay(f - 1) for f in (1, 2, 7, 8)] == [30.0, 60.0, 1800.0, 1800.0]
    relay = client.Backoff()
    assert (relay.first, relay.cap, relay.factor, relay.jitter, relay.stable_after) == (0.1, 10.0, 2.0, 0.5, 5.0)
    rto = Backoff(first=0.5)
    assert [rto.delay(a - 1) for a in (1, 2, 3)] == [0.5, 1.0, 2.0]
    assert rto.cap == math.inf


def test_jitter_scales_into_its_band_with_the_same_draws():
    """A jittered delay is the nominal one times rng.uniform(1 - jitter, 1): the same draw the relay always made."""
    b = Backoff(first=0.1, cap=5.0, jitter=0.5)
    ours, theirs = random.Random(3), random.Random(3)
    for attempt in range(12):
        assert b.delay(attempt, ours) == min(5.0, 0.1 * 2.0**attempt) * theirs.uniform(0.5, 1.0)


def test_a_jittered_backoff_without_rng_is_a_local_error():
    """Asking for a jittered delay without an rng is this side's bug."""
    with pytest.raises(LocalProtocolError):
        Backoff(first=1.0, jitter=0.5).delay(0)


def test_lasted_resets_only_after_stable_after():
    """A run counts as stable from stable_after seconds on; by default nothing is."""
    b = Backoff(first=1.0, stable_after=5.0)
    assert not b.lasted(4.999)
    assert b.lasted(5.0)
    assert not Backoff(first=1.0).lasted(1e9)
