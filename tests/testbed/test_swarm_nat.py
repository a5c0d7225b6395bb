"""The swarm across real NAT: a public worker reached directly, cone- and symmetric-NAT workers through the relay.

Runs as root in network namespaces (node/testbed); every node is a real process inside its namespace.
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


def test_direct_and_relayed_workers_generate_exactly_the_local_text(tmp_path):
    """Public worker direct, cone and symmetric NAT workers via the relay: tokens equal the local run."""
    from node.testbed.netns import Testbed

    model = GGUFModel(EMBEDDED_MODEL)
    store = ExpertStore(model)
    part = Partition(RANGES)
    ids = Tokenizer.from_spec(model.tokenizer_spec).encode(PROMPT)
    local = [t for t, _ in generate(Backbone(model), ids, 24, lambda i, x, e, w: grouped_moe(store, part, i, x, e, w))]
    with Testbed(rtt_ms=10) as tb, Cluster(tmp_path) as cluster:
        def start(name, role, *args):
            return cluster.start(name, *args, prefix=tb.exec_prefix(role))

        boot_ip, relay_ip = tb.addr("pub-bootstrap"), tb.addr("pub-relay")
        boot = start("bootstrap", "pub-bootstrap", "bootstrap", "--listen", f"{boot_ip}:4001").wait_ready()["dht_addrs"][0]
        url = start("relay", "pub-relay", "relay", "--listen", f"{relay_ip}:8080").wait_ready()["url"]
        common = ("--model", str(model.path), "--bootstrap", boot)
        pub_ip = tb.addr("pub-worker")
        workers = [
            start("pub", "pub-worker", "worker", *common, "--experts", "0-10", "--listen", f"{pub_ip}:4433", "--dht-listen", f"{pub_ip}:0"),
            start("cone", "worker-a", "worker", *common, "--experts", "11-20", "--relay", url, "--relay-only", "--dht-listen", f"{tb.addr('worker-a')}:0"),
            start("sym", "worker-b", "worker", *common, "--experts", "21-31", "--relay", url, "--relay-only", "--dht-listen", f"{tb.addr('worker-b')}:0"),
        ]
        infos = [w.wait_ready() for w in workers]
        bb_ip = tb.addr("backbone")
        out = tb.run("backbone", *cluster_cmd(), "backbone", "generate", *common, "--tokens", "24", "--wait-hosts", "3", "--json",
                     "--listen", f"{bb_ip}:0", "--dht-listen", f"{bb_ip}:0", "--data-dir", str(tmp_path / "bb"), PROMPT,
                     capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["token_ids"] == local
    assert result["failed_dispatches"] == 0 and result["local_groups"] == 0
    assert set(result["per_peer"]) == {i["peer_id"] for i in infos}
    pub, cone, sym = (i["peer_id"] for i in infos)
    assert result["paths"][pub] == {"direct": result["per_peer"][pub]}
    assert result["first_path"][cone] == "relay"
    assert result["paths"][sym] == {"relay": result["per_peer"][sym]}


def cluster_cmd() -> list[str]:
    import sys

    return [sys.executable, "-m", "node"]
