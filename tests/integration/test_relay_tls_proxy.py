"""wss:// relays behind a real TLS-terminating reverse proxy (nginx, started by the test) with a private CA.

The relay itself speaks plain ws:// on loopback; nginx terminates TLS with a certificate from a CA the test makes,
so the worker and the backbone reach the relay only with ``--relay-ca`` / ``RelaySettings(ca_file=...)``. The
proxy is restarted (fast shutdown: every WebSocket cut without a close) in the middle of a generation, whose tokens
must still equal the single-process run.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest
import structlog

from experts.embedded import EMBEDDED_MODEL
from experts.forward import Backbone, local_moe
from experts.generate import generate
from experts.gguf_model import GGUFModel
from experts.moe import Partition, grouped_moe
from experts.tokenizer import Tokenizer
from node.backbone.dispatch import RemoteMoE
from node.backbone.options import BackboneOptions
from node.backbone.session import backbone_session, wait_for_hosts
from node.launcher import Cluster
from p2p.identity import Identity, PeerId
from relay.client import RelaySettings
from relay.server import RelayServer
from tests.support import async_until, log_offset, moeswarm, run_bounded, until, wait_for_log
from tests.support.engine import generate_off_loop, kernel, local_engine
from tests.support.tlsproxy import NginxProxy, PrivateCA, free_port, nginx_binary

pytestmark = pytest.mark.skipif(nginx_binary() is None, reason="nginx is not installed (./dev setup installs it)")
PROMPT = "And the LORD said unto Moses"


def test_a_keepalive_below_the_proxys_idle_timeout_keeps_the_link(tmp_path):
    """Behind a proxy that cuts WebSockets idle for 2 s, a client pinging every 0.5 s keeps its one connection
    while a client on the default 15 s keepalive is cut (and reconnects)."""

    async def scenario() -> None:
        ca = PrivateCA.create(tmp_path / "pki")
        server = RelayServer(Identity.generate())
        await server.start("127.0.0.1", 0)
        proxy = NginxProxy(tmp_path / "nginx", f"127.0.0.1:{server.address[1]}", ca, read_timeout=2)
        await asyncio.to_thread(proxy.start)
        try:
            with structlog.testing.capture_logs() as logs:
                async with RelaySettings(ca.ca, keepalive=0.5).client(Identity.generate(), proxy.url) as brisk, \
                        RelaySettings(ca.ca).client(Identity.generate(), proxy.url) as sleepy:  # fmt: skip
                    await brisk.wait_connected(10)
                    await sleepy.wait_connected(10)

                    def events(link, name):
                        return [e for e in logs if e["event"] == name and e.get("peer") == str(link.peer_id)]

                    await async_until(lambda: events(sleepy, "relay.disconnected"), timeout=20)
                    assert events(sleepy, "relay.disconnected")[0]["reason"].startswith("connection lost without a close")
                    assert len(events(brisk, "relay.connected")) == 1 and not events(brisk, "relay.disconnected")
                    assert brisk.connected
                    await sleepy.wait_connected(10)
        finally:
            await asyncio.to_thread(proxy.stop)
            await server.close()

    run_bounded(scenario(), timeout=60)


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    """A relay on plain ws://, nginx with a private CA's certificate in front of it, a bootstrap node and a
    relay-only worker that reaches the relay as wss:// through the proxy."""
    tmp = tmp_path_factory.mktemp("tls-proxy")
    ca = PrivateCA.create(tmp / "pki")
    model = GGUFModel(EMBEDDED_MODEL)
    with Cluster(tmp) as cluster:
        relay_port = free_port()
        relay = cluster.start("relay", "relay", "--listen", f"127.0.0.1:{relay_port}")
        relay.wait_ready()
        proxy = NginxProxy(tmp / "nginx", f"127.0.0.1:{relay_port}", ca)
        with proxy:
            boot = cluster.start("bootstrap", "bootstrap", "--listen", "127.0.0.1:0").wait_ready()["dht_addrs"][0]
            worker = cluster.start("worker", "worker", "--model", str(model.path), "--bootstrap", boot, "--relay", proxy.url, "--relay-ca", str(ca.ca), "--relay-only")
            info = worker.wait_ready()
            assert info["quic_addr"] is None and info["relay"] == proxy.url
            yield {"model": model, "ca": ca, "proxy": proxy, "relay": relay, "boot": boot, "worker": info}


def local_tokens(model: GGUFModel, n: int) -> list[int]:
    ids = Tokenizer.from_spec(model.tokenizer_spec).encode(PROMPT)
    (bb, store), whole = local_engine(model), Partition(((0, model.cfg.n_expert),))
    return [t for t, _ in generate(bb, ids, n, local_moe(lambda i, x, e, w: grouped_moe(store, whole, i, x, e, w)))]


