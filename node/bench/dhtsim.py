"""`moeswarm bench dht --simulate`: the DHT code real nodes run, at thousands of nodes, on a virtual clock.

Not a second implementation: every simulated node is a `p2p.dht.kademlia._Node`. Its announcer and publication rounds, its
provide pacer and re-provide policy (`p2p.dht.provisions`), its maintenance loop, the provider and record walks of a
lookup (`_walk`, `_find_providers`, `_fetch_record`) and record validation (`p2p.dht.records.validate`) run as they do in
a node on the Internet. What is simulated is what sits under them, libp2p's part and the network's:

- the routing table (k-buckets of 20 by shared prefix with our own key, keyed like libp2p's: sha256 of the peer id;
  a full bucket keeps its oldest live peer, a peer that does not answer is dropped), filled by joining (a walk to our
  own id) and by being asked (a server learns the servers that query it);
- the RPCs our code sends (GET_PROVIDERS, GET_VALUE, and libp2p's FIND_NODE walk behind put_value and provide,
  which here reuses our walk, then PUT_VALUE / ADD_PROVIDER to the 20 closest that answered): each costs a one-way
  latency drawn from a log-normal distribution both ways, is lost with a probability, and a gone peer never answers
  (the caller's own timeout ends the wait, as on a real network);
- churn: sessions with heavy-tailed (Lomax) lifetimes whose mean gives the asked departure rate, each departure
  replaced by a new node (new identity) joining, except the first node: the bootstrap, a server that stays as a
  real swarm's bootstrap peers do; a share of the other nodes is NAT-bound (client mode: never asked, never
  in a routing table, their records reachable only through replicas).

trio's `MockClock` with autojump runs the whole swarm in one thread: virtual time jumps whenever every node waits,
so an hour of upkeep for thousands of nodes takes minutes of CPU, and `now` is the same virtual clock for everyone.
Not modelled: libp2p's per-sender ADD_PROVIDER limit (our pacer keeps under it), connection set-up costs, the
/24 provider-slot cap (addresses are not simulated), bandwidth.
"""

from __future__ import annotations

import hashlib
import heapq
import math
import os
import random
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import trio
import trio.testing

from p2p.dht.kademlia import QUERY_TIMEOUT, WALK_WIDTH, _Node
from p2p.dht.libp2p_glue import libp2p_api
from p2p.dht.provisions import Provisions
from p2p.dht.records import HostedSlice, RecordError, RelayAddress, validate
from p2p.identity import Identity

BASE_TIME = 1_900_000_000.0  # unix seconds at virtual time 0 (mid-epoch does not matter: epochs roll as in reality)
KAD = "/ipfs/kad/1.0.0"
MODEL = hashlib.sha256(b"moeswarm/bench/dhtsim").hexdigest()
BUCKET = 20
PROVIDER_LIFETIME = 48 * 3600.0  # libp2p keeps provider entries 48 h
RESULT_CAP = 20  # providers a server returns for a key (libp2p keeps at most 20)


@dataclass
class Options:
    nodes: int = 10_000
    layers: int = 48
    hosts: float = 0.2  # share of nodes announcing a layer record (workers; the others are DHT-only nodes)
    nat: float = 0.3  # share of nodes in client mode
    rtt_ms: float = 80.0  # median round trip
    rtt_sigma: float = 0.5  # log-normal sigma of one-way latency
    loss: float = 0.01  # per RPC
    churn_per_hour: float = 0.2  # departures per node per hour in the churn phase
    grow_s: float = 1800.0  # the swarm grows from one node to all of them over this long
    settle_s: float = 600.0  # upkeep before the first lookups
    churn_s: float = 1800.0  # churn before the second lookups
    lookups: int = 200  # per phase
    ttl: float = 600.0  # record TTL (re-put after half)
    seed: int = 0
    reprovide_on_change: bool = True  # False: provider entries re-sent by age only (the policy before p2p.dht.provisions)


def _libp2p_id(raw: bytes) -> Any:
    from libp2p.peer.id import ID  # libp2p only when a simulation runs, as in real nodes

    return ID(raw)


def _key_int(data: bytes) -> int:
    return int.from_bytes(hashlib.sha256(data).digest(), "big")


