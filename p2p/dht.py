"""Discovery over py-libp2p 0.8.1's Kademlia DHT (TCP + Noise), run in its own trio thread.

Storage scheme
  * Value ``/moeswarm/<hash of peer, model, layer>`` -> the peer's signed HostRecord for that
    (model, layer). PUT_VALUE keeps one value per key, so every key has exactly one writer.
  * Provider key sha256("moeswarm/providers/v1", model, layer, epoch, shard) -> peers hosting
    (model, layer). ``epoch`` is the hour of unix time: libp2p keeps provider entries 48 h with no
    way to remove them, so the key moves on and stale entries fall behind. ``shard`` = hash(peer)
    mod 4, because a libp2p node keeps at most 20 providers per key.
  * Lookup: walk GET_PROVIDERS towards this epoch's 4 shard keys, then per provider GET_VALUE its
    record from the provider itself, or else walk towards the record's key (replicas); every value
    goes through `decode_and_validate`, and the newest seq per peer wins.

libp2p 0.8.1 defects (each measured here) and what this module does about them
  * 250 ms head start per dial: ``ConnectionConfig(max_connections_per_peer=1)`` (7 ms instead).
  * Default hosts accept /plaintext/2.0.0: we offer Noise only (``sec_opt``).
  * Servers drop a sender's ADD_PROVIDER past 10 per 10 s, silently: `ProvidePacer` sends at most
    8 per 10.5 s, and libp2p's own unpaced republishing is switched off (we re-announce ourselves).
  * find_providers and get_value answer from the local store whenever it has an entry (48 h / 24 h,
    never asking the network again), and find_providers repeats peers: both unused; `_walk` asks
    the closest peers every time and results are de-duplicated.
  * No per-record TTL (values kept 24 h): expiry travels in the signed record, the validator checks
    it on every put and get, and `ExpiringValueStore` forgets each value at its own expiry.
  * Servers refuse FIND_NODE for non-multihash keys over 50 bytes, which libp2p's own put/get send:
    our value keys are 50 bytes (see `records.value_key`).
  * protocol_prefix is ignored (always /ipfs/kad/1.0.0): not fixable without patching libp2p. Our
    nodes join only through our bootstrap peers, and the strict validator stores our namespace only.
  * Peers that open a KAD stream join routing tables even in client mode, and small tables seed
    lookups with every connected peer: `ServerOnlyKadDHT` / `ServerOnlyPeerRouting` admit and ask
    only peers whose identify lists KAD.
  * Leaving ``host.run()`` closes no connection: ``host.close()`` in a finally.
  * Importing libp2p detaches its ``libp2p`` logger: `_ToStructlog` routes it into structlog.
  * Importing libp2p replaces aioquic's ``QuicStreamSender.get_frame`` process-wide: libp2p is
    imported only when a node starts, and the original method is put back (we use no libp2p QUIC),
    so the data path behaves the same in every process.
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import ipaddress
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from types import SimpleNamespace
from typing import Any

import structlog
import trio

from p2p.discovery import Announcer, DiscoveryError, Publication, live_hosts
from p2p.identity import Identity, IdentityError, PeerId
from p2p.records import (
    MAX_CLOCK_SKEW,
    NAMESPACE,
    HostedSlice,
    HostRecord,
    RecordError,
    decode,
    decode_and_validate,
    select_best,
    value_key,
)
from p2p.trio_thread import TrioThread

log = structlog.get_logger(__name__)

DEFAULT_TTL = 600.0  # seconds a record lives; re-signed and re-put after half of it
PROVIDER_EPOCH = 3600  # seconds per provider-key epoch
PROVIDER_SHARDS = 4  # provider keys per (model, layer, epoch)
PROVIDE_BUDGET, PROVIDE_WINDOW = 8, 10.5  # ADD_PROVIDER rounds per window (servers take 10 per 10 s)
REPROVIDE_AFTER = 1800.0  # provider entries live 48 h; re-send one only this often
QUERY_TIMEOUT = 5.0  # per RPC
CONNECT_TIMEOUT = 5.0
MAINTENANCE_INTERVAL = 60.0  # re-bootstrap check when no refresh is due sooner
RETRY_AFTER = 5.0  # after a failed publication round
PARALLEL_PUTS = 4  # libp2p put_value calls (each a FIND_NODE walk + up to 20 PUT_VALUE) in flight
PARALLEL_RPCS = 8  # our GET_PROVIDERS / GET_VALUE in flight: servers reset streams past 12
WALK_WIDTH, ALPHA = 20, 3  # Kademlia k (closest peers that must answer) and peers asked at once


def provider_key(model_digest: str, layer: int, epoch: int, shard: int) -> bytes:
    """The provider key of (model, layer) for one epoch and shard: a sha2-256 multihash."""
    material = b"moeswarm/providers/v1\0" + bytes.fromhex(model_digest) + layer.to_bytes(2, "big")
    return b"\x12\x20" + hashlib.sha256(material + epoch.to_bytes(8, "big") + bytes([shard])).digest()


def provider_shard(peer_id: PeerId) -> int:
    return hashlib.sha256(peer_id.raw).digest()[0] % PROVIDER_SHARDS


def provider_epochs(start: float, end: float) -> range:
    """Epochs overlapping [start, end]: a record must be findable under each while it lives."""
    return range(int(start // PROVIDER_EPOCH), int(end // PROVIDER_EPOCH) + 1)


class ProvidePacer:
    """Sliding-window limit on our ADD_PROVIDER rounds (a round reaches each closest peer once).

    libp2p 0.8.1 servers count a sender's ADD_PROVIDERs in 10 s windows and silently drop the 11th
    on. ``now`` is a monotonic clock.
    """

    def __init__(self, budget: int = PROVIDE_BUDGET, window: float = PROVIDE_WINDOW) -> None:
        self._budget, self._window = budget, window
        self._sent: deque[float] = deque()

    def wait_time(self, now: float) -> float:
        while self._sent and self._sent[0] <= now - self._window:
            self._sent.popleft()
        return 0.0 if len(self._sent) < self._budget else self._sent[0] + self._window - now

    def note(self, now: float) -> None:
        self._sent.append(now)


def tcp_multiaddr(listen: str) -> str:
    """``"127.0.0.1:4001"`` or ``"[::1]:4001"`` as a TCP multiaddr."""
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 0xFFFF:
        raise ValueError(f"listen address {listen!r} must be ip:port, e.g. 127.0.0.1:4001 or [::1]:4001")
    try:
        ip = ipaddress.ip_address(host[1:-1] if host.startswith("[") and host.endswith("]") else host)
    except ValueError:
        raise ValueError(f"listen address {listen!r}: {host!r} is not an IP address") from None
    return f"/ip{ip.version}/{ip}/tcp/{port}"


class _ToStructlog(logging.Handler):
    """Routes the ``libp2p`` logger (which libp2p detaches from the root) into structlog."""

    _BENIGN = frozenset({"Failed to read DHT message from stream: "})  # WARNING on every normal stream close
    _log = structlog.get_logger("libp2p")

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message not in self._BENIGN:
            emit = getattr(self._log, record.levelname.lower(), self._log.warning)
            emit("libp2p.log", logger=record.name, message=message)


_libp2p_lock = threading.Lock()
_libp2p_loaded: SimpleNamespace | None = None


def _libp2p() -> SimpleNamespace:
    """libp2p's names we use, importing it on the first call (from whichever node thread)."""
    global _libp2p_loaded
    with _libp2p_lock:
        if _libp2p_loaded is None:
            _libp2p_loaded = _import_libp2p()
        return _libp2p_loaded


