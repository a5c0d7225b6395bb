"""Provider slots per key (p2p/dht/slots.py): no network monopolises a key, refreshes renew, entries expire (sans-IO)."""

from __future__ import annotations

import pytest

from p2p.dht.slots import Admission, OwnerQuota, ProviderSlots, address_group

KEY = b"key"


def sybil_net(n: int, net: str = "203.0.113") -> list[tuple[str, str]]:
    """n (peer, group) pairs all connecting from one /24."""
    return [(f"sybil{i}", address_group(f"{net}.{i % 250 + 1}", f"sybil{i}")) for i in range(n)]


@pytest.mark.parametrize(
    ("ip", "group"),
    [
        ("203.0.113.7", "203.0.113.0/24"),
        ("203.0.113.200", "203.0.113.0/24"),
        ("10.1.2.3", "10.1.2.0/24"),
        ("2001:db8:1:2::5", "2001:db8:1::/48"),
        ("[2001:db8:1:ffff::9]", "2001:db8:1::/48"),
        ("::ffff:198.51.100.4", "198.51.100.0/24"),
        ("127.0.0.1", "lo/peerA"),
        ("127.5.6.7", "lo/peerA"),
        ("::1", "lo/peerA"),
    ],
)
def test_address_group_is_the_slash24_or_slash48_and_loopback_counts_per_peer(ip, group):
    """Providers are grouped by IPv4 /24 and IPv6 /48 (mapped IPv4 as IPv4); each loopback peer is its own group."""
    assert address_group(ip, "peerA") == group


def test_eighty_sybils_from_one_network_hold_four_slots_and_a_late_honest_host_gets_in():
    """80 identities from one /24 fill only per_group (4) slots of the key; an honest host from elsewhere is added after."""
    slots: ProviderSlots[str] = ProviderSlots()
    verdicts = [slots.offer(KEY, peer, group, peer, now=float(i)) for i, (peer, group) in enumerate(sybil_net(80))]
    assert [v.admission for v in verdicts[:4]] == [Admission.ADDED] * 4
    assert {v.admission for v in verdicts[4:]} == {Admission.GROUP_FULL}
    honest = slots.offer(KEY, "honest", address_group("198.51.100.9", "honest"), "honest", now=100.0)
    assert honest.admission is Admission.ADDED
    assert slots.providers(KEY, now=100.0) == ["sybil0", "sybil1", "sybil2", "sybil3", "honest"]


def test_without_the_network_limit_a_key_full_of_sybils_refuses_the_late_honest_host():
    """The eclipse the limit prevents: one slot per network and 20 sybil networks leave no room for a 21st."""
    slots: ProviderSlots[str] = ProviderSlots()
    for i in range(20):
        slots.offer(KEY, f"sybil{i}", f"net{i}", f"sybil{i}", now=float(i))
    assert slots.offer(KEY, "honest", "honest-net", "honest", now=100.0).admission is Admission.KEY_FULL


def test_a_full_key_gives_a_crowded_networks_stalest_slot_to_a_new_network():
    """With every slot taken, a newcomer from a new network displaces the stalest entry of the most crowded one."""
    slots: ProviderSlots[str] = ProviderSlots(capacity=4, per_group=2)
    for i, (peer, group) in enumerate([("a1", "A"), ("a2", "A"), ("b1", "B"), ("c1", "C")]):
        slots.offer(KEY, peer, group, peer, now=float(i))
    slots.offer(KEY, "a1", "A", "a1", now=10.0)  # a1 refreshed: a2 is now A's stalest
    verdict = slots.offer(KEY, "d1", "D", "d1", now=11.0)
    assert (verdict.admission, verdict.dropped) == (Admission.DISPLACED, "a2")
    assert sorted(slots.peers(KEY, now=11.0)) == ["a1", "b1", "c1", "d1"]


