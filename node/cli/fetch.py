"""`moeswarm fetch`: fetch a slice of a model (experts, dense weights or the head) from the swarm's workers, verified piece by piece against its digest."""

from __future__ import annotations

import asyncio
from pathlib import Path

import click

from experts.errors import UsageError
from experts.gguf_model import ExpertRange
from experts.parts import Part
from experts.slices import parse_range
from node.cli import progress
from node.cli.options import bootstrap_opt, dht_listen_opt, listen_opt, model_digest_value, relay_opts, relay_settings
from node.cli.root import emit_json
from node.runtime import parse_hostport
from p2p.dht.kademlia import check_bootstrap

MAX_INDEX = 0xFFFF  # the manifest gives the real bounds; the ranges are checked against it once it is fetched


@click.command("fetch")
@click.option("--model-digest", required=True, callback=model_digest_value, help="The model's digest (`moeswarm inspect FULL.gguf` prints it; whoever publishes the model publishes it): the only thing trusted, every fetched byte is checked against it.")
@click.option("--layers", default=None, help="Layer range of an expert slice, e.g. 0-3.")
@click.option("--experts", "experts_", default=None, help="Expert range of an expert slice, e.g. 0-31.")
@click.option("--dense", "dense", default=None, help="Instead: the dense weights of this layer range, e.g. 0-3 (a stage's slice).")
@click.option("--head", is_flag=True, help="Instead: the embeddings, output head and tokenizer (a client's slice).")
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False, path_type=Path), help="Slice file to write (verified experts are staged in OUTPUT.parts/ meanwhile: run again to resume).")
@bootstrap_opt
@dht_listen_opt
@listen_opt
@click.option("--max-datagram", default=1200, show_default=True, type=click.IntRange(1200, 16384), help="QUIC datagram size to send (16384 only on loopback).")
@click.option("--timeout", default=30.0, show_default=True, type=click.FloatRange(min=0, min_open=True), help="Seconds one piece (at most 4 MiB) may take before that holder gets a strike.")
@relay_opts
@click.option("--json", "as_json", is_flag=True, help="Print the result as one JSON object.")
def fetch_cmd(model_digest, layers, experts_, dense, head, output, bootstrap, bootstrap_wait, dht_listen, listen, max_datagram, timeout, relay_ca, relay_keepalive, as_json) -> None:
    """Fetch a slice of the model named by its digest from the workers serving it (NAT-bound ones through their
    relay, hole-punched to a direct path where their NAT allows): LAYERS x EXPERTS, the dense weights of layers
    (--dense A-B), or the head (--head)."""
    from node.fetch import FetchOptions, fetch_slice
    from p2p.identity import Identity

    digest = model_digest
    part = Part.HEAD if head else Part.DENSE if dense is not None else Part.EXPERTS
    if head and dense is not None:
        raise UsageError("give one of --dense and --head")
    if part is Part.EXPERTS and (layers is None or experts_ is None):
        raise UsageError("give --layers and --experts (an expert slice), --dense LAYERS or --head")
    if part is not Part.EXPERTS and (layers is not None or experts_ is not None):
        raise UsageError(f"--{part.value} takes neither --layers nor --experts")
    lr = parse_range(dense if part is Part.DENSE else layers, MAX_INDEX, "layer") if part is not Part.HEAD else range(0)
    er = parse_range(experts_, MAX_INDEX, "expert") if part is Part.EXPERTS else None
    experts = ExpertRange(er.start, er.stop) if er is not None else None
    opts = FetchOptions(digest, lr, experts, output, bootstrap, dht_listen=dht_listen, listen=parse_hostport(listen), max_datagram=max_datagram, timeout=timeout, relay=relay_settings(relay_ca, relay_keepalive), part=part)

    async def run(shown):
        await check_bootstrap(bootstrap, bootstrap_wait)
        return await fetch_slice(Identity.generate(), opts, progress.stage(shown, "fetching experts" if part is Part.EXPERTS else "fetching tensors"))

    with progress.bars(progress.wanted(as_json=as_json)) as shown:
        result = asyncio.run(run(shown))
    if as_json:
        emit_json({"out": str(result.out), "total_bytes": result.total_bytes, "fetched_bytes": result.fetched_bytes, "resumed_bytes": result.resumed_bytes, "seconds": result.seconds, "transfer_seconds": result.transfer_seconds, "by_holder": result.by_holder, "by_path": result.by_path, "dropped": result.dropped})
    else:
        what = f"layers {layers}, experts {experts_}" if part is Part.EXPERTS else opts.describe()
        click.echo(f"wrote {result.out}: {what} of model {digest[:16]}... ({result.fetched_bytes / 1e6:.1f} MB fetched from {len(result.by_holder)} holders, {result.resumed_bytes / 1e6:.1f} MB resumed, {len(result.dropped)} dropped, {result.seconds:.1f} s)")