@pytest.mark.slow
def test_worker_and_backbone_through_the_proxy_survive_its_restart(swarm):
    """Every dispatch goes worker <- nginx (wss://, private CA) <- relay -> nginx -> backbone; restarting nginx in
    the middle of the generation changes no token, and both links come back through the restarted proxy."""
    model, proxy, relay = swarm["model"], swarm["proxy"], swarm["relay"]
    n = 40
    local = local_tokens(model, n)
    ids = Tokenizer.from_spec(model.tokenizer_spec).encode(PROMPT)
    backbone_id = Identity.generate()
    marks: dict[str, float] = {}
    session: dict[str, RemoteMoE] = {}

    def chaos(i: int) -> None:
        if i == 8:
            since = log_offset(relay.log_file)
            proxy.stop()
            marks["stopped"] = time.monotonic()
            for peer in (swarm["worker"]["peer_id"], str(backbone_id.peer_id)):  # the proxy cut both links
                wait_for_log(relay.log_file, "relay.client_gone", f"peer={peer}", since=since, timeout=30)
        elif i == 14:
            since = log_offset(relay.log_file)
            proxy.start()
            marks["back"] = time.monotonic()
            for peer in (swarm["worker"]["peer_id"], str(backbone_id.peer_id)):
                wait_for_log(relay.log_file, "relay.client_connected", f"peer={peer}", since=since, timeout=60)
        elif i == 20:  # token 14 probed the worker: our link back ended its bench (Router.relay_restored), however long it had grown
            health = session["moe"].router.health[PeerId.from_string(swarm["worker"]["peer_id"])]
            until(lambda: health.state(time.monotonic()) == "ready", timeout=30, what="the worker ready again after the proxy restart")

    async def run():
        bb = Backbone(model, kernel())
        async with backbone_session(backbone_id, model, [swarm["boot"]], bb.kernel, BackboneOptions(timeout=2.0, relay=RelaySettings(ca_file=swarm["ca"].ca))) as moe:
            session["moe"] = moe
            await wait_for_hosts(moe, model.layers, 1, 60)
            return await generate_off_loop(bb, moe.hook, ids, n, chaos), moe

    with structlog.testing.capture_logs() as logs:
        out, moe = asyncio.run(run())
    assert out == local
    recs = moe.stats.records
    assert recs and all(r.path == "relay" for r in recs)
    assert all(r.ok for r in recs if r.at < marks["stopped"]), "a dispatch failed before the proxy went away"
    after = [(round(r.at - marks["back"], 3), r.ok, r.probe, r.timed_out) for r in recs if r.at > marks["back"]]
    events = [(e["event"], e.get("reason"), e.get("benched_s")) for e in logs if e["event"].startswith(("dispatch.", "route.", "relay."))]
    assert any(r.ok and r.at > marks["back"] for r in recs), f"the worker never served through the restarted proxy: dispatches after it {after}, events {events}"
    lost = [e for e in logs if e["event"] == "relay.disconnected" and e.get("peer") == str(backbone_id.peer_id)]
    assert lost and lost[0]["reason"].startswith("connection lost without a close from the relay"), lost


@pytest.mark.slow
def test_backbone_generate_trusts_the_proxy_with_relay_ca_only(swarm):
    """`backbone generate --relay-ca` reaches the worker through the proxy and gives the local tokens; without the
    CA the same command cannot verify the proxy, computes every layer itself (same tokens) and says why in its log."""
    model, n = swarm["model"], 12
    local = local_tokens(model, n)
    base = ["backbone", "generate", "--model", str(model.path), "--bootstrap", swarm["boot"], "--tokens", str(n), "--timeout", "1", "--no-speculative", "--json", PROMPT]
    trusted = moeswarm(*base, "--relay-ca", str(swarm["ca"].ca), timeout=180)
    assert trusted.returncode == 0, trusted.stderr[-3000:]
    result = json.loads(trusted.stdout.strip().splitlines()[-1])
    assert result["token_ids"] == local
    assert result["local_groups"] == 0 and result["failed_dispatches"] == 0 and result["dispatches"] > 0, result
    base[base.index("--tokens") + 1] = "2"  # every layer waits out its dispatch timeout: keep it short
    untrusted = moeswarm("--log-level", "info", *base, timeout=180)
    assert untrusted.returncode == 0, untrusted.stderr[-3000:]
    assert json.loads(untrusted.stdout.strip().splitlines()[-1])["token_ids"] == local[:2]
    assert "CERTIFICATE_VERIFY_FAILED" in untrusted.stderr
