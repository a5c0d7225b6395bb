"""Provider slots that no one network can monopolise: the admission policy of a DHT node's provider store (sans-IO).

Theory of operation
  A provider key (one (model, layer, epoch, shard)) has ``capacity`` slots, libp2p's k = 20. libp2p 0.8.1 fills
  them first come, first served and then ignores every newcomer, so 80 generated identities announcing first
  eclipsed every honest worker that joined later. Identities are free; network addresses are not. So each
  provider is filed under the *network* it connected from (``address_group``: an IPv4 /24, an IPv6 /48) and:

  * a network holds at most ``per_group`` slots of one key;
  * a full key takes a newcomer by dropping the stalest entry of a network that holds more slots than the
    newcomer's would after joining (so the slots drift towards an even spread over networks); a key whose
    slots are spread as evenly as that allows keeps its entries and refuses the newcomer;
  * one peer provides at most ``per_peer`` keys at this node, one network at most ``per_group_total``
    (memory: keys are free to invent);
  * a refresh (the same peer again) only renews its entry.

  Eclipsing a key then takes ``capacity / per_group`` networks, not ``capacity`` key pairs. The lookup side
  (``p2p.dht.vetting``) adds what a store cannot know: whether a host answers, and whether it served well.

Loopback: every peer on 127.0.0.0/8 or ::1 is its own network (group ``lo/<peer id>``). All loopback dials come
from 127.0.0.1, and tests run whole swarms there; a real attacker cannot connect from our loopback.

The clock is a parameter (unix seconds); entries live ``ttl`` seconds after their last refresh.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Collection, Hashable, Iterator
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Generic, TypeVar

CAPACITY = 20  # Kademlia k: libp2p's per-key provider limit, and what a GET_PROVIDERS answer carries
PER_GROUP = 4  # slots of one key a /24 (/48) may hold: a fifth of k; a NAT'd office or a testbed WAN has a few hosts
PER_PEER = 512  # keys one peer provides here: an honest host needs 2 per hosted layer (this epoch's and the next)
PER_GROUP_TOTAL = 4 * PER_PEER
IPV4_PREFIX, IPV6_PREFIX = 24, 48

P = TypeVar("P")  # what the store keeps per provider (libp2p's PeerInfo); opaque here


def address_group(ip: str, loopback_as: str) -> str:
    """The network an address counts under: its /24 (IPv4) or /48 (IPv6); a loopback one as ``lo/<loopback_as>``
    (the provider store passes the peer id, the lookup side the port). A ValueError unless ``ip`` is an IP."""
    addr = ipaddress.ip_address(ip.strip("[]"))
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    if addr.is_loopback:
        return f"lo/{loopback_as}"
    prefix = IPV4_PREFIX if addr.version == 4 else IPV6_PREFIX
    return str(ipaddress.ip_network(f"{addr}/{prefix}", strict=False))


class Admission(Enum):
    ADDED = "added"  # a free slot
    REFRESHED = "refreshed"  # the peer already held a slot of the key
    DISPLACED = "displaced"  # took the slot of an entry of a more crowded network (``Verdict.dropped``)
    GROUP_FULL = "group_full"  # refused: the newcomer's network holds per_group slots of the key
    KEY_FULL = "key_full"  # refused: every slot is taken and no network holds more than its share
    PEER_LIMIT = "peer_limit"  # refused: the peer (or its network) provides too many keys here


@dataclass(frozen=True)
class Verdict:
    admission: Admission
    dropped: Hashable | None = None  # the peer whose entry made room (DISPLACED)

    @property
    def stored(self) -> bool:
        return self.admission in (Admission.ADDED, Admission.REFRESHED, Admission.DISPLACED)


@dataclass
class _Entry(Generic[P]):
    group: str
    refreshed: float
    payload: P


@dataclass
class ProviderSlots(Generic[P]):
    """Providers per key under the limits in the module docstring. Keys and peers are any hashable values."""

    capacity: int = CAPACITY
    per_group: int = PER_GROUP
    per_peer: int = PER_PEER
    per_group_total: int = PER_GROUP_TOTAL
    ttl: float = 48 * 3600.0  # libp2p's provider record lifetime
    _keys: dict[Hashable, dict[Hashable, _Entry[P]]] = field(default_factory=dict)
    _peer_keys: dict[Hashable, int] = field(default_factory=dict)
    _group_keys: dict[str, int] = field(default_factory=dict)

    def offer(self, key: Hashable, peer: Hashable, group: str, payload: P, now: float) -> Verdict:
        """Store (or refuse) ``peer`` as a provider of ``key``, connecting from network ``group``."""
        self._expire_key(key, now)
        slots = self._keys.get(key, {})
        held = slots.get(peer)
        if held is not None:
            held.refreshed, held.payload = now, payload
            return Verdict(Admission.REFRESHED)
        if self._peer_keys.get(peer, 0) >= self.per_peer or self._group_keys.get(group, 0) >= self.per_group_total:
            return Verdict(Admission.PEER_LIMIT)
        counts = _group_counts(slots)
        if counts.get(group, 0) >= self.per_group:
            return Verdict(Admission.GROUP_FULL)
        dropped = None
        if len(slots) >= self.capacity:
            dropped = self._displaceable(slots, counts, counts.get(group, 0) + 1)
            if dropped is None:
                return Verdict(Admission.KEY_FULL)
            self._remove(key, dropped)
        self._keys.setdefault(key, {})[peer] = _Entry(group, now, payload)
        self._peer_keys[peer] = self._peer_keys.get(peer, 0) + 1
        self._group_keys[group] = self._group_keys.get(group, 0) + 1
        return Verdict(Admission.ADDED if dropped is None else Admission.DISPLACED, dropped)

    def providers(self, key: Hashable, now: float) -> list[P]:
        """The live providers of ``key``, oldest entry first."""
        self._expire_key(key, now)
        return [e.payload for e in self._keys.get(key, {}).values()]

    def peers(self, key: Hashable, now: float) -> list[Hashable]:
        self._expire_key(key, now)
        return list(self._keys.get(key, {}))

    def keys_of(self, peer: Hashable) -> list[Hashable]:
        return [k for k, slots in self._keys.items() if peer in slots]

    def expire(self, now: float) -> None:
        """Forget every entry not refreshed for ``ttl`` seconds."""
        for key in list(self._keys):
            self._expire_key(key, now)

    def __len__(self) -> int:
        return sum(len(slots) for slots in self._keys.values())

    def __iter__(self) -> Iterator[Hashable]:
        return iter(list(self._keys))

    def _displaceable(self, slots: dict[Hashable, _Entry[P]], counts: dict[str, int], newcomer: int) -> Hashable | None:
        """The stalest entry among the networks holding more slots than the newcomer's would (None: no such)."""
        crowded = max(counts.values(), default=0)
        if crowded <= newcomer:
            return None
        candidates = [(e.refreshed, i, p) for i, (p, e) in enumerate(slots.items()) if counts[e.group] == crowded]
        return min(candidates, key=lambda c: (c[0], c[1]))[2]

    def _expire_key(self, key: Hashable, now: float) -> None:
        slots = self._keys.get(key)
        if slots is None:
            return
        for peer in [p for p, e in slots.items() if now - e.refreshed > self.ttl]:
            self._remove(key, peer)

    def _remove(self, key: Hashable, peer: Hashable) -> None:
        slots = self._keys[key]
        entry = slots.pop(peer)
        if not slots:
            del self._keys[key]
        _decrement(self._peer_keys, peer)
        _decrement(self._group_keys, entry.group)


@dataclass
class OwnerQuota:
    """At most ``per_owner`` value keys per record owner at this node.

    libp2p keeps 50,000 values and evicts the oldest when full, so without a quota one identity signing records for
    invented models would evict every honest record. The owner is the peer that signed the record (a replica may
    be put by anyone), so the quota follows the signer, whoever sends it. ``held`` is what the store still holds:
    keys it expired or evicted stop counting the next time the owner is at its limit.
    """

    per_owner: int = PER_PEER
    _keys: dict[Hashable, set[Hashable]] = field(default_factory=dict)

    def admit(self, owner: Hashable, key: Hashable, held: Collection[Hashable]) -> bool:
        keys = self._keys.setdefault(owner, set())
        if key in keys:
            return True
        if len(keys) >= self.per_owner:
            keys.intersection_update(k for k in keys if k in held)
            if len(keys) >= self.per_owner:
                return False
        keys.add(key)
        return True


def _decrement(counter: dict[Any, int], name: Hashable) -> None:
    counter[name] -= 1
    if not counter[name]:
        del counter[name]


def _group_counts(slots: dict[Hashable, _Entry[P]]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for entry in slots.values():
        counts[entry.group] = counts.get(entry.group, 0) + 1
    return counts
