"""What every benchmark shares: the reference config, exact message sizes, a median timer, its error."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import numpy as np

from experts.codecs import Codec, encoded_size
from experts.errors import UsageError

REFERENCE: dict[str, Any] = dict(arch="qwen3moe", n_layer=1, n_embd=3072, n_head=24, n_head_kv=4, head_dim=128, n_expert=128, n_expert_used=8, n_ff_exp=768)


class BenchmarkError(UsageError):
    """A benchmark could not measure what it was asked to (its message says which option to change)."""


def median_time(fn, repeat: int) -> float:
    """Median seconds of `repeat` calls of `fn`, after one warm-up call."""
    fn()  # warm-up
    samples = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return float(np.median(samples))


def overhead_ms_p50(records: Iterable) -> float:
    """p50 over answered dispatches (probes aside) of round trip minus the worker's own reported time: what a
    dispatch costs beyond the work, per dispatch rather than as a difference of two medians."""
    gaps = [r.latency_ms - r.worker_ms for r in records if r.ok and not r.probe]
    return round(float(np.median(gaps)), 3) if gaps else 0.0


def message_bytes(d: int, k: int, n_tokens: int = 1) -> dict:
    """Exact dispatch message sizes per token per layer, for one worker holding all k experts of a token.

    ``partial_*``: what the protocol sends (one weighted sum per token back). ``raw_*``: the
    baseline of returning every expert's output (k vectors per token), sized with the same framing.
    """
    from p2p.wire import messages as wire

    out = {}
    ids = tuple(range(k)) * n_tokens
    weights = (1.0 / k,) * (k * n_tokens)
    for codec in Codec:
        hidden = b"\0" * encoded_size(codec, n_tokens, d)
        req = wire.DispatchRequest(b"\1" * 16, b"\2" * 16, 0, codec, n_tokens, k, ids, weights, hidden).encode()
        for kind, rows in (("partial", n_tokens), ("raw", n_tokens * k)):
            reply = wire.DispatchReply(b"\1" * 16, codec, n_tokens, b"\0" * encoded_size(codec, rows, d), 0, b"\0" * 72).encode()
            out[f"{kind}_{codec.name.lower()}"] = {"out": len(req) / n_tokens, "back": len(reply) / n_tokens, "total": (len(req) + len(reply)) / n_tokens}
    return out


# The echo side of `udp_round_trip_floor`: a bare asyncio datagram protocol that answers every datagram with
# argv[1] zero bytes, in its own interpreter (so the floor includes a process switch, as a worker's reply does).
_ECHO = """
import asyncio, sys
class Echo(asyncio.DatagramProtocol):
    def connection_made(self, t): self.t = t
    def datagram_received(self, d, a): self.t.sendto(REPLY, a)
REPLY = bytes(int(sys.argv[1]))
async def main():
    t, _ = await asyncio.get_running_loop().create_datagram_endpoint(Echo, local_addr=("127.0.0.1", 0))
    print(t.get_extra_info("sockname")[1], flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the parent closes stdin
asyncio.run(main())
"""


def udp_round_trip_floor(out_bytes: int, back_bytes: int, n: int = 2000, timeout: float = 30.0) -> dict:
    """What the cheapest Python request/reply between two processes on loopback costs at a dispatch's sizes: one
    UDP datagram each way through asyncio, no QUIC, no crypto, no decode, no compute.

    Why: `bench dispatch`'s gap is per-dispatch overhead; this is the part of it no Python transport with asyncio at
    the edges can remove, so the report can say how much of the gap is reachable at all."""
    import asyncio
    import subprocess
    import sys

    async def measure(port: int) -> list[float]:
        loop = asyncio.get_running_loop()

        class Client(asyncio.DatagramProtocol):
            reply: asyncio.Future = loop.create_future()

            def datagram_received(self, data: bytes, addr: object) -> None:
                if not self.reply.done():
                    self.reply.set_result(None)

        transport, client = await loop.create_datagram_endpoint(Client, remote_addr=("127.0.0.1", port))
        payload, samples = bytes(out_bytes), []
        try:
            for _ in range(n + n // 10):  # the first tenth warms up
                client.reply = loop.create_future()
                t = time.perf_counter()
                transport.sendto(payload)
                await asyncio.wait_for(client.reply, 1.0)  # loopback UDP does not drop, but never wait forever
                samples.append(time.perf_counter() - t)
        finally:
            transport.close()
        return samples[n // 10 :]

    echo = subprocess.Popen([sys.executable, "-c", _ECHO, str(back_bytes)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert echo.stdout is not None
        port = int(echo.stdout.readline() or 0)
        if not port:
            raise BenchmarkError("the UDP echo process did not start")
        samples = asyncio.run(asyncio.wait_for(measure(port), timeout))
    finally:
        echo.kill()
        echo.wait()
    ms = np.array(samples) * 1e3
    return {"udp_round_trip_ms_p50": round(float(np.median(ms)), 3), "udp_round_trip_ms_p10": round(float(np.percentile(ms, 10)), 3), "round_trips": len(samples)}
