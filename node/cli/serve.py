"""`moeswarm backbone serve`: an OpenAI-compatible HTTP gateway over the swarm."""

from __future__ import annotations

import asyncio

import click
import structlog

from experts.embedded import EMBEDDED_MODEL
from experts.forward import Backbone
from experts.gguf_model import GGUFModel
from experts.kernels import Kernel
from experts.tokenizer import Tokenizer
from node.backbone.batching import DEFAULT_WINDOW_S, BatchingMoE
from node.backbone.options import BackboneOptions
from node.backbone.prefix_cache import PrefixCache
from node.backbone.session import backbone_session, wait_for_hosts
from node.cli.options import backbone_options, backbone_opts, bootstrap_opt, data_dir_opt, drafter_opt, kernel_options, open_kernel, parse_size, ready_opt
from node.gateway.engine import Engine
from node.gateway.options import GatewayOptions
from node.gateway.server import BODY_TIMEOUT, Gateway
from node.gateway.summary import Counts, log_summaries
from node.ledger.store import FILENAME
from node.runtime import data_dir as node_dir
from node.runtime import load_identity, parse_hostport, until_stopped, write_ready
from node.status.coverage import Phase
from node.status.server import NodeStatus, model_shape, url_of, watching
from p2p.dht.kademlia import check_bootstrap
from p2p.identity import Identity

log = structlog.get_logger("node.cli.serve")


@click.command("serve")
@click.option("--model", "model_path", default=str(EMBEDDED_MODEL), show_default="the embedded model", help="Full model GGUF (the backbone runs its dense part).")
@bootstrap_opt
@click.option("--http", "http_addr", default="127.0.0.1:8000", show_default=True, help="HOST:PORT for the OpenAI-compatible API (port 0: any free port).")
@click.option("--api-key", default=None, envvar="MOESWARM_API_KEY", show_envvar=True, callback=lambda ctx, param, v: _api_key(v), help="Require 'Authorization: Bearer KEY' (the OpenAI client's api_key) on every path but /healthz and /readyz; 401 otherwise. Prefer the environment variable: a command line is visible to other users.")
@click.option("--body-timeout", default=BODY_TIMEOUT, show_default=True, type=click.FloatRange(min=0, min_open=True), help="Seconds for a request body to arrive in full once its headers have; past it HTTP 408 and the connection is closed.")
@click.option("--served-model-name", default=None, help="Model id clients must ask for (default: the GGUF file's name without .gguf).")
@click.option("--wait-hosts", default=1, show_default=True, help="Wait until each layer has this many hosts before serving.")
@click.option("--wait-timeout", default=60.0, show_default=True, type=click.FloatRange(min=0), help="Seconds to wait for those hosts (meanwhile /v1 and /readyz answer 503) before giving up.")
@click.option("--max-batch", default=8, show_default=True, type=click.IntRange(1, 256), help="Sequences decoded concurrently (their MoE layers share dispatches).")
@click.option("--max-queue", default=64, show_default=True, type=click.IntRange(0), help="Requests that may wait for a slot; more get HTTP 429.")
@click.option("--batch-window-ms", default=DEFAULT_WINDOW_S * 1e3, show_default=True, type=click.FloatRange(0), help="A layer's batch goes without the sequences still computing once none has arrived for this long.")
@click.option("--prefix-cache", "prefix_cache", default="256M", show_default=True, help="Memory for cached prompt prefixes (keys/values); 0 turns the cache off.")
@click.option("--summary-interval", "summary_s", default=60.0, show_default=True, type=click.FloatRange(min=1), help="Seconds between the info lines that sum up requests, tokens, dispatches, failures and hosts used (a quiet interval prints none).")
@click.option("--no-speculative", is_flag=True, help="Decode greedy requests one token per pass (same output, more round trips).")
@drafter_opt
@backbone_opts
@click.option("--no-ledger", is_flag=True, help="Do not record receipts (DATA_DIR/ledger.sqlite by default).")
@kernel_options
@data_dir_opt
@ready_opt
def serve_cmd(model_path, bootstrap, bootstrap_wait, http_addr, api_key, body_timeout, served_model_name, wait_hosts, wait_timeout, max_batch, max_queue, batch_window_ms, prefix_cache, summary_s, no_speculative, drafter, no_ledger, kernel_name, threads, data_dir, ready_file, **backbone) -> None:
    """Serve /v1/completions and /v1/chat/completions, batching concurrent requests' dispatches."""
    model = GGUFModel(model_path)
    home = node_dir(data_dir, "backbone")
    session = backbone_options(model.digest, None if no_ledger else home / FILENAME, **backbone)
    cache_bytes = parse_size(prefix_cache) if prefix_cache not in ("0", "") else 0
    options = GatewayOptions(max_batch=max_batch, max_queue=max_queue, window_s=batch_window_ms / 1e3, prefix_bytes=cache_bytes, speculative=not no_speculative, drafter=drafter, summary_s=summary_s, body_timeout=body_timeout)
    kernel = open_kernel(kernel_name, threads)
    asyncio.run(serve(load_identity(home), model, (bootstrap, bootstrap_wait), parse_hostport(http_addr), served_model_name or model.path.name.removesuffix(".gguf"), (wait_hosts, wait_timeout), kernel, session, options, ready_file, api_key))