class SimTable:
    """A routing table: buckets of 20 by the shared prefix of sha256(peer id) with ours."""

    def __init__(self, me: int) -> None:
        self.me = me
        self.buckets: dict[int, list[Any]] = {}
        self.keys: dict[Any, int] = {}

    def add(self, peer: Any, key: int, alive: Callable[[Any], bool]) -> None:
        if key == self.me or peer in self.keys:
            return
        bucket = self.buckets.setdefault((self.me ^ key).bit_length(), [])
        if len(bucket) >= BUCKET:
            dead = next((p for p in bucket if not alive(p)), None)  # Kademlia pings the oldest; a dead one goes
            if dead is None:
                return
            self.remove(dead)
        bucket.append(peer)
        self.keys[peer] = key

    def remove(self, peer: Any) -> None:
        key = self.keys.pop(peer, None)
        if key is not None:
            self.buckets[(self.me ^ key).bit_length()].remove(peer)

    def find_local_closest_peers(self, key: bytes, count: int = BUCKET) -> list[Any]:
        target, keys = _key_int(key), self.keys
        return heapq.nsmallest(count, keys, key=lambda p: keys[p] ^ target)

    def size(self) -> int:
        return len(self.keys)

    def get_peer_ids(self) -> list[Any]:
        return list(self.keys)


@dataclass(frozen=True)
class Stored:
    """A value a node holds, as libp2p's value store returns it (``.value``), with its validated seq."""

    value: bytes
    seq: int


class SimNet:
    """Delivery between simulated nodes, and the counters the bench reports."""

    def __init__(self, opts: Options, rng: random.Random) -> None:
        self.opts, self.rng = opts, rng
        self.peers: dict[Any, SimPeer] = {}  # every node ever, by libp2p id
        self.messages = 0
        self.lookup_messages = 0  # sent by a node while it runs a measured lookup
        self.upkeep_messages = 0
        self.counting_upkeep = False
        self.mu = math.log(opts.rtt_ms / 2000.0)

    def alive(self, peer: Any) -> bool:
        p = self.peers.get(peer)
        return p is not None and p.alive

    def server(self, peer: Any) -> bool:
        p = self.peers.get(peer)
        return p is not None and not p.client

    async def rpc(self, src: SimPeer, dst: Any, serve: Callable[[SimPeer], Any]) -> Any:
        """One request and its answer; a lost or unanswered one waits until the caller's timeout cancels it.

        The answer is read from the remote's state when the request is sent and delivered a round trip later
        (one timer per RPC instead of two: the states differ by milliseconds)."""
        self.messages += 1
        if src.in_lookup:
            self.lookup_messages += 1
        elif self.counting_upkeep:
            self.upkeep_messages += 1
        peer = self.peers.get(dst)
        if peer is None or not peer.alive or peer.client:
            src.table.remove(dst)  # a peer that does not answer leaves the routing table (Kademlia)
            await trio.sleep_forever()
        assert peer is not None
        if self.rng.random() < self.opts.loss:
            await trio.sleep_forever()
        if not src.client:
            peer.table.add(src.id, src.key, self.alive)
        answer = serve(peer)
        await trio.sleep(self.rng.lognormvariate(self.mu, self.opts.rtt_sigma) + self.rng.lognormvariate(self.mu, self.opts.rtt_sigma))
        if not src.alive:
            await trio.sleep_forever()
        return answer


