"""Relayed vs direct QUIC round trips on loopback, and the relay's CPU per forwarded packet.

``python -m relay.bench [--size 6144] [--n 300]``: a relay and an echo endpoint run in their own processes; this
process calls the echo endpoint directly over UDP and, from a second endpoint (so no connection is shared), through
the relay. The relay's CPU time comes from /proc (Linux), divided by the packets it forwarded for the relayed run.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import structlog

from p2p.identity import Identity, PeerId
from p2p.quic.endpoint import Endpoint

from .client import RelayClient, attach

_RELAY = """
import asyncio, sys
from p2p.identity import Identity
from relay.bench import quiet
from relay.server import run_relay

async def main():
    quiet()
    ready = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(run_relay(Identity.generate(), "127.0.0.1", 0, ready=ready))
    print("READY", (await ready).url, flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    task.cancel()

asyncio.run(main())
"""

_ECHO = """
import asyncio, sys
from p2p.identity import Identity
from p2p.quic.endpoint import Endpoint
from relay.bench import quiet
from relay.client import RelayClient, attach

async def echo(peer, data):
    return data

async def main():
    quiet()
    ident = Identity.generate()
    endpoint = await Endpoint.bind(ident, "127.0.0.1", 0, handler=echo)
    link = RelayClient(ident, sys.argv[1])
    attach(endpoint, link)
    async with link:
        await link.wait_connected(10)
        print("READY", endpoint.local_addr[1], ident.peer_id, flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await endpoint.close()

asyncio.run(main())
"""


def quiet() -> None:
    """Only warnings and errors: results go to stdout, and info logs would interleave with them."""
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))


def _spawn(script: str, *args: str) -> tuple[subprocess.Popen[str], list[str]]:
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root)}
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(script), *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("READY"):
            return proc, line.split()[1:]
    raise RuntimeError("a benchmark process exited before it was ready")


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


async def _round_trips(endpoint: Endpoint, addr: tuple[str, int], peer: PeerId, size: int, n: int) -> list[float]:
    payload = os.urandom(size)
    await endpoint.request(addr, peer, payload, timeout=10)  # handshake outside the timing
    times = []
    for _ in range(n):
        start = time.perf_counter()
        await endpoint.request(addr, peer, payload, timeout=10)
        times.append(time.perf_counter() - start)
    return times


async def bench(size: int, n: int, url: str, relay_pid: int, echo_port: int, echo_peer: PeerId) -> None:
    direct = await Endpoint.bind(Identity.generate(), "127.0.0.1", 0, handler=None)
    times = await _round_trips(direct, ("127.0.0.1", echo_port), echo_peer, size, n)
    print(f"direct  {size} B -> {size} B: median {statistics.median(times) * 1e3:.2f} ms over {n}")
    await direct.close()

    ident = Identity.generate()
    relayed = await Endpoint.bind(ident, "127.0.0.1", 0, handler=None)
    link = RelayClient(ident, url)
    path = attach(relayed, link)
    async with link:
        await link.wait_connected(10)
        addr = path.address(echo_peer)
        await relayed.request(addr, echo_peer, b"warm-up", timeout=10)
        cpu, sent, received = _cpu_seconds(relay_pid), link.sent, link.received
        times = await _round_trips(relayed, addr, echo_peer, size, n)
        cpu = _cpu_seconds(relay_pid) - cpu
        packets = link.sent - sent + link.received - received
    await relayed.close()
    print(f"relayed {size} B -> {size} B: median {statistics.median(times) * 1e3:.2f} ms over {n}")
    print(f"relay CPU: {cpu * 1e6 / packets:.0f} us per forwarded packet ({packets} packets, {cpu:.2f} s)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=6144)
    parser.add_argument("--n", type=int, default=300)
    args = parser.parse_args()
    quiet()
    relay, (url,) = _spawn(_RELAY)
    echo, (port, peer) = _spawn(_ECHO, url)
    try:
        asyncio.run(bench(args.size, args.n, url, relay.pid, int(port), PeerId.from_string(peer)))
    finally:
        for proc in (echo, relay):
            assert proc.stdin is not None
            proc.stdin.close()
            proc.wait(timeout=10)


if __name__ == "__main__":
    main()
