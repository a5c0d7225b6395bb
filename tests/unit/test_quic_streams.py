"""The sans-IO request-per-stream layer (p2p.quic.streams) in memory: two RequestStreams joined by a fake wire that
cuts messages into packets and interleaves streams, with a hand-moved clock. No sockets, no asyncio, no aioquic."""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import cast

import pytest

from p2p.identity import Identity
from p2p.quic.budget import ServeBudget, ServeLimits
from p2p.quic.errors import ConnectionLost, ErrorCode, MessageTooLarge, RemoteError
from p2p.quic.streams import (
    AbortStream,
    CallFailed,
    Event,
    Output,
    ReplyReceived,
    RequestReceived,
    RequestStreams,
    ResetStream,
    SendStream,
    ServeCancelled,
)

CLIENT, SERVER = Identity.generate().peer_id, Identity.generate().peer_id
TIMEOUT = 5.0
ROOMY = ServeLimits(max_streams_per_conn=1024)  # the wire's own tests interleave hundreds of streams (budget: test_budget)


@dataclass(eq=False)
class Side:
    streams: RequestStreams
    events: list[Event] = field(default_factory=list)


@dataclass(frozen=True)
class Packet:
    to: Side
    stream_id: int
    data: bytes = b""
    end_stream: bool = False
    reset: ErrorCode | None = None


class Wire:
    """A client and a server layer; commands become packets of ``chunk`` bytes, one lane per stream, delivered
    round-robin across lanes by ``flush`` at the wire's clock ``now``."""

    def __init__(self, *, client_max: int = 1 << 20, server_max: int = 1 << 20, serving: bool = True, chunk: int = 1000):
        self.now = 0.0
        self.chunk = chunk
        self.client = Side(RequestStreams(SERVER, is_client=True, max_message=client_max, serving=True, stream_timeout=TIMEOUT))
        self.server = Side(
            RequestStreams(CLIENT, is_client=False, max_message=server_max, serving=serving, stream_timeout=TIMEOUT, budget=ServeBudget(ROOMY))
        )
        self.lanes: dict[tuple[int, int], deque[Packet]] = {}

    def peer_of(self, side: Side) -> Side:
        return self.server if side is self.client else self.client

    def emit(self, side: Side, outputs: Sequence[Output]) -> None:
        """Queue ``side``'s commands towards its peer; keep its events."""
        to = self.peer_of(side)
        for out in outputs:
            if isinstance(out, SendStream):
                pieces = [out.data[i : i + self.chunk] for i in range(0, len(out.data), self.chunk)] or [b""]
                for i, piece in enumerate(pieces):
                    self._queue(Packet(to, out.stream_id, piece, out.end_stream and i == len(pieces) - 1))
            elif isinstance(out, ResetStream):
                self._queue(Packet(to, out.stream_id, reset=out.code))
            elif isinstance(out, AbortStream):  # STOP_SENDING and RESET_STREAM: the peer hears of it twice
                self._queue(Packet(to, out.stream_id, reset=out.code))
                self._queue(Packet(to, out.stream_id, reset=out.code))
            else:
                side.events.append(out)

    def flush(self) -> None:
        while self.lanes:
            for key in list(self.lanes):
                lane = self.lanes[key]
                packet = lane.popleft()
                if not lane:
                    del self.lanes[key]
                streams = packet.to.streams
                if packet.reset is not None:
                    self.emit(packet.to, streams.stream_reset(packet.stream_id, packet.reset))
                else:
                    self.emit(packet.to, streams.stream_data(packet.stream_id, packet.data, packet.end_stream, self.now))

    def call(self, payload: bytes, side: Side | None = None) -> int:
        """Send a request from ``side`` (the client); its stream id."""
        side = side or self.client
        stream_id, commands = side.streams.request(payload)
        self.emit(side, commands)
        return stream_id

    def serve(self, answer: Callable[[bytes], bytes], side: Side | None = None) -> None:
        """Answer every request ``side`` (the server) has received, with ``answer(request)``."""
        side = side or self.server
        received = [e for e in side.events if isinstance(e, RequestReceived)]
        side.events = [e for e in side.events if not isinstance(e, RequestReceived)]
        for request in received:
            self.emit(side, side.streams.reply(request.stream_id, answer(request.data)))

    def _queue(self, packet: Packet) -> None:
        self.lanes.setdefault((id(packet.to), packet.stream_id), deque()).append(packet)


