"""The swarm across real NAT: a public worker reached directly, a cone-NAT worker through the relay and then on a
hole-punched direct path, a symmetric-NAT worker through the relay only.

Runs as root in network namespaces (node/testbed); every node is a real process inside its namespace. The bootstrap
node, the relay and the public worker are the reachability helpers (announced in the DHT); the NAT-bound workers
find out what they are behind by themselves (no --relay-only).
"""

from __future__ import annotations

import json

import pytest

from experts.embedded import EMBEDDED_MODEL
from experts.forward import Backbone
from experts.generate import generate
from experts.gguf_model import GGUFModel
from experts.moe import Partition, grouped_moe
from experts.slices import ExpertStore
from experts.tokenizer import Tokenizer
from node.launcher import Cluster

from .conftest import testbed_unavailable

pytestmark = pytest.mark.skipif(testbed_unavailable() is not None, reason=testbed_unavailable() or "")
RANGES = ((0, 11), (11, 21), (21, 32))
PROMPT = "And God said"
TOKENS = 48  # the punch (~0.35 s at 10 ms RTT) lands early in the generation, leaving most dispatches direct


def test_direct_relayed_and_punched_workers_generate_exactly_the_local_text(tmp_path):
    """Public worker direct; cone worker relay then direct; symmetric worker relay only: tokens equal the local run."""
    from node.testbed.netns import Testbed

    model = GGUFModel(EMBEDDED_MODEL)
    store = ExpertStore(model)
    part = Partition(RANGES)
    ids = Tokenizer.from_spec(model.tokenizer_spec).encode(PROMPT)
    local = [t for t, _ in generate(Backbone(model), ids, TOKENS, lambda i, x, e, w: grouped_moe(store, part, i, x, e, w))]
    with Testbed(rtt_ms=10) as tb, Cluster(tmp_path) as cluster:
        def start(name, role, *args):
            return cluster.start(name, *args, prefix=tb.exec_prefix(role))

        boot_ip, relay_ip = tb.addr("pub-bootstrap"), tb.addr("pub-relay")
        boot = start("bootstrap", "pub-bootstrap", "bootstrap", "--listen", f"{boot_ip}:4001").wait_ready()["dht_addrs"][0]
        url = start("relay", "pub-relay", "relay", "--listen", f"{relay_ip}:8080", "--bootstrap", boot).wait_ready()["url"]
        common = ("--model", str(model.path), "--bootstrap", boot)
        pub_ip = tb.addr("pub-worker")
        # The public worker is the third helper: NAT-bound workers check once it is announced.
        infos = [start("pub", "pub-worker", "worker", *common, "--experts", "0-10", "--listen", f"{pub_ip}:4433", "--dht-listen", f"{pub_ip}:0").wait_ready()]
        nat_workers = [
            start("cone", "worker-a", "worker", *common, "--experts", "11-20", "--relay", url, "--listen", "0.0.0.0:0", "--dht-listen", f"{tb.addr('worker-a')}:0"),
            start("sym", "worker-b", "worker", *common, "--experts", "21-31", "--relay", url, "--listen", "0.0.0.0:0", "--dht-listen", f"{tb.addr('worker-b')}:0"),
        ]
        infos += [w.wait_ready() for w in nat_workers]
        bb_ip = tb.addr("backbone")
        out = tb.run("backbone", *cluster_cmd(), "--log-level", "info", "backbone", "generate", *common, "--tokens", str(TOKENS), "--wait-hosts", "3", "--wire", "f32", "--json",
                     "--listen", f"{bb_ip}:0", "--dht-listen", f"{bb_ip}:0", "--data-dir", str(tmp_path / "bb"), PROMPT,
                     capture_output=True, text=True, timeout=300)
        (tmp_path / "backbone.log").write_text(out.stderr)
        assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
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


def cluster_cmd() -> list[str]:
    import sys

    return [sys.executable, "-m", "node"]