def _import_libp2p() -> SimpleNamespace:
    """Import libp2p (~0.5 s), undo its process-wide side effects, and define our subclasses of it."""
    from aioquic.quic.stream import QuicStreamSender
    from libp2p import new_host
    from libp2p.crypto.ed25519 import create_new_key_pair
    from libp2p.crypto.x25519 import create_new_key_pair as create_x25519_key_pair
    from libp2p.kad_dht.common import PROTOCOL_ID
    from libp2p.kad_dht.kad_dht import ROUTING_TABLE_REFRESH_INTERVAL, DHTMode, KadDHT
    from libp2p.kad_dht.peer_routing import PeerRouting
    from libp2p.kad_dht.utils import sort_peer_ids_by_distance
    from libp2p.kad_dht.value_store import ValueStore
    from libp2p.network.config import ConnectionConfig
    from libp2p.peer.peerinfo import info_from_p2p_addr
    from libp2p.peer.peerstore import PeerStoreError
    from libp2p.records.validator import NamespacedValidator, Validator
    from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
    from libp2p.security.noise.transport import Transport as NoiseTransport
    from libp2p.tools.anyio_service import background_trio_service
    from multiaddr import Multiaddr

    patched = QuicStreamSender.get_frame
    if getattr(patched, "_libp2p_keep_pending_fin", False):  # libp2p's mark on its replacement
        # The replacement closes over the original, whichever module imported libp2p first.
        QuicStreamSender.get_frame = inspect.getclosurevars(patched).nonlocals["original"]
        log.debug("dht.aioquic_patch_reverted")
    logging.getLogger("libp2p").addHandler(_ToStructlog(logging.WARNING))

    class RecordValidator(Validator):
        """The /moeswarm/ namespace's validator: every put and get goes through decode_and_validate."""

        def __init__(self, clock: Callable[[], float]) -> None:
            self._clock = clock

        def validate(self, key: str, value: bytes) -> None:
            try:
                decode_and_validate(key, value, self._clock())
            except RecordError as exc:
                log.info("dht.record_rejected", key=key[:60], error=type(exc).__name__, reason=str(exc))
                raise

        def select(self, key: str, values: list[bytes]) -> int:
            return select_best(key, values, self._clock())

    class ExpiringValueStore(ValueStore):
        """A value store that forgets each record at its own expires_at, not libp2p's fixed 24 h."""

        def put(self, key: bytes, value: bytes, validity: float = 0.0) -> None:
            super().put(key, value, validity)
            self._clamp(key)

        def put_record(self, key: bytes, record: Any) -> None:
            super().put_record(key, record)
            self._clamp(key)

        def _clamp(self, key: bytes) -> None:
            stored, validity = self.store[key]
            try:
                expires_at = decode(stored.value)[0].expires_at
            except RecordError:
                return  # the validator refuses such values before they get here
            self.store[key] = (stored, min(validity, expires_at))

    def speaks_kad(host: Any, peer_id: Any) -> bool | None:
        """Whether identify lists KAD for peer_id; None while identify has not answered."""
        try:
            protocols = host.get_peerstore().get_protocols(peer_id)
        except PeerStoreError:
            return None
        return (str(PROTOCOL_ID) in protocols) if protocols else None

    class ServerOnlyPeerRouting(PeerRouting):
        """Peer routing that neither asks nor returns peers known not to serve KAD (client mode)."""

        async def find_closest_peers_network(self, target_key: bytes, count: int = 20) -> list[Any]:
            found = await super().find_closest_peers_network(target_key, count)
            return [p for p in found if speaks_kad(self.host, p) is not False]

        async def _query_peer_for_closest(self, peer: Any, target_key: bytes) -> list[Any]:
            if speaks_kad(self.host, peer) is False:
                return []
            return await super()._query_peer_for_closest(peer, target_key)

    class ServerOnlyKadDHT(KadDHT):
        """KadDHT whose routing table admits only peers that identify as KAD servers.

        libp2p adds every peer that opens a KAD stream (``skip_server_mode_check``); a peer whose
        identify has not answered yet is checked again once it has.
        """

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.value_store = ExpiringValueStore(host=self.host, local_peer_id=self.local_peer_id)
            self.peer_routing = ServerOnlyPeerRouting(self.host, self.routing_table)
            self.provider_store.peer_routing = self.peer_routing
            self.spawn: Callable[..., None] | None = None  # set once our nursery runs
            self._awaiting_identify: set[Any] = set()

        async def add_peer(self, peer_id: Any, *, skip_server_mode_check: bool = False) -> bool:
            if not skip_server_mode_check:
                return await super().add_peer(peer_id)
            server = speaks_kad(self.host, peer_id)
            if server is None and self.spawn is not None and peer_id not in self._awaiting_identify:
                self._awaiting_identify.add(peer_id)
                self.spawn(self._add_once_identified, peer_id)
            return bool(server) and await super().add_peer(peer_id, skip_server_mode_check=True)

        async def _run_main_loop(self) -> None:
            """libp2p's maintenance loop without its republishing: that re-sends our records once at
            start (racing our first announce, so servers refuse the duplicates) and every 22 h, with
            ADD_PROVIDERs unpaced. `_Node` re-announces by itself."""
            while self.manager.is_running:
                try:
                    await self.refresh_routing_table()
                    self.value_store.cleanup_expired()
                    self.provider_store.cleanup_expired()
                except Exception as exc:  # as libp2p does: log and keep maintaining
                    log.warning("dht.maintenance_failed", error=repr(exc))
                await trio.sleep(ROUTING_TABLE_REFRESH_INTERVAL)

        async def _add_once_identified(self, peer_id: Any) -> None:
            try:
                for _ in range(50):
                    await trio.sleep(0.1)
                    if (server := speaks_kad(self.host, peer_id)) is not None:
                        if server:
                            await super().add_peer(peer_id, skip_server_mode_check=True)
                        return
            except Exception as exc:  # runs in our nursery: must not take the node down
                log.warning("dht.add_peer_failed", peer=str(peer_id), error=repr(exc))
            finally:
                self._awaiting_identify.discard(peer_id)

    return SimpleNamespace(
        new_host=new_host,
        create_new_key_pair=create_new_key_pair,
        create_x25519_key_pair=create_x25519_key_pair,
        ConnectionConfig=ConnectionConfig,
        NOISE_PROTOCOL_ID=NOISE_PROTOCOL_ID,
        NoiseTransport=NoiseTransport,
        DHTMode=DHTMode,
        NamespacedValidator=NamespacedValidator,
        RecordValidator=RecordValidator,
        ServerOnlyKadDHT=ServerOnlyKadDHT,
        background_trio_service=background_trio_service,
        info_from_p2p_addr=info_from_p2p_addr,
        Multiaddr=Multiaddr,
        speaks_kad=speaks_kad,
        sort_by_distance=sort_peer_ids_by_distance,
    )


