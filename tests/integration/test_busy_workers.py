"""Several backbones share a pool: a saturated worker's OVERLOADED refusal is "busy, ask a replica", not a failure.

Two worker processes, each holding every expert with room for one dispatch at a time (``--max-in-flight 1``, each
dispatch held 1 s); three dispatches of one layer at once. Two are served remotely, the one no worker has room for
is refused by each (OVERLOADED) and computed here. Nothing fails, no worker is benched for being full, every sum is
exact. (Before: a refusal counted as a failed dispatch and benched the worker, doubling, as if it had crashed.)"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import structlog

from experts.embedded import EMBEDDED_MODEL
from experts.gguf_model import GGUFModel
from experts.moe import Partition, grouped_moe
from node.backbone.options import BackboneOptions
from node.backbone.session import backbone_session, wait_for_hosts
from node.launcher import Cluster
from p2p.identity import Identity, PeerId
from tests.support.engine import kernel, local_engine
from tests.support.polling import async_until

pytestmark = pytest.mark.slow


def test_a_full_worker_is_busy_not_failed_and_its_group_goes_elsewhere(tmp_path):
    model = GGUFModel(EMBEDDED_MODEL)
    cfg = model.cfg
    bb, store = local_engine(model)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, cfg.n_embd)).astype(np.float32)
    ids, w = bb.router(0, x)
    expected = grouped_moe(store, Partition(((0, cfg.n_expert),)), 0, x, ids, w)
    with Cluster(tmp_path) as cluster:
        boot = cluster.start("bootstrap", "bootstrap", "--listen", "127.0.0.1:0").wait_ready()["dht_addrs"][0]
        common = ("worker", "--model", str(model.path), "--bootstrap", boot, "--max-in-flight", "1", "--dispatch-delay", "1.0")
        peers = [PeerId.from_string(cluster.start(f"w{i}", *common).wait_ready()["peer_id"]) for i in range(2)]

        async def main():
            async with backbone_session(Identity.generate(), model, [boot], kernel(), BackboneOptions(timeout=30.0, spot_check=0.0)) as moe:
                await wait_for_hosts(moe, model.layers, 2, 60)
                await async_until(lambda: all(p in moe.router.health for p in peers), timeout=60)  # both vetted
                moe.router.unmeasured_compute_ms = None  # a held dispatch is waited for, not cut at its ping's deadline
                sums = await asyncio.gather(*(moe.dispatch_layer(0, x, ids, w) for _ in range(3)))
                return sums, moe.stats.summary(), {p: moe.router.health[p] for p in peers}

        with structlog.testing.capture_logs() as logs:
            sums, stats, health = asyncio.run(main())
    for s in sums:
        np.testing.assert_array_equal(s, expected)
    assert stats["failed_dispatches"] == 0, stats
    assert stats["refusals"].get("overloaded", 0) >= 1, stats  # the third found both full
    assert stats["dispatches"] == 2 and stats["local_groups"] >= 1, stats
    assert all(h.failures == 0 and not h.demoted for h in health.values())  # full is not broken: nobody benched
    assert not [e for e in logs if e["event"] in ("dispatch.failed", "route.demoted")]
    assert [e for e in logs if e["event"] == "dispatch.busy"]
