"""`moeswarm bench dht`: a swarm of real py-libp2p DHT nodes on loopback, lookups before and after churn.

Several processes (py-libp2p's trio loop runs one node per thread; a process holds many) each start
a share of the nodes; every node announces one host record for a (fake) model's layer, as a worker
would. The parent then asks each process for lookups from random nodes of its own (``in_flight`` processes at a time, each
one lookup after another) and gathers:
Kademlia hops (rounds of ALPHA parallel queries of the longest provider walk in a lookup) against
log2 N, lookup latency percentiles, and the fraction of a layer's live announcers each lookup found.
Then it kills a fraction of the nodes without warning (no withdraw: as a crashed worker leaves) and
measures again: found fraction among the live, and how many dead hosts the records still name
(they expire with their TTL).

Every node's upkeep (re-announcing its record after half its TTL, one routing-table walk per k-bucket) runs every
``--upkeep`` seconds: the product's 600 by default. On one machine that upkeep is the swarm's, not one node's: ~150
nodes' background walks alone keep 2 cores saturated, so a larger value measures the DHT rather than the machine.

Processes talk to the parent over stdin/stdout, one JSON line per command and answer; every wait is
bounded. Loopback only.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import resource
import subprocess
import sys
import tempfile
import time

import numpy as np

from node.bench.common import BenchmarkError

MODEL = "ab" * 32  # a record names a model by digest; no weights are involved
START_TIMEOUT = 1200.0  # one process's joins; 25 nodes joining a swarm of 175 took 9 min on 2 cores
COMMAND_TIMEOUT = 900.0
START_ATTEMPTS = 3  # starts (a new identity each) of a node whose join timed out before it is left out and counted


def _pct(xs: list[float], q: float) -> float | None:
    return round(float(np.percentile(xs, q)), 1) if xs else None


# -- the child: a share of the nodes


async def _child(n_nodes: int, layers: int, bootstrap: list[str], seed: int, ttl: float, lookup_timeout: float) -> None:
    from p2p.dht.kademlia import BootstrapUnreachable, LibP2PDiscovery
    from p2p.dht.records import HostedSlice
    from p2p.identity import Identity

    rng = random.Random(seed)
    nodes: list[LibP2PDiscovery] = []
    start_failures = 0  # starts whose join timed out (a node that failed them all is left out and counted)
    for _ in range(n_nodes):
        for _ in range(START_ATTEMPTS):
            # A process's first node joins through one of the swarm's entry nodes (the bootstrap and every earlier
            # process's first node; another pick each attempt), the others through that first node: a single
            # bootstrap answering every join (and the walks that follow) stops answering in time on 2 loaded cores.
            via = [a for n in nodes[:1] for a in n.multiaddrs] or rng.sample(bootstrap, min(1, len(bootstrap)))
            d = LibP2PDiscovery(Identity.generate(), bootstrap=via, ttl=ttl, lookup_timeout=lookup_timeout, routing_refresh=ttl)
            try:
                await d.start()
            except BootstrapUnreachable:
                start_failures += 1
                continue
            nodes.append(d)
            break
    if not nodes:
        raise BenchmarkError(f"none of this process's {n_nodes} nodes could join ({start_failures} failed starts)")
    layer_of = {str(d.peer_id): (seed * 7919 + i) % layers for i, d in enumerate(nodes)}
    await asyncio.gather(*(d.announce([HostedSlice(MODEL, layer_of[str(d.peer_id)], ((0, 8),), quic_addr="127.0.0.1:9")]) for d in nodes))
    print(json.dumps({"ready": True, "addrs": [a for d in nodes for a in d.multiaddrs][:1], "peers": layer_of, "start_failures": start_failures}), flush=True)
    loop = asyncio.get_running_loop()
    while line := await loop.run_in_executor(None, sys.stdin.readline):
        cmd = json.loads(line)
        if cmd["do"] == "lookup":
            out = []
            for _ in range(cmd["n"]):
                d, layer = rng.choice(nodes), rng.randrange(layers)
                await d.take_walks()
                t0 = time.perf_counter()
                records = await d.lookup(MODEL, layer)
                ms = (time.perf_counter() - t0) * 1e3
                walks = await d.take_walks()
                record_walks = [w for w in walks if w.kind == "record"]
                out.append({"layer": layer, "ms": ms, "hops": max((w.rounds for w in walks), default=0), "asked": sum(w.asked for w in walks),
                            "found": sorted({str(r.peer_id) for r in records}),
                            "providers": sorted({p for w in walks if w.kind == "providers" for p in w.found}),
                            "record_walks": len(record_walks), "record_walks_found": sum(bool(w.found) for w in record_walks)})  # fmt: skip
            print(json.dumps({"lookups": out}), flush=True)
        elif cmd["do"] == "kill":
            gone = rng.sample(nodes, round(len(nodes) * cmd["fraction"]))
            await asyncio.gather(*(d.close() for d in gone))
            nodes = [d for d in nodes if d not in gone]
            print(json.dumps({"killed": [str(d.peer_id) for d in gone]}), flush=True)
        elif cmd["do"] == "quit":
            break
    await asyncio.gather(*(d.close() for d in nodes), return_exceptions=True)


def child_main() -> None:
    n, layers, seed, ttl, lookup_timeout = (int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5]), float(sys.argv[6]))
    from node.logs import configure_logging

    configure_logging("warning")  # stdout is the parent's channel; stderr (why a join failed) is shown when a process fails
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # dozens of nodes, each with a connection per peer
    asyncio.run(_child(n, layers, sys.argv[7:], seed, ttl, lookup_timeout))


# -- the parent


class _Proc:
    def __init__(self, n: int, layers: int, seed: int, ttl: float, lookup_timeout: float, bootstrap: list[str]) -> None:
        cmd = [sys.executable, "-m", "node.bench.dht", "child", str(n), str(layers), str(seed), str(ttl), str(lookup_timeout), *bootstrap]
        self.err = tempfile.TemporaryFile("w+")
        self.p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err, text=True)

    def tail(self) -> str:
        self.err.seek(0)
        return "".join(self.err.readlines()[-6:]).strip()

    def read(self, timeout: float) -> dict:
        import selectors

        sel = selectors.DefaultSelector()
        assert self.p.stdout is not None
        sel.register(self.p.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            raise BenchmarkError(f"a DHT process did not answer within {timeout:.0f} s: {self.tail()}")
        line = self.p.stdout.readline()
        if not line:
            raise BenchmarkError(f"a DHT process exited ({self.p.poll()}): {self.tail()}")
        return json.loads(line)

    def send(self, **cmd: object) -> None:
        assert self.p.stdin is not None
        self.p.stdin.write(json.dumps(cmd) + "\n")
        self.p.stdin.flush()

    def close(self) -> None:
        try:
            self.send(do="quit")
            self.p.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired, ValueError):
            self.p.kill()
            self.p.wait()


def _phase(procs: list[_Proc], lookups: int, in_flight: int, lookup_timeout: float, live: dict[str, int], dead: set[str]) -> dict:
    """Each process runs its share of the lookups one after another; ``in_flight`` processes at a time (each lookup
    costs its ~100 peers' Python too: 9 processes' lookups at once at 200 nodes ran the 2 cores at load 20 and nearly
    every lookup into its 20 s timeout)."""
    per = max(1, lookups // len(procs))
    rows = []
    for i in range(0, len(procs), in_flight):
        wave = procs[i : i + in_flight]
        for p in wave:
            p.send(do="lookup", n=per)
        rows += [row for p in wave for row in p.read(COMMAND_TIMEOUT)["lookups"]]
    found, named, finished, stale = [], [], [], 0
    for r in rows:
        want = {peer for peer, layer in live.items() if layer == r["layer"]}
        got = set(r["found"])
        found.append(len(got & want) / len(want) if want else 1.0)
        named.append(len(set(r["providers"]) & want) / len(want) if want else 1.0)
        if r["ms"] < lookup_timeout * 1e3:  # a lookup cut off at its timeout returns what it had fetched by then
            finished.append(found[-1])
        stale += len(got & dead)
    ms = [r["ms"] for r in rows]
    hops = [r["hops"] for r in rows]
    return {
        "lookups": len(rows),
        "hops": {"median": float(np.median(hops)), "p90": _pct(hops, 90), "max": max(hops)},
        "peers_asked_median": float(np.median([r["asked"] for r in rows])),
        "latency_ms": {"p50": _pct(ms, 50), "p90": _pct(ms, 90), "p99": _pct(ms, 99)},
        "found_fraction": {"mean": round(float(np.mean(found)), 4), "min": round(min(found), 4), "all_found": round(sum(f == 1.0 for f in found) / len(found), 4)},
        "timed_out": len(rows) - len(finished),
        "found_fraction_finished": round(float(np.mean(finished)), 4) if finished else None,
        # The found fraction's ceiling: live hosts the provider walks named. A host below it was missed by the walks
        # (its provider entries sit elsewhere); between the two, its record could not be fetched.
        "providers_named_fraction": {"mean": round(float(np.mean(named)), 4), "min": round(min(named), 4)},
        "record_walks": {"walks": sum(r["record_walks"] for r in rows), "found": sum(r["record_walks_found"] for r in rows)},
        "dead_hosts_named": stale,
    }


def run(n_nodes: int, procs: int, layers: int, lookups: int, churn: float, ttl: float, in_flight: int = 2, lookup_timeout: float = 20.0) -> dict:
    if n_nodes < 2 * procs:
        raise BenchmarkError("--nodes must be at least twice --procs")
    t0 = time.monotonic()
    first = _Proc(1, layers, 0, ttl, lookup_timeout, [])  # the bootstrap: one node in a process of its own
    started = [first]
    try:
        ready = [first.read(START_TIMEOUT)]
        entries = list(ready[0]["addrs"])  # where a new process joins: the bootstrap, then each process's first node
        shares = [len(r) for r in np.array_split(np.arange(n_nodes - 1), procs)]
        for i, k in enumerate(shares):  # one process at a time: 8 starting together time their own joins out on 2 cores
            started.append(_Proc(k, layers, i + 1, ttl, lookup_timeout, entries))
            try:
                ready.append(started[-1].read(START_TIMEOUT))
            except BenchmarkError as exc:
                raise BenchmarkError(f"{exc}\n(the bootstrap's process: {first.tail() or 'nothing on stderr'})") from None
            entries += ready[-1]["addrs"]
        live: dict[str, int] = {peer: layer for r in ready for peer, layer in r["peers"].items()}
        start_s = time.monotonic() - t0
        before = _phase(started, lookups, in_flight, lookup_timeout, live, set())
        killed: set[str] = set()
        for p in started[1:]:
            p.send(do="kill", fraction=churn)
        for p in started[1:]:
            killed |= set(p.read(COMMAND_TIMEOUT)["killed"])
        after = _phase(started, lookups, in_flight, lookup_timeout, {k: v for k, v in live.items() if k not in killed}, killed)
    finally:
        for p in started:
            p.close()
            p.err.close()
    return {
        "nodes": n_nodes,
        "processes": procs + 1,
        "layers": layers,
        "log2_nodes": round(math.log2(n_nodes), 2),
        "upkeep_s": ttl,
        "lookups_in_flight": in_flight,
        "lookup_timeout_s": lookup_timeout,
        "start_s": round(start_s, 1),
        "live_nodes": len(live),
        "start_failures": sum(r["start_failures"] for r in ready),
        "before_churn": before,
        "churn": {"killed": len(killed), "fraction": churn},
        "after_churn": after,
    }


if __name__ == "__main__" and sys.argv[1:2] == ["child"]:
    child_main()
