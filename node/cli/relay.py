"""`moeswarm relay`: run a packet relay for NAT-bound peers (WebSocket over HTTP(S), CDN-friendly)."""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import click

from node.cli.options import http_opt
from node.cli.root import emit_json
from node.runtime import data_dir as node_dir
from node.runtime import load_identity, parse_hostport, until_stopped, write_ready
from node.status.coverage import Phase
from node.status.server import NodeStatus, serve_status
from p2p.identity import Identity
from relay.server import RelayLimits, RelayServer, run_relay
from relay.session import SessionLimits

_PEM = click.Path(exists=True, dir_okay=False)


@click.command("relay")
@click.option("--listen", default="127.0.0.1:3340", show_default=True, help="TCP HOST:PORT for HTTP(S)/WebSocket.")
@click.option("--tls-cert", default=None, type=_PEM, help="PEM certificate (chain): serve https:// and wss://.")
@click.option("--tls-key", default=None, type=_PEM, help="PEM private key for --tls-cert.")
@click.option("--data-dir", default=None, help="Where the relay keeps its key (default ~/.moeswarm/relay).")
@click.option("--ready-file", default=None, help="Write a JSON line with the relay's URL and peer id once it serves.")
@click.option("--bootstrap", multiple=True, help="DHT bootstrap multiaddr (repeatable): also serve as a reachability helper, announced in the DHT.")
@click.option("--quic-listen", default=None, help="With --bootstrap: UDP HOST:PORT answering reachability probes (default: the --listen host and port number, over UDP).")
@click.option("--dht-listen", default=None, help="With --bootstrap: TCP HOST:PORT for the DHT client (default: the --listen host, port 0).")
@click.option("--max-clients", default=1024, show_default=True, type=click.IntRange(min=1), help="WebSocket connections in all; past it the oldest unauthenticated one is closed for a newcomer, and only a relay full of authenticated peers answers 503.")
@click.option("--max-per-ip", default=64, show_default=True, type=click.IntRange(min=0), help="Connections from one remote IP (the same eviction rule); 0: no cap. Behind a reverse proxy every client has the proxy's IP: raise it or use 0.")
@click.option("--auth-timeout", default=10.0, show_default=True, type=click.FloatRange(min=0.5), help="Seconds a connection may take to send its WebSocket handshake, and then to authenticate, before it is closed.")
@http_opt
def relay_cmd(
    listen: str, tls_cert: str | None, tls_key: str | None, data_dir: str | None, ready_file: str | None,
    bootstrap: tuple[str, ...], quic_listen: str | None, dht_listen: str | None, max_clients: int, max_per_ip: int,
    auth_timeout: float, http_addr: str | None,
) -> None:
    """Relay packets between peers that cannot reach each other directly, until Ctrl-C."""
    host, port = parse_hostport(listen)
    if (tls_cert is None) != (tls_key is None):
        raise click.UsageError("give both --tls-cert and --tls-key, or neither")
    if (quic_listen or dht_listen) and not bootstrap:
        raise click.UsageError("--quic-listen and --dht-listen need --bootstrap (the helper is announced in the DHT)")
    helper = None
    if bootstrap:
        quic = parse_hostport(quic_listen) if quic_listen else (host, port)
        helper = (bootstrap, quic, dht_listen or f"{f'[{host}]' if ':' in host else host}:0")
    ident = load_identity(node_dir(data_dir, "relay"))
    limits = RelayLimits(max_clients=max_clients, max_per_ip=max_per_ip, session=SessionLimits(auth_timeout=auth_timeout))
    asyncio.run(_serve(ident, host, port, tls_cert, tls_key, ready_file, helper, parse_hostport(http_addr) if http_addr else None, limits))


async def _serve(
    ident: Identity, host: str, port: int, tls_cert: str | None, tls_key: str | None, ready_file: str | None,
    helper: tuple[tuple[str, ...], tuple[str, int], str] | None, http: tuple[str, int] | None, limits: RelayLimits,
) -> None:
    status = NodeStatus("relay", str(ident.peer_id))
    async with serve_status(http, status):
        await _relay(ident, host, port, tls_cert, tls_key, ready_file, helper, status, limits)


async def _relay(
    ident: Identity, host: str, port: int, tls_cert: str | None, tls_key: str | None, ready_file: str | None,
    helper: tuple[tuple[str, ...], tuple[str, int], str] | None, status: NodeStatus, limits: RelayLimits,
) -> None:
    ready: asyncio.Future[RelayServer] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(run_relay(ident, host, port, tls_cert=tls_cert, tls_key=tls_key, ready=ready, limits=limits))
    waiting: list[asyncio.Future[Any]] = [task, ready]
    await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
    if not ready.done():
        try:
            task.result()
        except OSError as exc:
            raise click.ClickException(f"cannot listen on {host}:{port}: {exc}") from None
    server = ready.result()
    status.relay, status.info, status.phase = server, {"addresses": server.url}, Phase.SERVING
    info = {"url": server.url, "peer_id": str(server.peer_id), **({"http_addr": status.http_addr} if status.http_addr else {})}
    try:
        async with AsyncExitStack() as stack:
            if helper is not None:
                info["quic_addr"] = await stack.enter_async_context(_helper(ident, *helper))
            write_ready(ready_file, info)
            emit_json(info)
            await until_stopped()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def _helper(ident: Identity, bootstrap: tuple[str, ...], quic: tuple[str, int], dht_listen: str):
    """The relay as a reachability helper: a DHT client announcing the UDP socket that answers probes."""
    from p2p.dht.kademlia import LibP2PDiscovery  # libp2p is heavy: imported only for a relay that helps
    from p2p.nat.helpers import serve_helper

    @asynccontextmanager
    async def run():
        async with LibP2PDiscovery(ident, listen=dht_listen, bootstrap=bootstrap, client_mode=True) as dht:
            async with serve_helper(ident, dht, *quic) as addr:
                yield addr

    return run()
