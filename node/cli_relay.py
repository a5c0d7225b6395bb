"""`moeswarm relay`: run a packet relay for NAT-bound peers (WebSocket over HTTP(S), CDN-friendly)."""

from __future__ import annotations

import asyncio

import click

from p2p.identity import Identity
from relay.server import RelayServer, run_relay

from .cli import emit_json, main
from .runtime import data_dir as node_dir
from .runtime import load_identity, parse_hostport, until_stopped, write_ready

_PEM = click.Path(exists=True, dir_okay=False)


@main.command("relay")
@click.option("--listen", default="127.0.0.1:3340", show_default=True, help="TCP HOST:PORT for HTTP(S)/WebSocket.")
@click.option("--tls-cert", default=None, type=_PEM, help="PEM certificate (chain): serve https:// and wss://.")
@click.option("--tls-key", default=None, type=_PEM, help="PEM private key for --tls-cert.")
@click.option("--data-dir", default=None, help="Where the relay keeps its key (default ~/.moeswarm/relay).")
@click.option("--ready-file", default=None, help="Write a JSON line with the relay's URL and peer id once it serves.")
def relay_cmd(
    listen: str, tls_cert: str | None, tls_key: str | None, data_dir: str | None, ready_file: str | None
) -> None:
    """Relay packets between peers that cannot reach each other directly, until Ctrl-C."""
    host, port = parse_hostport(listen)
    if (tls_cert is None) != (tls_key is None):
        raise click.UsageError("give both --tls-cert and --tls-key, or neither")
    ident = load_identity(node_dir(data_dir, "relay"))
    asyncio.run(_serve(ident, host, port, tls_cert, tls_key, ready_file))


async def _serve(
    ident: Identity, host: str, port: int, tls_cert: str | None, tls_key: str | None, ready_file: str | None
) -> None:
    ready: asyncio.Future[RelayServer] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(run_relay(ident, host, port, tls_cert=tls_cert, tls_key=tls_key, ready=ready))
    await asyncio.wait({task, ready}, return_when=asyncio.FIRST_COMPLETED)
    if not ready.done():
        try:
            task.result()
        except OSError as exc:
            raise click.ClickException(f"cannot listen on {host}:{port}: {exc}") from None
    server = ready.result()
    info = {"url": server.url, "peer_id": str(server.peer_id)}
    write_ready(ready_file, info)
    emit_json(info)
    try:
        await until_stopped()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
