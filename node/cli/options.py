"""Options and value parsers shared by several command families."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import click

if TYPE_CHECKING:
    from relay.client import RelaySettings

bootstrap_opt = click.option("--bootstrap", "bootstrap", multiple=True, help="DHT bootstrap multiaddr /ip4/H/tcp/P/p2p/ID (repeatable).")
data_dir_opt = click.option("--data-dir", default=None, help="Where this node keeps its key (default ~/.moeswarm/ROLE).")
ready_opt = click.option("--ready-file", default=None, help="Write a JSON line with this node's addresses once it serves.")


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
