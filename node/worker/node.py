"""A worker node: its slice, QUIC endpoint, DHT records, reachability and optional relay, from start to stop."""


from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import structlog

from experts.gguf_model import ExpertRange, GGUFModel
from experts.slices import ExpertStore, check_slice
from node.backbone.routing import scarcity_price
from node.ledger.sink import LedgerSink
from node.runtime import until_stopped, write_ready
from node.worker.service import Worker
from p2p.dht import LibP2PDiscovery
from p2p.helpers import NodeReachability, helper_address
from p2p.identity import Identity
from p2p.nat import announced_address
from p2p.quic import Endpoint
from p2p.reachability import Verdict
from p2p.records import HostedSlice, RelayAddress
from relay.client import RelayClient, attach

log = structlog.get_logger("node.backbone.session")


@dataclass(frozen=True)
class WorkerOptions:
    model: Path
    layers: range | None
    experts: ExpertRange | None
    listen: tuple[str, int]
    dht_listen: str
    bootstrap: Sequence[str]
    memory_budget: int | None = None
    price: int = 0
    capacity: int = 0
    advertise: str | None = None  # host:port others should dial (default: the bound address)
    model_digest: str | None = None  # for a slice: the model it must belong to
    max_datagram: int = 1200  # QUIC datagram size this end sends (1200 is safe on any path; loopback takes 16384)
    reprice_s: float = 60.0
    relay: str | None = None  # ws(s)://HOST:PORT/relay: also reachable through this relay; check reachability
    relay_only: bool = False  # announce the relay address only, skip the check, answer no punch (relay path only)
    recheck_s: float = 300.0  # with a relay: seconds between reachability re-checks (a change is re-announced)


async def run_worker(identity: Identity, opts: WorkerOptions, ready_file: str | None, ledger_path: Path | None = None) -> None:
    """Load the slice, serve dispatches, announce until SIGINT/SIGTERM, then withdraw and close."""
    model = GGUFModel(opts.model)
    if model.is_slice:
        check_slice(model, opts.model_digest)
    store = ExpertStore(model, opts.layers, opts.experts, memory_budget=opts.memory_budget)
    await asyncio.to_thread(store.warm)  # announce only once dispatches are served at full speed
    ledger = LedgerSink(ledger_path, "worker", identity) if ledger_path else None
    worker = Worker(identity, store, price=opts.price, ledger=ledger)
    endpoint = await Endpoint.bind(identity, opts.listen[0], opts.listen[1], handler=worker.handle, max_datagram_size=opts.max_datagram)
    port = endpoint.local_addr[1]
    configured = opts.advertise or helper_address(opts.listen[0], port)  # a direct address we were told, if any
    addr = None if opts.relay else opts.advertise or f"{opts.listen[0]}:{port}"  # with a relay: decided by the check
    ranges = ((store.experts.start, store.experts.stop),)
    # A worker behind a relay may be NAT-bound: it joins the DHT as a client (nobody may be able to dial it, so it
    # must not host records), also when its check finds it public.
    dht = LibP2PDiscovery(identity, listen=opts.dht_listen, bootstrap=opts.bootstrap, client_mode=bool(opts.relay))
    reach = NodeReachability(endpoint, dht, recheck=opts.recheck_s)  # answers probes on the QUIC socket in every mode
    relay_addr, relay_path = None, None
    if opts.relay:
        relay_path = attach(endpoint, RelayClient(identity, opts.relay))
        relay_path.client.start()
        await relay_path.client.wait_connected(30)
        relay_addr = RelayAddress(opts.relay, relay_path.client.relay_peer)
        reach.nat.attach_relay(relay_path.client, initiate=False)  # answers backbones' punches with our verdict
        worker.path_of = reach.nat.path

    def slices(price: int) -> list[HostedSlice]:
        return [HostedSlice(model.digest, layer, ranges, quic_addr=addr, relay=relay_addr, capacity=opts.capacity, price=price) for layer in store.layers]

    async def replicas() -> int:
        """Live hosts (this one included) of our slice's scarcest layer."""
        counts = []
        for layer in store.layers:
            hosts = await dht.lookup(model.digest, layer)
            counts.append(1 + sum(1 for r in hosts if r.peer_id != identity.peer_id and r.hosted.expert_ranges == ranges))
        return min(counts)

    async def reprice() -> None:
        """Re-announce when the scarcity price changes (README: pricing)."""
        while True:
            await asyncio.sleep(opts.reprice_s)
            price = scarcity_price(opts.price, await replicas())
            if price != worker.price:
                worker.price = price
                await dht.announce(slices(price))
                log.info("worker.repriced", price=price)

    async def readvertise(verdict: Verdict) -> None:
        """A re-check changed the verdict: announce the direct address it implies (or withdraw ours)."""
        nonlocal addr
        new = announced_address(verdict, configured)
        if new == addr:
            return
        log.info("worker.readvertised", quic=new, before=addr, reachability=verdict.kind.name.lower(), reason=verdict.reason)
        addr = new
        try:
            await dht.announce(slices(worker.price))
            await reach.announce(new)
        except Exception as exc:  # the records keep their refresh loop; the next change or restart retries
            log.warning("worker.readvertise_failed", error=repr(exc))

    readvertising: set[asyncio.Task] = set()

    def on_change(verdict: Verdict) -> None:
        task = asyncio.ensure_future(readvertise(verdict))
        readvertising.add(task)
        task.add_done_callback(readvertising.discard)

    repricing = None
    try:
        await dht.start()
        reach.start()
        if opts.relay and not opts.relay_only:
            verdict = await reach.check()
            addr = announced_address(verdict, configured)
            reachability = verdict.kind.name.lower()
            reach.nat.reach.on_change = on_change
        else:
            reachability = "relay-only" if opts.relay_only else "unchecked"  # public by configuration
        await reach.announce(addr if opts.relay else configured)  # public nodes help others check theirs
        worker.price = scarcity_price(opts.price, await replicas()) if opts.price else 0
        await dht.announce(slices(worker.price))
        if opts.price:
            repricing = asyncio.create_task(reprice())
        log.info("worker.ready", peer=str(identity.peer_id), quic=addr, reachability=reachability, layers=f"{store.layers.start}-{store.layers.stop - 1}", experts=str(store.experts), mode=store.plan.mode)
        write_ready(ready_file, {"role": "worker", "peer_id": str(identity.peer_id), "quic_addr": addr, "relay": opts.relay, "reachability": reachability, "dht_addrs": dht.multiaddrs, "load": store.plan.mode, "price": worker.price, "ledger": str(ledger_path) if ledger_path else None})
        await until_stopped()
    finally:
        for task in (repricing, *readvertising):
            if task:
                task.cancel()
        try:
            await asyncio.wait_for(dht.withdraw(), 10)
            log.info("worker.withdrawn", peer=str(identity.peer_id))
        except Exception as exc:  # shutdown goes on; records then expire on their own
            log.warning("worker.withdraw_failed", error=repr(exc))
        await reach.close()
        if relay_path:
            relay_path.detach()
            await relay_path.client.close()
        await endpoint.close()
        await dht.close()
        worker.close()
        if ledger:
            ledger.close()


