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
  * Reachability helpers (public nodes answering ``p2p.nat.reachability`` probes) use the same scheme with
    one well-known slot: value ``records.helper_key(peer)`` -> its signed ``HelperRecord``, provider key
    sha256("moeswarm/helpers/v1", epoch, shard). A node has at most one helper record.

libp2p 0.8.1 defects (each measured here) and what this module does about them
  * 250 ms head start per dial: ``ConnectionConfig(max_connections_per_peer=1)`` (7 ms instead).
  * Every host keeps dialing peers from its peerstore until it holds ~200 connections (auto-connector target between
    the default watermarks 100 and 300, re-checked every 10 s below 50): a swarm of N nodes converges on a full mesh,
    O(N^2) Noise+Yamux connections, and 175 nodes on one machine stopped admitting joins. Kademlia needs no standing
    connections (a lookup dials whom it asks), so `connection_config` keeps a few, as kubo's bootstrapper does.
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
  * Importing libp2p detaches its ``libp2p`` logger: `p2p.dht.libp2p_glue.reattach_libp2p_logger` hands it back to the
    root handler (shown at debug only, see `node.logs`).
  * Importing libp2p replaces aioquic's ``QuicStreamSender.get_frame`` process-wide: libp2p is
    imported only when a node starts, and the original method is put back (we use no libp2p QUIC),
    so the data path behaves the same in every process.
"""

from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import os
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Literal

import structlog
import trio

from experts.errors import UsageError
from p2p.backoff import Backoff
from p2p.dht.discovery import Announcer, DiscoveryError, Publication, live_hosts
from p2p.dht.libp2p_glue import libp2p_api
from p2p.dht.provisions import Provisions, View
from p2p.dht.records import (
    MAX_CLOCK_SKEW,
    NAMESPACE,
    HelperRecord,
    HostedSlice,
    HostRecord,
    ModelShape,
    RecordError,
    helper_key,
    issue_helper,
    value_key,
)
from p2p.dht.stage_records import HostedStage, StageRecord, StageShape, issue_stage, live_stages, stage_key, stage_provider_key
from p2p.dht.stage_records import validate as validate_any
from p2p.dht.trio_thread import TrioThread
from p2p.identity import Identity, IdentityError, PeerId
from p2p.ports import check_free

log = structlog.get_logger(__name__)

DEFAULT_TTL = 600.0  # seconds a record lives; re-signed and re-put after half of it
PROVIDER_EPOCH = 3600  # seconds per provider-key epoch
PROVIDER_SHARDS = 4  # provider keys per (model, layer, epoch)
PROVIDE_BUDGET, PROVIDE_WINDOW = 8, 10.5  # ADD_PROVIDER rounds per window (servers take 10 per 10 s)
QUERY_TIMEOUT = 5.0  # per RPC
CONNECT_TIMEOUT = 5.0
MAINTENANCE_INTERVAL = 60.0  # re-bootstrap check when no refresh is due sooner
RETRY_AFTER = 5.0  # after a failed publication round
PARALLEL_PUTS = 4  # libp2p put_value calls (each a FIND_NODE walk + up to 20 PUT_VALUE) in flight
PARALLEL_RPCS = 8  # our GET_PROVIDERS / GET_VALUE in flight: servers reset streams past 12
WALK_WIDTH, ALPHA = 20, 3  # Kademlia k (closest peers that must answer) and peers asked at once
BOOTSTRAP_WAIT = 30.0  # seconds an unreachable bootstrap is retried before a node gives up (before loading its model)
PROBE_BACKOFF = Backoff(first=0.5, cap=5.0)  # between those retries


def provider_key(model_digest: str, layer: int, epoch: int, shard: int) -> bytes:
    """The provider key of (model, layer) for one epoch and shard: a sha2-256 multihash."""
    material = b"moeswarm/providers/v1\0" + bytes.fromhex(model_digest) + layer.to_bytes(2, "big")
    return b"\x12\x20" + hashlib.sha256(material + epoch.to_bytes(8, "big") + bytes([shard])).digest()


def helper_provider_key(epoch: int, shard: int) -> bytes:
    """The well-known provider key of reachability helpers for one epoch and shard."""
    return b"\x12\x20" + hashlib.sha256(b"moeswarm/helpers/v1\0" + epoch.to_bytes(8, "big") + bytes([shard])).digest()


def _provider_key_of(record: HostRecord | HelperRecord | StageRecord, epoch: int) -> bytes:
    shard = provider_shard(record.peer_id)
    if isinstance(record, HelperRecord):
        return helper_provider_key(epoch, shard)
    if isinstance(record, StageRecord):
        return stage_provider_key(record.stage.model_digest, epoch, shard)
    return provider_key(record.hosted.model_digest, record.hosted.layer, epoch, shard)


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


def parse_listen(listen: str) -> tuple[str, int]:
    """``"127.0.0.1:4001"`` or ``"[::1]:4001"`` -> (ip, port); a UsageError showing the form otherwise."""
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 0xFFFF:
        raise UsageError(f"listen address {listen!r} must be ip:port, e.g. 127.0.0.1:4001 or [::1]:4001")
    try:
        ip = ipaddress.ip_address(host[1:-1] if host.startswith("[") and host.endswith("]") else host)
    except ValueError:
        raise UsageError(f"listen address {listen!r}: {host!r} is not an IP address; give an IP, e.g. 0.0.0.0:4001") from None
    return str(ip), int(port)


def tcp_multiaddr(listen: str) -> str:
    """``"127.0.0.1:4001"`` or ``"[::1]:4001"`` as a TCP multiaddr."""
    ip, port = parse_listen(listen)
    return f"/ip{ipaddress.ip_address(ip).version}/{ip}/tcp/{port}"


class BootstrapError(DiscoveryError, UsageError):
    """A bootstrap peer is unreachable, or answers with another peer id than its address names."""


class BootstrapUnreachable(BootstrapError):
    """No TCP connection to the bootstrap's address within the retry window."""


