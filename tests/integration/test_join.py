"""`moeswarm join` on real processes: it hosts what the swarm lacks, and refuses what the swarm could not use."""

from __future__ import annotations

import asyncio
import os
import re

import numpy as np
import pytest

from experts.codecs import Codec
from experts.gguf_model import ExpertRange, GGUFModel
from node.launcher import Cluster
from p2p.dht.kademlia import LibP2PDiscovery
from p2p.identity import Identity
from p2p.wire import messages as wire
from tests.support import moeswarm, until, wait_for_log
from tests.support.dispatch import partial_sums
from tests.support.tlsproxy import free_port

from ..conftest import make_model

pytestmark = pytest.mark.slow
N_LAYER = 3


@pytest.fixture(scope="module")
def model32(tmp_path_factory):
    """A random model with 32 experts per layer."""
    return make_model(tmp_path_factory.mktemp("join"), "qwen3moe", n_expert=32, n_layer=N_LAYER)


async def hosted_ranges(boot: str, digest: str) -> dict[str, tuple]:
    """Each host's announced expert ranges on every layer, from a DHT client of our own."""
    async with LibP2PDiscovery(Identity.generate(), bootstrap=[boot], client_mode=True) as dht:
        found = await asyncio.gather(*(dht.lookup(digest, layer) for layer in range(N_LAYER)))
    by_peer: dict[str, set] = {}
    for records in found:
        for r in records:
            by_peer.setdefault(str(r.peer_id), set()).add(r.hosted.expert_ranges)
    return {peer: tuple(sorted(ranges)) for peer, ranges in by_peer.items()}


def test_join_hosts_the_experts_the_swarm_lacks(tmp_path, model32):
    """Workers hold experts 0-15 of every layer: `join` picks 16-31 of every layer, announces them in the DHT,
    says so in one line, and prints no progress bar into its piped output."""
    digest = GGUFModel(model32).digest
    with Cluster(tmp_path) as cluster:
        boot = cluster.start("bootstrap", "bootstrap", "--listen", "127.0.0.1:0").wait_ready()["dht_addrs"][0]
        low = cluster.start("low", "worker", "--model", str(model32), "--experts", "0-15", "--bootstrap", boot).wait_ready()
        joiner = cluster.start("joiner", "join", "--model", str(model32), "--bootstrap", boot, "--memory", "1G")
        ready = joiner.wait_ready(timeout=120)
        line = wait_for_log(joiner.log_file, "serving layers", timeout=30)
        assert re.fullmatch(rf"serving layers 0-{N_LAYER - 1} experts 16-31 of {re.escape(model32.name)} reachable at 127\.0\.0\.1:\d+ via direct", line), line
        assert ready["quic_addr"] in line
        until(lambda: asyncio.run(hosted_ranges(boot, digest)) == {low["peer_id"]: (((0, 16),),), ready["peer_id"]: (((16, 32),),)}, timeout=60, what="the DHT lists both workers' ranges on every layer")
        log = joiner.log_file.read_text()
        assert "\r" not in log and "\x1b[" not in log  # piped: no bar, no cursor movement


def test_join_refuses_to_announce_an_address_the_swarm_cannot_dial(model32):
    """Towards a bootstrap on another machine, a wildcard or loopback --advertise (or a loopback-only --listen)
    is refused before any network use: exit 2, one `error:` line naming the address, no traceback."""
    far = f"/ip4/198.51.100.7/tcp/4001/p2p/{Identity.generate().peer_id}"  # TEST-NET-2: nothing is ever sent there
    for args, named in ((["--advertise", "0.0.0.0:7000"], "wildcard address 0.0.0.0"), (["--advertise", "127.0.0.1:7000"], "loopback address 127.0.0.1"), (["--listen", "127.0.0.1:0"], "loopback address 127.0.0.1")):
        r = moeswarm("join", "--model", str(model32), "--bootstrap", far, *args, timeout=60)
        assert r.returncode == 2, r.stderr
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and named in lines[0], r.stderr
        assert "Traceback" not in r.stderr and not r.stdout


def test_join_gives_up_on_an_unreachable_bootstrap_with_one_line(tmp_path, model32):
    """A bootstrap port nobody listens on is retried for --bootstrap-wait seconds, then one `error:` line names it."""
    addr = f"/ip4/127.0.0.1/tcp/{free_port()}/p2p/{Identity.generate().peer_id}"  # nobody listens: refused
    r = moeswarm("join", "--model", str(model32), "--bootstrap", addr, "--bootstrap-wait", "1", "--data-dir", str(tmp_path / "j"), timeout=60)
    assert r.returncode == 2, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and addr in errors[0] and "unreachable" in errors[0], r.stderr
    assert "Traceback" not in r.stderr


