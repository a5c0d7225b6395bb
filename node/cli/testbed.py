"""`moeswarm testbed up|run|down`: the real-NAT namespace testbed from the command line (root only)."""

from __future__ import annotations

import subprocess
import sys

import click

from node.cli.root import emit_json
from node.testbed import Testbed, TestbedError, down_stale, require_root, teardown
from node.testbed.netns import exists, list_states
from node.testbed.topology import Nat, normalize_prefix


def _only_testbed(name: str | None) -> str:
    """The prefix named, or the one testbed that `up` left running."""
    if name:
        return normalize_prefix(name)
    names = list_states()
    if len(names) != 1:
        raise TestbedError(f"{'no testbed is up' if not names else 'several testbeds are up: ' + ', '.join(names)}; pass --name")
    return names[0]


def parse_links(items: tuple[str, ...]) -> dict[str, float]:
    """``("backbone=0", "worker-a=40")`` -> ``{"backbone": 0.0, "worker-a": 40.0}``."""
    out = {}
    for item in items:
        role, sep, ms = item.partition("=")
        try:
            out[role.strip()] = float(ms)
        except ValueError:
            sep = ""
        if not sep:
            raise click.BadParameter(f"{item!r}: expected ROLE=MS, e.g. backbone=0", param_hint="--link")
    return out


@click.group("testbed")
def testbed_group() -> None:
    """Network namespaces with real NAT and WAN latency, for trying the swarm across routers (needs root)."""


@testbed_group.command("up")
@click.option("--rtt-ms", default=80.0, show_default=True, type=click.FloatRange(min=0), help="Round trip added across the WAN.")
@click.option("--loss", default=0.0, show_default=True, type=click.FloatRange(0, 100, max_open=True), help="Percent of packets dropped per direction.")
@click.option("--name", default=None, help="Testbed name (namespaces are msw<NAME>-<role>); random if omitted.")
@click.option("--routers", default="cone,symmetric", show_default=True, help="NAT kind of each home router, comma-separated (cone|symmetric).")
@click.option("--link", "links", multiple=True, metavar="ROLE=MS", help="This host's share of every round trip through it (default RTT/2), e.g. backbone=0 (repeatable).")
@click.option("--public-workers", default=1, show_default=True, type=click.IntRange(1, 8), help="Public workers: pub-worker, pub-worker-2, ...")
def up_cmd(rtt_ms: float, loss: float, name: str | None, routers: str, links: tuple[str, ...], public_workers: int) -> None:
    """Build a testbed and leave it running; prints its namespaces and addresses as JSON."""
    require_root()
    kinds = tuple(r.strip() for r in routers.split(","))
    bad = [k for k in kinds if k not in tuple(Nat)]
    if bad:
        raise TestbedError(f"unknown NAT kind {bad[0]!r}: use cone or symmetric")
    tb = Testbed(rtt_ms=rtt_ms, loss_pct=loss, name=name, routers=kinds, keep=True, links=parse_links(links), public_workers=public_workers).up()
    emit_json(tb.describe())


@testbed_group.command("run", context_settings={"ignore_unknown_options": True})
@click.option("--in", "where", required=True, help="Role (e.g. worker-a) or namespace name to run in.")
@click.option("--name", default=None, help="Which testbed (default: the only one up).")
@click.argument("cmd", nargs=-1, required=True, type=click.UNPROCESSED)
def run_cmd(where: str, name: str | None, cmd: tuple[str, ...]) -> None:
    """Run CMD inside one of the testbed's namespaces: `moeswarm testbed run --in worker-a -- ip addr`."""
    require_root()
    tb = Testbed.attach(_only_testbed(name))
    role = tb.plan.role_of(where)
    try:
        code = subprocess.run([*tb.exec_prefix(role), *cmd]).returncode
    except KeyboardInterrupt:
        code = 130
    sys.exit(code)


@testbed_group.command("down")
@click.option("--name", default=None, help="Which testbed (default: the only one up).")
@click.option("--all-stale", is_flag=True, help="Remove every testbed whose owning process is gone, including those left by `up`.")
def down_cmd(name: str | None, all_stale: bool) -> None:
    """Remove a testbed: its processes, namespaces (and with them every veth) and state."""
    require_root()
    if all_stale:
        emit_json({"removed": down_stale()})
        return
    prefix = _only_testbed(name)
    if not exists(prefix):
        raise TestbedError(f"no testbed named {prefix} is up")
    teardown(prefix)
    emit_json({"removed": [prefix]})


