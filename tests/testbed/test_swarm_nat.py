"""The swarm across real NAT: a public worker reached directly, a cone-NAT worker through the relay and then on a
hole-punched direct path, a symmetric-NAT worker through the relay only.

Runs as root in network namespaces (node/testbed); every node is a real process inside its namespace. The bootstrap
node, the relay and the public worker are the reachability helpers (announced in the DHT); the NAT-bound workers
find out what they are behind by themselves (no --relay-only).
"""

from __future__ import annotations

import pytest

from experts.embedded import EMBEDDED_MODEL
from experts.forward import local_moe
from experts.generate import generate
from experts.gguf_model import GGUFModel
from experts.moe import Partition, grouped_moe
from experts.tokenizer import Tokenizer
from node.launcher import Cluster
from tests.support import wait_for_log
from tests.support.engine import local_engine

from .conftest import why_no_testbed

pytestmark = pytest.mark.skipif(why_no_testbed() is not None, reason=why_no_testbed() or "")
RANGES = ((0, 11), (11, 21), (21, 32))
PROMPT = "And God said"
TOKENS = 48  # the punch (~0.35 s at 10 ms RTT) lands early in the generation, leaving most dispatches direct


def local_tokens(ranges: tuple[tuple[int, int], ...], n: int) -> list[int]:
    model = GGUFModel(EMBEDDED_MODEL)
    (bb, store), part = local_engine(model), Partition(ranges)
    ids = Tokenizer.from_spec(model.tokenizer_spec).encode(PROMPT)
    return [t for t, _ in generate(bb, ids, n, local_moe(lambda i, x, e, w: grouped_moe(store, part, i, x, e, w)))]


def test_direct_relayed_and_punched_workers_generate_exactly_the_local_text(tmp_path):
    """Public worker direct; cone worker relay then direct; symmetric worker relay only: tokens equal the local run."""
    from node.testbed.netns import Testbed
    from node.testbed.nodes import SwarmInTestbed

    local = local_tokens(RANGES, TOKENS)
    with Testbed(rtt_ms=10) as tb, Cluster(tmp_path) as cluster:
        swarm = SwarmInTestbed(tb, cluster)
        swarm.start_bootstrap()
        swarm.start_relay()
        # The public worker is the third helper (after the bootstrap node and the relay): NAT-bound workers check once it is announced.
        infos = [swarm.start_worker("pub", "pub-worker", "--experts", "0-10").wait_ready()]
        nat_workers = [swarm.start_worker(name, role, "--experts", experts, path="relay") for name, role, experts in (("cone", "worker-a", "11-20"), ("sym", "worker-b", "21-31"))]
        infos += [w.wait_ready() for w in nat_workers]
        result = swarm.generate("bb", PROMPT, TOKENS, "--wait-hosts", "3", "--wire", "f32")
    assert [i["reachability"] for i in infos] == ["unchecked", "nat", "symmetric"]
    assert infos[1]["quic_addr"] is None and infos[2]["quic_addr"] is None
    assert result["token_ids"] == local
    assert result["failed_dispatches"] == 0 and result["local_groups"] == 0
    assert set(result["per_peer"]) == {i["peer_id"] for i in infos}
    pub, cone, sym = (i["peer_id"] for i in infos)
    assert result["paths"][pub] == {"direct": result["per_peer"][pub]}
    assert result["first_path"][cone] == "relay"
    assert set(result["paths"][cone]) == {"relay", "direct"} and result["paths"][cone]["direct"] > 0, result["paths"]
    assert result["paths"][sym] == {"relay": result["per_peer"][sym]}


def test_a_port_forward_makes_a_nat_worker_public_and_it_is_reannounced(tmp_path):
    """Behind a cone NAT a worker announces only its relay; once the router forwards its port, a re-check finds it
    PUBLIC at the router's address, it re-announces, and a backbone then reaches it directly with the exact tokens."""
    from node.testbed.netns import Testbed
    from node.testbed.nodes import QUIC_PORT, SwarmInTestbed

    ranges = ((0, 16), (16, 32))
    with Testbed(rtt_ms=10) as tb, Cluster(tmp_path) as cluster:
        swarm = SwarmInTestbed(tb, cluster)
        swarm.start_bootstrap()
        swarm.start_relay()
        swarm.start_worker("pub", "pub-worker", "--experts", "0-15").wait_ready()
        worker = swarm.start_worker("cone", "worker-a", "--experts", "16-31", "--reachability-recheck", "2", path="relay")
        info = worker.wait_ready()
        assert info["reachability"] == "nat" and info["quic_addr"] is None
        lan, wan = tb.addr("worker-a"), tb.addr("router-a")
        for rule in (["-t", "nat", "-A", "PREROUTING", "-i", "wan", "-p", "udp", "--dport", str(QUIC_PORT), "-j", "DNAT", "--to-destination", f"{lan}:{QUIC_PORT}"],
                     ["-I", "FORWARD", "-i", "wan", "-o", "lan", "-p", "udp", "-d", lan, "--dport", str(QUIC_PORT), "-j", "ACCEPT"]):  # fmt: skip
            tb.run("router-a", "iptables", *rule, check=True)
        announced = wait_for_log(worker.log_file, "worker.readvertised", timeout=60)
        assert f"quic={wan}:{QUIC_PORT}" in announced and "reachability=public" in announced
        result = swarm.generate("bb", PROMPT, 12, "--wait-hosts", "2", "--wire", "f32", "--no-speculative")
    assert result["token_ids"] == local_tokens(ranges, 12)
    assert result["paths"][info["peer_id"]] == {"direct": result["per_peer"][info["peer_id"]]}
    assert result["failed_dispatches"] == 0