def bootstrap_target(addr: str) -> tuple[str, int, PeerId]:
    """``/ip4/H/tcp/P/p2p/ID`` (also ip6, dns, dns4, dns6) -> (host, port, peer id); a UsageError showing the form."""
    parts = addr.split("/")
    ok = len(parts) == 7 and parts[0] == "" and parts[1] in ("ip4", "ip6", "dns", "dns4", "dns6") and parts[3] == "tcp" and parts[4].isdigit() and int(parts[4]) <= 0xFFFF and parts[5] == "p2p"
    try:
        if ok:
            return parts[2], int(parts[4]), PeerId.from_string(parts[6])
    except IdentityError:
        pass
    raise UsageError(f"bootstrap address {addr!r} must look like /ip4/127.0.0.1/tcp/4001/p2p/12D3KooW... (the line a bootstrap prints: 'join with: --bootstrap ...')")


async def probe_bootstrap(addr: str, timeout: float = BOOTSTRAP_WAIT, *, backoff: Backoff = PROBE_BACKOFF) -> None:
    """Check that *addr* is a running bootstrap with the peer id it names, before a node spends time loading a model.

    TCP connects, and handshakes that time out or fail (a busy bootstrap, or another program on that port), are
    retried with *backoff* for *timeout* seconds (a swarm whose nodes start together), then
    :class:`BootstrapUnreachable`; a peer that proves another key than the named id in the Noise handshake is
    :class:`BootstrapError` at once (waiting will not change it).
    The handshake runs a throwaway libp2p host in its own trio run (a worker thread), not this node's key.
    """
    host, port, peer = bootstrap_target(addr)
    loop = asyncio.get_running_loop()
    deadline, attempt = loop.time() + timeout, 0
    while True:
        reason = await _tcp_reason(host, port, deadline - loop.time())
        if reason is None:
            outcome = await asyncio.to_thread(trio.run, _handshake, addr)
            if outcome == "ok":
                return
            if outcome == "refused":
                raise BootstrapError(f"bootstrap {addr} answers on TCP {host}:{port}, but not as peer {peer}: use the address that bootstrap prints ('join with: --bootstrap ...'); its /p2p/ part names its key, which changes with its --data-dir")
            # A busy bootstrap (or a loaded machine) may take longer than CONNECT_TIMEOUT, or drop the dial: not a wrong key.
            reason = f"it accepts TCP but did not finish a libp2p handshake (within {CONNECT_TIMEOUT:.0f} s)"
        delay = backoff.delay(attempt)
        if loop.time() + delay > deadline:
            raise BootstrapUnreachable(f"bootstrap {addr} is unreachable ({reason}, retried for {timeout:.0f} s): check that it runs and that TCP {host}:{port} is reachable from here (firewall, address)")
        (log.info if attempt == 0 else log.debug)("dht.bootstrap_retry", addr=addr, reason=reason, retry_in=round(delay, 1), gives_up_in=round(deadline - loop.time(), 1))
        await asyncio.sleep(delay)
        attempt += 1


