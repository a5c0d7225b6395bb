"""`moeswarm fetch` across real NAT: a holder that nobody can dial serves its experts through the relay.

Runs as root in network namespaces (node/testbed); every node, the fetcher included, is a real process inside its
namespace. The fetcher sits on the WAN where the backbone would; the NAT-bound holder is behind a symmetric NAT with
``--relay-only`` (it announces the relay alone and answers no punch), so every byte it serves crosses the relay.
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


def test_a_slice_from_a_public_and_a_nat_bound_holder_is_the_cut(tmp_path):
    """A public holder of experts 0-3 (dialled) and a NAT-bound one of 4-7 (relay only): the fetch of layers 0-1 x
    experts 0-7 takes each half from its only holder, by that holder's path, and equals `moeswarm slice`'s cut."""
    from node.testbed.netns import Testbed
    from node.testbed.nodes import SwarmInTestbed

    model = GGUFModel(EMBEDDED_MODEL)
    cut = write_slice(model, range(0, 2), ExpertRange(0, 8), tmp_path / "cut.gguf").read_bytes()
    with Testbed(rtt_ms=10) as tb, Cluster(tmp_path) as cluster:
        swarm = SwarmInTestbed(tb, cluster)
        swarm.start_bootstrap()
        swarm.start_relay()
        holders = [swarm.start_worker("pub", "pub-worker", "--experts", "0-3"), swarm.start_worker("nat", "worker-b", "--experts", "4-7", path="relay-only")]
        pub, nat = (h.wait_ready() for h in holders)
        out, ip = tmp_path / "fetched.gguf", tb.addr("backbone")
        p = tb.run("backbone", sys.executable, "-m", "node", "fetch", "--model-digest", model.digest, "--layers", "0-1", "--experts", "0-7", "-o", str(out), "--bootstrap", swarm.bootstrap or "",
                   "--listen", f"{ip}:0", "--dht-listen", f"{ip}:0", "--json", capture_output=True, text=True, timeout=300)  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    result = json.loads(p.stdout.strip().splitlines()[-1])
    assert nat["quic_addr"] is None  # nobody can dial it: the relay is its only address
    assert out.read_bytes() == cut
    half = 2 * 3 * 4 * EXPERT_BYTES  # 2 layers x 3 tensors x 4 experts
    assert result["by_path"] == {pub["peer_id"]: {"direct": half}, nat["peer_id"]: {"relay": half}}
    assert not result["dropped"] and result["fetched_bytes"] == result["total_bytes"] == 2 * half
