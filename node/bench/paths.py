"""`moeswarm bench paths`'s measurement: hole punching and relay vs direct dispatch in the real-NAT testbed (root)."""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

from experts.embedded import DEFAULT_PROMPT
from node.launcher import Cluster
from node.testbed.netns import require_root


def punch_stats(rtt_ms: float, attempts: int) -> dict:
    from node.testbed.punchlab import attempt, punch_lab
    from p2p.nat.paths import PathState

    out, upgrades = {}, []
    pairs = {"cone_public": ("worker-a", "pub-worker"), "cone_cone": ("worker-a", "worker-c"), "symmetric_any": ("worker-b", "pub-worker")}
    with punch_lab(rtt_ms) as lab:
        for name, (a, b) in pairs.items():
            tries = attempts if name != "symmetric_any" else max(2, attempts // 4)
            ok = 0
            for _ in range(tries):
                *_, state, good, took = attempt(lab, a, b)
                if state is PathState.DIRECT and good:
                    ok += 1
                    upgrades.append(took * 1e3)
            out[name] = {"ok": ok, "tries": tries}
    return {"punch": out, "upgrade_ms_median": round(statistics.median(upgrades), 1) if upgrades else None}


def path_throughput(rtt_ms: float, n_tokens: int, workdir: Path, relay_link_ms: float) -> dict:
    """The same generation (F32 wire) with every expert on one worker `rtt_ms` away from the backbone: once dialled directly,
    once behind a symmetric NAT through the relay. `relay_link_ms` places the relay: 0 is next to the backbone (a
    provider's edge, as a CDN would put it), rtt_ms / 2 is mid-WAN (each relayed round trip crosses the WAN twice)."""
    from node.testbed.netns import Testbed
    from node.testbed.nodes import SwarmInTestbed

    links = {"backbone": 0.0, "pub-relay": relay_link_ms, "pub-worker": rtt_ms, "worker-b": rtt_ms}
    results = {}
    with Testbed(rtt_ms=rtt_ms, links=links) as tb, Cluster(workdir) as cluster:
        swarm = SwarmInTestbed(tb, cluster)
        swarm.start_bootstrap()
        swarm.start_relay()
        for path, role in (("direct", "pub-worker"), ("relay", "worker-b")):
            worker = swarm.start_worker(f"worker-{path}", role, path="relay-only" if path == "relay" else "direct")
            worker.wait_ready()
            results[path] = swarm.generate(f"bb-{path}", DEFAULT_PROMPT, n_tokens, "--no-speculative", "--wire", "f32", "--timeout", "10")
            worker.stop()
    d, r = results["direct"], results["relay"]
    return {
        "relay_link_ms": relay_link_ms,
        "throughput": {"direct_tokens_s": d["tokens_per_s"], "relay_tokens_s": r["tokens_per_s"], "ratio": round(r["tokens_per_s"] / d["tokens_per_s"], 3)},
        "failed_dispatches": d["failed_dispatches"] + r["failed_dispatches"],
        "identical": d["token_ids"] == r["token_ids"],
        "rtt_ms_measured": {"direct": d["rtt_ms"], "relay": r["rtt_ms"]},
    }


def run(rtt_ms: float, attempts: int, n_tokens: int) -> dict:
    """The whole `bench paths` measurement (root only: it builds testbeds)."""
    require_root()
    with tempfile.TemporaryDirectory(prefix="moeswarm-paths-") as tmp:
        edge = path_throughput(rtt_ms, n_tokens, Path(tmp) / "edge", 0.0)
        mid = path_throughput(rtt_ms, n_tokens, Path(tmp) / "mid", rtt_ms / 2)
        return {"rtt_ms": rtt_ms, **punch_stats(rtt_ms, attempts), **edge, "failed_dispatches": edge["failed_dispatches"] + mid["failed_dispatches"],
                "relay_mid_wan": {k: mid[k] for k in ("relay_link_ms", "throughput", "identical", "rtt_ms_measured")}}