def replies(side: Side) -> dict[int, bytes]:
    return {e.stream_id: e.data for e in side.events if isinstance(e, ReplyReceived)}


def failures(side: Side) -> dict[int, Exception]:
    return {e.stream_id: e.error for e in side.events if isinstance(e, CallFailed)}


class Huge:
    """A stand-in for a chunk of data far above any limit: reading its bytes (buffering it) raises."""

    def __len__(self) -> int:
        return 1 << 40


def test_request_reply_round_trip() -> None:
    """A request arrives whole at the server, its reply whole at the client, and neither side keeps any state."""
    wire = Wire()
    sid = wire.call(b"ping" * 1000)
    wire.flush()
    assert wire.server.events == [RequestReceived(sid, b"ping" * 1000)]
    wire.serve(lambda data: data[::-1])
    wire.flush()
    assert wire.client.events == [ReplyReceived(sid, (b"ping" * 1000)[::-1])]
    empty = wire.call(b"")
    wire.flush()
    wire.serve(lambda data: b"")
    wire.flush()
    assert replies(wire.client)[empty] == b""
    assert wire.client.streams.buffered() == wire.server.streams.buffered() == 0
    assert wire.client.streams.get_timer() is None and wire.server.streams.get_timer() is None


def test_many_concurrent_streams_get_their_own_replies() -> None:
    """200 requests of different sizes, interleaved packet by packet, each get their own reply, both ways."""
    rng = random.Random(7)
    wire = Wire(chunk=700)
    payloads = {}
    for _ in range(200):
        payload = rng.randbytes(rng.randrange(0, 9000))
        payloads[wire.call(payload)] = payload
    wire.flush()
    received = {e.stream_id: e.data for e in wire.server.events if isinstance(e, RequestReceived)}
    assert received == payloads
    wire.serve(lambda data: b"re:" + data)
    wire.flush()
    assert replies(wire.client) == {sid: b"re:" + payload for sid, payload in payloads.items()}
    back = wire.call(b"from the server", side=wire.server)
    wire.flush()
    wire.serve(lambda data: data.upper(), side=wire.client)
    wire.flush()
    assert replies(wire.server) == {back: b"FROM THE SERVER"}


def test_oversized_messages_are_refused_before_they_are_buffered() -> None:
    """A request or reply above max_message is refused from its length alone; the stream is stopped, the caller
    told which side refused, and the connection's next message of max_message bytes goes through."""
    wire = Wire(server_max=1000, client_max=2000)
    sid, _ = wire.client.streams.request(b"x" * 1200)  # its bytes reach the server by hand below
    assert wire.server.streams.stream_data(sid, b"x" * 600, False, wire.now) == []
    assert wire.server.streams.buffered() == 600
    refused = wire.server.streams.stream_data(sid, cast(bytes, Huge()), False, wire.now)
    assert refused == [AbortStream(sid, ErrorCode.MESSAGE_TOO_LARGE)]
    assert wire.server.streams.buffered() == 0
    wire.emit(wire.server, refused)
    wire.flush()
    error = failures(wire.client)[sid]
    assert isinstance(error, MessageTooLarge) and "refused" in str(error)

    big = wire.call(b"y" * 1001)  # cut into packets: refused when the second would pass the limit
    wire.flush()
    assert isinstance(failures(wire.client)[big], MessageTooLarge)
    assert not [e for e in wire.server.events if isinstance(e, RequestReceived)]

    ok = wire.call(b"z" * 1000)
    wire.flush()
    assert [e.stream_id for e in wire.server.events if isinstance(e, RequestReceived)] == [ok]
    wire.server.events.clear()
    wire.emit(wire.server, wire.server.streams.reply(ok, b"r" * 1000))
    wire.flush()
    assert replies(wire.client) == {ok: b"r" * 1000}

    reply_sid = wire.call(b"big reply please")
    wire.flush()
    wire.server.events.clear()
    cut = wire.client.streams.stream_data(reply_sid, cast(bytes, Huge()), False, wire.now)
    assert cut[0] == AbortStream(reply_sid, ErrorCode.MESSAGE_TOO_LARGE)
    assert isinstance(cut[1], CallFailed) and "reply from" in str(cut[1].error)
    assert wire.client.streams.buffered() == 0


