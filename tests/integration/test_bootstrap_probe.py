"""The bootstrap check before a node loads its model: only a proven other key is "the wrong peer id"; any other
failed handshake (a bootstrap too busy to finish it, another program on the port) is retried, then unreachable."""

from __future__ import annotations

import asyncio

import pytest

from p2p.dht.kademlia import BootstrapUnreachable, _caused_by, probe_bootstrap
from p2p.identity import Identity


class Mismatch(Exception):
    pass


def test_a_cause_is_found_inside_multierrors_and_chains():
    """libp2p reports a wrong key as SwarmDialAllFailedError -> MultiError(errors=[...]) -> ... -> the mismatch."""
    multi = Exception("Error 1: failed to upgrade security")
    try:
        try:
            raise Mismatch("peer id does not correspond to the received pubkey")
        except Mismatch as inner:
            raise RuntimeError("handshake failed when upgrading to secure connection") from inner
    except RuntimeError as upgrade:
        multi.errors = [ValueError("another address"), upgrade]  # type: ignore[attr-defined]
    outer = Exception("unable to connect")
    outer.__cause__ = multi
    assert _caused_by(outer, Mismatch)
    assert not _caused_by(Exception("unable to connect", ValueError("reset")), Mismatch)


def test_a_program_that_drops_every_handshake_is_retried_then_unreachable():
    """A TCP server that accepts and closes at once (as a loaded bootstrap or another program may): the handshake
    fails without a key mismatch, so the probe keeps trying until its deadline and then says unreachable."""

    async def scenario() -> tuple[str, int]:
        accepted = 0

        async def drop(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            nonlocal accepted
            accepted += 1
            writer.close()

        server = await asyncio.start_server(drop, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            with pytest.raises(BootstrapUnreachable) as caught:
                await probe_bootstrap(f"/ip4/127.0.0.1/tcp/{port}/p2p/{Identity.generate().peer_id}", timeout=3.0)
        finally:
            server.close()
            await server.wait_closed()
        return str(caught.value), accepted

    message, accepted = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert "did not finish a libp2p handshake" in message and "not as peer" not in message
    assert accepted >= 4  # each try is a TCP check and a handshake: more than one try