def test_join_through_a_relay_says_so(tmp_path, model32):
    """With --relay (and --relay-only, as behind a NAT) the joiner announces no direct address: its line names the
    relay URL and the relay path."""
    with Cluster(tmp_path) as cluster:
        url = cluster.start("relay", "relay", "--listen", f"127.0.0.1:{free_port()}").wait_ready()["url"]
        boot = cluster.start("bootstrap", "bootstrap", "--listen", "127.0.0.1:0").wait_ready()["dht_addrs"][0]
        joiner = cluster.start("joiner", "join", "--model", str(model32), "--bootstrap", boot, "--memory", "1G", "--relay", url, "--relay-only")
        assert joiner.wait_ready(timeout=120)["quic_addr"] is None
        line = wait_for_log(joiner.log_file, "serving layers", timeout=30)
        assert line == f"serving layers 0-{N_LAYER - 1} experts 0-31 of {model32.name} reachable at {url} via relay", line


def test_join_with_a_slice_chooses_within_it(tmp_path, model32):
    """A slice of experts 8-31 on a swarm hosting 0-15: the joiner takes 16-31, the part of its slice no one serves."""
    sliced = tmp_path / "slice.gguf"
    r = moeswarm("slice", str(model32), "--layers", f"0-{N_LAYER - 1}", "--experts", "8-31", "-o", str(sliced))
    assert r.returncode == 0, r.stderr
    with Cluster(tmp_path) as cluster:
        boot = cluster.start("bootstrap", "bootstrap", "--listen", "127.0.0.1:0").wait_ready()["dht_addrs"][0]
        cluster.start("low", "worker", "--model", str(model32), "--experts", "0-15", "--bootstrap", boot).wait_ready()
        joiner = cluster.start("joiner", "join", "--slice", str(sliced), "--bootstrap", boot, "--memory", "1G")
        joiner.wait_ready(timeout=120)
        line = wait_for_log(joiner.log_file, "serving layers", timeout=30)
        assert line.startswith(f"serving layers 0-{N_LAYER - 1} experts 16-31 of slice.gguf reachable at 127.0.0.1:"), line


def test_join_fetch_fetches_the_thin_part_and_serves_it_bit_exact(tmp_path, model32):
    """Workers hold experts 0-15, 16-31 and (a second copy) 0-7 of every layer, serving slices: `join --fetch` with
    no model file picks 8-31 (one host each), fetches exactly them from the two holders that have them, and
    then answers dispatches bit for bit as those full-model holders do, while the DHT lists it for 8-31."""
    model = GGUFModel(model32)
    with Cluster(tmp_path) as cluster:
        boot = cluster.start("bootstrap", "bootstrap", "--listen", "127.0.0.1:0").wait_ready()["dht_addrs"][0]
        workers = [cluster.start(f"w{e}", "worker", "--model", str(model32), "--experts", e, "--bootstrap", boot) for e in ("0-15", "16-31", "0-7")]
        low, high, _ = (w.wait_ready(timeout=120) for w in workers)
        joiner = cluster.start("joiner", "join", "--fetch", "--model-digest", model.digest, "--bootstrap", boot, "--memory", "1G")
        ready = joiner.wait_ready(timeout=180)
        line = wait_for_log(joiner.log_file, "serving layers", timeout=30)
        assert re.fullmatch(rf"serving layers 0-{N_LAYER - 1} experts 8-31 of {model.digest[:16]}-layers0-{N_LAYER - 1}-experts8-31\.gguf reachable at 127\.0\.0\.1:\d+ via direct", line), line
        fetched = wait_for_log(joiner.log_file, "fetched ", timeout=5)
        assert "from 2 holders" in fetched and "0 dropped" in fetched, fetched
        sliced = GGUFModel(tmp_path / "joiner" / f"{model.digest[:16]}-layers0-{N_LAYER - 1}-experts8-31.gguf")  # in its data dir
        assert sliced.is_slice and sliced.experts == ExpertRange(8, 32) and sliced.digest == model.digest
        until(lambda: asyncio.run(hosted_ranges(boot, model.digest)).get(ready["peer_id"]) == (((8, 32),),), timeout=60, what="the DHT lists the joiner for experts 8-31")
        for experts, holder in (((8, 15, 9, 12), low), ((16, 31, 20, 24), high)):
            request = dispatch_request(model, experts)
            assert asyncio.run(partial_sums(ready, request)) == asyncio.run(partial_sums(holder, request))


def dispatch_request(model: GGUFModel, experts: tuple[int, ...]) -> wire.DispatchRequest:
    """Two tokens of layer 1, each routed to two of *experts*."""
    x = np.random.default_rng(2).standard_normal((2, model.cfg.n_embd)).astype(np.float32).tobytes()
    return wire.DispatchRequest(os.urandom(16), wire.model_id_of(bytes.fromhex(model.digest)), 1, Codec.F32, 2, 2, experts, (0.6, 0.4, 0.3, 0.7), x)