async def _tcp_reason(host: str, port: int, left: float) -> str | None:
    """Why a TCP connect to host:port failed within min(CONNECT_TIMEOUT, *left*) seconds (None: it connected)."""
    try:
        async with asyncio.timeout(max(0.1, min(CONNECT_TIMEOUT, left))):
            _, writer = await asyncio.open_connection(host, port)
        writer.close()
        return None
    except (OSError, TimeoutError) as exc:
        return os.strerror(exc.errno).lower() if isinstance(exc, OSError) and exc.errno else f"no answer within {CONNECT_TIMEOUT:.0f} s"


# Standing connections a DHT host keeps: the auto-connector dials up to the midpoint of the watermarks (16) and
# the pruner trims past the high one once connections are older than libp2p's 20 s grace period.
MIN_CONNECTIONS, LOW_WATERMARK, HIGH_WATERMARK = 4, 8, 24


def connection_config(lib: Any) -> Any:
    """libp2p's connection manager settings for our hosts (see the module docstring for why not its defaults)."""
    return lib.ConnectionConfig(max_connections_per_peer=1, min_connections=MIN_CONNECTIONS, low_watermark=LOW_WATERMARK, high_watermark=HIGH_WATERMARK)


async def _handshake(addr: str) -> str:
    """How a libp2p host with a fresh key fares in a Noise handshake with the peer *addr* names: "ok", "refused"
    (the peer there proved another key) or "slow" (no answer within CONNECT_TIMEOUT, or the dial failed some other
    way: a bootstrap on a loaded machine resets handshakes it cannot finish, which says nothing about its key)."""
    lib = libp2p_api()
    key_pair = lib.create_new_key_pair(Identity.generate().seed)
    noise = lib.NoiseTransport(key_pair, noise_privkey=lib.create_x25519_key_pair().private_key)
    host = lib.new_host(key_pair=key_pair, sec_opt={lib.NOISE_PROTOCOL_ID: noise}, connection_config=connection_config(lib))
    async with host.run([]):
        try:
            with trio.move_on_after(CONNECT_TIMEOUT) as scope:
                try:
                    await host.connect(lib.info_from_p2p_addr(lib.Multiaddr(addr)))
                    return "ok"
                except Exception as exc:  # libp2p dial errors share no base class (and may wrap our cancellation)
                    if not scope.cancel_called:
                        log.debug("dht.bootstrap_handshake_failed", addr=addr, error=repr(exc))
                        return "refused" if _caused_by(exc, lib.PeerIDMismatchesPubkey) else "slow"
            log.debug("dht.bootstrap_handshake_slow", addr=addr)
            return "slow"
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(CONNECT_TIMEOUT):
                await host.close()


def _caused_by(exc: BaseException, kind: type[BaseException], depth: int = 0) -> bool:
    """Whether *kind* is somewhere in *exc*'s causes: libp2p wraps a dial's real error in MultiErrors (``errors``)
    and exception chains several levels deep."""
    if isinstance(exc, kind):
        return True
    if depth > 8:
        return False
    inner = [*(getattr(exc, "errors", None) or ()), *(getattr(exc, "exceptions", None) or ()), exc.__cause__, exc.__context__]
    return any(_caused_by(e, kind, depth + 1) for e in inner if isinstance(e, BaseException))


