"""`moeswarm bench paths`: hole punching and relay vs direct dispatch in the real-NAT testbed (root)."""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path

import click

from experts.embedded import EMBEDDED_MODEL

from .bench import _append_md, bench_group
from .cli import emit_json
from .launcher import Cluster


def punch_stats(rtt_ms: float, attempts: int) -> dict:
    from p2p.paths import PathState

    from .testbed.punchlab import attempt, punch_lab

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


def path_throughput(rtt_ms: float, n_tokens: int, workdir: Path) -> dict:
    """The same generation with every expert on one worker: once dialled directly, once behind a symmetric NAT via the relay."""
    from .testbed.netns import Testbed

    results = {}
    with Testbed(rtt_ms=rtt_ms) as tb, Cluster(workdir) as cluster:
        def start(name, role, *args):
            return cluster.start(name, *args, prefix=tb.exec_prefix(role))

        boot = start("bootstrap", "pub-bootstrap", "bootstrap", "--listen", f"{tb.addr('pub-bootstrap')}:4001").wait_ready()["dht_addrs"][0]
        url = start("relay", "pub-relay", "relay", "--listen", f"{tb.addr('pub-relay')}:8080").wait_ready()["url"]
        common = ("--model", str(EMBEDDED_MODEL), "--bootstrap", boot)
        for path, role, extra in (("direct", "pub-worker", ("--listen", f"{tb.addr('pub-worker')}:4433", "--dht-listen", f"{tb.addr('pub-worker')}:0")),
                                  ("relay", "worker-b", ("--relay", url, "--relay-only", "--dht-listen", f"{tb.addr('worker-b')}:0"))):
            worker = start(f"worker-{path}", role, "worker", *common, *extra)
            worker.wait_ready()
            bb = tb.addr("backbone")
            p = tb.run("backbone", sys.executable, "-m", "node", "backbone", "generate", *common, "--tokens", str(n_tokens), "--no-speculative", "--json",
                       "--listen", f"{bb}:0", "--dht-listen", f"{bb}:0", "--data-dir", str(workdir / f"bb-{path}"), "--timeout", "10",
                       "And the LORD said unto Moses,", capture_output=True, text=True, timeout=900)
            if p.returncode != 0:
                raise click.ClickException(f"backbone over the {path} path failed: {p.stderr[-500:]}")
            results[path] = json.loads(p.stdout.strip().splitlines()[-1])
            worker.stop()
    d, r = results["direct"], results["relay"]
    return {
        "throughput": {"direct_tokens_s": d["tokens_per_s"], "relay_tokens_s": r["tokens_per_s"], "ratio": round(r["tokens_per_s"] / d["tokens_per_s"], 3)},
        "failed_dispatches": d["failed_dispatches"] + r["failed_dispatches"],
        "identical": d["token_ids"] == r["token_ids"],
        "rtt_ms_measured": {"direct": d["rtt_ms"], "relay": r["rtt_ms"]},
    }


@bench_group.command("paths")
@click.option("--json", "as_json", is_flag=True)
@click.option("--rtt-ms", default=80.0, show_default=True, help="WAN round trip between any two testbed hosts.")
@click.option("--attempts", default=20, show_default=True, help="Punch attempts per pair.")
@click.option("--tokens", "n_tokens", default=16, show_default=True)
@click.option("--write", "write_md", type=click.Path(dir_okay=False), default=None, help="Append the results to this Markdown file.")
def bench_paths(as_json: bool, rtt_ms: float, attempts: int, n_tokens: int, write_md: str | None) -> None:
    """Punch success (cone<->public, cone<->cone, symmetric), time to upgrade, relay vs direct throughput. Root only."""
    from .testbed.netns import require_root

    require_root()
    with tempfile.TemporaryDirectory(prefix="moeswarm-paths-") as tmp:
        result = {"rtt_ms": rtt_ms, **punch_stats(rtt_ms, attempts), **path_throughput(rtt_ms, n_tokens, Path(tmp))}
    if write_md:
        _append_md(write_md, f"moeswarm bench paths --json --rtt-ms {rtt_ms:g} --attempts {attempts}", result)
    if as_json:
        emit_json(result)
    else:
        for k, v in result["punch"].items():
            click.echo(f"punch {k}: {v['ok']}/{v['tries']} direct")
        t = result["throughput"]
        click.echo(f"upgrade median {result['upgrade_ms_median']} ms; direct {t['direct_tokens_s']} tokens/s, relay {t['relay_tokens_s']} ({t['ratio']}x); failed dispatches {result['failed_dispatches']}")
