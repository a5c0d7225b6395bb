"""NAT-bound workers through the relay: exact output, and the relay dying mid-generation changes nothing."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest
import structlog

from experts.embedded import EMBEDDED_MODEL
from experts.forward import local_moe
from experts.generate import generate
from experts.gguf_model import GGUFModel
from experts.moe import Partition, grouped_moe
from experts.tokenizer import Tokenizer
from node.backbone.options import BackboneOptions
from node.backbone.session import backbone_session, wait_for_hosts
from node.launcher import Cluster
from p2p.identity import Identity
from tests.support import log_offset, wait_for_log
from tests.support.engine import generate_off_loop, local_engine

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_relay_only_worker_serves_exactly_and_survives_a_relay_restart(tmp_path):
    """Every dispatch to a relay-only worker goes through the relay; killing the relay mid-generation falls back
    without changing a token; once the relay is back, the worker serves through it again."""
    model = GGUFModel(EMBEDDED_MODEL)
    ids = Tokenizer.from_spec(model.tokenizer_spec).encode("And the LORD said unto Moses")
    bb, store = local_engine(model)
    whole = Partition(((0, model.cfg.n_expert),))
    n = 40
    local = [t for t, _ in generate(bb, ids, n, local_moe(lambda i, x, e, w: grouped_moe(store, whole, i, x, e, w)))]
    port = free_port()
    with Cluster(tmp_path) as cluster:
        relay = cluster.start("relay", "relay", "--listen", f"127.0.0.1:{port}")
        url = relay.wait_ready()["url"]
        boot = cluster.start("bootstrap", "bootstrap", "--listen", "127.0.0.1:0").wait_ready()["dht_addrs"][0]
        info = cluster.start("nat", "worker", "--model", str(model.path), "--bootstrap", boot, "--relay", url, "--relay-only").wait_ready()
        assert info["quic_addr"] is None
        marks: dict[str, float] = {}
        backbone_id = Identity.generate()

        def chaos(i: int) -> None:
            if i == 8:
                relay.kill()
                marks["killed"] = time.monotonic()
            elif i == 20:
                restart = log_offset(relay.log_file)
                relay.start()
                relay.wait_ready()
                marks["back"] = time.monotonic()
                # The worker's and the backbone's relay clients reconnect with backoff: wait until the new relay
                # has registered both.
                for peer in (info["peer_id"], str(backbone_id.peer_id)):
                    wait_for_log(relay.log_file, "relay.client_connected", f"peer={peer}", since=restart, timeout=60)

        async def run():
            async with backbone_session(backbone_id, model, [boot], bb.kernel, BackboneOptions(timeout=1.0)) as moe:
                await wait_for_hosts(moe, model.layers, 1, 60)
                return await generate_off_loop(bb, moe.hook, ids, n, chaos), moe

        with structlog.testing.capture_logs() as logs:
            out, moe = asyncio.run(run())
    assert out == local
    recs = moe.stats.records
    assert recs and all(r.path == "relay" for r in recs)
    assert all(r.ok for r in recs if r.at < marks["killed"])
    assert any(not r.ok for r in recs) and moe.stats.local_groups > 0
    assert any(e["event"] == "dispatch.failed" and e["peer"] == info["peer_id"] for e in logs)
    assert any(r.ok and r.at > marks["back"] for r in recs), "the worker never served through the restarted relay"
    assert all(r.path == "relay" for r in moe.receipts)
