"""Asking a worker process for partial sums over QUIC, as a backbone would (tests comparing workers bit for bit)."""

from __future__ import annotations

from p2p.identity import Identity, PeerId
from p2p.quic.endpoint import Endpoint
from p2p.wire import messages as wire


async def partial_sums(ready: dict, request: wire.DispatchRequest) -> bytes:
    """The partial sums the worker whose ready file said *ready* answers *request* with, over QUIC."""
    host, _, port = ready["quic_addr"].rpartition(":")
    ep = await Endpoint.bind(Identity.generate(), "127.0.0.1", 0, handler=None)
    try:
        reply = wire.decode(await ep.request((host, int(port)), PeerId.from_string(ready["peer_id"]), request.encode(), timeout=30))
    finally:
        await ep.close()
    assert isinstance(reply, wire.DispatchReply), reply
    return reply.partial
