"""SIGTERM drains a worker process: it withdraws, refuses new dispatches, answers those in flight, then exits."""

from __future__ import annotations

import asyncio
import json
import signal

import numpy as np
import pytest
import structlog

from experts import codecs
from experts.embedded import EMBEDDED_MODEL
from experts.forward import Backbone
from experts.generate import generate
from experts.gguf_model import GGUFModel
from experts.moe import Partition
from experts.tokenizer import Tokenizer
from node.backbone.dispatch import RemoteMoE
from node.backbone.options import BackboneOptions
from node.backbone.session import backbone_session, wait_for_hosts
from node.launcher import Cluster, NodeProcess
from p2p.connector import Connector
from p2p.identity import Identity, PeerId
from p2p.wire import messages as wire
from tests.support.engine import kernel
from tests.support.polling import async_until

from .test_swarm import N_TOKENS, local_run

pytestmark = pytest.mark.slow
DELAY_S = 8.0  # the victim holds each dispatch this long: longer than its withdrawal, so the drain starts mid-dispatch


@pytest.fixture(scope="module")
def model() -> GGUFModel:
    return GGUFModel(EMBEDDED_MODEL)


def events(node: NodeProcess, name: str) -> list[dict]:
    """The structlog events called *name* in a node's JSON log (libp2p's plain-text lines are skipped)."""
    found = []
    for line in node.log_file.read_text(errors="replace").splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and event.get("event") == name:
            found.append(event)
    return found


def test_sigterm_with_a_dispatch_in_flight_loses_nothing(model, tmp_path, monkeypatch):
    """Two replicas; SIGTERM to one while it computes a dispatch: that dispatch is answered (with a valid receipt), a
    request sent during the drain is refused and goes to the other replica, no dispatch fails, the tokens equal the
    local run, and the worker exits 0 after logging draining with the dispatch in flight."""
    whole = Partition(((0, model.cfg.n_expert),))
    ids = Tokenizer.from_spec(model.tokenizer_spec).encode("In the beginning")
    local = [t for t, _ in local_run(model, whole, ids)]
    with Cluster(tmp_path) as cluster:
        boot = cluster.start("bootstrap", "bootstrap", "--listen", "127.0.0.1:0").wait_ready()["dht_addrs"][0]
        common = ("worker", "--model", str(model.path), "--bootstrap", boot)
        steady = cluster.start("steady", "--log-json", *common)
        victim = cluster.start("victim", "--log-json", *common, "--dispatch-delay", str(DELAY_S), "--drain-timeout", "60")
        steady.wait_ready()
        victim_id = PeerId.from_string(victim.wait_ready()["peer_id"])
        seen: dict[str, object] = {}

        request = Connector.request
        session: list[RemoteMoE] = []

        async def signal_mid_dispatch(self, peer, direct, relay, data, *, timeout):
            """The victim's first dispatch: SIGTERM it while it computes, then send the same layer again mid-drain.
            (The backbone pings a host before its first dispatch: pings pass through.)"""
            if peer != victim_id or "signalled" in seen or isinstance(wire.decode(data), wire.Ping):
                return await request(self, peer, direct, relay, data, timeout=timeout)
            seen["signalled"] = True
            in_flight = asyncio.ensure_future(request(self, peer, direct, relay, data, timeout=timeout))
            await async_until(lambda: events(victim, "dispatch.delayed"), timeout=60)
            victim.proc.send_signal(signal.SIGTERM)
            await async_until(lambda: events(victim, "worker.withdrawn"), timeout=60)
            req = wire.decode(data)  # one group holds every expert: its ids are the layer's, its sum is the layer's
            x = codecs.decode(req.codec, req.hidden, req.n_tokens, model.cfg.n_embd)
            ids = np.array(req.expert_ids, dtype=np.int32).reshape(req.n_tokens, req.top_k)
            w = np.array(req.router_weights, dtype=np.float32).reshape(req.n_tokens, req.top_k)
            seen["during_drain"] = await session[0].dispatch_layer(req.layer, x, ids, w)  # refused, redirected
            reply = await in_flight
            seen["in_flight"] = codecs.decode(req.codec, wire.decode(reply.data).partial, req.n_tokens, model.cfg.n_embd)
            return reply

        monkeypatch.setattr(Connector, "request", signal_mid_dispatch)

        async def main():
            k = kernel()
            async with backbone_session(Identity.generate(), model, [boot], k, BackboneOptions(timeout=60.0)) as moe:
                session.append(moe)
                await wait_for_hosts(moe, model.layers, 2, 60)
                await async_until(lambda: victim_id in moe.router.health, timeout=60)  # vetted (pinged), not only announced
                moe.router.health[victim_id].rtt_ms = 0.0  # the victim takes the first dispatch
                moe.router.unmeasured_compute_ms = None  # and is waited on for it (DELAY_S), not cut at its ping's deadline
                bb = Backbone(model, k)
                out = await asyncio.to_thread(lambda: [t for t, _ in generate(bb, ids, N_TOKENS, moe.hook)])
                return out, moe

        with structlog.testing.capture_logs() as logs:
            out, moe = asyncio.run(main())
        assert victim.proc.wait(60) == 0
    assert out == local
    assert moe.stats.summary()["failed_dispatches"] == 0
    assert np.array_equal(seen["in_flight"], seen["during_drain"])
    assert any(r.worker == str(victim_id) for r in moe.receipts)  # the in-flight reply came with a valid receipt
    assert [e["peer"] for e in logs if e["event"] == "dispatch.redirected"] == [str(victim_id)]
    draining = events(victim, "worker.draining")
    assert len(draining) == 1 and draining[0]["in_flight"] == 1
    assert [e for e in events(victim, "dispatch.refused") if "shutting down" in e["error"]]
    assert events(victim, "worker.drained") and events(victim, "worker.closed")