async def check_bootstrap(addrs: Sequence[str], timeout: float = BOOTSTRAP_WAIT) -> None:
    """Probe every bootstrap at once (:func:`probe_bootstrap`): a malformed or mismatched one is an error, and so is
    none reachable; some unreachable is a warning (the DHT joins through the others)."""
    results = await asyncio.gather(*(probe_bootstrap(a, timeout) for a in addrs), return_exceptions=True)
    unreachable = [r for r in results if isinstance(r, BootstrapUnreachable)]
    for r in results:
        if isinstance(r, BaseException) and not isinstance(r, BootstrapUnreachable):
            raise r
    if unreachable and len(unreachable) == len(addrs):
        raise unreachable[0]
    for r in unreachable:
        log.warning("dht.bootstrap_unreachable", error=str(r))


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
        models: Sequence[ModelShape],
        routing_refresh: float | None,
    ) -> None:
        self.identity, self.listen, self.bootstrap = identity, tcp_multiaddr(listen), list(bootstrap)
        self.routing_refresh = routing_refresh
        self.models = {m.digest: m for m in models}  # the models this node loaded: records must fit their shape
        self.client_mode, self.lookup_timeout, self.clock = client_mode, lookup_timeout, clock
        self.announcer = Announcer(identity, ttl=ttl)
        self.ttl = ttl
        self.helper: Publication[HelperRecord] | None = None  # our helper record (or its tombstone), refreshed like the others
        self.stage: Publication[StageRecord] | None = None  # our stage record (p2p.dht.stage_records), refreshed like the others
        self.multiaddrs: list[str] = []
        self.pacer = ProvidePacer()
        self.provisions = Provisions()  # the provider entries we sent, and when each is due again
        self.republish_all = False  # set when a publication round failed
        self.host: Any = None
        self.dht: Any = None
        self.lock = trio.Lock()  # one publication round at a time (announce, withdraw, refresh)
        self.changed = trio.Event()  # wakes the refresh loop
        self.puts = trio.CapacityLimiter(PARALLEL_PUTS)
        self.rpcs = trio.CapacityLimiter(PARALLEL_RPCS)
        self.walks: deque[Walk] = deque(maxlen=256)  # the last walks' shape, for `moeswarm bench dht`

    @asynccontextmanager
    async def running(self) -> AsyncIterator[trio.Nursery]:
        """Run host and DHT, yielding a nursery for calls; on exit, cancel those, then close the host.

        Only our own tasks are cancelled: cancelling libp2p's interrupts its connections' close
        half-way (the socket stays open, and host.close() then skips the connection as closed).
        """
        lib = libp2p_api()
        key_pair = lib.create_new_key_pair(self.identity.seed)
        noise = lib.NoiseTransport(key_pair, noise_privkey=lib.create_x25519_key_pair().private_key)
        listen = lib.Multiaddr(self.listen)
        self.host = lib.new_host(
            key_pair=key_pair,
            sec_opt={lib.NOISE_PROTOCOL_ID: noise},
            connection_config=connection_config(lib),
            listen_addrs=[listen],
        )
        if self.host.get_id().to_base58() != str(self.identity.peer_id):
            raise DiscoveryError("libp2p derived another peer id from our key; identity.seed is not its Ed25519 seed")
        validator = lib.NamespacedValidator(
            {NAMESPACE: lib.RecordValidator(self.clock, self.models)}, strict_validation=True
        )
        mode = lib.DHTMode.CLIENT if self.client_mode else lib.DHTMode.SERVER
        self.dht = lib.ServerOnlyKadDHT(
            self.host, mode, validator=validator, validator_changed=True, strict_validation=True, clock=self.clock,
            refresh_interval=self.routing_refresh,
        )
        async with self.host.run([listen]):
            try:
                async with lib.background_trio_service(self.dht), trio.open_nursery() as tasks:
                    self.dht.spawn = tasks.start_soon
                    self.multiaddrs = [str(a) for a in self.host.get_addrs()]
                    if self.bootstrap and not await self._join():
                        raise BootstrapUnreachable(f"none of the bootstrap peers answered: {', '.join(self.bootstrap)}; check that they run and are reachable from here")
                    tasks.start_soon(self._maintain)
                    log.debug(
                        "dht.started", peer=str(self.identity.peer_id), addrs=self.multiaddrs, client=self.client_mode
                    )
                    try:
                        yield tasks
                    finally:
                        # A KAD stream arriving while the host shuts down must not spawn into our closed nursery
                        # (trio's "Nursery is closed to new arrivals" ended the node's thread as a crash).
                        self.dht.spawn = None
                        tasks.cancel_scope.cancel()
            finally:
                # Leaving host.run() closes no connection, and once it has stopped the swarm, close()
                # no longer reaches them either: close while the host still runs.
                with trio.CancelScope(shield=True), trio.move_on_after(CONNECT_TIMEOUT):
                    await self.host.close()

    async def _join(self) -> int:
        """Connect to the bootstrap peers and walk towards our own id; returns how many answered."""
        lib = libp2p_api()
        reached = 0
        for addr in self.bootstrap:
            try:
                info = lib.info_from_p2p_addr(lib.Multiaddr(addr))
            except Exception as exc:  # multiaddr raises several types for bad text
                raise UsageError(
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
            due_at = min(filter(None, (self.announcer.next_refresh_at(), self._helper_refresh_at(), self._stage_refresh_at())), default=None)
            delay = MAINTENANCE_INTERVAL if due_at is None else min(MAINTENANCE_INTERVAL, due_at - self.clock())
            with trio.move_on_after(max(delay, 0.0)):
                await self.changed.wait()
            self.changed = trio.Event()
            try:
                if self.bootstrap and self.dht.get_routing_table_size() == 0:
                    await self._join()
                async with self.lock:
                    pubs = self.announcer.due(self.clock(), everything=self.republish_all)
                    pubs += self._helper_due(everything=self.republish_all)
                    pubs += self._stage_due(everything=self.republish_all)
                    if await self._publish(pubs):
                        self.republish_all = False
                        if pubs:
                            log.debug("dht.refreshed", records=len(pubs))
                    await self._reprovide({p.record.key for p in pubs})
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
        log.debug("dht.announced", slices=len(slices), published=len(pubs), ms=_ms_since(started))

    async def withdraw(self) -> None:
        async with self.lock:
            pubs = self.announcer.withdraw(self.clock())
            ok = await self._publish(pubs)
        if not ok:
            raise DiscoveryError("publishing tombstones failed; see dht.publish_failed")
        log.debug("dht.withdrawn", tombstones=len(pubs))

    async def announce_helper(self, quic_addr: str | None) -> None:
        """Publish (None: withdraw) our helper record; the refresh loop keeps it fresh."""
        async with self.lock:
            now, held = self.clock(), self.helper
            if quic_addr is None and (held is None or now >= held.record.expires_at):
                self.helper = None  # nothing live to replace
                return
            if quic_addr:
                ttl = self.ttl
            else:
                assert held is not None  # a withdrawal with nothing held returned above
                ttl = held.record.expires_at - int(now)
            seq = max(int(now * 1000), held.record.seq + 1 if held else 0)
            self.helper = Publication(*issue_helper(self.identity, quic_addr, now=now, ttl=ttl, seq=seq))
            ok = await self._publish([self.helper])
        self.changed.set()
        if not ok:
            raise DiscoveryError(f"announcing helper address {quic_addr} failed (retrying every {RETRY_AFTER:.0f}s)")
        log.debug("dht.helper_announced" if quic_addr else "dht.helper_withdrawn", quic=quic_addr)

    def _helper_refresh_at(self) -> float | None:
        helper = self.helper
        if helper is None or helper.record.quic_addr is None:
            return None
        return helper.record.issued_at + self.ttl / 2

    def _helper_due(self, *, everything: bool) -> list[Publication]:
        at = self._helper_refresh_at()
        if at is None or not (everything or self.clock() >= at):
            return []
        now, helper = self.clock(), self.helper
        assert helper is not None  # _helper_refresh_at is None without one
        seq = max(int(now * 1000), helper.record.seq + 1)
        addr = helper.record.quic_addr
        self.helper = Publication(*issue_helper(self.identity, addr, now=now, ttl=self.ttl, seq=seq))
        return [self.helper]

    async def announce_stage(self, stage: HostedStage | None) -> None:
        """Publish our stage record (None: a tombstone over the one held); the refresh loop keeps it fresh."""
        async with self.lock:
            now, held = self.clock(), self.stage
            if stage is None:
                if held is None or now >= held.record.expires_at:
                    self.stage = None
                    return
                stage = HostedStage(held.record.stage.model_digest, range(0))
            seq = max(int(now * 1000), held.record.seq + 1 if held else 0)
            self.stage = Publication(*issue_stage(self.identity, stage, now=now, ttl=self.ttl, seq=seq))
            ok = await self._publish([self.stage])
        self.changed.set()
        if not ok:
            raise DiscoveryError(f"announcing the stage of layers {stage.layers.start}-{stage.layers.stop - 1} failed (retrying every {RETRY_AFTER:.0f}s)")
        log.debug("dht.stage_announced", layers=f"{stage.layers.start}-{stage.layers.stop - 1}" if stage.layers else "withdrawn")

    def _stage_refresh_at(self) -> float | None:
        held = self.stage
        return None if held is None or held.record.stage.is_tombstone else held.record.issued_at + self.ttl / 2

    def _stage_due(self, *, everything: bool) -> list[Publication]:
        at = self._stage_refresh_at()
        if at is None or not (everything or self.clock() >= at):
            return []
        now, held = self.clock(), self.stage
        assert held is not None  # _stage_refresh_at is None without one
        self.stage = Publication(*issue_stage(self.identity, held.record.stage, now=now, ttl=self.ttl, seq=max(int(now * 1000), held.record.seq + 1)))
        return [self.stage]

    async def lookup_stages(self, model_digest: str, n_layer: int) -> list[StageRecord]:
        """Live stage records of the model (newest per peer, other models' and out-of-shape ones dropped)."""
        records = await self._gather(lambda epoch, shard: stage_provider_key(model_digest, epoch, shard), lambda peer: stage_key(peer, model_digest), f"stages of model {model_digest[:12]}")
        return live_stages(records, StageShape(model_digest, n_layer), self.clock())

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
        await self._provide_due([p.record for p in pubs])
        return True

    async def _reprovide(self, just_published: set[str]) -> None:
        """Provider entries of our live records whose neighbourhood moved (`p2p.dht.provisions`), between refreshes."""
        held: list[HostRecord | HelperRecord | StageRecord] = [r for r in self.announcer.live(self.clock()) if r.key not in just_published]
        for own in (self.helper, self.stage):
            if own is not None and own.record.key not in just_published:
                held.append(own.record)
        await self._provide_due(held)

    async def _provide_due(self, records: Sequence[HostRecord | HelperRecord | StageRecord]) -> None:
        """Send the provider entries of the live records that are due (new, old, or sent to a neighbourhood that moved)."""
        now = self.clock()
        self.provisions.forget_before(int(now // PROVIDER_EPOCH) - 1)
        for record in (r for r in records if r.is_live(now)):
            for epoch in provider_epochs(now - MAX_CLOCK_SKEW, record.expires_at + MAX_CLOCK_SKEW):
                key = _provider_key_of(record, epoch)
                if reason := self.provisions.due(key, now, self._view(key)):
                    await self._provide(key, epoch, reason)

    def _view(self, key: bytes) -> View:
        """The routing table's closest peers to key and its size (local, no traffic)."""
        table = self.dht.routing_table
        closest = table.find_local_closest_peers(key, WALK_WIDTH)
        return View(frozenset(peer.to_bytes() for peer in closest), table.size())

    async def _provide(self, key: bytes, epoch: int, reason: str) -> None:
        while (wait := self.pacer.wait_time(trio.current_time())) > 0:
            await trio.sleep(wait)
        self.pacer.note(trio.current_time())
        view = self._view(key)  # before the walk: what the next check compares against
        if await self.dht.provider_store.provide(key):  # False: no peer took it; retried next refresh
            self.provisions.sent(key, epoch, self.clock(), view)
            if reason != "new":
                log.debug("dht.reprovided", key=key.hex()[4:16], reason=reason, table=view.table_size)
        self.dht.provider_store.providing_keys.discard(key)  # only libp2p's republish (off) reads it

    async def lookup(self, model_digest: str, layer: int) -> list[HostRecord]:
        started = trio.current_time()
        records = await self._gather(
            lambda epoch, shard: provider_key(model_digest, layer, epoch, shard),
            lambda peer: value_key(peer, model_digest, layer),
            f"model {model_digest[:12]} layer {layer}",
        )
        hosts = live_hosts(records, model_digest, layer, self.clock(), self.models.get(model_digest))
        log.debug("dht.lookup", model=model_digest[:12], layer=layer, hosts=len(hosts), ms=_ms_since(started))
        return hosts

    async def lookup_helpers(self) -> list[HelperRecord]:
        """Live helper records, newest per peer, sorted by peer id."""
        records = await self._gather(helper_provider_key, helper_key, "reachability helpers")
        newest: dict[PeerId, HelperRecord] = {}
        for record in records:
            if isinstance(record, HelperRecord) and (record.seq, record.expires_at) > (
                (held.seq, held.expires_at) if (held := newest.get(record.peer_id)) else (-1, -1)
            ):
                newest[record.peer_id] = record
        now = self.clock()
        return sorted((r for r in newest.values() if r.is_live(now)), key=lambda r: r.peer_id)

    async def _gather(
        self, provider_key_of: Callable[[int, int], bytes], value_key_of: Callable[[PeerId], str], what: str
    ) -> list[Any]:
        """The validated records that this epoch's providers hold under their value keys."""
        epoch = int(self.clock() // PROVIDER_EPOCH)
        providers: set[Any] = set()
        records: list[Any] = []
        with trio.move_on_after(self.lookup_timeout) as deadline:
            async with trio.open_nursery() as nursery:
                for shard in range(PROVIDER_SHARDS):
                    nursery.start_soon(self._find_providers, provider_key_of(epoch, shard), providers)
            async with trio.open_nursery() as nursery:
                for peer in providers:
                    nursery.start_soon(self._fetch_record, peer, value_key_of, records)
        if deadline.cancelled_caught:
            log.warning("dht.lookup_timeout", what=what, seconds=self.lookup_timeout)
        return records

    async def _walk(self, key: bytes, ask: Callable[[Any], Awaitable[list[Any]]]) -> tuple[int, int]:
        """Iterative Kademlia walk towards key: ask(peer) records what the peer holds and returns closer
        peers; the walk ends when the WALK_WIDTH closest peers that answer have all been asked. Returns its
        rounds and the peers it asked.

        One RPC per peer does both jobs: half the traffic of a FIND_NODE walk followed by GETs. A peer that
        times out or names no closer peer (libp2p returns the same empty list for an error) leaves the window,
        as in go-libp2p-kad-dht's query: counting a departed peer as one of the closest ended walks after
        churn short of the live peers that hold the entries.
        """
        lib = libp2p_api()
        known = set(self.dht.routing_table.find_local_closest_peers(key, WALK_WIDTH))
        asked: set[Any] = {self.host.get_id()}
        silent: set[Any] = set()

        async def ask_one(peer: Any) -> None:
            closer: list[Any] = []
            async with self.rpcs:
                with trio.move_on_after(QUERY_TIMEOUT):
                    closer = await ask(peer)
            if not closer:
                silent.add(peer)
            known.update(p for p in closer if lib.speaks_kad(self.host, p) is not False)

        rounds = 0
        while batch := [p for p in lib.sort_by_distance(key, list(known - silent))[:WALK_WIDTH] if p not in asked][:ALPHA]:
            asked.update(batch)
            rounds += 1
            async with trio.open_nursery() as nursery:
                for peer in batch:
                    nursery.start_soon(ask_one, peer)
        return rounds, len(asked) - 1

    async def take_walks(self) -> list[Walk]:
        out = list(self.walks)
        self.walks.clear()
        return out

    async def _find_providers(self, key: bytes, out: set[Any]) -> None:
        mine = {info.peer_id for info in self.dht.provider_store.get_providers(key)}

        async def ask(peer: Any) -> list[Any]:
            found, closer = await self.dht.provider_store._get_providers_from_peer_with_closers(peer, key)
            mine.update(info.peer_id for info in found)
            return closer

        rounds, asked = await self._walk(key, ask)
        out.update(mine)
        self.walks.append(Walk("providers", rounds, asked, frozenset(p.to_base58() for p in mine)))

    async def _fetch_record(self, peer: Any, value_key_of: Callable[[PeerId], str], out: list[Any]) -> None:
        """Peer's record under ``value_key_of(peer)``: from the peer itself if it answers, else from the replicas.

        The owner holds its newest record or tombstone and can only serve what it signed itself;
        the walk is for owners in client mode, gone, or restarted without their records.
        """
        try:
            key = value_key_of(PeerId.from_string(peer.to_base58()))
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

        if libp2p_api().speaks_kad(self.host, peer) is not False:
            async with self.rpcs:
                with trio.move_on_after(QUERY_TIMEOUT):
                    await ask(peer)
        if not self._accept(key, values, out):
            if (local := self.dht.value_store.get(key_bytes)) is not None:
                values.add(local.value)
            rounds, asked = await self._walk(key_bytes, ask)
            found = self._accept(key, values, out)
            self.walks.append(Walk("record", rounds, asked, frozenset({peer.to_base58()} if found else ())))

    def _accept(self, key: str, values: set[bytes], out: list[Any]) -> bool:
        """Append the valid records among values to out; whether there was one."""
        now, before = self.clock(), len(out)
        for value in values:
            try:
                out.append(validate_any(key, value, now))
            except RecordError as exc:
                log.debug("dht.record_rejected", key=key, error=type(exc).__name__, reason=str(exc))
        return len(out) > before

    async def routing_peers(self) -> list[str]:
        return sorted(p.to_base58() for p in self.dht.routing_table.get_peer_ids())


@dataclass(frozen=True)
class Walk:
    """One iterative walk of a lookup: its rounds of ALPHA parallel queries (Kademlia's hops), the peers it asked
    and the peers whose entries it found. Kept apart by kind so that `moeswarm bench dht` can tell a host missed by
    the provider walks from one whose record could not be fetched.
    """

    kind: Literal["providers", "record"]  # the providers of one shard's key; a host's record from its replicas
    rounds: int
    asked: int
    found: frozenset[str]  # providers' peer ids; for a record walk, the owner's if a valid record turned up


def _ms_since(started: float) -> float:
    return round((trio.current_time() - started) * 1000, 1)


class LibP2PDiscovery:
    """Discovery on the libp2p Kademlia DHT; the node runs in its own trio thread.

    ``listen`` is ``ip:port`` (port 0 picks one); ``bootstrap`` holds multiaddrs like
    ``/ip4/127.0.0.1/tcp/4001/p2p/12D3KooW...``. ``client_mode`` is for NAT-bound nodes: they query
    and publish but serve nobody (they still listen: libp2p drops provider records without an
    address). ``models``: the shapes of the models this node loaded; it refuses to store or return records
    naming layers or experts they do not have. ``routing_refresh``: seconds between the walks that refresh the routing
    table (one per non-empty k-bucket; libp2p's 10 min when None). Use ``async with LibP2PDiscovery(...) as d:`` or start()/close().
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
        models: Sequence[ModelShape] = (),
        routing_refresh: float | None = None,
    ) -> None:
        self.peer_id = identity.peer_id
        self._listen = listen
        self._node = _Node(
            identity,
            listen=listen,
            bootstrap=bootstrap,
            client_mode=client_mode,
            ttl=ttl,
            lookup_timeout=lookup_timeout,
            clock=clock,
            models=models,
            routing_refresh=routing_refresh,
        )
        self._thread = TrioThread(f"dht-{identity.peer_id.short()}")

    @property
    def multiaddrs(self) -> list[str]:
        """This node's listen multiaddrs with /p2p/<peer-id>, for other nodes' bootstrap lists."""
        return list(self._node.multiaddrs)

    async def start(self) -> None:
        check_free("TCP", *parse_listen(self._listen), "the DHT")  # libp2p's SO_REUSEPORT would share a taken port
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

    async def announce_helper(self, quic_addr: str | None) -> None:
        """Announce that we answer reachability probes on UDP ``quic_addr`` (None: withdraw that); kept fresh."""
        await self._call(self._node.announce_helper, quic_addr)

    async def lookup_helpers(self) -> list[HelperRecord]:
        """The live reachability helpers the DHT knows (``records.HelperRecord``)."""
        return await self._call(self._node.lookup_helpers)

    async def lookup(self, model_digest: str, layer: int, *, fresh: bool = False) -> list[HostRecord]:
        return await self._call(self._node.lookup, model_digest, layer)  # no cache here: always fresh

    async def announce_stage(self, stage: HostedStage | None) -> None:
        """Announce that we run *stage* (None: withdraw it); kept fresh like the host records."""
        await self._call(self._node.announce_stage, stage)

    async def lookup_stages(self, model_digest: str, n_layer: int) -> list[StageRecord]:
        """The live stages of the model the DHT knows (``p2p.dht.stage_records``), sorted by first layer."""
        return await self._call(self._node.lookup_stages, model_digest, n_layer)

    async def routing_peers(self) -> list[str]:
        """Peer ids in this node's Kademlia routing table (servers only)."""
        return await self._call(self._node.routing_peers)

    async def take_walks(self) -> list[Walk]:
        """The walks (hops, peers asked) since the last call: what a lookup cost."""
        return await self._call(self._node.take_walks)

    async def close(self) -> None:
        await asyncio.wrap_future(self._thread.stop())

    async def _call(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        return await asyncio.wrap_future(self._thread.submit(fn, *args))
