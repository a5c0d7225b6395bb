"""`moeswarm join`: a volunteer's one command, from a model file and a bootstrap address to a serving worker.

In order, each step failing with one line before the next costs anything: the addresses (no network use: an
address the swarm could not dial is refused first), the bootstrap (TCP, retried with backoff for a bounded time),
the swarm's coverage (a short-lived DHT client under a throwaway identity, so the worker's own identity joins only
once), the part to host (``node.worker.placement``), then the worker exactly as `moeswarm worker` runs it.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import time
from collections.abc import Sequence
from pathlib import Path

import click

from experts.errors import UsageError
from experts.gguf_model import ExpertRange, GGUFModel
from experts.hosting import MB, packed_bytes
from node.cli.options import parse_size
from node.cli.swarm import record_field, serving_options, start_worker
from node.runtime import parse_hostport
from node.status.coverage import Coverage, build_coverage
from node.worker.node import WorkerNode
from node.worker.placement import check_advertise, choose_part, default_budget, host_counts
from p2p.backoff import Backoff
from p2p.dht import LibP2PDiscovery, bootstrap_hostport, probe_bootstrap
from p2p.discovery import DiscoveryError
from p2p.identity import Identity
from p2p.records import check_quic_addr

PROBE_BACKOFF = Backoff(first=0.5, cap=5.0)
PROBE_TIMEOUT = 5.0  # per TCP attempt


@click.command("join")
@click.option("--model", "model_path", default=None, help="Full model GGUF: the part to host is chosen from what the swarm lacks.")
@click.option("--slice", "slice_path", default=None, help="Or a slice GGUF from `moeswarm slice`: the part is chosen within it.")
@click.option("--model-digest", default=None, help="With --slice: refuse a slice of any other model.")
@click.option("--bootstrap", "bootstrap", multiple=True, required=True, help="The multiaddr the swarm's `moeswarm bootstrap` printed, /ip4/H/tcp/P/p2p/ID (repeatable).")
@click.option("--memory", default=None, help="RAM the hosted experts may take, e.g. 2G (default: half of MemAvailable in /proc/meminfo).")
@click.option("--listen", default="0.0.0.0:0", show_default=True, help="UDP HOST:PORT for QUIC dispatch; a wildcard host binds the address that routes to the bootstrap.")
@click.option("--advertise", default=None, callback=record_field(check_quic_addr), help="HOST:PORT the swarm should dial, if not the bound address (e.g. a port forward); never a wildcard, nor loopback towards a bootstrap on another machine.")
@click.option("--dht-listen", default=None, help="TCP HOST:PORT for the DHT (default: the address that routes to the bootstrap, any port).")
@click.option("--bootstrap-wait", default=60.0, show_default=True, type=click.FloatRange(min=0), help="Seconds to keep retrying an unreachable bootstrap before giving up.")
@serving_options
def join_cmd(model_path, slice_path, model_digest, bootstrap, memory, listen, advertise, dht_listen, bootstrap_wait, **serving) -> None:
    """Join a swarm: host the least covered experts that fit in memory, then serve like `moeswarm worker`."""
    if bool(model_path) == bool(slice_path):
        raise click.UsageError("give exactly one of --model and --slice")
    boot_host = bootstrap_hostport(bootstrap[0])[0]
    for addr in bootstrap[1:]:
        bootstrap_hostport(addr)
    listen_host, listen_port = parse_hostport(listen)
    if advertise:
        check_advertise(advertise.rpartition(":")[0], boot_host)  # before anything else looks at the network
    local = _local_address_towards(boot_host) if _is_wildcard(listen_host) else listen_host
    if not advertise:
        check_advertise(local, boot_host)
    if _is_wildcard(listen_host) and not advertise and not serving["relay"]:
        listen_host = local  # then the bound address is the one announced
    model = GGUFModel(model_path or slice_path)
    budget = parse_size(memory) if memory else default_budget(Path("/proc/meminfo").read_text())

    _wait_for_bootstrap(bootstrap, bootstrap_wait)
    coverage = asyncio.run(_survey(model, bootstrap, dht_listen or f"{local}:0"))
    unit = max(packed_bytes(model, range(layer, layer + 1), ExpertRange(model.experts.start, model.experts.start + 1)) for layer in model.layers if model.cfg.is_moe(layer)) if model.moe_layers else 0
    part = choose_part(host_counts(coverage, model.moe_layers), model.layers, model.experts, unit, budget)
    size = packed_bytes(model, part.layers, part.experts)
    click.echo(f"swarm: {len(coverage.peers)} hosts; least covered: {part.describe()} ({part.hosts_before} hosts); hosting them: {size / MB:.1f} MB of the {budget / MB:.1f} MB this worker may use", err=True)

    def serving_line(node: WorkerNode) -> None:
        s = node.store
        via, addr = ("direct", node.addr) if node.addr else ("relay", node.opts.relay)
        click.echo(f"serving layers {s.layers.start}-{s.layers.stop - 1} experts {s.experts.start}-{s.experts.stop - 1} of {model.path.name} reachable at {addr} via {via}")

    start_worker(model, layers=part.layers, experts=part.experts, listen=(listen_host, listen_port), advertise=advertise, dht_listen=dht_listen or f"{local}:0", bootstrap=bootstrap, memory_budget=budget, model_digest=model_digest, on_ready=serving_line, **serving)


def _is_wildcard(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_unspecified
    except ValueError:
        return False


def _local_address_towards(host: str) -> str:
    """This machine's address on the route to *host*: a connected UDP socket's own address (no packet is sent)."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((host.strip("[]"), 9))
            return str(s.getsockname()[0])
    except OSError as exc:
        raise UsageError(f"no route from this machine to the bootstrap host {host} ({exc.strerror or exc}); check the network, or give --listen HOST:PORT with this machine's address") from None


def _wait_for_bootstrap(bootstrap: Sequence[str], wait: float) -> None:
    """Return once one bootstrap answers TCP; retry with backoff for *wait* seconds, then one UsageError."""
    deadline = time.monotonic() + wait
    attempt = 0
    while True:
        errors = []
        for addr in bootstrap:
            try:
                probe_bootstrap(addr, min(PROBE_TIMEOUT, max(deadline - time.monotonic(), 0.5)))
                return
            except DiscoveryError as exc:
                errors.append(str(exc))
        pause = PROBE_BACKOFF.delay(attempt)
        if time.monotonic() + pause > deadline:
            raise UsageError(f"{'; '.join(errors)} (retried for {wait:.0f} s); check the address `moeswarm bootstrap` printed and that its TCP port is open to this machine")
        if attempt == 0:
            click.echo(f"waiting for the bootstrap: {errors[0]}; retrying for up to {wait:.0f} s", err=True)
        time.sleep(pause)
        attempt += 1


async def _survey(model: GGUFModel, bootstrap: Sequence[str], dht_listen: str) -> Coverage:
    """The swarm's coverage of *model*: one DHT lookup per layer from a throwaway client."""
    cfg = model.cfg
    try:
        async with LibP2PDiscovery(Identity.generate(), listen=dht_listen, bootstrap=bootstrap, client_mode=True) as dht:
            found = await asyncio.gather(*(dht.lookup(model.digest, layer) for layer in model.moe_layers))
    except DiscoveryError as exc:
        raise UsageError(f"could not join the DHT through {', '.join(bootstrap)}: {exc}; check the peer id in the address (the part after /p2p/)") from None
    return build_coverage(model.digest, cfg.n_layer, cfg.n_expert, dict(zip(model.moe_layers, found, strict=True)), time.time())
