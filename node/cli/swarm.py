"""Swarm commands: bootstrap, worker, backbone generate."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import click

from experts.forward import Backbone
from experts.gguf_model import ExpertRange, GGUFModel
from experts.kernels import Kernel
from experts.slices import parse_range
from experts.speculative import pick_drafter
from experts.tokenizer import Tokenizer
from node.backbone.options import BackboneOptions
from node.backbone.session import backbone_session, wait_for_hosts
from node.bootstrap import run_bootstrap_node
from node.cli import progress
from node.cli.options import (
    backbone_options,
    backbone_opts,
    bootstrap_opt,
    data_dir_opt,
    dht_listen_opt,
    drafter_opt,
    http_opt,
    kernel_options,
    max_datagram_opt,
    open_kernel,
    parse_size,
    ready_opt,
    relay_opts,
    relay_settings,
    thread_count,
)
from node.cli.root import LazyGroup, emit_json
from node.cli.staged import generate_staged, stages_options
from node.cli.streaming import stream_tokens
from node.ledger.store import FILENAME
from node.runtime import data_dir as node_dir
from node.runtime import load_identity, parse_hostport
from node.status.server import model_shape
from node.worker.node import WorkerNode, WorkerOptions, run_worker
from node.worker.slice_server import SliceLimits
from p2p.dht.kademlia import BOOTSTRAP_WAIT, check_bootstrap
from p2p.dht.records import MalformedRecord, check_quic_addr, check_relay_url
from p2p.quic.budget import ServeLimits


def record_field(check):
    """A click callback that refuses a value the worker's DHT records could not carry, before anything starts."""

    def callback(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
        if value is not None:
            try:
                check(value)
            except MalformedRecord as exc:
                raise click.BadParameter(str(exc)) from None
        return value

    return callback


@click.command("bootstrap")
@click.option("--listen", default="127.0.0.1:4001", show_default=True, help="TCP HOST:PORT for the DHT.")
@click.option("--quic-listen", default=None, help="UDP HOST:PORT where this node answers reachability probes and which it announces as a helper (default: the --listen host and port number, over UDP; a wildcard host is not announced).")
@bootstrap_opt
@http_opt
@click.option("--model", "model_path", default=None, help="The model GGUF this bootstrap serves: it refuses records naming layers or experts the model does not have, and with --http the status page shows its coverage (hosts per layer and expert range).")
@data_dir_opt
@ready_opt
def bootstrap_cmd(listen: str, quic_listen: str | None, bootstrap: tuple[str, ...], bootstrap_wait: float, http_addr: str | None, model_path: str | None, data_dir: str | None, ready_file: str | None) -> None:
    """Run a DHT bootstrap node (also a reachability helper for NAT detection)."""
    parse_hostport(listen)
    quic = parse_hostport(quic_listen) if quic_listen else None
    http = parse_hostport(http_addr) if http_addr else None
    shape = model_shape(GGUFModel(model_path)) if model_path else None
    ident = load_identity(node_dir(data_dir, "bootstrap"))
    asyncio.run(run_bootstrap_node(ident, listen, bootstrap, ready_file, quic, http=http, model=shape, on_ready=_print_bootstrap, bootstrap_wait=bootstrap_wait))


def _print_bootstrap(addrs: list[str]) -> None:
    """The one line a bootstrap's operator needs at the default log level: what to give the other nodes."""
    click.echo(f"bootstrap serving; join with: --bootstrap {addrs[0]}" if addrs else "bootstrap serving, but libp2p reports no listen address")


def serving_options(f):
    """The options `worker` and `join` share: how the worker computes, is paid, is reached and stops."""
    options = [
        kernel_options,
        click.option("--price", default=0, show_default=True, help="Price per work unit, announced in the DHT record."),
        max_datagram_opt,
        click.option("--capacity", default=0, show_default=True, help="Announced capacity (tokens per second, informative)."),
        click.option("--no-ledger", is_flag=True, help="Do not record receipts (DATA_DIR/ledger.sqlite by default)."),
        click.option("--relay", default=None, callback=record_field(check_relay_url), help="Relay URL (ws://HOST:PORT/relay) through which this worker is also reachable. The worker then checks its reachability against the DHT's helpers: public -> it also announces a direct QUIC address; behind NAT -> only the relay, and backbones hole-punch to it (not behind a symmetric NAT)."),
        click.option("--reachability-recheck", "recheck_s", default=300.0, show_default=True, type=click.FloatRange(min=1), help="With --relay: seconds between reachability re-checks; a changed verdict is re-announced (e.g. after a port forward)."),
        click.option("--drain-timeout", default=10.0, show_default=True, type=click.FloatRange(min=0), help="On SIGTERM/SIGINT: seconds to finish the dispatches in flight (after withdrawing the records, new ones are refused) before closing."),
        click.option("--dispatch-delay", default=0.0, hidden=True, type=click.FloatRange(min=0), help="Test only: seconds every dispatch waits before computing."),
        click.option("--relay-only", is_flag=True, help="With --relay: skip the check, announce only the relay address and answer no hole punch (every dispatch through the relay)."),
        click.option("--summary-interval", "summary_s", default=60.0, show_default=True, type=click.FloatRange(min=1), help="Seconds between the info lines that sum up what this worker served and earned (an interval with no dispatch prints none)."),
        click.option("--request-buffer", default="64M", show_default=True, help="Request bytes all peers together may make this worker hold (arriving or being computed); past it the stalest unfinished requests are reset, then new ones refused (OVERLOADED)."),
        click.option("--request-buffer-per-peer", default="16M", show_default=True, help="Request bytes one connection may make this worker hold (also the largest request it accepts); past it its new streams are refused (OVERLOADED)."),
        click.option("--max-streams-per-peer", default=64, show_default=True, type=click.IntRange(min=1), help="Request streams one connection may have open at once."),
        click.option("--request-deadline", default=30.0, show_default=True, type=click.FloatRange(min=0.1), help="Seconds from a request's first byte to its end; a slower request is reset and freed."),
        click.option("--max-in-flight", default=256, show_default=True, type=click.IntRange(min=1), help="Dispatches computed or queued at once, all peers; more get an OVERLOADED error reply."),
        click.option("--max-in-flight-per-peer", default=32, show_default=True, type=click.IntRange(min=1), help="Dispatches computed or queued at once for one peer; more get an OVERLOADED error reply."),
        click.option("--no-serve-slices", is_flag=True, help="Do not serve the hosted experts' bytes to peers fetching a slice (`moeswarm fetch`); by default a worker serves them and says so in its records."),
        click.option("--slice-rate", default="64M", show_default=True, help="Bytes per second all slice fetchers together may take from this worker (dispatches go first: this bounds what a fetch takes of the link)."),
        click.option("--slice-rate-per-peer", default="32M", show_default=True, help="Bytes per second one fetcher may take."),
        relay_opts,
        http_opt,
        data_dir_opt,
        ready_opt,
    ]
    for option in reversed(options):
        f = option(f)
    return f


@click.command("worker")
@click.option("--model", "model_path", default=None, help="Full model GGUF (host a part of it).")
@click.option("--slice", "slice_path", default=None, help="Slice GGUF from `moeswarm slice`.")
@click.option("--model-digest", default=None, help="With --slice: refuse a slice of any other model.")
@click.option("--layers", default=None, help="Layer range to host, e.g. 0-3 (default: all in the file).")
@click.option("--experts", "experts_", default=None, help="Expert range to host, e.g. 0-31 (default: all in the file).")
@click.option("--listen", default="127.0.0.1:0", show_default=True, help="UDP HOST:PORT for QUIC dispatch (and reachability probes; with --relay use a routable or wildcard host, e.g. 0.0.0.0:0).")
@click.option("--advertise", default=None, callback=record_field(check_quic_addr), help="HOST:PORT to announce, if not the listen address (with --relay: only if the check finds this node public).")
@dht_listen_opt
@bootstrap_opt
@click.option("--memory-budget", default=None, help="RAM the hosted experts may take (e.g. 512M): the worker refuses to start if they do not fit (see `moeswarm inspect`); with --kernel reference, above their float32 size they are dequantized on the fly.")
@serving_options
def worker_cmd(model_path, slice_path, model_digest, layers, experts_, listen, advertise, dht_listen, bootstrap, bootstrap_wait, memory_budget, **serving) -> None:
    """Host expert slices: load, announce on the DHT, serve dispatches until Ctrl-C (then withdraw)."""
    if bool(model_path) == bool(slice_path):
        raise click.UsageError("give exactly one of --model and --slice")
    model = GGUFModel(model_path or slice_path)
    lr = parse_range(layers, model.cfg.n_layer, "layer") if layers else None
    er = parse_range(experts_, model.cfg.n_expert, "expert") if experts_ else None
    start_worker(model, layers=lr, experts=ExpertRange(er.start, er.stop) if er else None, listen=parse_hostport(listen), advertise=advertise, dht_listen=dht_listen, bootstrap=bootstrap, bootstrap_wait=bootstrap_wait, memory_budget=parse_size(memory_budget) if memory_budget else None, model_digest=model_digest, **serving)


def start_worker(model: GGUFModel, *, layers: range | None, experts: ExpertRange | None, listen: tuple[str, int], advertise: str | None, dht_listen: str, bootstrap: Sequence[str], memory_budget: int | None, model_digest: str | None = None, on_ready: Callable[[WorkerNode], None] | None = None, bootstrap_wait: float = BOOTSTRAP_WAIT,
                 kernel_name, threads, price, max_datagram, capacity, no_ledger, relay, recheck_s, drain_timeout, dispatch_delay, relay_only, summary_s, request_buffer, request_buffer_per_peer, max_streams_per_peer, request_deadline, max_in_flight, max_in_flight_per_peer,
                 no_serve_slices, slice_rate, slice_rate_per_peer, relay_ca, relay_keepalive, http_addr, data_dir, ready_file) -> None:
    """Run a worker until it is stopped: what `worker` and `join` both end in, given the parts to host."""
    if relay_only and not relay:
        raise click.UsageError("--relay-only needs --relay URL")
    opts = WorkerOptions(
        model=model.path,
        layers=layers,
        experts=experts,
        listen=listen,
        dht_listen=dht_listen,
        bootstrap=bootstrap,
        bootstrap_wait=bootstrap_wait,
        memory_budget=memory_budget,
        kernel=kernel_name,
        threads=thread_count(threads),
        price=price,
        capacity=capacity,
        advertise=advertise,
        model_digest=model_digest,
        max_datagram=max_datagram,
        relay=relay,
        relay_only=relay_only,
        relay_settings=relay_settings(relay_ca, relay_keepalive),
        recheck_s=recheck_s,
        drain_timeout=drain_timeout,
        dispatch_delay=dispatch_delay,
        serve_limits=_serve_limits(request_buffer, request_buffer_per_peer, max_streams_per_peer, request_deadline),
        max_in_flight=max_in_flight,
        max_in_flight_per_peer=max_in_flight_per_peer,
        summary_s=summary_s,
        serve_slices=not no_serve_slices,
        slice_limits=SliceLimits(rate=parse_size(slice_rate), rate_per_peer=parse_size(slice_rate_per_peer)),
    )
    home = node_dir(data_dir, "worker")
    ident = load_identity(home)
    http = parse_hostport(http_addr) if http_addr else None
    with progress.bars(progress.wanted()) as shown:
        try:
            asyncio.run(run_worker(ident, opts, ready_file, None if no_ledger else home / FILENAME, http=http, progress=shown, on_ready=on_ready))
        except KeyboardInterrupt:
            click.echo("worker stopped: interrupted", err=True)
            sys.exit(130)


def _serve_limits(buffer: str, per_peer: str, streams: int, deadline: float) -> ServeLimits:
    try:
        return ServeLimits(max_bytes=parse_size(buffer), max_bytes_per_conn=parse_size(per_peer), max_streams_per_conn=streams, request_deadline=deadline)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


@click.group("backbone", cls=LazyGroup, lazy_subcommands={"generate": "node.cli.swarm:generate_cmd", "serve": "node.cli.serve:serve_cmd"})
def backbone_group() -> None:
    """Backbone: run a model whose experts live on swarm workers."""


@click.command("generate")
@click.option("--model", "model_path", required=True, help="Full model GGUF (the backbone runs its dense part).")
@bootstrap_opt
@click.argument("prompt")
@click.option("--tokens", "n_tokens", default=32, show_default=True)
@click.option("--wait-hosts", default=1, show_default=True, help="Wait until each layer has this many hosts.")
@backbone_opts
@click.option("--ledger", "ledger_path", default=None, help="Append every receipt to this ledger (default DATA_DIR/ledger.sqlite).")
@click.option("--speculative/--no-speculative", default=True, show_default=True, help="Verify prompt-lookup drafts in one pass (greedy output unchanged).")
@drafter_opt
@click.option("--overlap/--no-overlap", default=True, show_default=True, help="Compute the shared expert while a layer's dispatch is in flight.")
@kernel_options
@data_dir_opt
@stages_options
@click.option("--json", "as_json", is_flag=True)
def generate_cmd(model_path, bootstrap, bootstrap_wait, prompt, n_tokens, wait_hosts, ledger_path, speculative, drafter, overlap, kernel_name, threads, data_dir, stages, stages_wait, stage_timeout, as_json, **backbone) -> None:
    """Generate text, streaming tokens; each MoE layer is dispatched to the workers that host it (or, with
    --stages auto, the hidden states go along a chain of stages that run the layers)."""
    model = GGUFModel(model_path)
    home = node_dir(data_dir, "backbone")
    ident = load_identity(home)
    session = backbone_options(model.digest, Path(ledger_path) if ledger_path else home / FILENAME, **backbone)
    kernel = open_kernel(kernel_name, threads)
    staged = (stages_wait, stage_timeout) if stages == "auto" else None
    result = asyncio.run(_generate(ident, model, (bootstrap, bootstrap_wait), prompt, n_tokens, wait_hosts, kernel, session, stream=not as_json, speculative=speculative, drafter=drafter, overlap=overlap, staged=staged))
    if as_json:
        emit_json(result)


async def _generate(ident, model, bootstrap, prompt, n_tokens, wait_hosts, kernel: Kernel, session: BackboneOptions, *, stream: bool, speculative: bool, drafter: str, overlap: bool, staged: tuple[float, float] | None = None) -> dict:
    bootstrap, wait = bootstrap
    await check_bootstrap(bootstrap, wait)  # before the dense weights load
    tok = Tokenizer.from_spec(model.tokenizer_spec)
    if staged is not None:  # (seconds to wait for a chain, a hop's timeout)
        result = await generate_staged(ident, model, bootstrap, kernel, session, tok, prompt, n_tokens, stream=stream, speculative=speculative, drafter=drafter, wait_s=staged[0], hop_timeout=staged[1])
        if result is not None:
            return result
    bb = Backbone(model, kernel)
    drafts = pick_drafter(bb, drafter) if speculative else None  # an MTP refusal before any connection
    async with backbone_session(ident, model, bootstrap, kernel, session) as moe:
        await wait_for_hosts(moe, model.moe_layers, wait_hosts, 60)
        out, elapsed, spec, rollbacks = await stream_tokens(bb, tok, prompt, n_tokens, moe.hook, stream=stream, speculative=speculative, drafter=drafts, overlap=overlap, culprits=moe.checker.culprits, settle=moe.settle_blocking)
        verification = {**moe.checker.summary(), **(rollbacks.summary() if rollbacks else {})}
        if stream:
            click.echo(json.dumps({**moe.stats.summary(), "verification": verification}), err=True)
        hit = round(moe.hot.hit_rate, 4) if moe.hot else 0.0
        extra = {"speculative": {**spec.summary(), "drafter": drafter}, "verification": verification} if spec else {"verification": verification}
        return {"tokens": len(out), "text": tok.decode(out), "token_ids": out, "tokens_per_s": round(len(out) / elapsed, 3), "local_hit_rate": hit, **extra, **moe.stats.summary()}
