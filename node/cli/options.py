"""Options and value parsers shared by several command families."""

from __future__ import annotations

import click

bootstrap_opt = click.option("--bootstrap", "bootstrap", multiple=True, help="DHT bootstrap multiaddr /ip4/H/tcp/P/p2p/ID (repeatable).")
data_dir_opt = click.option("--data-dir", default=None, help="Where this node keeps its key (default ~/.moeswarm/ROLE).")
http_opt = click.option("--http", "http_addr", default=None, help="HOST:PORT for /healthz, /readyz, /metrics and the /status page (port 0: any free port; default: no HTTP).")
ready_opt = click.option("--ready-file", default=None, help="Write a JSON line with this node's addresses once it serves.")


def parse_size(text: str) -> int:
    """'512M', '2G', '1.5G', '4096' -> bytes."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    try:
        return int(float(t[:-1]) * units[t[-1]]) if t and t[-1] in units else int(t)
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a size such as 512M or 2G") from None
