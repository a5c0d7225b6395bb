"""Many sybil identities announcing host records that never serve (a test double run as one real process).

Usage: python -m tests.doubles.sybils [--log-level L] --bootstrap ADDR --count N --model-digest HEX --layers 0,1
       --listen IP --quic-addr HOST:PORT [--data-dir D] --ready-file F

Identities are ground so that each of the provider shards of a layer gets ``count / PROVIDER_SHARDS`` of them (an
attacker's first move: 80 fill the 4 x 20 slots libp2p keeps per (model, layer)). Each is its own libp2p DHT client (one trio thread each: libp2p servers only take an ADD_PROVIDER from
the provider itself) and signs a valid record per layer offering every expert at price 0 on ``--quic-addr``, where
nothing answers. Once all are announced it writes the ready file (their peer ids) and waits for SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
from pathlib import Path

from p2p.dht.kademlia import PROVIDER_SHARDS, LibP2PDiscovery, provider_shard
from p2p.dht.records import HostedSlice
from p2p.identity import Identity

PARALLEL = 8  # identities starting and announcing at once (each a libp2p host and a DHT walk)


async def run(args: argparse.Namespace) -> None:
    layers = [int(x) for x in args.layers.split(",")]
    nodes: list[LibP2PDiscovery] = []
    gate = asyncio.Semaphore(PARALLEL)

    async def one(shard: int) -> None:
        identity = Identity.generate()
        while provider_shard(identity.peer_id) != shard:  # 4 tries on average
            identity = Identity.generate()
        node = LibP2PDiscovery(identity, listen=f"{args.listen}:0", bootstrap=[args.bootstrap], client_mode=True)
        async with gate:
            await node.start()
            nodes.append(node)
            slices = [HostedSlice(args.model_digest, layer, ((0, args.n_expert),), quic_addr=args.quic_addr) for layer in layers]
            await asyncio.wait_for(node.announce(slices), 120)

    stopped = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopped.set)
    try:
        await asyncio.gather(*(one(i % PROVIDER_SHARDS) for i in range(args.count)))
        Path(args.ready_file).write_text(json.dumps({"role": "sybils", "peer_ids": [str(n.peer_id) for n in nodes]}))
        await stopped.wait()
    finally:
        await asyncio.gather(*(n.close() for n in nodes), return_exceptions=True)


def main() -> None:
    parser = argparse.ArgumentParser(prog="sybils")
    parser.add_argument("--log-level", default="warning")
    parser.add_argument("--bootstrap", required=True)
    parser.add_argument("--count", type=int, required=True)
    parser.add_argument("--model-digest", required=True)
    parser.add_argument("--n-expert", type=int, required=True)
    parser.add_argument("--layers", required=True)
    parser.add_argument("--listen", required=True)
    parser.add_argument("--quic-addr", required=True)
    parser.add_argument("--data-dir")
    parser.add_argument("--ready-file", required=True)
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
