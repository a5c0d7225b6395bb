"""`moeswarm stage`: serve layers A..B of a model as one stage of a chain (issue 26)."""

from __future__ import annotations

import asyncio
import dataclasses
import sys

import click

from experts.gguf_model import GGUFModel
from experts.slices import parse_range
from node.cli.options import backbone_options, backbone_opts, bootstrap_opt, data_dir_opt, kernel_options, open_kernel, ready_opt
from node.cli.swarm import record_field
from node.runtime import data_dir as node_dir
from node.runtime import load_identity
from node.stage.node import EXPERTS, StageOptions, run_stage
from p2p.dht.records import check_quic_addr


@click.command("stage")
@click.option("--model", "model_path", required=True, help="Model GGUF (the full file: the stage runs its layers and, with --experts all, their experts).")
@click.option("--layers", required=True, help="Layer range this stage runs, e.g. 0-11.")
@click.option("--experts", "experts_", default="all", show_default=True, type=click.Choice(EXPERTS), help="all: compute the MoE layers' experts here (the file holds them); remote: dispatch them to workers found through --bootstrap, as a backbone does.")
@click.option("--wait-hosts", default=1, show_default=True, type=click.IntRange(min=1), help="With --experts remote: hosts every MoE layer of the stage needs before it serves.")
@click.option("--max-sessions", default=64, show_default=True, type=click.IntRange(min=1), help="Sessions whose KV cache the stage keeps; past it the oldest is dropped (its client replays).")
@click.option("--advertise", default=None, callback=record_field(check_quic_addr), help="QUIC HOST:PORT to announce in the stage record, if not the --listen address (a wildcard listen needs it).")
@click.option("--price", default=0, show_default=True, type=click.IntRange(min=0), help="Price per pass-token, announced in the stage record.")
@bootstrap_opt
@backbone_opts
@kernel_options
@data_dir_opt
@ready_opt
def stage_cmd(model_path, layers, experts_, wait_hosts, max_sessions, advertise, price, bootstrap, bootstrap_wait, kernel_name, threads, data_dir, ready_file, **backbone) -> None:
    """Serve layers A..B on hidden states (their KV cache per session) until Ctrl-C; a client chains stages.

    --listen is the stage's QUIC address (what the ready file's quic_addr says); with --experts remote the dispatch
    to workers goes out through a second, client-only endpoint, as a backbone's does. With --bootstrap the stage
    announces a signed stage record on the DHT (kept fresh while it runs, withdrawn when it stops): clients with
    `--stages auto` find it there.
    """
    model = GGUFModel(model_path)
    span = parse_range(layers, model.cfg.n_layer, "layer")
    session = backbone_options(model.digest, None, **backbone)
    dispatch = dataclasses.replace(session, listen=(session.listen[0], 0))  # the workers' side: any free port
    opts = StageOptions(model.path, span, listen=session.listen, experts=experts_, bootstrap=bootstrap, bootstrap_wait=bootstrap_wait, dht_listen=session.dht_listen, advertise=advertise, price=price, wait_hosts=wait_hosts, max_datagram=session.max_datagram, max_sessions=max_sessions, backbone=dispatch)
    kernel = open_kernel(kernel_name, threads)
    try:
        asyncio.run(run_stage(load_identity(node_dir(data_dir, "stage")), opts, kernel, ready_file))
    except KeyboardInterrupt:
        click.echo("stage stopped: interrupted", err=True)
        sys.exit(130)
