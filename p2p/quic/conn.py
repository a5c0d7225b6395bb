"""What ``p2p.quic.endpoint.Endpoint`` keeps per connection: a plain record, no I/O of its own.

Split from ``p2p.quic.endpoint`` so the endpoint module holds only behaviour; the endpoint alone creates and changes these.
The request bookkeeping on the connection's streams is the sans-IO ``p2p.quic.streams.RequestStreams``; the record
holds only what ties it to asyncio (the caller's futures and the handler's tasks).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from p2p.identity import PeerId
from p2p.quic.adapter import AuthQuicConnection
from p2p.quic.errors import Address, TransportError
from p2p.quic.streams import RequestStreams


@dataclass(eq=False)
class Conn:
    """One QUIC connection: aioquic's state machine, who is on the other end, and the requests on its streams."""

    quic: AuthQuicConnection
    ready: asyncio.Future[None]  # resolves once the peer's certificate is verified
    expected: PeerId | None = None  # the peer id we dialled (None: the peer dialled us)
    peer: PeerId | None = None  # the verified peer id
    failure: TransportError | None = None  # set when the connection starts closing
    close_reason: str = ""
    streams: RequestStreams | None = None  # made once the peer is verified
    calls: dict[int, asyncio.Future[bytes]] = field(default_factory=dict)  # our requests, by stream id
    serves: dict[int, asyncio.Task[None]] = field(default_factory=dict)  # the handler answering each request
    cids: set[bytes] = field(default_factory=set)
    timer: asyncio.TimerHandle | None = None
    timer_at: float | None = None

    @property
    def is_client(self) -> bool:
        return self.quic.configuration.is_client

    @property
    def addr(self) -> Address | None:
        return self.quic.get_peer_address()


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
