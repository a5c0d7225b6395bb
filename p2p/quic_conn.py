"""What ``p2p.quic.Endpoint`` keeps per connection and per request stream: plain records, no I/O of their own.

Split from ``p2p.quic`` so the endpoint module holds only behaviour; the endpoint alone creates and changes these.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from p2p.identity import PeerId
from p2p.quic_aioquic import AuthQuicConnection
from p2p.quic_errors import Address, TransportError


@dataclass(eq=False)
class Call:
    """A request we sent, waiting for its reply."""

    future: asyncio.Future[bytes]
    data: bytearray = field(default_factory=bytearray)


@dataclass(eq=False)
class Serve:
    """A request we are receiving (``task`` None) or answering; ``refused`` ones only wait for the stream to end."""

    data: bytearray = field(default_factory=bytearray)
    task: asyncio.Task[None] | None = None
    refused: bool = False


@dataclass(eq=False)
class Conn:
    """One QUIC connection: aioquic's state machine, who is on the other end, and our requests on its streams."""

    quic: AuthQuicConnection
    ready: asyncio.Future[None]  # resolves once the peer's certificate is verified
    expected: PeerId | None = None  # the peer id we dialled (None: the peer dialled us)
    peer: PeerId | None = None  # the verified peer id
    failure: TransportError | None = None  # set when the connection starts closing
    close_reason: str = ""
    calls: dict[int, Call] = field(default_factory=dict)
    serves: dict[int, Serve] = field(default_factory=dict)
    cids: set[bytes] = field(default_factory=set)
    timer: asyncio.TimerHandle | None = None
    timer_at: float | None = None

    @property
    def is_client(self) -> bool:
        return self.quic.configuration.is_client

    @property
    def addr(self) -> Address | None:
        return self.quic.get_peer_address()

    def is_local(self, stream_id: int) -> bool:
        return (stream_id & 1) == (0 if self.is_client else 1)


def settle(future: asyncio.Future[Any], *, result: Any = None, error: BaseException | None = None) -> None:
    """Resolve ``future`` unless it already is (a reply may race a failure)."""
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def retrieve(future: asyncio.Future[Any]) -> None:
    """Mark a future's exception as seen: a failed dial nobody waits for is not an error worth a warning."""
    if not future.cancelled():
        future.exception()
