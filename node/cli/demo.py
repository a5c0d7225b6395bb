"""`moeswarm demo`: a real local swarm on the embedded model.

Starts a DHT bootstrap node and three workers (separate OS processes on loopback,
each hosting a third of every layer's experts), then runs a backbone here that
finds them through the DHT and dispatches every MoE layer to them over QUIC.
The generated text is checked against the single-process forward with the same
expert grouping (bit-identical with the F32 wire). Every process is stopped at
the end, also on Ctrl-C or an error.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import click

from experts.codecs import Codec
from experts.embedded import DEFAULT_PROMPT, EMBEDDED_MODEL
from experts.forward import Backbone, local_moe
from experts.generate import generate
from experts.gguf_model import GGUFModel
from experts.hosting import open_experts
from experts.kernels import Kernel
from experts.moe import Partition, grouped_moe
from experts.tokenizer import Tokenizer
from node.backbone.options import BackboneOptions
from node.backbone.session import backbone_session, wait_for_hosts
from node.cli.options import kernel_options, open_kernel
from node.cli.root import emit_json
from node.cli.streaming import stream_tokens
from node.launcher import LOOPBACK_DATAGRAM, Cluster, start_local_swarm
from node.ledger.store import FILENAME
from node.runtime import data_dir, load_identity
from p2p.identity import Identity


@click.command("demo")
@click.option("--model", "model_path", default=str(EMBEDDED_MODEL), help="GGUF model (default: the embedded one).")
@click.option("--prompt", default=DEFAULT_PROMPT, show_default=True)
@click.option("--tokens", "n_tokens", default=48, show_default=True)
@click.option("--workers", "n_workers", default=3, show_default=True, help="Worker processes; each hosts an equal share of the experts.")
@click.option("--wire", default="f32", show_default=True, type=click.Choice(["f32", "f16", "int8"]))
@click.option("--workdir", default=None, help="Node logs, keys and ledgers (default: a new directory under $MOESWARM_HOME/demo).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON summary instead of streaming text.")
@kernel_options
def demo_cmd(model_path: str, prompt: str, n_tokens: int, n_workers: int, wire: str, workdir: str | None, as_json: bool, kernel_name: str, threads: int | None) -> None:
    """Start a bootstrap node and workers on loopback, generate text through them, compare with the local run."""
    model = GGUFModel(model_path)
    kernel = open_kernel(kernel_name, threads)  # the backbone's; each worker process self-tests its own
    part = Partition.even(model.cfg.n_expert, n_workers)
    root = Path(workdir) if workdir else data_dir(None, "demo") / time.strftime("run-%Y%m%d-%H%M%S")
    with Cluster(root) as cluster:
        say = (lambda *a: None) if as_json else click.echo
        say(f"model {model.path.name}: {model.cfg.arch}, {model.cfg.n_layer} MoE layers, {model.cfg.n_expert} experts top-{model.cfg.n_expert_used}, digest {model.digest[:16]}...")
        boot, workers = start_local_swarm(cluster, model.path, part.bounds, kernel=kernel_name, max_datagram=LOOPBACK_DATAGRAM)
        addr = boot["dht_addrs"][0]
        say(f"bootstrap {boot['peer_id']} at {addr}")
        for w, (a, b) in zip(workers, part.bounds):
            say(f"worker {w['peer_id']} at {w['quic_addr']}: experts {a}-{b - 1} of every layer ({w['load']}, kernel {w['kernel']})")
        backbone_home = data_dir(str(root / "backbone"), "backbone")
        summary = asyncio.run(_run(model, kernel, part, addr, prompt, n_tokens, Codec.parse(wire), load_identity(backbone_home), backbone_home / FILENAME, stream=not as_json))
    summary["workers"] = [{"peer_id": w["peer_id"], "experts": f"{a}-{b - 1}", "path": "direct", "dispatches": summary["per_peer"].get(w["peer_id"], 0)} for w, (a, b) in zip(workers, part.bounds)]
    summary["ledger_paths"] = [w["ledger"] for w in workers] + [str(backbone_home / FILENAME)]
    summary["workdir"] = str(root)
    if as_json:
        emit_json(summary)
    else:
        for w in summary["workers"]:
            click.echo(f"  {w['peer_id']}: {w['dispatches']} dispatches ({w['path']})")
        bpt = summary["bytes_per_token_per_layer"]
        click.echo(f"hosts per layer {summary['hosts_per_layer']}; bytes per token per layer: out {bpt['out']}, back {bpt['back']}; "
                   f"round trip p50 {summary['rtt_ms']['p50']} ms, p99 {summary['rtt_ms']['p99']} ms; failed dispatches {summary['failed_dispatches']}")
        click.echo(f"{summary['tokens']} tokens at {summary['tokens_per_s']} tokens/s; identical to the single-process run: {summary['identical_to_local']}")
        click.echo(f"logs, keys and ledgers in {root}; e.g. moeswarm ledger show --ledger {summary['ledger_paths'][-1]}")
    if not summary["identical_to_local"] and wire == "f32":
        raise SystemExit(1)


async def _run(model: GGUFModel, kernel: Kernel, part: Partition, bootstrap: str, prompt: str, n_tokens: int, codec: Codec, identity: Identity, ledger_path: Path, *, stream: bool) -> dict:
    tok = Tokenizer.from_spec(model.tokenizer_spec)
    bb = Backbone(model, kernel)
    ids = tok.encode(prompt)
    stop = {tok.eos_id}
    async with backbone_session(identity, model, [bootstrap], kernel, BackboneOptions(codec=codec, max_datagram=LOOPBACK_DATAGRAM, ledger_path=ledger_path)) as moe:
        await wait_for_hosts(moe, model.moe_layers, 1, 60)
        out, elapsed, _, _ = await stream_tokens(bb, tok, prompt, n_tokens, moe.hook, stream=stream, culprits=moe.checker.culprits, settle=moe.settle_blocking)
        stats = moe.stats.summary()
    store, _ = open_experts(model, kernel)
    local = [t for t, _ in generate(bb, ids, n_tokens, local_moe(lambda i, x, e, w: grouped_moe(store, part, i, x, e, w)), stop=stop)]
    return {
        "model": str(model.path),
        "model_digest": model.digest,
        "prompt": prompt,
        "tokens": len(out),
        "text": tok.decode(out),
        "identical_to_local": out == local,
        "wire": codec.name.lower(),
        "tokens_per_s": round(len(out) / elapsed, 2),
        **stats,
    }
