"""Spot checks catch a worker process that returns perturbed partial sums; it stops receiving work."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import structlog

from experts.embedded import EMBEDDED_MODEL
from experts.forward import Backbone
from experts.generate import generate
from experts.gguf_model import GGUFModel
from experts.tokenizer import Tokenizer
from node.backbone.session import backbone_session, wait_for_hosts
from node.launcher import Cluster
from p2p.identity import Identity
from tests.support.engine import kernel

pytestmark = pytest.mark.slow
REPO = str(Path(__file__).resolve().parents[2])


def test_malicious_worker_is_caught_disputed_and_banned(tmp_path):
    """At a 10% sampling rate the cheat is caught within 100 dispatches, its receipts disputed, and it gets no more work."""
    model = GGUFModel(EMBEDDED_MODEL)
    ids = Tokenizer.from_spec(model.tokenizer_spec).encode("And it came to pass")
    with Cluster(tmp_path) as cluster:
        boot = cluster.start("bootstrap", "bootstrap", "--listen", "127.0.0.1:0").wait_ready()["dht_addrs"][0]
        cheat = cluster.start("cheat", "worker", "--model", str(model.path), "--bootstrap", boot, module="tests.doubles.malicious_worker", env={"PYTHONPATH": REPO})
        peer = cheat.wait_ready()["peer_id"]

        async def run():
            k = kernel()  # the cheat's kernel (it is the real worker's): its sums are checked bit for bit
            async with backbone_session(Identity.generate(), model, [boot], timeout=3.0, spot_check=0.1, spot_seed=7, kernel=k) as moe:
                await wait_for_hosts(moe, model.layers, 1, 60)
                bb = Backbone(model, k)
                await asyncio.to_thread(lambda: list(generate(bb, ids, 40, moe.hook)))
                return moe

        with structlog.testing.capture_logs() as logs:
            moe = asyncio.run(run())
    to_cheat = [r for r in moe.stats.records if r.peer == peer]
    disputes = [e for e in logs if e["event"] == "receipt.disputed"]
    assert disputes and {e["peer"] for e in disputes} == {peer}
    assert moe.disputes[0].receipt.worker == peer
    assert len(to_cheat) <= 100  # caught within 100 dispatches
    assert all(r.at <= moe.disputes[0].at for r in to_cheat)  # no work after the first dispute
    assert moe.stats.local_groups > 0  # its experts were computed by the backbone after the ban
    assert all(r.worker != peer for r in moe.receipts)  # every receipt of the cheat is disputed, none paid
    assert len(moe.disputes) == len([r for r in to_cheat if r.ok])
