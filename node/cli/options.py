"""Options and value parsers shared by several command families."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import click

if TYPE_CHECKING:
    from node.backbone.options import BackboneOptions
    from relay.client import RelaySettings

# experts.kernels.KERNELS' names, spelled out so that parsing options does not load ggml (tests/unit/test_kernels.py
# checks the two agree).
KERNEL_NAMES = ("ggml", "reference")
DRAFTER_NAMES = ("ngram", "mtp")  # experts.speculative.DRAFTERS, spelled out likewise (tests/unit/test_mtp.py)
ROUTE_REFRESH_S = 3.0  # node.backbone.routing.ROUTE_REFRESH_S, spelled out likewise (tests/unit/test_churn_routing.py)


def model_digest_value(ctx: click.Context | None, param: click.Parameter | None, value: str | None) -> str | None:
    """A ``--model-digest`` callback: 64 hex characters (sha256), lowercased; None stays None."""
    if value is None:
        return None
    digest = value.strip().lower()
    if len(digest) != 64 or not set(digest) <= set("0123456789abcdef"):
        raise click.BadParameter("a model digest is 64 hex characters (sha256)", ctx=ctx, param=param)
    return digest


def kernel_options(command):
    """--kernel and --threads: how this node computes (dense part and experts alike)."""
    command = click.option("--threads", default=None, type=click.IntRange(min=1), help="Threads for the compute kernel (default: every core this process may use).")(command)
    return click.option(
        "--kernel",
        "kernel_name",
        default="ggml",
        show_default=True,
        type=click.Choice(KERNEL_NAMES),
        help="Compute kernel: ggml (llama.cpp's, on the quantized bytes in place) or reference (numpy over float32, portable). Self-tested at start; bit-exact only against nodes with the same kernel.",
    )(command)


def thread_count(threads: int | None) -> int:
    """--threads, or every core this process may use (its CPU affinity, which containers and taskset narrow)."""
    return threads or len(os.sched_getaffinity(0))


def open_kernel(name: str, threads: int | None):
    """The named kernel with ``thread_count(threads)`` threads, self-tested on this machine (KernelError if not)."""
    from experts.kernels import make_kernel

    return make_kernel(name, thread_count(threads))

def bootstrap_opt(command):
    """--bootstrap and --bootstrap-wait: whom to join, and how long to retry them (checked before a model loads)."""
    command = click.option("--bootstrap-wait", default=30.0, show_default=True, type=click.FloatRange(min=0), help="Seconds to retry an unreachable --bootstrap (with backoff) before giving up with an error; checked before the model loads.")(command)
    return click.option("--bootstrap", "bootstrap", multiple=True, help="DHT bootstrap multiaddr /ip4/H/tcp/P/p2p/ID (repeatable), as the bootstrap prints it.")(command)
data_dir_opt = click.option("--data-dir", default=None, help="Where this node keeps its key (default ~/.moeswarm/ROLE).")
http_opt = click.option("--http", "http_addr", default=None, help="HOST:PORT for /healthz, /readyz, /metrics and the /status page (port 0: any free port; default: no HTTP).")
timeout_opt = click.option("--timeout", default=5.0, show_default=True, type=click.FloatRange(min=0, min_open=True), help="Most seconds a dispatch waits for a host; a measured host gets a deadline from its round trips (never more than this).")
route_refresh_opt = click.option("--route-refresh", default=ROUTE_REFRESH_S, show_default=True, type=click.FloatRange(min=0.1), help="Seconds between re-reads of every layer's hosts from the DHT: a worker that joins is used within about this long.")
hedge_opt = click.option("--hedge", is_flag=True, help="When a group's host is late (2x its measured round trip), ask the next replica too and take the first answer (more work for the swarm, a shorter tail).")
drafter_opt = click.option("--drafter", default="ngram", show_default=True, type=click.Choice(DRAFTER_NAMES), help="What proposes speculative drafts: ngram (the model's n-gram table beside it, else prompt lookup) or mtp (the model's own MTP block, run on this node; models with nextn layers).")
ready_opt = click.option("--ready-file", default=None, help="Write a JSON line with this node's addresses once it serves.")


def spot_check_opts(command):
    """``--spot-check`` and ``--verify-all``: how much of the workers' work a backbone re-computes (locally, or on another replica)."""
    from node.backbone.spotcheck import DEFAULT_SPOT_CHECK

    command = click.option("--verify-all", is_flag=True, help="Check every dispatch (as --spot-check 1): each costs a second computation.")(command)
    return click.option("--spot-check", default=DEFAULT_SPOT_CHECK, show_default=True, type=click.FloatRange(0, 1), help="Fraction of dispatches re-computed (locally, or by another replica) to catch workers returning wrong sums; 0 turns checks off.")(command)


