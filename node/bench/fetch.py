"""`moeswarm bench fetch`: slice fetch throughput from 1 and from 3 holders on loopback and across the emulated WAN of
the real-NAT testbed (holders `RTT` from the fetcher), and a holder's dispatch latency while it serves a fetch (a
fetch must not starve dispatches; on loopback).

Real processes (a bootstrap and worker processes, as `tests/integration/test_fetch.py` runs them, or as
``node.testbed.nodes`` starts them in the testbed's namespaces); the fetch and the dispatch probe run here (in the
testbed: on a thread inside the backbone's namespace, the public workers' RTT away). ``mb_s`` counts the whole command's work (DHT lookups, SliceInfo round trips, pieces, hashing,
the final write); ``transfer_mb_s`` only the pieces and their hashing. The latency probe sends one-token dispatches to the first holder one
after another, first while nothing else runs, then during the 3-holder fetch.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import tempfile
from pathlib import Path

import numpy as np

from experts.codecs import Codec
from experts.embedded import EMBEDDED_MODEL
from experts.gguf_model import ExpertRange, GGUFModel
from node.bench.wan import WORKERS
from node.fetch import FetchOptions, fetch_slice
from node.launcher import Cluster
from node.testbed.netns import require_root
from p2p.identity import Identity, PeerId
from p2p.quic.endpoint import Endpoint
from p2p.wire import messages as wire


async def _dispatch_latencies(target: dict, model: GGUFModel, until: asyncio.Event | None, count: int) -> list[float]:
    """Round trips (ms) of one-token dispatches to *target*, back to back: *count* of them, or until *until* is set."""
    ident = Identity.generate()
    host, _, port = target["quic_addr"].rpartition(":")
    peer = PeerId.from_string(target["peer_id"])
    x = np.ones((1, model.cfg.n_embd), dtype=np.float32).tobytes()
    mid = wire.model_id_of(bytes.fromhex(model.digest))
    ep = await Endpoint.bind(ident, "127.0.0.1", 0, handler=None)
    out: list[float] = []
    try:
        loop = asyncio.get_running_loop()
        while (until is None and len(out) < count) or (until is not None and not until.is_set()):
            req = wire.DispatchRequest(os.urandom(16), mid, model.moe_layers[0], Codec.F32, 1, 2, (0, 1), (0.5, 0.5), x)
            t0 = loop.time()
            reply = wire.decode(await ep.request((host, int(port)), peer, req.encode(), timeout=10))
            if isinstance(reply, wire.DispatchReply):
                out.append((loop.time() - t0) * 1e3)
    finally:
        await ep.close()
    return out


def _stats(ms: list[float]) -> dict:
    ms = sorted(ms)
    return {"n": len(ms), "p50_ms": round(statistics.median(ms), 3), "p99_ms": round(ms[min(len(ms) - 1, int(0.99 * len(ms)))], 3), "max_ms": round(ms[-1], 3)} if ms else {"n": 0}


async def _fetch(boot: str, model: GGUFModel, out: Path, *, ip: str = "127.0.0.1", max_datagram: int = 16384) -> dict:
    """Fetch every expert of *model* once (listening on *ip*); what it took."""
    opts = FetchOptions(model.digest, range(model.cfg.n_layer), ExpertRange(0, model.cfg.n_expert), out, [boot], dht_listen=f"{ip}:0", listen=(ip, 0), max_datagram=max_datagram)
    r = await fetch_slice(Identity.generate(), opts)
    out.unlink()
    mb = r.fetched_bytes / 1e6
    return {"holders": len(r.by_holder), "mb": round(mb, 2), "seconds": round(r.seconds, 3), "mb_s": round(mb / r.seconds, 1), "transfer_seconds": round(r.transfer_seconds, 3), "transfer_mb_s": round(mb / r.transfer_seconds, 1)}


def across_wan(rtt_ms: float, rate: str, model: GGUFModel, workdir: Path) -> dict:
    """The same two fetches in a testbed: public holders (full-model workers) `rtt_ms` from the fetcher, which runs
    in the backbone's namespace; datagrams of 1200 bytes, as on a real WAN."""
    from node.testbed.netns import Testbed
    from node.testbed.nodes import SwarmInTestbed

    def fetch(out: str) -> dict:
        return tb.call("backbone", lambda: asyncio.run(_fetch(boot, model, workdir / out, ip=tb.addr("backbone"), max_datagram=1200)))

    with Testbed(rtt_ms=rtt_ms, public_workers=len(WORKERS)) as tb, Cluster(workdir) as cluster:
        swarm = SwarmInTestbed(tb, cluster)
        boot = swarm.start_bootstrap()

        def holders(roles: tuple[str, ...]) -> None:
            for h in [swarm.start_worker(role, role, "--slice-rate", rate, "--slice-rate-per-peer", rate) for role in roles]:
                h.wait_ready(timeout=180)

        holders(WORKERS[:1])
        one = fetch("one.gguf")
        holders(WORKERS[1:])  # after the first fetch: it must find one holder only
        three = fetch("three.gguf")
        rtt = tb.rtt("backbone", WORKERS[0])
    return {"rtt_ms": rtt, "one_holder": one, "three_holders": three}


def run(rate: str = "1G", probes: int = 200, rtt_ms: float = 80.0) -> dict:
    """Loopback, then (``rtt_ms`` > 0, root only) the testbed with holders ``rtt_ms`` away."""
    if rtt_ms > 0:
        require_root()  # before the loopback part: fail in a second, not after it
    model = GGUFModel(EMBEDDED_MODEL)
    with tempfile.TemporaryDirectory() as tmp, Cluster(Path(tmp)) as cluster:
        boot = cluster.start("bootstrap", "bootstrap", "--listen", "127.0.0.1:0").wait_ready()["dht_addrs"][0]

        def worker(i: int) -> dict:
            return cluster.start(f"w{i}", "worker", "--model", str(model.path), "--bootstrap", boot, "--max-datagram", "16384", "--slice-rate", rate, "--slice-rate-per-peer", rate).wait_ready(timeout=180)

        first = worker(0)
        one = asyncio.run(_fetch(boot, model, Path(tmp) / "one.gguf"))
        for i in (1, 2):
            worker(i)

        async def three_with_probe() -> tuple[dict, list[float], list[float]]:
            idle = await _dispatch_latencies(first, model, None, probes)
            stop = asyncio.Event()
            probe = asyncio.ensure_future(_dispatch_latencies(first, model, stop, 0))
            try:
                three = await _fetch(boot, model, Path(tmp) / "three.gguf")
            finally:
                stop.set()
            return three, idle, await probe

        three, idle, busy = asyncio.run(three_with_probe())
        wan = across_wan(rtt_ms, rate, model, Path(tmp) / "testbed") if rtt_ms > 0 else None
    return {
        "model": f"embedded ({model.cfg.n_layer} layers x {model.cfg.n_expert} experts, F32)",
        "slice_rate_per_holder": rate,
        "loopback": {"one_holder": one, "three_holders": three},
        "dispatch_latency_of_a_holder": {"idle": _stats(idle), "while_serving_a_fetch": _stats(busy)},
        "testbed": wan,
    }
