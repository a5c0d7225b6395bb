"""Reachability helpers found through the real libp2p DHT on 127.0.0.1, and one answering probes on its QUIC socket."""

from __future__ import annotations

import asyncio

import pytest

from p2p.dht.kademlia import LibP2PDiscovery
from p2p.identity import Identity
from p2p.nat.helpers import NodeReachability, serve_helper
from p2p.quic.endpoint import Endpoint
from tests.support import async_poll

pytestmark = pytest.mark.timeout(90)


async def until_found(node: LibP2PDiscovery, want: set[str], within: float = 20.0) -> set[str]:
    """The helper addresses ``node`` finds, polled until they are ``want`` (or ``within`` s pass)."""

    async def found() -> set[str]:
        return {str(r.quic_addr) for r in await node.lookup_helpers()}

    return await async_poll(found, lambda got: got == want, within)


def test_helpers_announced_in_the_dht_are_found_and_answer_probes():
    """Two helpers (one a bootstrap node) are listed by a third node's lookup, answer its observe requests on their
    UDP sockets, and drop out of the list once withdrawn."""

    async def main():
        boot_id, helper_id, asker_id = (Identity.generate() for _ in range(3))
        async with LibP2PDiscovery(boot_id, listen="127.0.0.1:0") as boot:
            bootstrap = boot.multiaddrs
            async with (
                LibP2PDiscovery(helper_id, listen="127.0.0.1:0", bootstrap=bootstrap, client_mode=True) as dht,
                LibP2PDiscovery(asker_id, listen="127.0.0.1:0", bootstrap=bootstrap, client_mode=True) as asker,
                serve_helper(boot_id, boot, "127.0.0.1", 0) as boot_addr,
            ):
                async with serve_helper(helper_id, dht, "127.0.0.1", 0) as helper_addr:
                    both = await until_found(asker, {boot_addr, helper_addr})
                    endpoint = await Endpoint.bind(asker_id, "127.0.0.1", 0, handler=None)
                    reach = NodeReachability(endpoint, asker)
                    try:
                        reach.start()
                        verdict = await reach.check(wait_helpers=2.0)
                        observers = {o.observer for o in reach.nat.reach.core.observations()}
                    finally:
                        await reach.close()
                        await endpoint.close()
                after = await until_found(asker, {boot_addr})
        return boot_addr, helper_addr, both, after, verdict, observers, endpoint.local_addr

    boot_addr, helper_addr, both, after, verdict, observers, local = asyncio.run(main())
    assert boot_addr and helper_addr and both == {boot_addr, helper_addr}
    assert after == {boot_addr}
    # One IP on loopback: one observer suffices to learn the observed address (the verdict needs two IPs).
    assert len(observers) == 1
    assert verdict.addresses == (("127.0.0.1", local[1]),)
