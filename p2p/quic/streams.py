"""One request per QUIC stream, sans-IO: stream events in, completed requests/replies and stream commands out.

Like aioquic's ``h0/connection.py``, but owning no ``QuicConnection``: ``p2p.quic.endpoint.Endpoint`` feeds a
``RequestStreams`` (one per verified connection) the stream events aioquic reports, performs the ``SendStream`` /
``ResetStream`` / ``AbortStream`` commands it returns and acts on its events; ``tests/unit/test_quic_streams.py``
drives two of them against each other with a hand-moved clock. No asyncio, no aioquic: time is a parameter.

Protocol. A request is one bidirectional stream opened by the caller: payload, FIN. The reply comes back on the same
stream, FIN, or the stream is reset with an ``ErrorCode`` (handler failed, no handler, too large, cancelled). The
stream's end delimits the message, so there is no framing.

Limits. A message above ``max_message`` is refused (STOP_SENDING + RESET_STREAM, ``MESSAGE_TOO_LARGE``) before its
bytes are buffered. Every request stream is charged to the endpoint's ``p2p.quic.budget.ServeBudget`` (streams and bytes,
per connection and in all) from its first byte until it is answered: a stream the budget refuses is reset
(``OVERLOADED``), and the stalest incomplete streams it evicts to make room are reset the same way
(``StreamsEvicted`` names those of other connections). A request stream that receives nothing for ``stream_timeout``
seconds, or is not complete ``request_deadline`` seconds after its first byte (truncated, or a peer that never
finishes), is reset (``CANCELLED``) by ``handle_timer``; a reply has no such timer, the caller's own timeout ends it
(``cancel``).

aioquic 1.7.2 pitfalls handled here (FIELD-NOTES): stream ids are ours, allocated in order and never reused
(``create_stream`` hands out one id twice); per-stream state is dropped as soon as a stream ends (aioquic's reader
table never forgets a finished stream), and what stays of an ended peer stream is only that its id is below the
peer's next one, so its late data is never taken for a new request; ``close`` fails every pending request at once (aioquic reports the end of a
connection only 3 PTO later, so pending requests would hang until then).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import structlog

from p2p.identity import PeerId
from p2p.quic.budget import Key, ServeBudget
from p2p.quic.errors import ErrorCode, MessageTooLarge, RemoteError, TransportError

log = structlog.get_logger("p2p.quic.endpoint")


# --- commands: what the transport must do ------------------------------------------------------------------------


@dataclass(frozen=True)
class SendStream:
    """Send ``data`` on the stream (opening it if it is new), then FIN if ``end_stream``."""

    stream_id: int
    data: bytes
    end_stream: bool


@dataclass(frozen=True)
class ResetStream:
    """End our sending side of the stream with ``code`` (RESET_STREAM)."""

    stream_id: int
    code: ErrorCode


@dataclass(frozen=True)
class AbortStream:
    """Stop both directions of the stream with ``code`` (STOP_SENDING, and RESET_STREAM if bidirectional)."""

    stream_id: int
    code: ErrorCode


# --- events: what the application must do ------------------------------------------------------------------------


@dataclass(frozen=True)
class RequestReceived:
    """A whole request arrived: answer it with ``reply`` or ``refuse``."""

    stream_id: int
    data: bytes


@dataclass(frozen=True)
class ServeCancelled:
    """Stop answering this request: the caller reset it, or the connection closed."""

    stream_id: int


@dataclass(frozen=True)
class ReplyReceived:
    """The whole reply to our request on this stream."""

    stream_id: int
    data: bytes


@dataclass(frozen=True)
class CallFailed:
    """Our request on this stream failed: refused, reset by the peer, reply too large, or the connection closed."""

    stream_id: int
    error: TransportError


@dataclass(frozen=True)
class StreamsEvicted:
    """The shared budget evicted these streams of *other* connections to make room: call ``evict`` on each owner."""

    victims: tuple[Key, ...]


Command = SendStream | ResetStream | AbortStream
Event = RequestReceived | ServeCancelled | ReplyReceived | CallFailed | StreamsEvicted
Output = Command | Event


def check_request_size(payload: bytes, max_message: int) -> None:
    """Raise ``MessageTooLarge`` for a request this side may not send (checked before any connection is made)."""
    if len(payload) > max_message:
        raise MessageTooLarge(f"request of {len(payload)} bytes exceeds max_message {max_message}")


MAX_GAP = 1024  # peer stream ids skipped at once that we remember as still to come (aioquic allows ~128 open)


@dataclass(eq=False)
class _Incoming:
    """A request stream still arriving."""

    opened: float  # when its first byte arrived
    last: float  # when data last arrived
    data: bytearray = field(default_factory=bytearray)


class RequestStreams:
    """The request streams of one verified connection to ``peer``: ours (calls) and the peer's (serves).

    ``serving`` False refuses every request (``NO_HANDLER``). ``budget`` is shared by every connection of the
    endpoint (a private one if omitted).
    """

    def __init__(
        self,
        peer: PeerId,
        *,
        is_client: bool,
        max_message: int,
        serving: bool,
        stream_timeout: float,
        budget: ServeBudget | None = None,
    ) -> None:
        if max_message < 1 or stream_timeout <= 0:
            raise ValueError("max_message and stream_timeout must be positive")
        self.peer = peer
        self.is_client = is_client
        self.max_message = max_message
        self.serving = serving
        self.stream_timeout = stream_timeout
        self.budget = budget or ServeBudget()
        self._next_id = 0 if is_client else 1  # our bidirectional streams: 0, 4, 8... (client) or 1, 5, 9...
        self._calls: dict[int, bytearray] = {}  # our requests, with the reply so far
        self._incoming: dict[int, _Incoming] = {}
        self._peer_next: dict[int, int] = {}  # per stream type (id & 3): the peer's next unseen stream id
        self._skipped: set[int] = set()  # peer stream ids below that which we have not seen yet
        self._serving: set[int] = set()  # requests handed to the application, not yet answered

    # --- our requests -------------------------------------------------------------------------------------------

    def request(self, payload: bytes) -> tuple[int, list[Command]]:
        """Open a new stream for ``payload``; its id (never used before on this connection) and what to send."""
        check_request_size(payload, self.max_message)
        stream_id, self._next_id = self._next_id, self._next_id + 4
        self._calls[stream_id] = bytearray()
        return stream_id, [SendStream(stream_id, payload, True)]

    def cancel(self, stream_id: int) -> list[Command]:
        """We gave up on our request (the caller's timeout): stop its stream, forget it."""
        if self._calls.pop(stream_id, None) is None:
            return []
        return [AbortStream(stream_id, ErrorCode.CANCELLED)]

    # --- answering the peer's requests --------------------------------------------------------------------------

    def reply(self, stream_id: int, data: bytes) -> list[Command]:
        """Answer a ``RequestReceived``; nothing if it was cancelled meanwhile. A reply above ``max_message`` is
        not sent: the stream is reset with ``MESSAGE_TOO_LARGE``."""
        if len(data) > self.max_message and stream_id in self._serving:
            log.warning("quic.reply_too_large", peer=str(self.peer), size=len(data), limit=self.max_message)
            return self.refuse(stream_id, ErrorCode.MESSAGE_TOO_LARGE)
        if not self._answer(stream_id):
            return []
        return [SendStream(stream_id, bytes(data), True)]

    def refuse(self, stream_id: int, code: ErrorCode) -> list[Command]:
        """Answer a ``RequestReceived`` with a reset (e.g. ``HANDLER_FAILED``); nothing if it was cancelled."""
        return [ResetStream(stream_id, code)] if self._answer(stream_id) else []

    def _answer(self, stream_id: int) -> bool:
        if stream_id not in self._serving:
            return False
        self._serving.discard(stream_id)
        self.budget.release(self, stream_id)
        return True

    def evict(self, stream_id: int) -> list[Command]:
        """The shared budget evicted this incomplete request stream for another connection's: reset it."""
        if self._incoming.pop(stream_id, None) is None:
            return []
        log.warning("quic.request_evicted", peer=str(self.peer), stream=stream_id)
        return [AbortStream(stream_id, ErrorCode.OVERLOADED)]

    # --- inputs from the transport ------------------------------------------------------------------------------

    def stream_data(self, stream_id: int, data: bytes, end_stream: bool, now: float) -> list[Output]:
        """Bytes (and perhaps the FIN) that arrived on a stream."""
        if self._is_local(stream_id):
            return self._reply_data(stream_id, data, end_stream)
        return self._request_data(stream_id, data, end_stream, now)

    def stream_reset(self, stream_id: int, code: int) -> list[Event]:
        """The peer reset the stream or asked us to stop sending on it (RESET_STREAM, STOP_SENDING)."""
        if self._is_local(stream_id):
            if self._calls.pop(stream_id, None) is None:
                return []
            error: TransportError = (
                MessageTooLarge(f"{self.peer} refused the request: it exceeds the peer's max_message")
                if code == ErrorCode.MESSAGE_TOO_LARGE
                else RemoteError(self.peer, code)
            )
            return [CallFailed(stream_id, error)]
        self._incoming.pop(stream_id, None)
        self.budget.release(self, stream_id)
        return [ServeCancelled(stream_id)] if self._answer(stream_id) else []

    def close(self, error: TransportError) -> list[Event]:
        """The connection is closing: every pending request fails with ``error``, every serve is cancelled."""
        out: list[Event] = [CallFailed(sid, error) for sid in self._calls]
        out += [ServeCancelled(sid) for sid in self._serving]
        self._calls.clear()
        self._incoming.clear()
        self._serving.clear()
        self.budget.release_all(self)
        return out

    def get_timer(self) -> float | None:
        """When ``handle_timer`` must run next (the first incomplete request stream to go quiet or late)."""
        return min((self._expiry(s) for s in self._incoming.values()), default=None)

    def handle_timer(self, now: float) -> list[Command]:
        """Reset the request streams that received nothing for ``stream_timeout`` seconds, or are not complete
        ``request_deadline`` seconds after their first byte."""
        out: list[Command] = []
        for sid, incoming in list(self._incoming.items()):
            if self._expiry(incoming) <= now:
                del self._incoming[sid]
                self.budget.release(self, sid)
                log.warning("quic.request_timed_out", peer=str(self.peer), stream=sid, size=len(incoming.data))
                out.append(AbortStream(sid, ErrorCode.CANCELLED))
        return out

    def _expiry(self, incoming: _Incoming) -> float:
        return min(incoming.last + self.stream_timeout, incoming.opened + self.budget.limits.request_deadline)

    def buffered(self) -> int:
        """Bytes held for messages not yet complete (what a peer can make us buffer: at most ``max_message`` per
        stream)."""
        return sum(len(c) for c in self._calls.values()) + sum(len(s.data) for s in self._incoming.values())

    # --- internals ----------------------------------------------------------------------------------------------

    def _is_local(self, stream_id: int) -> bool:
        return (stream_id & 1) == (0 if self.is_client else 1)

    def _reply_data(self, sid: int, data: bytes, end_stream: bool) -> list[Output]:
        reply = self._calls.get(sid)
        if reply is None:  # a request we gave up on, or a stream we never opened
            return []
        if len(reply) + len(data) > self.max_message:
            del self._calls[sid]
            error = MessageTooLarge(f"reply from {self.peer} exceeds max_message {self.max_message}")
            return [AbortStream(sid, ErrorCode.MESSAGE_TOO_LARGE), CallFailed(sid, error)]
        reply += data
        if not end_stream:
            return []
        del self._calls[sid]
        return [ReplyReceived(sid, bytes(reply))]

    def _request_data(self, sid: int, data: bytes, end_stream: bool, now: float) -> list[Output]:
        incoming = self._incoming.get(sid)
        if incoming is None:
            if not self._first_sight(sid):  # a stream that ended already (answered, refused, timed out)
                return []
            if not self.serving:
                return self._refuse_incoming(sid, ErrorCode.NO_HANDLER)
            if sid & 2:  # unidirectional streams carry nothing in our protocol
                return self._refuse_incoming(sid, ErrorCode.PROTOCOL_VIOLATION)
            incoming = self._incoming[sid] = _Incoming(opened=now, last=now)
        if len(incoming.data) + len(data) > self.max_message:
            log.warning("quic.request_too_large", peer=str(self.peer), limit=self.max_message)
            return self._refuse_incoming(sid, ErrorCode.MESSAGE_TOO_LARGE)
        charge = self.budget.charge(self, sid, len(data), now)
        if charge.refused:
            log.warning("quic.overloaded", peer=str(self.peer), stream=sid, reason=charge.refused)
            return self._refuse_incoming(sid, ErrorCode.OVERLOADED)
        out: list[Output] = []
        others = tuple(v for v in charge.evicted if v[0] is not self)
        for _, victim in set(charge.evicted) - set(others):
            out += self.evict(victim)
        if others:
            out.append(StreamsEvicted(others))
        incoming.data += data
        incoming.last = now
        if not end_stream:
            return out
        del self._incoming[sid]
        self._serving.add(sid)
        self.budget.complete(self, sid)
        return [*out, RequestReceived(sid, bytes(incoming.data))]

    def _first_sight(self, sid: int) -> bool:
        """Whether ``sid`` is a peer stream we hear of for the first time, so that an ended stream's late data is
        never taken for a new request. Peers open stream ids in order, so we keep the next id per stream type and
        the (few) skipped ones whose data has not arrived yet, not every id ever used. Past ``MAX_GAP`` skipped ids
        are not remembered: their data is ignored and their callers time out (aioquic refuses such ids first)."""
        kind = sid & 3
        first = self._peer_next.get(kind, kind)
        if sid >= first:
            if sid - first <= 4 * MAX_GAP:
                self._skipped.update(range(first, sid, 4))
            self._peer_next[kind] = sid + 4
            return True
        if sid in self._skipped:
            self._skipped.discard(sid)
            return True
        return False

    def _refuse_incoming(self, sid: int, code: ErrorCode) -> list[Output]:
        self._incoming.pop(sid, None)
        self.budget.release(self, sid)
        return [AbortStream(sid, code)]
