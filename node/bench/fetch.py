"""`moeswarm bench fetch`: slice fetch throughput from 1 and from 3 holders on loopback, and a holder's dispatch
latency while it serves a fetch (a fetch must not starve dispatches).

Real processes (a bootstrap and worker processes, as `tests/integration/test_fetch.py` runs them); the fetch and the
dispatch probe run here. ``mb_s`` counts the whole command's work (DHT lookups, SliceInfo round trips, pieces, hashing,
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
from node.fetch import FetchOptions, fetch_slice
from node.launcher import Cluster
from p2p import wire
from p2p.identity import Identity, PeerId
from p2p.quic import Endpoint


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


async def _fetch(boot: str, model: GGUFModel, out: Path) -> dict:
    opts = FetchOptions(model.digest, range(model.cfg.n_layer), ExpertRange(0, model.cfg.n_expert), out, [boot], max_datagram=16384)
    r = await fetch_slice(Identity.generate(), opts)
    out.unlink()
    mb = r.fetched_bytes / 1e6
    return {"holders": len(r.by_holder), "mb": round(mb, 2), "seconds": round(r.seconds, 3), "mb_s": round(mb / r.seconds, 1), "transfer_seconds": round(r.transfer_seconds, 3), "transfer_mb_s": round(mb / r.transfer_seconds, 1)}


def run(rate: str = "1G", probes: int = 200) -> dict:
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
    return {
        "model": f"embedded ({model.cfg.n_layer} layers x {model.cfg.n_expert} experts, F32)",
        "slice_rate_per_holder": rate,
        "loopback": {"one_holder": one, "three_holders": three},
        "dispatch_latency_of_a_holder": {"idle": _stats(idle), "while_serving_a_fetch": _stats(busy)},
        "testbed_80ms": "not measured (fetch through the testbed's relay path is not implemented yet)",
    }