class SimPeer:
    """One node: a real `_Node` whose libp2p host, DHT and stores are these simulated ones."""

    def __init__(self, net: SimNet, identity: Identity, *, client: bool, ttl: float, reprovide_on_change: bool) -> None:
        self.net, self.identity, self.client = net, identity, client
        self.id = _libp2p_id(identity.peer_id.raw)
        self.key = _key_int(self.id.to_bytes())
        self.alive = True
        self.in_lookup = False
        self.table = SimTable(self.key)
        self.providers: dict[bytes, dict[Any, float]] = {}  # key -> provider -> expiry (virtual)
        self.values: dict[bytes, Stored] = {}
        self.hosted: int | None = None  # layer, once announced
        self.announced_at: float | None = None
        self.joined_at: float | None = None  # when its session began: what churn weighs (hosts or not)
        node = _Node(
            identity, listen="127.0.0.1:0", bootstrap=[], client_mode=client, ttl=ttl, lookup_timeout=60.0,
            clock=lambda: BASE_TIME + trio.current_time(), models=[], routing_refresh=None,
        )
        if not reprovide_on_change:
            node.provisions = Provisions(changed=math.inf, grew=math.inf)
        node.host = _SimHost(self)
        node.dht = _SimDHT(self)
        self.node = node
        self.scope = trio.CancelScope()

    # --- what a server answers ---
    def closest(self, key: bytes) -> list[Any]:
        """What a server names as closer peers: its table's closest (tables hold servers only)."""
        return self.table.find_local_closest_peers(key, BUCKET)

    def providers_of(self, key: bytes) -> list[Any]:
        now = trio.current_time()
        held = self.providers.get(key, {})
        return [_Info(p) for p, until in list(held.items())[:RESULT_CAP] if until > now]

    def store_value(self, key: bytes, value: bytes) -> None:
        """PUT_VALUE as our validator and selector take it: a valid record replaces an older one."""
        try:
            new = validate(key.decode(), value, self.node.clock())
        except RecordError:
            return
        held = self.values.get(key)
        if held is None or new.seq > held.seq:
            self.values[key] = Stored(value, new.seq)

    async def walk_closest(self, key: bytes) -> list[Any]:
        """libp2p's FIND_NODE walk (our walk, asking for closer peers only): the 20 closest servers that answered."""
        answered: set[Any] = set()

        async def ask(peer: Any) -> list[Any]:
            closer = await self.net.rpc(self, peer, lambda remote: remote.closest(key))
            answered.add(peer)
            return closer

        await self.node._walk(key, ask)
        return libp2p_api().sort_by_distance(key, list(answered))[:WALK_WIDTH]

    async def send_all(self, peers: list[Any], serve: Callable[[SimPeer], Any]) -> int:
        took = 0

        async def one(peer: Any) -> None:
            nonlocal took
            with trio.move_on_after(QUERY_TIMEOUT):
                await self.net.rpc(self, peer, serve)
                took += 1

        async with trio.open_nursery() as nursery:
            for peer in peers:
                nursery.start_soon(one, peer)
        return took


@dataclass(frozen=True)
class _Info:
    peer_id: Any


class _Peerstore:
    def __init__(self, net: SimNet) -> None:
        self.net = net

    def get_protocols(self, peer: Any) -> list[str]:
        return [KAD] if self.net.server(peer) else ["/ipfs/id/1.0.0"]


class _SimHost:
    def __init__(self, peer: SimPeer) -> None:
        self.peer = peer
        self.peerstore = _Peerstore(peer.net)

    def get_id(self) -> Any:
        return self.peer.id

    def get_peerstore(self) -> _Peerstore:
        return self.peerstore


class _SimProviderStore:
    def __init__(self, peer: SimPeer) -> None:
        self.peer = peer
        self.providing_keys: set[bytes] = set()

    def get_providers(self, key: bytes) -> list[_Info]:
        return self.peer.providers_of(key)

    async def _get_providers_from_peer_with_closers(self, holder: Any, key: bytes) -> tuple[list[_Info], list[Any]]:
        return await self.peer.net.rpc(self.peer, holder, lambda remote: (remote.providers_of(key), remote.closest(key)))

    async def provide(self, key: bytes) -> bool:
        me, until = self.peer.id, trio.current_time() + PROVIDER_LIFETIME
        closest = await self.peer.walk_closest(key)
        return await self.peer.send_all(closest, lambda remote: remote.providers.setdefault(key, {}).__setitem__(me, until)) > 0


class _SimValueStore:
    def __init__(self, peer: SimPeer) -> None:
        self.peer = peer

    def get(self, key: bytes) -> Stored | None:
        return self.peer.values.get(key)

    async def _get_from_peer(self, holder: Any, key: bytes, *, return_record: bool, return_closer_peers: bool) -> tuple[Stored | None, list[Any]]:
        return await self.peer.net.rpc(self.peer, holder, lambda remote: (remote.values.get(key), remote.closest(key)))


class _SimDHT:
    def __init__(self, peer: SimPeer) -> None:
        self.peer = peer
        self.routing_table = peer.table
        self.provider_store = _SimProviderStore(peer)
        self.value_store = _SimValueStore(peer)

    def get_routing_table_size(self) -> int:
        return self.routing_table.size()

    async def put_value(self, key: str, value: bytes) -> None:
        raw = key.encode()
        self.peer.store_value(raw, value)
        closest = await self.peer.walk_closest(raw)
        await self.peer.send_all(closest, lambda remote: remote.store_value(raw, value))


