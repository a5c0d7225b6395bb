"""py-libp2p 0.8.1 under :mod:`p2p.dht.kademlia`: imported lazily, with our record validator, an expiry-clamping record
store, a provider store that no network can monopolise (:mod:`p2p.dht.slots`), patched Kademlia routing, and its logger
re-attached to the root (see :func:`reattach_libp2p_logger`).

Everything here works around a measured defect listed in :mod:`p2p.dht.kademlia`'s docstring; keeping it in one module keeps
the DHT logic free of libp2p's internals and makes the next libp2p upgrade a one-file review.
"""

from __future__ import annotations

import inspect
import logging
import os
import threading
from collections.abc import Callable, Mapping
from types import SimpleNamespace
from typing import Any

import structlog
import trio

from p2p.dht.records import HostRecord, ModelShape, RecordError
from p2p.dht.slots import Admission, OwnerQuota, ProviderSlots, address_group
from p2p.dht.stage_records import StageRecord, StageShape, expires_at_of, select_best, signer_of, validate
from p2p.lograte_edge import ThrottledLog

log = structlog.get_logger("p2p.dht.kademlia")
# What any DHT peer can make a node refuse at will; used from the DHT's trio thread only (one ThrottledLog, one thread).
peer_log = ThrottledLog(log)


def reattach_libp2p_logger() -> None:
    """Undo libp2p's detaching of its ``libp2p`` logger on import (no propagation): its info records and up go to the
    root handler again, whose filter (:mod:`node.logs`) shows them at debug only. Its debug records stay off: a
    busy DHT node makes ~1,000 a second. Left alone when ``LIBP2P_DEBUG`` is set: then libp2p logs everything
    through its own handlers, as its documentation says."""
    if not os.environ.get("LIBP2P_DEBUG"):
        logger = logging.getLogger("libp2p")
        logger.setLevel(logging.INFO)
        logger.propagate = True


_libp2p_lock = threading.Lock()
_libp2p_loaded: SimpleNamespace | None = None


