"""`udp_round_trip_floor`, the bare Python round trip `bench dispatch` reports beside its gap: a real echo process."""

from __future__ import annotations

import math

import pytest

from node.bench.common import udp_round_trip_floor


def test_floor_measures_every_round_trip_at_the_asked_sizes():
    """A dispatch-sized request and a larger reply (60 KB): every round trip is counted, p10 <= p50, both finite."""
    r = udp_round_trip_floor(12385, 60000, n=200)
    assert r["round_trips"] == 200
    assert 0 < r["udp_round_trip_ms_p10"] <= r["udp_round_trip_ms_p50"] and math.isfinite(r["udp_round_trip_ms_p50"])


def test_floor_fails_cleanly_when_the_reply_cannot_be_sent():
    """A reply over UDP's 64 KB limit never arrives: a bounded wait, then an error (not a hang)."""
    with pytest.raises((TimeoutError, OSError)):
        udp_round_trip_floor(100, 70000, n=10, timeout=5.0)