def test_reply_above_the_servers_limit_is_never_sent() -> None:
    """A handler's reply above the server's own max_message becomes a reset: the caller gets MessageTooLarge."""
    wire = Wire(server_max=100)
    sid = wire.call(b"q")
    wire.flush()
    assert wire.server.streams.reply(sid, b"r" * 101) == [ResetStream(sid, ErrorCode.MESSAGE_TOO_LARGE)]
    assert wire.server.streams.reply(sid, b"r") == []  # answered once only
    wire.emit(wire.server, [ResetStream(sid, ErrorCode.MESSAGE_TOO_LARGE)])
    wire.flush()
    assert isinstance(failures(wire.client)[sid], MessageTooLarge)


def test_a_request_that_never_finishes_is_timed_out() -> None:
    """A request stream that stops before its FIN is reset (CANCELLED) stream_timeout after its last byte; the
    caller sees RemoteError(CANCELLED) and the server keeps nothing."""
    wire = Wire()
    sid, _ = wire.client.streams.request(b"abcdef")  # only part of it reaches the server: truncated
    assert wire.server.streams.stream_data(sid, b"abc", False, now=0.0) == []
    assert wire.server.streams.get_timer() == TIMEOUT
    assert wire.server.streams.stream_data(sid, b"d", False, now=3.0) == []  # data arrived: the wait restarts
    assert wire.server.streams.get_timer() == 3.0 + TIMEOUT
    assert wire.server.streams.handle_timer(now=3.0 + TIMEOUT - 0.001) == []
    expired = wire.server.streams.handle_timer(now=3.0 + TIMEOUT)
    assert expired == [AbortStream(sid, ErrorCode.CANCELLED)]
    assert wire.server.streams.get_timer() is None and wire.server.streams.buffered() == 0
    wire.emit(wire.server, expired)
    wire.flush()
    error = failures(wire.client)[sid]
    assert isinstance(error, RemoteError) and error.code == ErrorCode.CANCELLED
    assert wire.server.streams.stream_data(sid, b"ef", True, now=9.0) == []  # its late end is ignored, not served


def test_a_request_being_answered_has_no_timer() -> None:
    """Once a request is complete the handler may take as long as it likes: no timer runs on the server."""
    wire = Wire()
    sid = wire.call(b"slow")
    wire.flush()
    assert wire.server.streams.get_timer() is None
    wire.now = 1000.0
    assert wire.server.streams.handle_timer(wire.now) == []
    wire.serve(lambda data: b"done")
    wire.flush()
    assert replies(wire.client) == {sid: b"done"}


def test_stream_ids_are_never_reused() -> None:
    """Every request opens a fresh stream id in order (client 0, 4, 8...; server 1, 5, 9...), whether earlier ones
    were answered, cancelled or failed; a late reply on a cancelled stream is ignored."""
    wire = Wire()
    ids = []
    for i in range(30):
        ids.append(wire.call(b"%d" % i))
        if i % 3 == 0:
            wire.emit(wire.client, wire.client.streams.cancel(ids[-1]))
        wire.flush()
        wire.serve(lambda data: data)
        wire.flush()
    assert ids == list(range(0, 120, 4))
    assert sorted(replies(wire.client)) == [sid for i, sid in enumerate(ids) if i % 3]
    cancelled = [e for e in wire.server.events if isinstance(e, ServeCancelled)]
    assert cancelled == [ServeCancelled(sid) for i, sid in enumerate(ids) if i % 3 == 0]  # reset after the FIN
    assert wire.client.streams.stream_data(ids[0], b"late", True, wire.now) == []
    assert [wire.call(b"s", side=wire.server) for _ in range(3)] == [1, 5, 9]


