"""`moeswarm join`: a volunteer's one command, from a model file and a bootstrap address to a serving worker.

In order, each step failing with one line before the next costs anything: the addresses (no network use: an
address the swarm could not dial is refused first), the bootstrap (TCP, retried with backoff for a bounded time),
the swarm's coverage (``node.cli.survey``: a short-lived DHT client under a throwaway identity, so the worker's own
identity joins only once), the part to host (``node.worker.placement``), then the worker exactly as `moeswarm worker` runs it.

With ``--fetch`` there is no model file: the model digest is the trust root. One fetch session (``node.fetch``, a
throwaway identity too) reads the model's manifest from a slice holder (checked against the digest: it gives the
layers, experts and each expert's size), then the coverage, picks the part the same way, fetches exactly that slice
(every expert verified before it is written) into the data directory, and the worker serves the slice file.
"""

from __future__ import annotations

import asyncio
import ipaddress
from collections.abc import Callable
from pathlib import Path

import click

from experts.errors import UsageError
from experts.gguf_model import ExpertRange, GGUFModel
from experts.hosting import MB, packed_bytes
from node.cli import progress
from node.cli.options import model_digest_value, parse_size, relay_settings
from node.cli.survey import coverage_of, local_address_towards, survey
from node.cli.swarm import record_field, serving_options, start_worker
from node.fetch import FetchOptions, FetchSession, slice_holders
from node.runtime import data_dir as node_dir
from node.runtime import parse_hostport
from node.status.server import model_shape
from node.worker.node import WorkerNode
from node.worker.placement import Part, check_advertise, choose_part, default_budget, host_counts
from p2p.dht.kademlia import bootstrap_target, check_bootstrap
from p2p.dht.records import check_quic_addr
from p2p.identity import Identity


@click.command("join")
@click.option("--model", "model_path", default=None, help="Full model GGUF: the part to host is chosen from what the swarm lacks.")
@click.option("--slice", "slice_path", default=None, help="Or a slice GGUF from `moeswarm slice`: the part is chosen within it.")
@click.option("--model-digest", default=None, callback=model_digest_value, help="With --slice: refuse a slice of any other model. With --fetch: the model to join (`moeswarm inspect FULL.gguf` prints it; whoever publishes the model publishes it).")
@click.option("--fetch", "fetch", is_flag=True, help="No model file: fetch the chosen part of the model named by --model-digest from the workers serving slices (verified expert by expert), then serve it.")
@click.option("--bootstrap", "bootstrap", multiple=True, required=True, help="The multiaddr the swarm's `moeswarm bootstrap` printed, /ip4/H/tcp/P/p2p/ID (repeatable).")
@click.option("--memory", default=None, help="RAM the hosted experts may take, e.g. 2G (default: half of MemAvailable in /proc/meminfo).")
@click.option("--listen", default="0.0.0.0:0", show_default=True, help="UDP HOST:PORT for QUIC dispatch; a wildcard host binds the address that routes to the bootstrap.")
@click.option("--advertise", default=None, callback=record_field(check_quic_addr), help="HOST:PORT the swarm should dial, if not the bound address (e.g. a port forward); never a wildcard, nor loopback towards a bootstrap on another machine.")
@click.option("--dht-listen", default=None, help="TCP HOST:PORT for the DHT (default: the address that routes to the bootstrap, any port).")
@click.option("--bootstrap-wait", default=60.0, show_default=True, type=click.FloatRange(min=0), help="Seconds to keep retrying an unreachable bootstrap before giving up.")
@serving_options
def join_cmd(model_path, slice_path, model_digest, fetch, bootstrap, memory, listen, advertise, dht_listen, bootstrap_wait, **serving) -> None:
    """Join a swarm: host the least covered experts that fit in memory, then serve like `moeswarm worker`."""
    if fetch and (model_path or slice_path or not model_digest):
        raise click.UsageError("--fetch takes no model file: give --model-digest D (and neither --model nor --slice)")
    if not fetch and bool(model_path) == bool(slice_path):
        raise click.UsageError("give exactly one of --model and --slice (or --fetch with --model-digest)")
    boot_host = bootstrap_target(bootstrap[0])[0]
    for addr in bootstrap[1:]:
        bootstrap_target(addr)
    listen_host, listen_port = parse_hostport(listen)
    if advertise:
        check_advertise(advertise.rpartition(":")[0], boot_host)  # before anything else looks at the network
    local = local_address_towards(boot_host) if _is_wildcard(listen_host) else listen_host
    if not advertise:
        check_advertise(local, boot_host)
    if _is_wildcard(listen_host) and not advertise and not serving["relay"]:
        listen_host = local  # then the bound address is the one announced
    budget = parse_size(memory) if memory else default_budget(Path("/proc/meminfo").read_text())
    dht_listen = dht_listen or f"{local}:0"
    asyncio.run(check_bootstrap(bootstrap, bootstrap_wait))
    if fetch:
        session = FetchSession(Identity.generate(), bootstrap, dht_listen=dht_listen, listen=(local, 0), max_datagram=serving["max_datagram"], relay=relay_settings(serving["relay_ca"], serving["relay_keepalive"]))
        with progress.bars(progress.wanted()) as shown:
            model = GGUFModel(asyncio.run(_fetch_part(session, model_digest, node_dir(serving["data_dir"], "worker"), budget, progress.stage(shown, "fetching experts"))))
        part = Part(model.layers, model.experts, 0)  # the whole slice
    else:
        model = GGUFModel(model_path or slice_path)
        coverage = asyncio.run(survey(model_shape(model), bootstrap, dht_listen))
        one = ExpertRange(model.experts.start, model.experts.start + 1)
        unit = max((packed_bytes(model, range(layer, layer + 1), one) for layer in model.moe_layers), default=0)  # one expert of the largest layer
        part = choose_part(host_counts(coverage, model.moe_layers), model.layers, model.experts, unit, budget)
        size = packed_bytes(model, part.layers, part.experts)
        click.echo(f"swarm: {len(coverage.peers)} hosts; least covered: {part.describe()} ({part.hosts_before} hosts); hosting them: {size / MB:.1f} MB of the {budget / MB:.1f} MB this worker may use", err=True)

    def serving_line(node: WorkerNode) -> None:
        s = node.store
        via, addr = ("direct", node.addr) if node.addr else ("relay", node.opts.relay)
        click.echo(f"serving layers {s.layers.start}-{s.layers.stop - 1} experts {s.experts.start}-{s.experts.stop - 1} of {model.path.name} reachable at {addr} via {via}")

    start_worker(model, layers=part.layers, experts=part.experts, listen=(listen_host, listen_port), advertise=advertise, dht_listen=dht_listen, bootstrap=bootstrap, bootstrap_wait=bootstrap_wait, memory_budget=budget, model_digest=model_digest, on_ready=serving_line, **serving)