def _api_key(value: str | None) -> str | None:
    """An API key is printable ASCII without spaces (what an HTTP header carries unchanged); an empty one is refused
    rather than read as "no key"."""
    if value is not None and (not value or not all(33 <= ord(c) < 127 for c in value)):
        raise click.BadParameter("the API key must be non-empty printable ASCII without spaces")
    return value


async def serve(identity: Identity, model: GGUFModel, bootstrap, http: tuple[str, int], name: str, wait: tuple[int, float], kernel: Kernel, session: BackboneOptions, options: GatewayOptions, ready_file: str | None, api_key: str | None = None) -> None:
    """Bind HTTP at once (503 until ready), find the workers, then serve on this loop until SIGINT/SIGTERM."""
    status = NodeStatus("gateway", str(identity.peer_id), phase=Phase.LOADING, model=model_shape(model), needs_swarm=True, ledger_path=session.ledger_path)
    gateway = Gateway(None, name, model.digest, status, api_key=api_key, body_timeout=options.body_timeout)
    host, port = await gateway.start(*http)
    status.http_addr = f"{host}:{port}"
    url = url_of(host, port) + "/v1"
    log.info("gateway.listening", http_addr=status.http_addr, status=url_of(host, port) + "/status", auth="bearer" if api_key else "none")
    bootstrap, bootstrap_wait = bootstrap
    try:
        await check_bootstrap(bootstrap, bootstrap_wait)  # before the dense weights load (/readyz says "loading")
        tok = Tokenizer.from_spec(model.tokenizer_spec)
        backbone = await asyncio.to_thread(Backbone, model, kernel)  # the loop keeps answering /readyz meanwhile
        async with backbone_session(identity, model, bootstrap, kernel, session) as remote, watching(status):
            status.remote, status.discovery, status.phase = remote, remote.discovery, Phase.WAITING
            await wait_for_hosts(remote, model.moe_layers, *wait)
            await status.refresh()  # /readyz judges the coverage it has now, not the empty map of the wait
            moe = BatchingMoE(remote, model.cfg.moe_layers, asyncio.get_running_loop(), window_s=options.window_s)
            cache = PrefixCache(options.prefix_bytes) if options.prefix_bytes else None
            engine = Engine(backbone, tok, moe, max_batch=options.max_batch, max_queue=options.max_queue, prefix_cache=cache, speculative=options.speculative, drafter=options.drafter)
            gateway.attach(engine)
            status.phase = Phase.SERVING
            summaries = asyncio.create_task(log_summaries(lambda: Counts(engine.stats.requests, engine.stats.completion_tokens, engine.stats.failed), remote.stats.records, options.summary_s))
            try:
                log.info("gateway.ready", url=url, model=name, max_batch=options.max_batch)
                write_ready(ready_file, {"role": "gateway", "peer_id": str(identity.peer_id), "http_addr": status.http_addr, "base_url": url, "model": name})
                await until_stopped()
            finally:
                summaries.cancel()
                status.phase = Phase.DRAINING
                await asyncio.to_thread(engine.close)
    finally:
        await gateway.close()