@dataclass
class Swarm:
    opts: Options
    rng: random.Random
    net: SimNet
    live: list[SimPeer] = field(default_factory=list)
    bootstrap: SimPeer | None = None  # the first node: a DHT server that stays, as a real swarm's bootstrap peers do
    departures: int = 0
    joins: int = 0
    nursery: Any = None  # where every node's upkeep runs, for the whole simulation

    def new_peer(self, *, server: bool = False) -> SimPeer:
        client = not server and self.rng.random() < self.opts.nat
        peer = SimPeer(self.net, Identity.generate(), client=client, ttl=self.opts.ttl,
                       reprovide_on_change=self.opts.reprovide_on_change)
        self.net.peers[peer.id] = peer
        return peer

    async def join(self, peer: SimPeer) -> None:
        """Enter through a random live server (its bootstrap), walk to our own id, run upkeep, maybe announce."""
        servers = [p for p in self.live if not p.client]
        peer.joined_at = trio.current_time()
        self.live.append(peer)
        self.joins += 1
        if servers:
            entry = self.rng.choice(servers)
            peer.table.add(entry.id, entry.key, self.net.alive)
            if not peer.client:
                entry.table.add(peer.id, peer.key, self.net.alive)
            for found in await peer.walk_closest(peer.id.to_bytes()):
                peer.table.add(found, self.net.peers[found].key, self.net.alive)
        self.nursery.start_soon(self._run, peer)

    async def grow(self) -> None:
        """From the bootstrap alone to opts.nodes over grow_s, each newcomer joining through a live server.

        The bootstrap is a server: a first node in client mode is in no routing table, and with no server to join
        through neither are the nodes after it until a server joins. Their tables stay empty for the whole run, and
        a lookup from one finds nothing (the found fraction 0.0 of issue 29's CI failure, seed 3)."""
        self.bootstrap = self.new_peer(server=True)
        await self.join(self.bootstrap)
        for _ in range(self.opts.nodes - 1):
            await trio.sleep(self.opts.grow_s / self.opts.nodes)
            self.nursery.start_soon(self.join, self.new_peer())

    async def _run(self, peer: SimPeer) -> None:
        with peer.scope:
            async with trio.open_nursery() as tasks:
                tasks.start_soon(peer.node._maintain)
                if self.rng.random() < self.opts.hosts:
                    layer = self.rng.randrange(self.opts.layers)
                    await peer.node.announce([_slice(layer, peer)])
                    peer.hosted, peer.announced_at = layer, trio.current_time()

    def leave(self, peer: SimPeer) -> None:
        """Gone without a word (a SIGKILL, a closed laptop): no tombstone, its entries stay until they expire."""
        peer.alive = False
        peer.scope.cancel()
        self.live.remove(peer)
        self.departures += 1

    async def churn(self, seconds: float) -> None:
        """Departures at the asked rate, each replaced by a newcomer: heavy-tailed sessions (Lomax, shape 2)."""
        rate = self.opts.churn_per_hour * len(self.live) / 3600.0
        end = trio.current_time() + seconds
        async with trio.open_nursery() as nursery:
            while rate > 0 and (now := trio.current_time()) < end:
                await trio.sleep(min(self.rng.expovariate(rate), end - now))
                if trio.current_time() >= end:
                    break
                self.leave(self.victim())
                nursery.start_soon(self.join, self.new_peer())
            await trio.sleep(0)

    def victim(self) -> SimPeer:
        """Whose session ends: the oldest sessions are the least likely to end (heavy tail), weight 1 / (age + scale).

        Age is the time since the node joined, host or not (the bootstrap stays): an age counted from announcing
        made every non-host look as old as the run and tilted churn towards the hosts."""
        scale = 2 * 3600.0 / max(self.opts.churn_per_hour, 1e-9)
        now, peers = trio.current_time(), [p for p in self.live if p is not self.bootstrap]
        return self.rng.choices(peers, weights=[1.0 / (now - (p.joined_at or 0.0) + scale) for p in peers])[0]


