"""An eclipse attempt with 80 sybil identities, as real processes: a late honest worker is still found and used.

Three networks meet on one veth: the sybils' namespace is 10.213.N.2 in 10.213.N.0/24 (one process, as identities
generated on one rented server would be); in this namespace the bootstrap's, the early worker's and the backbone's DHT
sockets are on 10.214.N.1 and the late worker's on 10.215.N.1 (two more /24s, so the provider store files each honest
host under a network of its own, not under loopback's exemption); QUIC stays on loopback. The sybils announce into
the bootstrap's and an early worker's provider stores, the two DHT servers, before a NAT-bound worker (a DHT client
reachable through a relay, which therefore holds no provider entry of its own) joins. Needs root (CI runs the integration tier as root); skipped otherwise.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from experts.embedded import EMBEDDED_MODEL
from experts.forward import local_moe
from experts.generate import generate
from experts.gguf_model import GGUFModel
from experts.moe import Partition, grouped_moe
from experts.tokenizer import Tokenizer
from node.launcher import Cluster
from tests.support import moeswarm
from tests.support.engine import local_engine
from tests.support.tlsproxy import free_port

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(600),
    pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None, reason="needs root and iproute2 for a netns"),
]
REPO = str(Path(__file__).resolve().parents[2])
PROMPT = "In the beginning"
N_SYBILS = 80
N_TOKENS = 8


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@pytest.fixture
def networks() -> Iterator[tuple[str, str, str, str]]:
    """A namespace joined to this one by a veth: (its name, its address, and two honest addresses, each in a /24 of its
    own: the servers and the early worker in one, the late worker in the other)."""
    tag, n = f"{os.getpid() % 100000}", os.getpid() % 250
    ns, here, there = f"msw-syb{tag}", f"msw-h{tag}", f"msw-s{tag}"
    ip("netns", "add", ns)
    try:
        ip("link", "add", here, "type", "veth", "peer", "name", there)
        ip("link", "set", there, "netns", ns)
        ip("addr", "add", f"10.213.{n}.1/24", "dev", here)
        ip("addr", "add", f"10.214.{n}.1/24", "dev", here)
        ip("addr", "add", f"10.215.{n}.1/24", "dev", here)
        ip("link", "set", here, "up")
        ip("-n", ns, "addr", "add", f"10.213.{n}.2/24", "dev", there)
        ip("-n", ns, "link", "set", there, "up")
        ip("-n", ns, "link", "set", "lo", "up")
        for net in (214, 215):
            ip("-n", ns, "route", "add", f"10.{net}.{n}.0/24", "via", f"10.213.{n}.1")
        yield ns, f"10.213.{n}.2", f"10.214.{n}.1", f"10.215.{n}.1"
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)  # takes the veth pair with it
        subprocess.run(["ip", "link", "del", here], capture_output=True, timeout=10)  # only if it never moved


def local_tokens(model: GGUFModel, n: int) -> list[int]:
    ids = Tokenizer.from_spec(model.tokenizer_spec).encode(PROMPT)
    (bb, store), whole = local_engine(model), Partition(((0, model.cfg.n_expert),))
    return [t for t, _ in generate(bb, ids, n, local_moe(lambda i, x, e, w: grouped_moe(store, whole, i, x, e, w)))]


def test_a_late_honest_worker_is_found_and_used_despite_eighty_sybils(tmp_path, networks):
    """80 sybils from one /24 announce every expert of every layer into both DHT servers before a NAT-bound honest
    worker joins; the servers keep only that network's share of each provider key, the backbone pings the hosts it
    found, and every dispatch goes to the honest workers: the tokens equal the local run."""
    ns, sybil_ip, honest_ip, late_ip = networks
    model = GGUFModel(EMBEDDED_MODEL)
    n_expert, half = model.cfg.n_expert, model.cfg.n_expert // 2
    dht = ("--dht-listen", f"{honest_ip}:0")
    with Cluster(tmp_path) as cluster:
        relay = cluster.start("relay", "relay", "--listen", f"127.0.0.1:{free_port()}")
        url = relay.wait_ready()["url"]
        boot = cluster.start("bootstrap", "bootstrap", "--listen", f"{honest_ip}:0", "--quic-listen", "127.0.0.1:0", "--model", str(model.path))
        boot_addr = boot.wait_ready()["dht_addrs"][0]
        early = cluster.start("early", "worker", "--model", str(model.path), "--experts", f"0-{half - 1}", "--bootstrap", boot_addr, *dht)
        early_info = early.wait_ready()
        sybils = cluster.start(
            "sybils", "--bootstrap", boot_addr, "--count", str(N_SYBILS), "--model-digest", model.digest, "--n-expert", str(n_expert),
            "--layers", ",".join(map(str, model.moe_layers)), "--listen", sybil_ip, "--quic-addr", f"{sybil_ip}:9",
            prefix=["ip", "netns", "exec", ns], module="tests.doubles.sybils", env={"PYTHONPATH": REPO},
        ).wait_ready(timeout=300)
        assert len(set(sybils["peer_ids"])) == N_SYBILS
        late = cluster.start("late", "worker", "--model", str(model.path), "--experts", f"{half}-{n_expert - 1}", "--bootstrap", boot_addr, "--dht-listen", f"{late_ip}:0", "--relay", url, "--relay-only").wait_ready()
        run = moeswarm(
            "--log-level", "info", "backbone", "generate", "--model", str(model.path), "--bootstrap", boot_addr, *dht, "--tokens", str(N_TOKENS),
            "--wait-hosts", "2", "--timeout", "2", "--no-speculative", "--json", "--data-dir", str(tmp_path / "backbone"), PROMPT, timeout=300,
        )
        logs = {p.name: p.log_file.read_text(errors="replace") for p in (boot, early)}
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["token_ids"] == local_tokens(model, N_TOKENS)
    assert set(result["per_peer"]) == {early_info["peer_id"], late["peer_id"]}, result["per_peer"]
    assert result["local_groups"] == 0 and result["failed_dispatches"] == 0, result
    for name, log in logs.items():  # both servers refused sybils for their network's share, and no honest node
        refused = [line for line in log.splitlines() if "dht.provider_refused" in line]
        assert any("reason=group_full" in line for line in refused), (name, log[-3000:])
        assert not [line for line in refused if early_info["peer_id"] in line or late["peer_id"] in line], name
    assert "discovery.host_unverified" in run.stderr  # the backbone did find sybils, pinged them, and left them out
    # ...and its lookups stayed fast: none ran into its timeout (the eclipsed run of issue 30 took 9.8 s a lookup)
    assert "dht.lookup_timeout" not in run.stderr, run.stderr[-3000:]