def relay_opts(command):
    """``--relay-ca`` and ``--relay-keepalive``: how a node links to ``wss://``/``ws://`` relays. A backbone needs
    them as much as a worker: it learns its workers' relay URLs from their records."""
    command = click.option("--relay-keepalive", default=None, show_default="15", type=click.FloatRange(min=0.5), help="Seconds of silence before pinging a relay; keep it below the idle timeout of any proxy in front of the relay.")(command)
    return click.option("--relay-ca", default=None, type=click.Path(exists=True, dir_okay=False, path_type=Path), help="PEM file of a CA to trust for wss:// relays, besides the system trust store (a relay or TLS proxy with a private certificate).")(command)


def relay_settings(ca_file: Path | None, keepalive: float | None) -> RelaySettings:
    """The options' ``RelaySettings``; a CA file that is no PEM certificate is refused now, before anything starts.
    (Imported here: commands that share this module but link to no relay do not load websockets.)"""
    from relay.client import DEFAULT_KEEPALIVE, RelaySettings

    settings = RelaySettings(ca_file, DEFAULT_KEEPALIVE if keepalive is None else keepalive)
    settings.tls()  # raises TrustError (one line from the CLI)
    return settings


def parse_size(text: str) -> int:
    """'512M', '2G', '1.5G', '4096' -> bytes."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    try:
        return int(float(t[:-1]) * units[t[-1]]) if t and t[-1] in units else int(t)
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a size such as 512M or 2G") from None


listen_opt = click.option("--listen", default="127.0.0.1:0", show_default=True, help="UDP HOST:PORT for QUIC (use this host's address, or a wildcard host, to reach other machines).")
dht_listen_opt = click.option("--dht-listen", default="127.0.0.1:0", show_default=True, help="TCP HOST:PORT for the DHT.")
max_datagram_opt = click.option("--max-datagram", default=1200, show_default=True, type=click.IntRange(1200, 16384), help="QUIC datagram size to send (16384 only on loopback).")
wire_opt = click.option("--wire", default="auto", show_default=True, type=click.Choice(["auto", "f32", "f16", "int8"]), help="auto: f16 once `moeswarm verify --wire f16` passed for the model, else f32.")
max_price_opt = click.option("--max-price", default=None, type=int, help="Never use workers asking more per work unit.")


def backbone_opts(command):
    """Every option of a backbone session (``node.backbone.options.BackboneOptions``), declared once for
    ``backbone generate`` and ``backbone serve``; ``backbone_options`` turns them into the value. The ledger's option
    differs per command (a path, or ``--no-ledger``) and stays with it, as does the kernel (``kernel_options``)."""
    options = [
        wire_opt,
        timeout_opt,
        route_refresh_opt,
        hedge_opt,
        listen_opt,
        dht_listen_opt,
        max_datagram_opt,
        spot_check_opts,
        click.option("--spot-seed", default=None, type=int, hidden=True, help="Seed of the spot-check sample (a reproducible choice of the dispatches checked; for tests)."),
        max_price_opt,
        click.option("--local-experts", default=0, show_default=True, type=click.IntRange(min=0), help="Keep this many of each layer's hottest experts local."),
        click.option("--local-memory", default=None, help="Or: as many hot experts as fit this much RAM, e.g. 2G."),
        click.option("--remote-experts-only", is_flag=True, help="Compute no routed expert here (a model whose experts do not fit this machine): no local fallback; spot checks re-ask another replica."),
        relay_opts,
    ]
    for option in reversed(options):
        command = option(command)
    return command


def backbone_options(model_digest: str, ledger_path: Path | None, *, wire: str, timeout: float, route_refresh: float, hedge: bool, listen: str, dht_listen: str, max_datagram: int, spot_check: float, verify_all: bool, spot_seed: int | None, max_price: int | None,
                     local_experts: int, local_memory: str | None, remote_experts_only: bool, relay_ca: Path | None, relay_keepalive: float | None) -> BackboneOptions:
    """The ``BackboneOptions`` that ``backbone_opts``' values say, checked now (a bad size, CA file or combination is
    a one-line error before anything starts)."""
    from experts.codecs import Codec
    from node.backbone.options import BackboneOptions
    from node.runtime import parse_hostport
    from node.verdicts import default_wire

    return BackboneOptions(
        codec=default_wire(model_digest) if wire == "auto" else Codec.parse(wire),
        listen=parse_hostport(listen),
        dht_listen=dht_listen,
        timeout=timeout,
        max_datagram=max_datagram,
        spot_check=1.0 if verify_all else spot_check,
        spot_seed=spot_seed,
        ledger_path=ledger_path,
        max_price=max_price,
        local_experts=local_experts,
        local_memory=parse_size(local_memory) if local_memory else None,
        hold_experts=not remote_experts_only,
        relay=relay_settings(relay_ca, relay_keepalive),
        route_refresh=route_refresh,
        hedge=hedge,
    )
