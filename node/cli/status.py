"""`moeswarm status`: the swarm's coverage map in the terminal (rich tables), or as JSON.

The same map as a node's ``/status`` page (``node.status.coverage``), read from the DHT through a throwaway client,
so it needs no node of one's own and no ``--http`` anywhere: layers x expert ranges with the hosts of each cell,
then one row per host with its address, the paths its record offers and what it serves.
"""

from __future__ import annotations

import asyncio

import click

from experts.gguf_model import GGUFModel
from node.cli.root import emit_json
from node.cli.survey import local_address_towards, survey
from node.status.coverage import Coverage, HostSummary, host_summaries
from node.status.server import model_shape
from p2p.dht.kademlia import bootstrap_target, check_bootstrap


@click.command("status")
@click.option("--bootstrap", "bootstrap", multiple=True, required=True, help="The swarm's bootstrap multiaddr, /ip4/H/tcp/P/p2p/ID (repeatable).")
@click.option("--model", "model_path", required=True, help="The model GGUF (or a slice of it) whose coverage to show: the DHT's records are keyed by its digest, and its shape gives the layers and experts.")
@click.option("--dht-listen", default=None, help="TCP HOST:PORT of the short-lived DHT client (default: the address that routes to the bootstrap, any port).")
@click.option("--bootstrap-wait", default=10.0, show_default=True, type=click.FloatRange(min=0), help="Seconds to keep retrying an unreachable bootstrap.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object: the coverage cells and each host's ranges.")
def status_cmd(bootstrap: tuple[str, ...], model_path: str, dht_listen: str | None, bootstrap_wait: float, as_json: bool) -> None:
    """Show which hosts serve which layers and experts of MODEL, and what no host serves."""
    host = bootstrap_target(bootstrap[0])[0]
    for addr in bootstrap[1:]:
        bootstrap_target(addr)
    model = GGUFModel(model_path)
    asyncio.run(check_bootstrap(bootstrap, bootstrap_wait))
    coverage = asyncio.run(survey(model_shape(model), bootstrap, dht_listen or f"{local_address_towards(host)}:0"))
    hosts = host_summaries(coverage)
    if as_json:
        emit_json({**coverage.to_json(), "moe_layers": list(model.moe_layers), "hosts": [h.to_json() for h in hosts]})
        return
    show(coverage, hosts, model)


def _ranges(ranges: tuple[tuple[int, int], ...]) -> str:
    return ", ".join(f"{a}-{b - 1}" for a, b in ranges)


def _layers(layers: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    runs: list[list[int]] = []
    for layer in sorted(layers):
        if runs and runs[-1][1] == layer - 1:
            runs[-1][1] = layer
        else:
            runs.append([layer, layer])
    return ", ".join(f"{a}-{b}" if a != b else str(a) for a, b in runs)


def show(coverage: Coverage, hosts: list[HostSummary], model: GGUFModel) -> None:
    from rich.console import Console
    from rich.table import Table

    moe = set(model.moe_layers)
    cells = [c for c in coverage.cells if c.layer in moe]
    cuts = sorted({c.start for c in cells} | {c.stop for c in cells})
    columns = list(zip(cuts, cuts[1:]))
    grid = Table(title=f"hosts per layer and expert range of {model.path.name}")
    grid.add_column("layer", justify="right")
    for a, b in columns:
        grid.add_column(f"experts {a}-{b - 1}")
    for layer in sorted(moe):
        row = [str(layer)]
        for a, _ in columns:
            cell = next(c for c in cells if c.layer == layer and c.start <= a < c.stop)
            row.append(f"{len(cell.hosts)}: " + " ".join(h.short for h in cell.hosts) if cell.hosts else "[bold red]none[/]")
        grid.add_row(*row)
    table = Table(title=f"{len(hosts)} hosts")
    for name in ("peer", "address", "path", "layers", "experts", "price"):
        table.add_column(name)
    for h in hosts:
        experts = sorted(set(h.ranges.values()))
        table.add_row(h.view.short, h.view.addr or "-", h.view.seen.path if h.view.seen else h.view.announced, _layers(list(h.ranges)), "; ".join(_ranges(r) for r in experts), str(h.view.price))
    console = Console()
    console.print(grid)
    console.print(table)
    lacking = [layer for layer in coverage.lacking if layer in moe]
    console.print(f"layers lacking hosts for some experts: {_layers(lacking)}" if lacking else "every expert of every layer has a host")
