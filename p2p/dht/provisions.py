"""When a provider entry we sent is due again (sans-IO: no libp2p, no trio, ``now`` passed in).

A provider entry lives at the ~20 peers closest to its key *when it was sent*. In a swarm that grows or churns
those stop being the closest: a lookup walks to the new closest peers, which never heard of us, and the host is
missed (BENCHMARKS.md, "DHT at scale": 200 nodes found 93% of hosts, 85% after killing 20%; the misses were in the
provider walks, entries placed while the swarm grew from 1 to 200 nodes). Re-sending only every 30 minutes
(the age rule) leaves that window open for half an hour.

So an entry is also due when this node's own view shows the neighbourhood moved, judged from its routing table
with no network traffic: a quarter or more of the table's closest peers to the key are peers it did not count
among them when it sent the entry (peers joined near the key, or the old ones died and left the table), or the
table has at least doubled since (the node was young: it sent while it knew few peers, e.g. right after joining).
go-libp2p-kad-dht re-provides on a timer only; its "accelerated" client keeps a full crawl of the network to put
entries at the true closest peers. A routing-table test costs nothing while the swarm is stable, and a new entry
at most once per ``min_gap`` per key while it moves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

REPROVIDE_AFTER = 1800.0  # provider entries live 48 h at libp2p servers; re-send one at least this often
CLOSEST_CHANGED = 0.25  # share of the closest peers that are new since the entry was sent
TABLE_GREW = 2.0  # routing-table size factor since the entry was sent
MIN_GAP = 60.0  # seconds between two sends of one key for a moved neighbourhood (not for age)

Reason = Literal["new", "age", "closest_changed", "table_grew"]


@dataclass(frozen=True)
class Sent:
    """One provider entry as we last sent it, with the routing table's view at that moment."""

    epoch: int
    at: float
    closest: frozenset[bytes]  # the routing table's closest peers to the key (raw peer ids)
    table_size: int


@dataclass(frozen=True)
class View:
    """The routing table's view of one key now: its closest peers, and how many peers the table holds."""

    closest: frozenset[bytes]
    table_size: int


class Provisions:
    """The provider entries this node sent, and which are due again (see the module docstring for why)."""

    def __init__(
        self,
        *,
        every: float = REPROVIDE_AFTER,
        changed: float = CLOSEST_CHANGED,
        grew: float = TABLE_GREW,
        min_gap: float = MIN_GAP,
    ) -> None:
        self.every, self.changed, self.grew, self.min_gap = every, changed, grew, min_gap
        self._sent: dict[bytes, Sent] = {}

    def __len__(self) -> int:
        return len(self._sent)

    def due(self, key: bytes, now: float, view: View) -> Reason | None:
        """Why the entry for key should be sent now, or None."""
        sent = self._sent.get(key)
        if sent is None:
            return "new"
        if now - sent.at >= self.every:
            return "age"
        if now - sent.at < self.min_gap:
            return None
        if view.closest:
            fresh = len(view.closest - sent.closest)
            if fresh >= max(1, self.changed * len(view.closest)):
                return "closest_changed"
        if sent.table_size > 0 and view.table_size >= self.grew * sent.table_size:
            return "table_grew"
        return None

    def sent(self, key: bytes, epoch: int, now: float, view: View) -> None:
        """Record that key's entry reached the network now, with the view it was sent under."""
        self._sent[key] = Sent(epoch, now, view.closest, view.table_size)

    def forget_before(self, epoch: int) -> None:
        """Drop entries of epochs before this one: their keys are no longer looked up."""
        self._sent = {k: s for k, s in self._sent.items() if s.epoch >= epoch}
