"""Counting the idle WebSocket connections a relay closed (its eviction of unauthenticated peers)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from websockets.asyncio.client import ClientConnection
from websockets.exceptions import ConnectionClosed


async def closed_by_peer(sockets: Iterable[ClientConnection]) -> int:
    """How many of *sockets* the other side has closed: each is drained for 10 ms, so a close frame already sent
    is read and a live connection costs no more than that."""
    closed = 0
    for ws in sockets:
        try:
            async with asyncio.timeout(0.01):
                while True:
                    await ws.recv()
        except (ConnectionClosed, TimeoutError):
            pass
        closed += ws.close_code is not None
    return closed