def libp2p_api() -> SimpleNamespace:
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
    from libp2p.kad_dht.provider_store import PROVIDER_RECORD_EXPIRATION_INTERVAL, ProviderStore
    from libp2p.kad_dht.utils import sort_peer_ids_by_distance
    from libp2p.kad_dht.value_store import ValueStore
    from libp2p.network.config import ConnectionConfig
    from libp2p.peer.peerinfo import info_from_p2p_addr
    from libp2p.peer.peerstore import PeerStoreError
    from libp2p.records.validator import NamespacedValidator, Validator
    from libp2p.security.noise.exceptions import PeerIDMismatchesPubkey
    from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
    from libp2p.security.noise.transport import Transport as NoiseTransport
    from libp2p.tools.anyio_service import background_trio_service
    from multiaddr import Multiaddr

    patched = QuicStreamSender.get_frame
    if getattr(patched, "_libp2p_keep_pending_fin", False):  # libp2p's mark on its replacement
        # The replacement closes over the original, whichever module imported libp2p first.
        setattr(QuicStreamSender, "get_frame", inspect.getclosurevars(patched).nonlocals["original"])  # noqa: B010  (mypy: no method assignment)
        log.debug("dht.aioquic_patch_reverted")
    reattach_libp2p_logger()

    class RecordValidator(Validator):
        """The /moeswarm/ namespace's validator: every put and get goes through stage_records.validate (host, helper and stage
        records), and a host or stage record of a model this node loaded must fit that model's shape (``models``: digest -> shape)."""

        def __init__(self, clock: Callable[[], float], models: Mapping[str, ModelShape]) -> None:
            self._clock, self._models = clock, models

        def validate(self, key: str, value: bytes) -> None:
            try:
                record = validate(key, value, self._clock())
                if isinstance(record, HostRecord) and (shape := self._models.get(record.hosted.model_digest)):
                    shape.check(record)
                if isinstance(record, StageRecord) and (shape := self._models.get(record.stage.model_digest)):
                    StageShape(shape.digest, shape.n_layer).check(record)
            except RecordError as exc:
                peer_log.info("dht.record_rejected", key=key[:60], error=type(exc).__name__, reason=str(exc))
                raise

        def select(self, key: str, values: list[bytes]) -> int:
            return select_best(key, values, self._clock())

    class ExpiringValueStore(ValueStore):
        """A value store that forgets each record at its own expires_at, not libp2p's fixed 24 h, and holds at most
        `p2p.dht.slots.OwnerQuota` values per signer."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.quota = OwnerQuota()

        def put(self, key: bytes, value: bytes, validity: float = 0.0) -> None:
            if self._admit(key, value):
                super().put(key, value, validity)
                self._clamp(key)

        def put_record(self, key: bytes, record: Any) -> None:
            if self._admit(key, record.value):
                super().put_record(key, record)
                self._clamp(key)

        def _admit(self, key: bytes, value: bytes) -> bool:
            try:
                signer = signer_of(value)
            except RecordError:
                return True  # not ours to judge here: the validator refuses such values before they get here
            if self.quota.admit(signer, key, self.store):
                return True
            peer_log.info("dht.record_refused", key=key[:60], reason="signer_limit", peer=str(signer))
            return False

        def _clamp(self, key: bytes) -> None:
            stored, validity = self.store[key]
            try:
                expires_at = expires_at_of(stored.value)
            except RecordError:
                return  # the validator refuses such values before they get here
            self.store[key] = (stored, min(validity, expires_at))

    class FairProviderStore(ProviderStore):
        """libp2p's provider store with `p2p.dht.slots.ProviderSlots` deciding who holds the slots of a key.

        A provider is filed under the network its connection to us comes from (what it cannot choose), not under
        the addresses it claims; our own entries (``provide`` adds them locally) count as their own network.
        """

        def __init__(self, host: Any, clock: Callable[[], float]) -> None:
            super().__init__(host)
            self._clock = clock
            self.slots: ProviderSlots[Any] = ProviderSlots(ttl=PROVIDER_RECORD_EXPIRATION_INTERVAL)

        def add_provider(self, key: bytes, provider: Any) -> None:
            if not provider or not provider.peer_id:
                return
            peer = str(provider.peer_id)
            verdict = self.slots.offer(key, peer, self._group_of(provider.peer_id), provider, self._clock())
            if verdict.admission is Admission.DISPLACED:
                peer_log.info("dht.provider_displaced", key=key.hex()[:16], peer=peer, dropped=str(verdict.dropped))
            elif not verdict.stored:
                peer_log.info("dht.provider_refused", per=verdict.admission.value, key=key.hex()[:16], peer=peer, reason=verdict.admission.value)

        def get_providers(self, key: bytes) -> list[Any]:
            return self.slots.providers(key, self._clock())

        def cleanup_expired(self) -> None:
            self.slots.expire(self._clock())

        def get_provided_keys(self, peer_id: Any) -> list[bytes]:
            return [k for k in self.slots.keys_of(str(peer_id)) if isinstance(k, bytes)]

        def size(self) -> int:
            return len(self.slots)

        def _group_of(self, peer_id: Any) -> str:
            if peer_id == self.local_peer_id:
                return f"self/{peer_id}"
            for conn in self.host.get_network().connections.get(peer_id, ()):
                remote = getattr(conn.muxed_conn, "get_remote_address", lambda: None)()  # yamux and mplex have it
                if remote:
                    return address_group(remote[0], str(peer_id))
            return f"unconnected/{peer_id}"  # only ADD_PROVIDER (on a live stream) reaches here; kept distinct

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

        def __init__(self, *args: Any, clock: Callable[[], float], refresh_interval: float | None = None, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.refresh_interval = refresh_interval or ROUTING_TABLE_REFRESH_INTERVAL  # libp2p's 10 min by default
            self.value_store = ExpiringValueStore(host=self.host, local_peer_id=self.local_peer_id)
            self.provider_store = FairProviderStore(self.host, clock)
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
                await trio.sleep(self.refresh_interval)

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
        PeerIDMismatchesPubkey=PeerIDMismatchesPubkey,
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