def test_a_key_spread_evenly_over_networks_keeps_its_entries():
    """When no network holds more than the newcomer's would, the newcomer is refused and nobody is displaced."""
    slots: ProviderSlots[str] = ProviderSlots(capacity=3, per_group=2)
    for i, group in enumerate("ABC"):
        slots.offer(KEY, group.lower(), group, group, now=float(i))
    assert slots.offer(KEY, "d", "D", "d", now=5.0).admission is Admission.KEY_FULL
    assert slots.offer(KEY, "a2", "A", "a2", now=5.0).admission is Admission.KEY_FULL  # A would hold 2 > 1
    assert sorted(slots.peers(KEY, now=5.0)) == ["a", "b", "c"]


def test_a_refresh_renews_the_entry_and_its_payload_without_a_new_slot():
    """The same peer offering again keeps one slot, with the new payload and refresh time."""
    slots: ProviderSlots[str] = ProviderSlots(ttl=100.0)
    slots.offer(KEY, "p", "A", "old addrs", now=0.0)
    assert slots.offer(KEY, "p", "A", "new addrs", now=90.0).admission is Admission.REFRESHED
    assert slots.providers(KEY, now=150.0) == ["new addrs"]  # lives 100 s after the refresh
    assert len(slots) == 1


def test_entries_expire_ttl_after_their_last_refresh_and_free_the_peers_budget():
    """Past ttl an entry is gone from answers and from the per-peer count, so the peer can provide again."""
    slots: ProviderSlots[str] = ProviderSlots(per_peer=1, ttl=100.0)
    slots.offer(KEY, "p", "A", "p", now=0.0)
    assert slots.offer(b"other", "p", "A", "p", now=50.0).admission is Admission.PEER_LIMIT
    slots.expire(now=101.0)
    assert (slots.providers(KEY, now=101.0), len(slots)) == ([], 0)
    assert slots.offer(b"other", "p", "A", "p", now=101.0).admission is Admission.ADDED


def test_one_peer_and_one_network_provide_a_bounded_number_of_keys():
    """A peer past per_peer keys, or a network past per_group_total, is refused for further keys."""
    slots: ProviderSlots[str] = ProviderSlots(per_peer=3, per_group_total=5)
    assert [slots.offer(bytes([k]), "p", "A", "p", now=0.0).admission for k in range(4)] == [Admission.ADDED] * 3 + [Admission.PEER_LIMIT]
    assert [slots.offer(bytes([k]), "q", "A", "q", now=0.0).admission for k in range(3)] == [Admission.ADDED] * 2 + [Admission.PEER_LIMIT]
    assert slots.offer(b"\x09", "r", "B", "r", now=0.0).admission is Admission.ADDED
    assert sorted(slots.keys_of("p")) == [b"\x00", b"\x01", b"\x02"]


def test_a_displaced_entry_frees_its_networks_share():
    """After displacement the crowded network counts one slot fewer: it may fill its share again elsewhere."""
    slots: ProviderSlots[str] = ProviderSlots(capacity=2, per_group=2, per_group_total=2)
    slots.offer(KEY, "a1", "A", "a1", now=0.0)
    slots.offer(KEY, "a2", "A", "a2", now=1.0)
    assert slots.offer(b"k2", "a3", "A", "a3", now=2.0).admission is Admission.PEER_LIMIT
    assert slots.offer(KEY, "b1", "B", "b1", now=3.0).dropped == "a1"
    assert slots.offer(b"k2", "a3", "A", "a3", now=4.0).admission is Admission.ADDED


def test_owner_quota_caps_the_values_one_signer_holds_and_counts_only_what_the_store_still_has():
    """A signer past per_owner value keys is refused a new key (its refresh of a held key is not); once the store
    dropped some of its keys, it may store new ones again."""
    quota = OwnerQuota(per_owner=3)
    held: set[str] = set()
    for key in ("k0", "k1", "k2"):
        assert quota.admit("signer", key, held)
        held.add(key)
    assert not quota.admit("signer", "k3", held)
    assert quota.admit("signer", "k1", held)  # a newer record under a key it holds
    assert quota.admit("other", "k3", held)  # the quota is per signer
    held.discard("k0")  # expired or evicted by the store
    assert quota.admit("signer", "k3", held)