def test_peer_streams_heard_out_of_order_are_served_once() -> None:
    """A peer stream whose first bytes arrive after a later stream's is still a request; an ended one is not again."""
    server = Wire().server.streams
    assert server.stream_data(8, b"third", True, 0.0) == [RequestReceived(8, b"third")]
    assert server.stream_data(0, b"first", True, 0.0) == [RequestReceived(0, b"first")]
    assert server.reply(8, b"ok") == [SendStream(8, b"ok", True)]
    assert server.stream_data(8, b"again", True, 0.0) == []
    assert server.stream_data(0, b"again", True, 0.0) == []
    assert server.stream_data(4, b"second", True, 0.0) == [RequestReceived(4, b"second")]


def test_unknown_stream_ids_are_ignored() -> None:
    """Data or resets on streams we never opened, and answers to requests that do not exist, change nothing."""
    wire = Wire()
    assert wire.client.streams.stream_data(400, b"who?", True, 0.0) == []
    assert wire.client.streams.stream_reset(404, ErrorCode.HANDLER_FAILED) == []
    assert wire.server.streams.stream_reset(401, ErrorCode.CANCELLED) == []
    assert wire.server.streams.reply(401, b"x") == [] and wire.server.streams.refuse(401, ErrorCode.HANDLER_FAILED) == []
    assert wire.client.streams.cancel(400) == []
    assert wire.client.streams.buffered() == wire.server.streams.buffered() == 0


def test_refusals_reach_the_caller_with_their_code() -> None:
    """No handler, a unidirectional stream and a failed handler each reset the stream with their own code."""
    wire = Wire(serving=False)
    sid = wire.call(b"anyone?")
    wire.flush()
    error = failures(wire.client)[sid]
    assert isinstance(error, RemoteError) and error.code == ErrorCode.NO_HANDLER

    wire = Wire()
    assert wire.server.streams.stream_data(2, b"uni", False, 0.0) == [AbortStream(2, ErrorCode.PROTOCOL_VIOLATION)]
    assert wire.server.streams.stream_data(2, b"", True, 0.0) == []
    sid = wire.call(b"fail")
    wire.flush()
    wire.emit(wire.server, wire.server.streams.refuse(sid, ErrorCode.HANDLER_FAILED))
    wire.flush()
    error = failures(wire.client)[sid]
    assert isinstance(error, RemoteError) and error.code == ErrorCode.HANDLER_FAILED


def test_caller_cancelling_an_answered_request_cancels_the_serve() -> None:
    """A request the caller resets while the server answers it reports ServeCancelled; the late reply is dropped."""
    wire = Wire()
    sid = wire.call(b"work")
    wire.flush()
    wire.emit(wire.client, wire.client.streams.cancel(sid))
    wire.flush()
    assert ServeCancelled(sid) in wire.server.events
    assert wire.server.streams.reply(sid, b"too late") == []


def test_close_fails_every_pending_request_at_once() -> None:
    """Closing fails our pending requests with the given error and cancels the serves; nothing is left."""
    wire = Wire()
    mine = [wire.call(b"a"), wire.call(b"b")]
    theirs = wire.call(b"c", side=wire.server)
    wire.flush()
    error = ConnectionLost(SERVER, ("127.0.0.1", 1), "test: closed")
    events = wire.client.streams.close(error)
    assert events == [CallFailed(mine[0], error), CallFailed(mine[1], error), ServeCancelled(theirs)]
    assert wire.client.streams.reply(theirs, b"x") == []
    assert wire.client.streams.stream_data(mine[0], b"late", True, wire.now) == []
    assert wire.client.streams.buffered() == 0


def test_oversized_request_is_refused_locally() -> None:
    """A request above our own max_message raises MessageTooLarge and opens no stream."""
    streams = RequestStreams(SERVER, is_client=True, max_message=10, serving=False, stream_timeout=TIMEOUT)
    with pytest.raises(MessageTooLarge):
        streams.request(b"x" * 11)
    assert streams.request(b"x" * 10)[0] == 0

