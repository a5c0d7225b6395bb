"""The relay's admission rule (relay.admission): per-IP and global caps, the oldest unauthenticated connection in
scope evicted for a newcomer, refusal only when the scope holds authenticated connections alone."""

from __future__ import annotations

import pytest

from relay.admission import Admission


def test_a_newcomer_evicts_the_oldest_pending_connection_of_its_ip():
    """Past max_per_ip the same IP's oldest unauthenticated connection makes room; other IPs are untouched."""
    adm = Admission(max_clients=100, max_per_ip=2)
    adm.open("other", "10.0.0.9")
    adm.open("a1", "10.0.0.1")
    adm.open("a2", "10.0.0.1")
    verdict = adm.open("a3", "10.0.0.1")
    assert verdict.admit and verdict.evict == ("a1",)
    assert adm.from_ip("10.0.0.1") == 2 and len(adm) == 3


def test_an_ip_full_of_authenticated_peers_is_refused():
    """Only when every connection of the IP authenticated is the newcomer refused, with the reason."""
    adm = Admission(max_clients=100, max_per_ip=2)
    for key in ("a1", "a2"):
        adm.open(key, "10.0.0.1")
        adm.authenticated(key)
    verdict = adm.check("10.0.0.1")
    assert not verdict.admit and "10.0.0.1" in verdict.reason
    assert adm.open("b", "10.0.0.2").admit


def test_the_global_cap_evicts_the_oldest_pending_of_anyone():
    """A full relay closes its oldest unauthenticated connection for a newcomer from any IP."""
    adm = Admission(max_clients=3, max_per_ip=0)
    adm.open("auth", "10.0.0.1")
    adm.authenticated("auth")
    adm.open("idle1", "10.0.0.2")
    adm.open("idle2", "10.0.0.3")
    assert adm.open("real", "10.0.0.4").evict == ("idle1",)
    adm.authenticated("real")
    adm.authenticated("idle2")
    assert "relay full" in adm.check("10.0.0.5").reason


def test_close_forgets_and_unknown_keys_are_ignored():
    """Closing returns the slot of the IP and of the relay; closing twice is harmless."""
    adm = Admission(max_clients=1, max_per_ip=1)
    adm.open("a", "10.0.0.1")
    adm.authenticated("a")
    adm.close("a")
    adm.close("a")
    assert len(adm) == 0 and adm.from_ip("10.0.0.1") == 0 and adm.check("10.0.0.1").admit


def test_caps_are_checked():
    """A relay that admits nobody is a configuration mistake."""
    with pytest.raises(ValueError):
        Admission(max_clients=0, max_per_ip=1)
