"""Which host answers for which experts: replica choice by measured RTT, load and health (sans-IO).

The backbone turns the DHT's host records for a layer into a :class:`Partition`
(the announced expert ranges, plus local groups for any gap) and, per group, an
ordered list of candidate hosts. Scores come from round trips the backbone itself
measured.

Theory of operation (churn). The backbone always holds every expert itself (its
fallback source), so no remote host is ever the only way to answer a group, and
a host that failed is never waited on again until it has proved itself:

==========  ==========================================  ==========================================
state       how it gets there                           what dispatch does with it
==========  ==========================================  ==========================================
ready       never failed, or its last answer was good   asked, best expected wait first
benched     failed (error or timeout); BENCH backoff    not asked; probed in the background once
            per consecutive failure                     the bench ends (success -> ready), or at
                                                        once when our link to its relay is back
demoted     DEMOTE_AFTER consecutive timeouts (one,     not asked; probed every DEMOTED backoff
            once demoted before)                        (success -> ready, but the next timeout
                                                        demotes it again at a longer interval);
                                                        benched again when our relay link is back
banned      a spot check caught it, or it is draining   neither asked nor probed until it ends
==========  ==========================================  ==========================================

A relay-only host's failures while *our own* link to its relay was down say nothing about the host: when that
link is re-established, :meth:`Router.relay_restored` ends their benches and demotions, so the next dispatch
probes them instead of leaving them out for a backoff that grew during our outage (a proxy restart cuts the
backbone's link and the worker's at once).

A probe is a real dispatch of the group in hand, sent alongside the local
compute that answers it: a host cannot tell a probe from work, and its answer
(with its receipt) arrives after the token moved on. Each dispatch waits at
most :meth:`Router.deadline`: a multiple of what the host's measured round trips
predict, never longer than the configured timeout.

A host never dispatched to is not waited on blind: the vetting ping (:mod:`p2p.dht.vetting`) that let it into the routes
measured its network round trip (:meth:`Router.pinged`), and a backbone that holds the experts itself assumes
``UNMEASURED_COMPUTE_MS`` per token for it (``Router.unmeasured_compute_ms``), so the first dispatch to a silent or
slow sole host waits about the probe's second (``DEADLINE_FLOOR_S``), not the full timeout, and the group is
computed locally. A backbone without the experts (``--remote-experts-only``) leaves the prior off: it has no local
answer to fall back on, so a slow first prefill is better waited for than cut short.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from experts.moe import Partition
from p2p.backoff import Backoff
from p2p.dht.records import HostRecord, RelayAddress
from p2p.identity import PeerId
from p2p.pathkind import Path

BUSY_S = 0.2  # a host that answered OVERLOADED is asked after its replicas for this long (it is full, not failing)
LEAVING_S = 60.0  # longer than a drain (withdraw, then finish within its deadline); a worker restarted under the same key is used again after it
DEFAULT_RTT_MS = 50.0  # prior for a host never measured: tried, but after measured fast ones
EWMA = 0.2
BENCH = Backoff(first=1.0, cap=60.0)  # seconds until a failed host's next probe, doubling per consecutive failure
DEMOTE_AFTER = 3  # consecutive timeouts that demote a host (a sybil, a dead or overloaded worker): rarely probed from then on
DEMOTED = Backoff(first=30.0, cap=600.0)  # seconds between probes of a demoted host, doubling per demotion
ROUTE_REFRESH_S = 3.0  # routes are re-read this often: a new host is asked within about this long (one DHT lookup per MoE layer each time)
DEADLINE_K = 4.0  # a dispatch may take this many times its host's predicted round trip ...
DEADLINE_MARGIN_S = 0.25  # ... plus this (scheduling noise on either side) ...
DEADLINE_FLOOR_S = 1.0  # ... and never less than this, nor more than the configured timeout
HEDGE_K = 2.0  # with hedging on, a second replica is asked once the first took this many times its predicted round trip
HEDGE_FLOOR_S = 0.005  # ... but not sooner (a loopback round trip predicts ~1 ms; scheduling noise is larger)
UNMEASURED_COMPUTE_MS = 10.0  # per token, assumed for a pinged host that never answered a dispatch (see the docstring)
SIMILAR_RTT = 1.25  # replicas whose expected waits differ by less than this factor compete on price


@dataclass
class HostHealth:
    rtt_ms: float | None = None  # EWMA of the round trip less the worker's compute time
    inflight: int = 0
    failures: int = 0  # consecutive; > 0: benched (probed, not asked) until an answer comes back
    benched_until: float = 0.0  # next probe not before then
    banned_until: float = 0.0  # caught returning wrong answers: no work at all until then
    dispatches: int = 0
    compute_ms_per_token: float | None = None  # EWMA of the worker's reported compute time per token
    timeouts: int = 0  # consecutive dispatches that got no answer in time
    demotions: int = 0  # times demoted this session (a demoted host that came back is demoted at its next timeout)
    demoted: bool = False
    probing: bool = False  # a probe is in flight: no second one

    def score(self) -> float:
        """Expected wait: RTT inflated by requests already queued on that host."""
        return (self.rtt_ms if self.rtt_ms is not None else DEFAULT_RTT_MS) * (1 + self.inflight)

    def state(self, now: float) -> str:
        """``ready``, ``benched``, ``demoted`` or ``banned`` (the module docstring's table)."""
        if self.banned_until > now:
            return "banned"
        if self.demoted:
            return "demoted"
        return "benched" if self.failures else "ready"


@dataclass(frozen=True)
class Host:
    peer_id: PeerId
    addr: tuple[str, int] | None  # direct QUIC address; None: reachable through its relay only (NAT-bound)
    ranges: tuple[tuple[int, int], ...]
    price: int
    relay: RelayAddress | None = None
    kernel: str = ""  # the worker's kernel identity from its record: its sums are bit-comparable with ours if equal

    @property
    def path(self) -> Path:
        """Path policy: publicly reachable hosts are dialled directly, NAT-bound ones through their relay."""
        return Path.DIRECT if self.addr is not None else Path.RELAY

    @classmethod
    def from_record(cls, r: HostRecord) -> Host | None:
        addr = None
        if r.hosted.quic_addr is not None:
            host, _, port = r.hosted.quic_addr.rpartition(":")
            addr = (host.strip("[]"), int(port))
        elif r.hosted.relay is None:
            return None
        return cls(r.peer_id, addr, r.hosted.expert_ranges, r.hosted.price, r.hosted.relay, r.hosted.kernel)

    def covers(self, start: int, stop: int) -> bool:
        return any(a <= start and stop <= b for a, b in self.ranges)


@dataclass
class LayerRoute:
    partition: Partition
    hosts: list[list[Host]]  # per group, every host that can answer for it (unordered)

    def peers(self) -> set[PeerId]:
        return {h.peer_id for group in self.hosts for h in group}


@dataclass(frozen=True)
class Plan:
    """What to do for one group now: the hosts to ask in order (none: compute locally), and the hosts to probe."""

    ask: tuple[Host, ...]
    probe: tuple[Host, ...]


@dataclass
class Router:
    """Per-layer partitions and candidates, and per-host health, fed by lookups and dispatch results."""

    n_expert: int
    max_price: int | None = None  # hosts asking more per work unit are never used
    routes: dict[int, LayerRoute] = field(default_factory=dict)
    health: dict[PeerId, HostHealth] = field(default_factory=dict)
    unmeasured_compute_ms: float | None = None  # per token, for a host whose compute was never measured (None: wait the cap)

    def update(self, layer: int, records: list[HostRecord]) -> LayerRoute:
        hosts = [h for h in (Host.from_record(r) for r in records) if h is not None]
        if self.max_price is not None:
            hosts = [h for h in hosts if h.price <= self.max_price]
        part = Partition.covering([rg for h in hosts for rg in h.ranges], self.n_expert)
        route = LayerRoute(part, [[h for h in hosts if h.covers(a, b)] for a, b in part.bounds])
        self.routes[layer] = route
        for h in hosts:
            self.health.setdefault(h.peer_id, HostHealth())
        return route

    def candidates(self, layer: int, group: int, now: float, prefer: PeerId | None = None) -> list[Host]:
        """Hosts that could answer a group, best first; benched hosts (until their bench ends) last.

        *prefer* (slot affinity: the host a session used before) goes first while it is ready.
        """
        return self._ranked(self.routes[layer].hosts[group], now, prefer)

    def plan(self, route: LayerRoute, group: int, now: float, prefer: PeerId | None = None) -> Plan:
        """The hosts to ask for a group of *route* (only ready ones), and those due a probe (marked as probing).

        *route* is the one the dispatch split its tokens by: a refresh may replace ``routes[layer]`` meanwhile.
        """
        ranked = self._ranked(route.hosts[group], now, prefer)
        ask = tuple(h for h in ranked if not self.health[h.peer_id].failures)
        probe = tuple(h for h in ranked if self.health[h.peer_id].failures and self.health[h.peer_id].benched_until <= now and not self.health[h.peer_id].probing)
        for h in probe:
            self.health[h.peer_id].probing = True
        return Plan(ask, probe)

    def deadline(self, peer: PeerId, n_tokens: int, cap: float) -> float:
        """Seconds to wait for *peer*'s answer to an *n_tokens* dispatch.

        ``DEADLINE_K`` x the round trip its measurements predict (network RTT + per-token compute) +
        ``DEADLINE_MARGIN_S``, at least ``DEADLINE_FLOOR_S``, at most *cap*; *cap* itself for a host not yet measured.
        """
        predicted_s = self._predicted_s(peer, n_tokens)
        if predicted_s is None:
            return cap
        return min(cap, max(DEADLINE_FLOOR_S, DEADLINE_K * predicted_s + DEADLINE_MARGIN_S))

    def hedge_after(self, peer: PeerId, n_tokens: int) -> float | None:
        """Seconds after which an unanswered dispatch to *peer* is also sent to the next replica (hedging):
        ``HEDGE_K`` x its predicted round trip, at least ``HEDGE_FLOOR_S``; None for a host not yet measured."""
        predicted_s = self._predicted_s(peer, n_tokens)
        return None if predicted_s is None else max(HEDGE_FLOOR_S, HEDGE_K * predicted_s)

    def served(self, peer: PeerId) -> int:
        """Dispatches *peer* has answered us: hosts that served us need no vetting ping (p2p.dht.vetting)."""
        health = self.health.get(peer)
        return health.dispatches if health else 0

    def pinged(self, peer: PeerId, rtt_ms: float) -> None:
        """*peer* answered a vetting ping in *rtt_ms*: its network round trip, until dispatches measure it."""
        h = self.health.setdefault(peer, HostHealth())
        if h.dispatches == 0:
            h.rtt_ms = rtt_ms

    def _predicted_s(self, peer: PeerId, n_tokens: int) -> float | None:
        h = self.health[peer]
        compute_ms = h.compute_ms_per_token if h.compute_ms_per_token is not None else self.unmeasured_compute_ms
        if h.rtt_ms is None or compute_ms is None:
            return None
        return (h.rtt_ms + n_tokens * compute_ms) / 1e3

    def _ranked(self, group_hosts: list[Host], now: float, prefer: PeerId | None) -> list[Host]:
        hosts = [h for h in group_hosts if self.health[h.peer_id].banned_until <= now]
        ready = [h for h in hosts if self.health[h.peer_id].benched_until <= now]
        benched = [h for h in hosts if h not in ready]
        best = min((self.health[h.peer_id].score() for h in hosts), default=1.0)

        def key(h: Host) -> tuple:
            score = self.health[h.peer_id].score()
            return (score > best * SIMILAR_RTT, h.price, score, h.peer_id)

        return sorted(ready, key=lambda h: (h.peer_id != prefer, *key(h))) + sorted(benched, key=key)

    def expected_ms(self, route: LayerRoute, group: int, now: float) -> float:
        """Expected round trip of a group's dispatch: its best ready host's measured RTT (0 if it is computed locally)."""
        best = next((h for h in self._ranked(route.hosts[group], now, None) if not self.health[h.peer_id].failures), None)
        return self.health[best.peer_id].score() if best else 0.0

    def started(self, peer: PeerId) -> None:
        self.health[peer].inflight += 1

    def succeeded(self, peer: PeerId, rtt_ms: float, compute_ms: float = 0.0, n_tokens: int = 1) -> None:
        """*peer* answered: *rtt_ms* on the network, *compute_ms* (its own report) for *n_tokens*. It is ready again."""
        h = self.health[peer]
        h.inflight -= 1
        h.failures = h.timeouts = 0
        h.benched_until = 0.0
        h.demoted = h.probing = False
        h.dispatches += 1
        h.rtt_ms = _ewma(h.rtt_ms if h.dispatches > 1 else None, rtt_ms)  # the first answer replaces the ping's RTT
        h.compute_ms_per_token = _ewma(h.compute_ms_per_token, compute_ms / max(n_tokens, 1))

    def ban(self, peer: PeerId, now: float, seconds: float) -> None:
        """Give *peer* no work for *seconds* (a spot check caught it)."""
        h = self.health[peer]
        h.banned_until = max(h.banned_until, now + seconds)

    def leaving(self, peer: PeerId, now: float) -> None:
        """*peer* refused because it is draining (shutting down): no work for ``LEAVING_S``, no failure counted."""
        h = self.health[peer]
        h.inflight -= 1
        h.probing = False
        h.banned_until = max(h.banned_until, now + LEAVING_S)

    def busy(self, peer: PeerId, now: float) -> None:
        """*peer* refused with OVERLOADED (its in-flight caps are full: other backbones keep it busy). No failure is
        counted and it stays askable; for ``BUSY_S`` it ranks after its ready replicas, so its load spreads to them.
        A benched host's probe that was refused so ends too: it is probed again once the bench allows."""
        h = self.health[peer]
        h.inflight -= 1
        h.probing = False
        h.benched_until = max(h.benched_until, now + BUSY_S)

    def relay_restored(self, url: str, now: float) -> list[PeerId]:
        """Our link to relay *url* is back: its relay-only hosts that failed are probed at the next dispatch
        (still not asked before a probe answers; banned hosts stay banned). Returns those hosts."""
        behind = {h.peer_id for route in self.routes.values() for group in route.hosts for h in group if h.addr is None and h.relay is not None and h.relay.url == url}
        restored = []
        for peer in sorted(behind, key=str):
            h = self.health[peer]
            if h.failures and h.banned_until <= now:
                h.benched_until, h.timeouts, h.demoted = now, 0, False
                restored.append(peer)
        return restored

    def unreachable(self, peer: PeerId, now: float) -> float:
        """*peer* could not be reached to sign its receipts: benched as after a failed dispatch (no dispatch of ours is
        in flight for it); returns the seconds to its next probe."""
        h = self.health[peer]
        h.failures += 1
        h.probing = False
        wait = BENCH.delay(h.failures - 1)
        h.benched_until = max(h.benched_until, now + wait)
        return wait

    def failed(self, peer: PeerId, now: float, *, timed_out: bool = False) -> float:
        """Bench the host (demote it after ``DEMOTE_AFTER`` consecutive timeouts); returns the seconds to its next probe."""
        h = self.health[peer]
        h.inflight -= 1
        h.failures += 1
        h.probing = False
        h.timeouts = h.timeouts + 1 if timed_out else 0
        if h.timeouts >= (1 if h.demotions else DEMOTE_AFTER) and not h.demoted:
            h.demoted = True
            h.demotions += 1
        wait = DEMOTED.delay(h.demotions - 1) if h.demoted else BENCH.delay(h.failures - 1)
        h.benched_until = now + wait
        return wait


def _ewma(old: float | None, new: float) -> float:
    return new if old is None else (1 - EWMA) * old + EWMA * new
