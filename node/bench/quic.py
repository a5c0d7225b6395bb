"""Round-trip benchmark of the QUIC data path between two processes on loopback.

Compares the two ways to carry messages over a connection:

- ``stream``: what ``p2p.quic.endpoint.Endpoint`` does, one bidirectional stream per request, its end delimiting the message;
- ``framed``: one persistent stream per connection, each message prefixed with its 4-byte length (a variant that
  exists only here, for sequential requests: replies are matched to requests by order).

Usage: ``python -m node.bench.quic [--requests 300] [--sizes 6144,12288] [--datagrams 1200,1452,16384]``.
Prints the median and 90th-percentile round trip and the CPU time per request of the client and of the server process
(steadier than wall time on a busy machine: CPU per round trip is what a transport change moves), per mode, datagram
size and message size. The server's is read from ``/proc`` (Linux; clock ticks, so run a few hundred requests).
Traffic stays on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import statistics
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field

import structlog
from aioquic.quic import events
from aioquic.quic.connection import stream_is_client_initiated

from p2p.identity import Identity, PeerId
from p2p.quic.conn import Conn
from p2p.quic.endpoint import Endpoint

LOOPBACK = "127.0.0.1"
_LENGTH = 4


@dataclass(eq=False)
class _Framing:
    stream_id: int | None = None
    waiters: deque[asyncio.Future[bytes]] = field(default_factory=deque)
    buffers: dict[int, bytearray] = field(default_factory=dict)


class FramedEndpoint(Endpoint):
    """``Endpoint`` with messages framed on one persistent stream per connection (benchmark only)."""

    def _framing(self, conn: Conn) -> _Framing:
        framing: _Framing = conn.__dict__.setdefault("framing", _Framing())
        return framing

    async def _call(self, conn: Conn, payload: bytes) -> bytes:
        framing = self._framing(conn)
        if framing.stream_id is None:
            framing.stream_id = conn.quic.get_next_available_stream_id()
        future: asyncio.Future[bytes] = self._loop.create_future()
        framing.waiters.append(future)
        conn.quic.send_stream_data(framing.stream_id, len(payload).to_bytes(_LENGTH, "big") + payload)
        self._pump(conn)
        return await future

    def _on_stream_data(self, conn: Conn, event: events.StreamDataReceived) -> None:
        framing = self._framing(conn)
        buf = framing.buffers.setdefault(event.stream_id, bytearray())
        buf += event.data
        while len(buf) >= _LENGTH and len(buf) >= _LENGTH + (size := int.from_bytes(buf[:_LENGTH], "big")):
            message = bytes(buf[_LENGTH : _LENGTH + size])
            del buf[: _LENGTH + size]
            if stream_is_client_initiated(event.stream_id) == (conn.expected is not None):  # we opened it: a reply
                framing.waiters.popleft().set_result(message)
            else:
                self._spawn(self._answer(conn, event.stream_id, message))

    async def _answer(self, conn: Conn, stream_id: int, message: bytes) -> None:
        assert self._handler is not None and conn.peer is not None
        reply = await self._handler(conn.peer, message)
        conn.quic.send_stream_data(stream_id, len(reply).to_bytes(_LENGTH, "big") + reply)
        self._pump(conn)


_MODES: dict[str, type[Endpoint]] = {"stream": Endpoint, "framed": FramedEndpoint}


async def _echo(peer: PeerId, data: bytes) -> bytes:
    return data


async def serve(mode: str, datagram: int) -> None:
    """Echo server: prints ``READY <port> <peer id>``, serves until stdin closes."""
    identity = Identity.generate()
    endpoint = await _MODES[mode].bind(identity, LOOPBACK, 0, handler=_echo, max_datagram_size=datagram)
    print("READY", endpoint.local_addr[1], identity.peer_id, flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await endpoint.close()


def process_cpu(pid: int) -> float:
    """CPU seconds (user + system) process ``pid`` has used so far; NaN where ``/proc`` is not there."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime (fields 14, 15)


async def measure(
    mode: str, datagram: int, port: int, peer: PeerId, size: int, requests: int, server_pid: int
) -> tuple[list[float], float, float]:
    """Round-trip times in seconds of ``requests`` sequential size->size requests (after a warm-up), and the
    client's and the server's CPU seconds per request (steadier than wall time on a loaded machine)."""
    client = await _MODES[mode].bind(Identity.generate(), LOOPBACK, 0, handler=None, max_datagram_size=datagram)
    payload = bytes(size)
    try:
        for _ in range(30):
            await client.request((LOOPBACK, port), peer, payload, timeout=10)
        times = []
        cpu, server_cpu = time.process_time(), process_cpu(server_pid)
        for _ in range(requests):
            start = time.perf_counter()
            await client.request((LOOPBACK, port), peer, payload, timeout=10)
            times.append(time.perf_counter() - start)
        return times, (time.process_time() - cpu) / requests, (process_cpu(server_pid) - server_cpu) / requests
    finally:
        await client.close()


def _spawn_server(mode: str, datagram: int) -> tuple[subprocess.Popen[str], int, PeerId]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "node.bench.quic", "--serve", mode, "--datagrams", str(datagram)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("READY"):
            _, port, peer = line.split()
            return proc, int(port), PeerId.from_string(peer)
    raise RuntimeError(f"{mode} server exited before it was ready")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--sizes", default="6144,12288", help="message sizes in bytes (request = reply)")
    parser.add_argument("--datagrams", default="1200,1452,16384", help="max_datagram_size values, set on both ends")
    parser.add_argument("--modes", default="stream,framed")
    parser.add_argument("--serve", choices=sorted(_MODES), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    datagrams = [int(d) for d in args.datagrams.split(",")]
    if args.serve:
        asyncio.run(serve(args.serve, datagrams[0]))
        return
    print(f"{'mode':8} {'datagram':>8} {'size':>7} {'median ms':>10} {'p90 ms':>8} {'client cpu ms':>14} {'server cpu ms':>14}")
    for datagram in datagrams:
        for mode in args.modes.split(","):
            proc, port, peer = _spawn_server(mode, datagram)
            try:
                for size in (int(s) for s in args.sizes.split(",")):
                    times, cpu, server_cpu = asyncio.run(measure(mode, datagram, port, peer, size, args.requests, proc.pid))
                    median, p90 = statistics.median(times), statistics.quantiles(times, n=10)[-1]
                    print(f"{mode:8} {datagram:8} {size:7} {median * 1e3:10.3f} {p90 * 1e3:8.3f} {cpu * 1e3:14.3f} {server_cpu * 1e3:14.3f}")
            finally:
                assert proc.stdin is not None
                proc.stdin.close()
                proc.wait(timeout=10)


if __name__ == "__main__":
    main()
