"""Stage records over real libp2p hosts on 127.0.0.1 (issue 26): a stage's announcement is found by model, a forged
or foreign-model stage record is refused by the nodes that store records, and a withdrawn stage disappears; a real
`moeswarm stage` process announces its record, and withdraws it when it stops."""

from __future__ import annotations

import asyncio
import hashlib
import time
from functools import partial

import pytest

from experts.gguf_model import GGUFModel
from p2p.dht.kademlia import LibP2PDiscovery
from p2p.dht.records import ModelShape
from p2p.dht.stage_records import SIGNING_CONTEXT, HostedStage, StageRecord, issue_stage
from p2p.identity import Identity, PeerId
from tests.integration.test_dht import inject
from tests.support import async_poll, run_bounded
from tests.support.swarm import Swarm

from ..conftest import make_model

MODEL = hashlib.sha256(b"stage-dht-model").hexdigest()
OTHER = hashlib.sha256(b"stage-dht-other").hexdigest()
N_LAYER = 24
run = partial(run_bounded, timeout=60.0)


def test_stages_are_announced_found_guarded_and_withdrawn():
    """Two stages found sorted by layer; forged and out-of-shape records refused by a node told the model; a
    foreign model's stage never answers this model's lookup; a withdrawn stage is gone."""

    async def main() -> None:
        shape = ModelShape(MODEL, N_LAYER, 8)
        boot = LibP2PDiscovery(Identity.generate(), models=[shape])
        await boot.start()
        stages = [LibP2PDiscovery(Identity.generate(), bootstrap=boot.multiaddrs, models=[shape]) for _ in range(3)]
        client = LibP2PDiscovery(Identity.generate(), bootstrap=boot.multiaddrs, client_mode=True)
        nodes = [boot, *stages, client]
        try:
            for node in nodes[1:]:
                await node.start()
            await stages[0].announce_stage(HostedStage(MODEL, range(0, 12), "127.0.0.1:7101", capacity=4))
            await stages[1].announce_stage(HostedStage(MODEL, range(12, 24), "127.0.0.1:7102", price=2))
            await stages[2].announce_stage(HostedStage(OTHER, range(0, 24), "127.0.0.1:7103"))
            lookup = partial(client.lookup_stages, MODEL, N_LAYER)
            found = await async_poll(lookup, lambda r: len(r) == 2, 20.0)
            assert [(r.peer_id, r.stage.layers, r.stage.quic_addr) for r in found] == [
                (stages[0].peer_id, range(0, 12), "127.0.0.1:7101"),
                (stages[1].peer_id, range(12, 24), "127.0.0.1:7102"),
            ]
            now = time.time()
            lure = StageRecord(stages[0].peer_id, HostedStage(MODEL, range(0, 24), "127.0.0.1:6666"), int(now), int(now) + 600, 2**62)
            forged = lure.body() + Identity.generate().sign(SIGNING_CONTEXT + lure.body())
            liar = Identity.generate()
            deep, deep_value = issue_stage(liar, HostedStage(MODEL, range(0, N_LAYER + 8), "127.0.0.1:6667"), now=now, ttl=600, seq=1)
            results = await asyncio.to_thread(inject, [boot.multiaddrs[0]], [(lure.key.encode(), forged), (deep.key.encode(), deep_value)])
            assert results[(boot.multiaddrs[0], lure.key.encode())][0] is False
            assert results[(boot.multiaddrs[0], deep.key.encode())] == (False, None)
            again = await client.lookup_stages(MODEL, N_LAYER)
            assert [r.stage.quic_addr for r in again if r.peer_id == stages[0].peer_id] == ["127.0.0.1:7101"]
            assert liar.peer_id not in {r.peer_id for r in again}
            await stages[1].announce_stage(None)
            gone = await async_poll(lookup, lambda r: len(r) == 1, 20.0)
            assert [r.peer_id for r in gone] == [stages[0].peer_id]
        finally:
            await asyncio.gather(*(node.close() for node in nodes))

    run(main())


@pytest.mark.slow
def test_a_stage_process_announces_its_record_and_withdraws_it_when_stopped(model_dir, tmp_path):
    """`moeswarm stage --bootstrap` puts its signed record on the DHT (the ready file's peer, address and layers, its
    capacity and price); a client's lookup finds it; after SIGTERM the stage's tombstone makes the lookup empty."""
    model = GGUFModel(make_model(model_dir, "qwen3moe", n_layer=4))

    with Swarm(tmp_path) as swarm:
        boot = swarm.start("bootstrap", "bootstrap", "--listen", "127.0.0.1:0").wait_ready()["dht_addrs"][0]
        proc = swarm.start("stage", "stage", "--model", str(model.path), "--layers", "2-3", "--kernel", "reference", "--threads", "1", "--bootstrap", boot, "--max-sessions", "5", "--price", "7")
        ready = proc.wait_ready(90)

        async def main() -> tuple[list[StageRecord], list[StageRecord]]:
            async with LibP2PDiscovery(Identity.generate(), bootstrap=[boot], client_mode=True) as client:
                lookup = partial(client.lookup_stages, model.digest, model.cfg.n_layer)
                found = await async_poll(lookup, lambda r: len(r) == 1, 30.0)
                await asyncio.to_thread(proc.stop)
                return found, await async_poll(lookup, lambda r: r == [], 30.0)

        found, after = run(main())
        assert len(found) == 1
        record = found[0]
        assert (record.peer_id, record.stage.layers, record.stage.quic_addr) == (PeerId.from_string(ready["peer_id"]), range(2, 4), ready["quic_addr"])
        assert (record.stage.capacity, record.stage.price, record.stage.model_digest) == (5, 7, model.digest)
        assert record.stage.kernel.startswith("numpy")
        assert after == [] and "stage.withdraw_failed" not in proc.log_file.read_text()