FIRST_LAYERS = 8  # looked up for a first holder: every MoE model has experts among its first layers (dense leads are 1-3)


async def _fetch_part(session: FetchSession, digest: str, home: Path, budget: int, shown: Callable[[int, int], None] | None) -> Path:
    """The least covered part of the model that fits *budget*, fetched into *home* (the worker's data directory);
    the slice file's path. A finished fetch of the same part found there is used again (the worker re-checks every
    expert of it against the digest when it loads it)."""
    async with session:
        first = slice_holders(await session.lookup(digest, range(FIRST_LAYERS)))
        if not first:
            raise UsageError(f"no worker on the DHT serves slices of model {digest[:16]}... (none in its first {FIRST_LAYERS} layers); check the digest, or join with --model FILE")
        whole = await session.manifest(digest, first)
        shape = model_shape(whole)
        coverage = coverage_of(shape, await session.lookup(digest, shape.moe_layers))
        unit = max(whole.expert_nbytes(layer) for layer in shape.moe_layers)  # one expert of the largest layer
        part = choose_part(host_counts(coverage, shape.moe_layers), range(whole.cfg.n_layer), ExpertRange(0, whole.cfg.n_expert), unit, budget)
        size = sum(whole.expert_nbytes(layer) for layer in part.layers if whole.cfg.is_moe(layer)) * len(part.experts)
        click.echo(f"swarm: {len(coverage.peers)} hosts; least covered: {part.describe()} ({part.hosts_before} hosts); fetching them: {size / MB:.1f} MB of the {budget / MB:.1f} MB this worker may use", err=True)
        out = home / f"{digest[:16]}-layers{part.layers.start}-{part.layers.stop - 1}-experts{part.experts.start}-{part.experts.stop - 1}.gguf"
        if out.exists():
            click.echo(f"using {out}, fetched before", err=True)
        else:
            r = await session.fetch(FetchOptions(digest, part.layers, part.experts, out, session.bootstrap), shown)
            click.echo(f"fetched {r.fetched_bytes / MB:.1f} MB from {len(r.by_holder)} holders ({r.resumed_bytes / MB:.1f} MB resumed, {len(r.dropped)} dropped) into {out}", err=True)
        return out


def _is_wildcard(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_unspecified
    except ValueError:
        return False
