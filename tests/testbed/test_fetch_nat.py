"""`moeswarm fetch` across real NAT: a holder that nobody can dial serves its experts through the relay.

Runs as root in network namespaces (node/testbed); every node, the fetcher included, is a real process inside its
namespace. The fetcher sits on the WAN where the backbone would. One NAT-bound holder is behind a symmetric NAT with
``--relay-only`` (it announces the relay alone and answers no punch), so every byte it serves crosses the relay; the
other is behind a cone NAT and finds that out by itself (its check needs the bootstrap, the relay and the public
worker as helpers, so it starts once they are announced): the fetch starts through its relay and the fetcher's
connector punches it to a direct path, as a backbone's does.
"""

from __future__ import annotations

import json
import sys

import pytest

from experts.embedded import EMBEDDED_MODEL
from experts.gguf_model import ExpertRange, GGUFModel
from experts.slices import write_slice
from node.launcher import Cluster

from .conftest import why_no_testbed

pytestmark = pytest.mark.skipif(why_no_testbed() is not None, reason=why_no_testbed() or "")
EXPERT_BYTES = 32768  # one expert's rows of one tensor in the embedded model (F32: all alike)


def test_a_slice_from_public_relayed_and_punched_holders_is_the_cut(tmp_path):
    """Holders of experts 0-3 (public, dialled), 4-7 (symmetric NAT, relay only) and 8-31 (cone NAT): the fetch of
    every expert takes each part from its only holder, by that holder's path (the cone's moving from the relay to a
    punched direct path), and equals `moeswarm slice`'s cut."""
    from node.testbed.netns import Testbed
    from node.testbed.nodes import SwarmInTestbed

    model = GGUFModel(EMBEDDED_MODEL)
    layers = model.cfg.n_layer
    cut = write_slice(model, range(layers), ExpertRange(0, 32), tmp_path / "cut.gguf").read_bytes()
    with Testbed(rtt_ms=10) as tb, Cluster(tmp_path) as cluster:
        swarm = SwarmInTestbed(tb, cluster)
        swarm.start_bootstrap()
        swarm.start_relay()
        starting = [swarm.start_worker("pub", "pub-worker", "--experts", "0-3"), swarm.start_worker("sym", "worker-b", "--experts", "4-7", path="relay-only")]
        pub, sym = (h.wait_ready() for h in starting)
        cone = swarm.start_worker("cone", "worker-a", "--experts", "8-31", path="relay").wait_ready()  # the public worker is its third helper
        out, ip = tmp_path / "fetched.gguf", tb.addr("backbone")
        p = tb.run("backbone", sys.executable, "-m", "node", "fetch", "--model-digest", model.digest, "--layers", f"0-{layers - 1}", "--experts", "0-31", "-o", str(out), "--bootstrap", swarm.bootstrap or "",
                   "--listen", f"{ip}:0", "--dht-listen", f"{ip}:0", "--json", capture_output=True, text=True, timeout=300)  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    result = json.loads(p.stdout.strip().splitlines()[-1])
    assert [sym["quic_addr"], cone["quic_addr"], cone["reachability"]] == [None, None, "nat"]  # nobody can dial them
    assert out.read_bytes() == cut
    share = layers * 3 * EXPERT_BYTES  # one expert of every layer's three tensors
    by_path = result["by_path"]
    assert by_path[pub["peer_id"]] == {"direct": 4 * share} and by_path[sym["peer_id"]] == {"relay": 4 * share}
    assert sum(by_path[cone["peer_id"]].values()) == 24 * share and by_path[cone["peer_id"]].get("direct", 0) > 0, by_path
    assert not result["dropped"] and result["fetched_bytes"] == result["total_bytes"] == 32 * share
