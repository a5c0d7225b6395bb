"""A real local swarm: bootstrap and worker processes on loopback, the backbone in this process."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import structlog

from experts.codecs import Codec
from experts.embedded import EMBEDDED_MODEL
from experts.forward import Backbone, local_moe
from experts.generate import generate
from experts.gguf_model import GGUFModel
from experts.moe import Partition, grouped_moe
from experts.tokenizer import Tokenizer
from node.backbone.options import BackboneOptions
from node.backbone.session import backbone_session, wait_for_hosts
from node.launcher import Cluster
from node.verdicts import record_verdict
from p2p.identity import Identity
from tests.support import MOESWARM, until
from tests.support.engine import kernel, local_engine
from tests.support.swarm import Swarm

pytestmark = pytest.mark.slow
N_TOKENS = 32


@pytest.fixture(scope="module")
def model() -> GGUFModel:
    return GGUFModel(EMBEDDED_MODEL)


def start_workers(cluster: Cluster, model: GGUFModel, boot: str, ranges, names) -> list[dict]:
    procs = [cluster.start(n, "worker", "--model", str(model.path), "--experts", f"{a}-{b - 1}", "--bootstrap", boot) for n, (a, b) in zip(names, ranges)]
    return [p.wait_ready() for p in procs]


def local_run(model, part, prompt_ids):
    bb, store = local_engine(model)
    return list(generate(bb, prompt_ids, N_TOKENS, local_moe(lambda i, x, e, w: grouped_moe(store, part, i, x, e, w))))


async def remote_run(model, boot, prompt_ids, *, codec=Codec.F32, hosts_per_layer=1, on_token=None, timeout=5.0):
    k = kernel()
    async with backbone_session(Identity.generate(), model, [boot], k, BackboneOptions(codec=codec, timeout=timeout)) as moe:
        await wait_for_hosts(moe, model.layers, hosts_per_layer, 60)
        bb = Backbone(model, k)

        def run():
            out = []
            for i, step in enumerate(generate(bb, prompt_ids, N_TOKENS, moe.hook)):
                out.append(step)
                if on_token:
                    on_token(i, moe)
            return out

        return await asyncio.to_thread(run), moe


def test_three_workers_bit_identical_f32_and_gated_f16(model, tmp_path):
    """32 tokens through 3 worker processes: F32 logits equal the local grouped forward bit for bit; F16 within the gate."""
    part = Partition.even(model.cfg.n_expert, 3)
    ids = Tokenizer.from_spec(model.tokenizer_spec).encode("In the beginning")
    with Swarm(tmp_path) as cluster:
        boot = cluster.start("bootstrap", "bootstrap", "--listen", "127.0.0.1:0").wait_ready()["dht_addrs"][0]
        workers = start_workers(cluster, model, boot, part.bounds, ["w0", "w1", "w2"])
        remote, moe = asyncio.run(remote_run(model, boot, ids))
        record_verdict(model.digest, Codec.F16, "pass")
        remote16, _ = asyncio.run(remote_run(model, boot, ids, codec=Codec.F16))
    local = local_run(model, part, ids)
    assert [t for t, _ in remote] == [t for t, _ in local]
    for (_, a), (_, b) in zip(remote, local):
        assert a.tobytes() == b.tobytes()
    s = moe.stats.summary()
    assert s["failed_dispatches"] == 0 and s["local_groups"] == 0
    assert set(s["per_peer"]) == {w["peer_id"] for w in workers}
    for (_, a), (_, b) in zip(remote16[:8], local[:8]):
        assert float(a @ b / np.linalg.norm(a) / np.linalg.norm(b)) >= 0.999


def test_replica_killed_mid_generation_then_found_again(model, tmp_path):
    """Killing one of two replicas mid-generation changes nothing in the output; the failure names the peer;
    the restarted worker is found again through the DHT and serves."""
    whole = Partition(((0, model.cfg.n_expert),))
    ids = Tokenizer.from_spec(model.tokenizer_spec).encode("And the LORD spake")
    local = [t for t, _ in local_run(model, whole, ids)]
    with Swarm(tmp_path) as cluster:
        boot = cluster.start("bootstrap", "bootstrap", "--listen", "127.0.0.1:0").wait_ready()["dht_addrs"][0]
        a, b = start_workers(cluster, model, boot, [whole.bounds[0]] * 2, ["a", "b"])
        procs = {n.name: n for n in cluster.nodes}
        name_of = {a["peer_id"]: "a", b["peer_id"]: "b"}
        victim: dict[str, str] = {}

        def kill_busiest(i, moe):
            if i == 8:
                per_peer = moe.stats.summary()["per_peer"]
                victim["peer"] = max(per_peer, key=per_peer.get)
                procs[name_of[victim["peer"]]].kill()

        with structlog.testing.capture_logs() as logs:
            out, moe = asyncio.run(remote_run(model, boot, ids, hosts_per_layer=2, on_token=kill_busiest, timeout=1.0))
        assert [t for t, _ in out] == local
        failures = [e for e in logs if e["event"] == "dispatch.failed"]
        assert failures and {e["peer"] for e in failures} == {victim["peer"]}
        survivor = ({a["peer_id"], b["peer_id"]} - {victim["peer"]}).pop()
        assert moe.stats.summary()["per_peer"][survivor] > 0

        dead = procs[name_of[victim["peer"]]]
        dead.start()
        again = dead.wait_ready()
        assert again["peer_id"] == victim["peer"]
        procs[name_of[survivor]].kill()
        out2, moe2 = asyncio.run(remote_run(model, boot, ids, hosts_per_layer=1, timeout=1.0))
        assert [t for t, _ in out2] == local
        assert moe2.stats.summary()["per_peer"].get(victim["peer"], 0) > 0


def test_demo_stops_every_process_on_ctrl_c(tmp_path):
    """SIGINT to `moeswarm demo` while it runs leaves no node process behind."""
    import signal
    import subprocess

    work = tmp_path / "demo"
    p = subprocess.Popen([*MOESWARM, "demo", "--tokens", "400", "--workdir", str(work)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    until(lambda: len(list(work.glob("worker*.ready.json"))) >= 3, timeout=60, interval=0.2, what="3 workers ready")
    assert len(list(work.glob("worker*.ready.json"))) == 3
    children = subprocess.run(["pgrep", "-f", str(work)], capture_output=True, text=True).stdout.split()
    assert len(children) >= 4  # bootstrap + 3 workers
    p.send_signal(signal.SIGINT)
    p.wait(60)

    def left() -> list[str]:
        """The node processes still running (a zombie has exited; a vanished /proc entry too)."""
        alive = []
        for pid in children:
            try:
                status = Path(f"/proc/{pid}/status").read_text()
            except FileNotFoundError:
                continue
            if "zombie" not in status:
                alive.append(pid)
        return alive

    until(lambda: not left(), timeout=5, what="every node process gone after the demo exited")
    assert left() == []