def _slice(layer: int, peer: SimPeer) -> HostedSlice:
    if peer.client:
        relay = RelayAddress("wss://relay.example:443/relay", peer.identity.peer_id)
        return HostedSlice(MODEL, layer, ((0, 8),), capacity=16, price=1, relay=relay)
    return HostedSlice(MODEL, layer, ((0, 8),), capacity=16, price=1, quic_addr="192.0.2.1:4433")


async def _lookups(swarm: Swarm, n: int) -> dict:
    """n lookups from random live nodes, one at a time; each scored against the live hosts that finished announcing."""
    found: list[float] = []
    all_found, rounds, dead, worst = 0, [], 0, {}
    before = swarm.net.lookup_messages
    for _ in range(n):
        peer = swarm.rng.choice(swarm.live)
        layer = swarm.rng.randrange(swarm.opts.layers)
        expect = {p.identity.peer_id for p in swarm.live if p.hosted == layer and p.announced_at is not None}
        if not expect:
            continue
        peer.in_lookup = True
        peer.node.walks.clear()
        try:
            got = {r.peer_id for r in await peer.node.lookup(MODEL, layer)}
        finally:
            peer.in_lookup = False
        rounds += [w.rounds for w in peer.node.walks if w.kind == "providers"]
        share = len(got & expect) / len(expect)
        if not found or share < min(found):
            worst = {"found": round(share, 4), "hosts": len(expect), "client": peer.client, "table": peer.table.size(),
                     "named_by_providers": len(set().union(*(w.found for w in peer.node.walks if w.kind == "providers")) & {str(p) for p in expect})}
        found.append(share)
        all_found += share == 1.0
        dead += len(got - {p.identity.peer_id for p in swarm.live})
    return {
        "lookups": len(found),
        "found_fraction": {"mean": round(statistics.fmean(found), 4), "min": round(min(found), 4), "all_found": round(all_found / len(found), 4)},
        "rounds": {"median": statistics.median(rounds), "p90": sorted(rounds)[int(0.9 * (len(rounds) - 1))], "max": max(rounds)},
        "messages_per_lookup": round((swarm.net.lookup_messages - before) / len(found), 1),
        "dead_hosts_named": dead,
        "worst": worst,  # the lookup that found the least: from whom, and whether its provider walks named the hosts
    }


async def _main(opts: Options) -> dict:
    rng = random.Random(opts.seed)
    net = SimNet(opts, rng)
    swarm = Swarm(opts, rng, net)
    async with trio.open_nursery() as nursery:
        swarm.nursery = nursery
        await swarm.grow()
        await trio.sleep(opts.settle_s)
        start, net.counting_upkeep = trio.current_time(), True
        net.upkeep_messages = 0
        await trio.sleep(min(opts.settle_s, 600.0))  # upkeep only: what a stable swarm costs per node
        upkeep_hours = (trio.current_time() - start) / 3600.0
        messages_per_node_hour = net.upkeep_messages / (len(swarm.live) * upkeep_hours)
        net.counting_upkeep = False
        stable = await _lookups(swarm, opts.lookups)
        churn_started, departed = trio.current_time(), swarm.departures
        await swarm.churn(opts.churn_s)
        churn_hours = (trio.current_time() - churn_started) / 3600.0
        churned = await _lookups(swarm, opts.lookups)
        churned["departures_per_node_hour"] = round((swarm.departures - departed) / (len(swarm.live) * churn_hours), 3)
        nursery.cancel_scope.cancel()
    return {
        "simulated": True,
        "nodes": opts.nodes,
        "log2_nodes": round(math.log2(opts.nodes), 2),
        "hosts": sum(1 for p in net.peers.values() if p.hosted is not None),
        "options": {k: v for k, v in vars(opts).items()},
        "messages_per_node_hour": round(messages_per_node_hour, 1),
        "before_churn": stable,
        "under_churn": churned,
        "virtual_s": round(trio.current_time(), 1),
    }


def run(opts: Options) -> dict:
    """The whole simulation on trio's virtual clock; returns the bench's JSON."""
    load = [round(x, 2) for x in os.getloadavg()]
    result = trio.run(_main, opts, clock=trio.testing.MockClock(autojump_threshold=0))
    result["load"] = {"start": load, "end": [round(x, 2) for x in os.getloadavg()]}
    return result