class _Node:
    """A libp2p host with a KadDHT and our announcements. Every method runs in the node's trio thread."""

    def __init__(
        self,
        identity: Identity,
        *,
        listen: str,
        bootstrap: Sequence[str],
        client_mode: bool,
        ttl: float,
        lookup_timeout: float,
        clock: Callable[[], float],
    ) -> None:
        self.identity, self.listen, self.bootstrap = identity, tcp_multiaddr(listen), list(bootstrap)
        self.client_mode, self.lookup_timeout, self.clock = client_mode, lookup_timeout, clock
        self.announcer = Announcer(identity, ttl=ttl)
        self.multiaddrs: list[str] = []
        self.pacer = ProvidePacer()
        self.provided: dict[bytes, tuple[int, float]] = {}  # provider key -> (epoch, when sent)
        self.republish_all = False  # set when a publication round failed
        self.host: Any = None
        self.dht: Any = None
        self.lock = trio.Lock()  # one publication round at a time (announce, withdraw, refresh)
        self.changed = trio.Event()  # wakes the refresh loop
        self.puts = trio.CapacityLimiter(PARALLEL_PUTS)
        self.rpcs = trio.CapacityLimiter(PARALLEL_RPCS)

    @asynccontextmanager
    async def running(self) -> AsyncIterator[trio.Nursery]:
        """Run host and DHT, yielding a nursery for calls; on exit, cancel those, then close the host.

        Only our own tasks are cancelled: cancelling libp2p's interrupts its connections' close
        half-way (the socket stays open, and host.close() then skips the connection as closed).
        """
        lib = _libp2p()
        key_pair = lib.create_new_key_pair(self.identity.seed)
        noise = lib.NoiseTransport(key_pair, noise_privkey=lib.create_x25519_key_pair().private_key)
        listen = lib.Multiaddr(self.listen)
        self.host = lib.new_host(
            key_pair=key_pair,
            sec_opt={lib.NOISE_PROTOCOL_ID: noise},
            connection_config=lib.ConnectionConfig(max_connections_per_peer=1),
            listen_addrs=[listen],
        )
        if self.host.get_id().to_base58() != str(self.identity.peer_id):
            raise DiscoveryError("libp2p derived another peer id from our key; identity.seed is not its Ed25519 seed")
        validator = lib.NamespacedValidator({NAMESPACE: lib.RecordValidator(self.clock)}, strict_validation=True)
        mode = lib.DHTMode.CLIENT if self.client_mode else lib.DHTMode.SERVER
        self.dht = lib.ServerOnlyKadDHT(
            self.host, mode, validator=validator, validator_changed=True, strict_validation=True
        )
        async with self.host.run([listen]):
            try:
                async with lib.background_trio_service(self.dht), trio.open_nursery() as tasks:
                    self.dht.spawn = tasks.start_soon
                    self.multiaddrs = [str(a) for a in self.host.get_addrs()]
                    if self.bootstrap and not await self._join():
                        raise DiscoveryError(f"none of the bootstrap peers answered: {', '.join(self.bootstrap)}")
                    tasks.start_soon(self._maintain)
                    log.info(
                        "dht.started", peer=str(self.identity.peer_id), addrs=self.multiaddrs, client=self.client_mode
                    )
                    yield tasks
                    tasks.cancel_scope.cancel()
            finally:
                # Leaving host.run() closes no connection, and once it has stopped the swarm, close()
                # no longer reaches them either: close while the host still runs.
                with trio.CancelScope(shield=True), trio.move_on_after(CONNECT_TIMEOUT):
                    await self.host.close()

    async def _join(self) -> int:
        """Connect to the bootstrap peers and walk towards our own id; returns how many answered."""
        lib = _libp2p()
        reached = 0
        for addr in self.bootstrap:
            try:
                info = lib.info_from_p2p_addr(lib.Multiaddr(addr))
            except Exception as exc:  # multiaddr raises several types for bad text
                raise ValueError(
                    f"bootstrap address {addr!r} must look like /ip4/127.0.0.1/tcp/4001/p2p/12D3KooW... ({exc})"
                ) from None
            if info.peer_id == self.host.get_id():
                continue
            try:
                with trio.fail_after(CONNECT_TIMEOUT):
                    await self.host.connect(info)
            except Exception as exc:  # libp2p dial errors share no base class; TooSlowError is ours
                log.warning("dht.bootstrap_unreachable", addr=addr, error=repr(exc))
                continue
            await self.dht.routing_table.add_peer(info, skip_server_mode_check=True)
            reached += 1
        if reached:
            await self.dht.peer_routing.find_closest_peers_network(self.host.get_id().to_bytes())
        return reached

    async def _maintain(self) -> None:
        """Re-sign and re-put records before they expire; rejoin through the bootstrap peers if alone."""
        while True:
            due_at = self.announcer.next_refresh_at()
            delay = MAINTENANCE_INTERVAL if due_at is None else min(MAINTENANCE_INTERVAL, due_at - self.clock())
            with trio.move_on_after(max(delay, 0.0)):
                await self.changed.wait()
            self.changed = trio.Event()
            try:
                if self.bootstrap and self.dht.get_routing_table_size() == 0:
                    await self._join()
                async with self.lock:
                    pubs = self.announcer.due(self.clock(), everything=self.republish_all)
                    if await self._publish(pubs):
                        self.republish_all = False
                        if pubs:
                            log.info("dht.refreshed", records=len(pubs))
            except Exception as exc:  # this loop must outlive any one failure; logged, then retried
                log.warning("dht.maintenance_failed", error=repr(exc))
                self.republish_all = True
            if self.republish_all:
                await trio.sleep(RETRY_AFTER)

    async def announce(self, slices: list[HostedSlice]) -> None:
        started = trio.current_time()
        async with self.lock:
            pubs = self.announcer.replace(slices, self.clock())
            ok = await self._publish(pubs)
        self.changed.set()
        if not ok:
            raise DiscoveryError(f"announcing {len(slices)} slices failed (retrying every {RETRY_AFTER:.0f}s)")
        log.info("dht.announced", slices=len(slices), published=len(pubs), ms=_ms_since(started))

    async def withdraw(self) -> None:
        async with self.lock:
            pubs = self.announcer.withdraw(self.clock())
            ok = await self._publish(pubs)
        if not ok:
            raise DiscoveryError("publishing tombstones failed; see dht.publish_failed")
        log.info("dht.withdrawn", tombstones=len(pubs))

    async def _publish(self, pubs: list[Publication]) -> bool:
        """PUT every record (in parallel), then paced provider announcements for the live ones.

        On failure, logs it and has the refresh loop re-sign and re-put everything until a round
        succeeds: the announcer already counts these records as published.
        """
        errors: list[Exception] = []

        async def put(pub: Publication) -> None:
            try:
                async with self.puts:
                    await self.dht.put_value(pub.key, pub.value)
            except Exception as exc:  # collected, reported below
                errors.append(exc)

        async with trio.open_nursery() as nursery:
            for pub in pubs:
                nursery.start_soon(put, pub)
        if errors:
            self.republish_all = True
            log.warning("dht.publish_failed", failed=len(errors), records=len(pubs), first=repr(errors[0]))
            return False
        now = self.clock()
        for record in (p.record for p in pubs if not p.record.hosted.is_tombstone):
            for key, epoch in self._provider_keys_due(record, now):
                await self._provide(key, epoch)
        return True

    def _provider_keys_due(self, record: HostRecord, now: float) -> list[tuple[bytes, int]]:
        current = int(now // PROVIDER_EPOCH)
        self.provided = {k: v for k, v in self.provided.items() if v[0] >= current - 1}
        due = []
        for epoch in provider_epochs(now - MAX_CLOCK_SKEW, record.expires_at + MAX_CLOCK_SKEW):
            key = provider_key(record.hosted.model_digest, record.hosted.layer, epoch, provider_shard(record.peer_id))
            sent = self.provided.get(key)
            if sent is None or now - sent[1] >= REPROVIDE_AFTER:
                due.append((key, epoch))
        return due

    async def _provide(self, key: bytes, epoch: int) -> None:
        while (wait := self.pacer.wait_time(trio.current_time())) > 0:
            await trio.sleep(wait)
        self.pacer.note(trio.current_time())
        if await self.dht.provider_store.provide(key):  # False: no peer took it; retried next refresh
            self.provided[key] = (epoch, self.clock())
        self.dht.provider_store.providing_keys.discard(key)  # only libp2p's republish (off) reads it

    async def lookup(self, model_digest: str, layer: int) -> list[HostRecord]:
        started = trio.current_time()
        epoch = int(self.clock() // PROVIDER_EPOCH)
        providers: set[Any] = set()
        records: list[HostRecord] = []
        with trio.move_on_after(self.lookup_timeout) as deadline:
            async with trio.open_nursery() as nursery:
                for shard in range(PROVIDER_SHARDS):
                    nursery.start_soon(self._find_providers, provider_key(model_digest, layer, epoch, shard), providers)
            async with trio.open_nursery() as nursery:
                for peer in providers:
                    nursery.start_soon(self._fetch_record, peer, model_digest, layer, records)
        if deadline.cancelled_caught:
            log.warning("dht.lookup_timeout", model=model_digest[:12], layer=layer, seconds=self.lookup_timeout)
        hosts = live_hosts(records, model_digest, layer, self.clock())
        log.debug("dht.lookup", model=model_digest[:12], layer=layer, hosts=len(hosts), ms=_ms_since(started))
        return hosts

    async def _walk(self, key: bytes, ask: Callable[[Any], Awaitable[list[Any]]]) -> None:
        """Iterative Kademlia walk towards key: ask(peer) records what the peer holds and returns closer
        peers; the walk ends when the WALK_WIDTH closest peers known have all been asked.

        One RPC per peer does both jobs: half the traffic of a FIND_NODE walk followed by GETs.
        """
        lib = _libp2p()
        known = set(self.dht.routing_table.find_local_closest_peers(key, WALK_WIDTH))
        asked: set[Any] = {self.host.get_id()}

        async def ask_one(peer: Any) -> None:
            async with self.rpcs:
                with trio.move_on_after(QUERY_TIMEOUT):
                    known.update(p for p in await ask(peer) if lib.speaks_kad(self.host, p) is not False)

        while batch := [p for p in lib.sort_by_distance(key, list(known))[:WALK_WIDTH] if p not in asked][:ALPHA]:
            asked.update(batch)
            async with trio.open_nursery() as nursery:
                for peer in batch:
                    nursery.start_soon(ask_one, peer)

    async def _find_providers(self, key: bytes, out: set[Any]) -> None:
        out.update(info.peer_id for info in self.dht.provider_store.get_providers(key))

        async def ask(peer: Any) -> list[Any]:
            found, closer = await self.dht.provider_store._get_providers_from_peer_with_closers(peer, key)
            out.update(info.peer_id for info in found)
            return closer

        await self._walk(key, ask)

    async def _fetch_record(self, peer: Any, model_digest: str, layer: int, out: list[HostRecord]) -> None:
        """Peer's record for (model, layer): from the peer itself if it answers, else from the replicas.

        The owner holds its newest record or tombstone and can only serve what it signed itself;
        the walk is for owners in client mode, gone, or restarted without their records.
        """
        try:
            key = value_key(PeerId.from_string(peer.to_base58()), model_digest, layer)
        except IdentityError:
            log.debug("dht.provider_skipped", peer=peer.to_base58(), reason="not an Ed25519 peer id")
            return
        key_bytes = key.encode()
        values: set[bytes] = set()

        async def ask(holder: Any) -> list[Any]:
            found, closer = await self.dht.value_store._get_from_peer(
                holder, key_bytes, return_record=True, return_closer_peers=True
            )
            if found is not None:
                values.add(found.value)
            return closer

        if _libp2p().speaks_kad(self.host, peer) is not False:
            async with self.rpcs:
                with trio.move_on_after(QUERY_TIMEOUT):
                    await ask(peer)
        if not self._accept(key, values, out):
            if (local := self.dht.value_store.get(key_bytes)) is not None:
                values.add(local.value)
            await self._walk(key_bytes, ask)
            self._accept(key, values, out)

    def _accept(self, key: str, values: set[bytes], out: list[HostRecord]) -> bool:
        """Append the valid records among values to out; whether there was one."""
        now, before = self.clock(), len(out)
        for value in values:
            try:
                out.append(decode_and_validate(key, value, now))
            except RecordError as exc:
                log.debug("dht.record_rejected", key=key, error=type(exc).__name__, reason=str(exc))
        return len(out) > before

    async def routing_peers(self) -> list[str]:
        return sorted(p.to_base58() for p in self.dht.routing_table.get_peer_ids())


def _ms_since(started: float) -> float:
    return round((trio.current_time() - started) * 1000, 1)


class LibP2PDiscovery:
    """Discovery on the libp2p Kademlia DHT; the node runs in its own trio thread.

    ``listen`` is ``ip:port`` (port 0 picks one); ``bootstrap`` holds multiaddrs like
    ``/ip4/127.0.0.1/tcp/4001/p2p/12D3KooW...``. ``client_mode`` is for NAT-bound nodes: they query
    and publish but serve nobody (they still listen: libp2p drops provider records without an
    address). Use ``async with LibP2PDiscovery(...) as d:`` or start()/close().
    """

    def __init__(
        self,
        identity: Identity,
        *,
        listen: str = "127.0.0.1:0",
        bootstrap: Sequence[str] = (),
        client_mode: bool = False,
        ttl: float = DEFAULT_TTL,
        lookup_timeout: float = 10.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.peer_id = identity.peer_id
        self._node = _Node(
            identity,
            listen=listen,
            bootstrap=bootstrap,
            client_mode=client_mode,
            ttl=ttl,
            lookup_timeout=lookup_timeout,
            clock=clock,
        )
        self._thread = TrioThread(f"dht-{identity.peer_id.short()}")

    @property
    def multiaddrs(self) -> list[str]:
        """This node's listen multiaddrs with /p2p/<peer-id>, for other nodes' bootstrap lists."""
        return list(self._node.multiaddrs)

    async def start(self) -> None:
        await asyncio.wrap_future(self._thread.start(self._node.running))

    async def __aenter__(self) -> LibP2PDiscovery:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def announce(self, slices: Sequence[HostedSlice]) -> None:
        """Publish exactly these slices (tombstoning dropped ones). Provider announcements are paced
        at 8 per 10.5 s, so announcing n new slices takes about 1.3 * max(0, n - 8) seconds."""
        await self._call(self._node.announce, list(slices))

    async def withdraw(self) -> None:
        await self._call(self._node.withdraw)

    async def lookup(self, model_digest: str, layer: int) -> list[HostRecord]:
        return await self._call(self._node.lookup, model_digest, layer)

    async def routing_peers(self) -> list[str]:
        """Peer ids in this node's Kademlia routing table (servers only)."""
        return await self._call(self._node.routing_peers)

    async def close(self) -> None:
        await asyncio.wrap_future(self._thread.stop())

    async def _call(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        return await asyncio.wrap_future(self._thread.submit(fn, *args))


async def run_bootstrap(
    identity: Identity,
    listen: str,
    *,
    bootstrap: Sequence[str] = (),
    on_ready: Callable[[list[str]], None] | None = None,
) -> None:
    """Run a plain DHT server (announcing nothing) until cancelled; on_ready gets its multiaddrs."""
    async with LibP2PDiscovery(identity, listen=listen, bootstrap=bootstrap) as node:
        log.info("dht.bootstrap_ready", addrs=node.multiaddrs)
        if on_ready is not None:
            on_ready(node.multiaddrs)
        await asyncio.Event().wait()
