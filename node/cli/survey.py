"""Looking a swarm up from the command line: wait for its bootstrap, then read its coverage map from the DHT.

Shared by `moeswarm join` (what to host) and `moeswarm status` (what is hosted). The lookups go through a
short-lived DHT client with a throwaway identity: it serves nobody and leaves no record.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Sequence

import click

from experts.errors import UsageError
from experts.gguf_model import GGUFModel
from node.status.coverage import Coverage, build_coverage
from p2p.backoff import Backoff
from p2p.dht import LibP2PDiscovery, probe_bootstrap
from p2p.discovery import DiscoveryError
from p2p.identity import Identity

PROBE_BACKOFF = Backoff(first=0.5, cap=5.0)
PROBE_TIMEOUT = 5.0  # per TCP attempt


def local_address_towards(host: str) -> str:
    """This machine's address on the route to *host*: a connected UDP socket's own address (no packet is sent)."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((host.strip("[]"), 9))
            return str(s.getsockname()[0])
    except OSError as exc:
        raise UsageError(f"no route from this machine to the bootstrap host {host} ({exc.strerror or exc}); check the network, or give --listen HOST:PORT with this machine's address") from None


def wait_for_bootstrap(bootstrap: Sequence[str], wait: float) -> None:
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


async def survey(model: GGUFModel, bootstrap: Sequence[str], dht_listen: str) -> Coverage:
    """The swarm's coverage of *model*: one DHT lookup per layer from a throwaway client."""
    cfg = model.cfg
    try:
        async with LibP2PDiscovery(Identity.generate(), listen=dht_listen, bootstrap=bootstrap, client_mode=True) as dht:
            found = await asyncio.gather(*(dht.lookup(model.digest, layer) for layer in model.moe_layers))
    except DiscoveryError as exc:
        raise UsageError(f"could not join the DHT through {', '.join(bootstrap)}: {exc}; check the peer id in the address (the part after /p2p/)") from None
    return build_coverage(model.digest, cfg.n_layer, cfg.n_expert, dict(zip(model.moe_layers, found, strict=True)), time.time())
