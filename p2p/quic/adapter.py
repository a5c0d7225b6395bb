"""The aioquic 1.7.2 adapter under :mod:`p2p.quic.endpoint`: a ``QuicConnection`` that authenticates both sides and
bounds what a peer can make it buffer, plus the import-time checks of the private hooks this needs.

Kept apart from the endpoint so every reliance on aioquic internals sits in one short file (see the pitfalls in
:mod:`p2p.quic.endpoint`'s docstring and docs/FIELD-NOTES.md): the server's client-certificate switch, the unpatched
``QuicStreamSender.get_frame`` (libp2p replaces it process-wide), the stream-window cap, the peer's certificates
and the connection's pending close.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from types import MethodType
from typing import Any

import aioquic.quic.stream
import aioquic.tls
from aioquic.quic.congestion.base import K_GRANULARITY
from aioquic.quic.connection import QuicConnection, QuicConnectionState
from aioquic.quic.events import ConnectionTerminated
from aioquic.tls import Epoch
from cryptography.hazmat.primitives.serialization import Encoding


def _load_pristine_get_frame() -> Callable[..., Any]:
    """aioquic's own ``QuicStreamSender.get_frame``, from a fresh copy of its module.

    Importing libp2p replaces ``QuicStreamSender.get_frame`` for the whole process
    (libp2p/transport/quic/aioquic_compat.py), possibly before this module is imported; re-executing aioquic's
    source gives the unpatched function whatever the import order.
    """
    path = aioquic.quic.stream.__file__
    spec = importlib.util.spec_from_file_location("aioquic.quic._moeswarm_pristine_stream", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot reload aioquic's stream module from {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.QuicStreamSender.get_frame


def _check_aioquic_internals() -> None:
    """Fail at import, not mid-handshake, if aioquic no longer has the private hooks we rely on."""
    hooks = ("_initialize", "_write_application", "_write_ack_frame", "_payload_received", "_write_crypto_frame", "_write_stream_frame", "_write_stream_limits", "_write_connection_limits")
    missing = [name for name in hooks if not hasattr(QuicConnection, name)]
    wanted_state = ("_ack_delay", "_close_event", "_local_max_data", "_local_max_streams_bidi", "_spaces", "_state", "_streams")
    missing += [n for n in wanted_state if n not in QuicConnection.__init__.__code__.co_names]
    names = aioquic.tls.Context.__init__.__code__.co_names
    wanted = ("_request_client_certificate", "_peer_certificate", "_peer_certificate_chain")
    missing += [name for name in wanted if name not in names]
    if missing:
        raise ImportError(f"aioquic {aioquic.__version__} lacks {missing}; p2p.quic.endpoint needs aioquic 1.7.2")


_check_aioquic_internals()
# How long a lone ACK may wait for data to ride on (aioquic: 1 ms; it advertises max_ack_delay 25 ms, which peers add
# to their loss timers, so anything below that is safe). See ``AuthQuicConnection`` for why.
ACK_DELAY = 0.010
_GET_FRAME = _load_pristine_get_frame()


def _pin_get_frame(sender: Any) -> None:
    if "get_frame" not in sender.__dict__:
        sender.get_frame = MethodType(_GET_FRAME, sender)


class AuthQuicConnection(QuicConnection):
    """A ``QuicConnection`` whose server requests a client certificate, whose streams ignore monkey-patches, and
    whose stream receive windows stop at ``window_cap``, whose peer may open at most ``max_streams`` request
    streams at once (aioquic grants 128, each with a window of its own to buffer), and whose connection credit runs
    at most ``conn_window`` bytes ahead of what the peer sent, and whose ACKs ride on the data it sends.

    ACKs. aioquic sends a 1-RTT ACK only once its ``_ack_delay`` (1 ms) has passed since the first unacknowledged
    packet, never with data sent before that. A request/reply exchange thus costs two extra datagrams, each a full
    receive/build/encrypt/send on both ends plus a timer wake-up: the server's lone ACK of the request ~1 ms after it
    replied, and the client's of the reply. That is about a third of aioquic's CPU per round trip at one datagram per
    message. Here an ACK that is due goes out in the next packet that carries stream data (the reply acknowledges the
    request, the next request the previous reply), and a lone ACK of one packet waits ``ACK_DELAY`` for such a
    packet. Once two or more ack-eliciting packets wait, aioquic's own 1 ms applies again (RFC 9000 section 13.2.2
    wants an ACK after two), so a bulk transfer (a slice piece, a message over several datagrams) is acknowledged as
    promptly as before and its congestion window grows as before.
    """

    def __init__(self, *, window_cap: int, max_streams: int, conn_window: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.window_cap = window_cap
        self.conn_window = conn_window
        self._ack_delay = ACK_DELAY
        self._unacked = 0  # ack-eliciting 1-RTT packets received since our last 1-RTT ACK
        self._unacked_since = 0.0  # when the first of them arrived
        self._data_queued = False  # stream data was queued since the last packets were built: an ACK can ride on it
        limit = self._local_max_streams_bidi  # read when the transport parameters are sent; aioquic raises it by
        limit.value = limit.sent = max_streams  # one per finished stream and sends it only when it differs from sent

    def _initialize(self, peer_cid: bytes) -> None:
        super()._initialize(peer_cid)
        self.tls._request_client_certificate = not self._is_client

    def send_stream_data(self, stream_id: int, data: bytes, end_stream: bool = False) -> None:
        super().send_stream_data(stream_id, data, end_stream)
        self._data_queued = True

    def receive_datagram(self, data: bytes, addr: Any, now: float) -> None:
        super().receive_datagram(data, addr, now)
        if self._unacked >= 2 and (space := self._spaces.get(Epoch.ONE_RTT)) is not None and space.ack_at is not None:
            space.ack_at = min(space.ack_at, self._unacked_since + K_GRANULARITY)  # aioquic's own delay

    def _payload_received(self, context: Any, plain: bytes, crypto_frame_required: bool = False) -> tuple[bool, bool]:
        is_ack_eliciting, is_probing = super()._payload_received(context, plain, crypto_frame_required)
        if is_ack_eliciting and context.epoch == Epoch.ONE_RTT:
            if not self._unacked:
                self._unacked_since = context.time
            self._unacked += 1
        return is_ack_eliciting, is_probing

    def _write_application(self, builder: Any, network_path: Any, now: float) -> None:
        if self._data_queued:
            self._data_queued = False
            space = self._spaces.get(Epoch.ONE_RTT)
            if space is not None and space.ack_at is not None:
                space.ack_at = now  # due now: aioquic writes it into the packet that carries the data
        super()._write_application(builder, network_path, now)

    def _write_ack_frame(self, builder: Any, space: Any, now: float) -> None:
        super()._write_ack_frame(builder, space, now)
        if space is self._spaces.get(Epoch.ONE_RTT):
            self._unacked = 0

    def _write_crypto_frame(self, builder: Any, space: Any, stream: Any) -> bool:
        _pin_get_frame(stream.sender)
        return super()._write_crypto_frame(builder, space, stream)

    def _write_stream_frame(self, builder: Any, space: Any, stream: Any, max_offset: int) -> int:
        _pin_get_frame(stream.sender)
        return super()._write_stream_frame(builder, space, stream, max_offset)

    def _write_stream_limits(self, builder: Any, space: Any, stream: Any) -> None:
        """aioquic doubles a stream's window whenever the peer reaches half of it, without end, and fills holes
        in out-of-order data with zeros: a hostile peer could make it allocate ever larger buffers. A window of
        max_message + 1 bytes is all a message needs (the extra byte reveals an oversized one)."""
        receiver, window = stream.receiver, stream.max_stream_data_local
        if not (window and receiver.highest_offset * 2 > window and window * 2 > self.window_cap):
            return super()._write_stream_limits(builder, space, stream)
        stream.max_stream_data_local = max(window, self.window_cap)
        highest, receiver.highest_offset = receiver.highest_offset, 0  # keeps aioquic from doubling the cap
        try:
            super()._write_stream_limits(builder, space, stream)
        finally:
            receiver.highest_offset = highest

    def _write_connection_limits(self, builder: Any, space: Any) -> None:
        """aioquic doubles MAX_DATA whenever the peer used half of it, whatever aioquic itself still holds; with
        holes left on purpose in stream data (aioquic fills them with zeros) a peer could make it allocate without
        bound. Here the credit runs at most ``conn_window`` bytes past what the peer sent, and stops growing while
        aioquic holds more than ``conn_window`` bytes it cannot deliver yet: at most ~2 windows per connection."""
        max_data = self._local_max_data
        if max_data.used * 2 <= max_data.value:
            return super()._write_connection_limits(builder, space)
        if self.held() <= self.conn_window:
            max_data.value = max(max_data.value, min(max_data.value * 2, max_data.used + self.conn_window))
        used, max_data.used = max_data.used, 0  # keeps aioquic from doubling it
        try:
            super()._write_connection_limits(builder, space)
        finally:
            max_data.used = used

    def held(self) -> int:
        """Bytes aioquic holds for the peer's streams that it cannot deliver yet (out-of-order data and holes)."""
        return sum(len(stream.receiver._buffer) for stream in self._streams.values())

    def peer_certificates(self) -> list[bytes]:
        """The DER certificates the peer presented in the handshake (leaf first)."""
        leaf = self.tls._peer_certificate
        if leaf is None:
            return []
        return [c.public_bytes(Encoding.DER) for c in [leaf, *self.tls._peer_certificate_chain]]

    def nothing_decrypted(self) -> bool:
        """Whether no packet of the peer could be decrypted yet: a server connection whose first Initial was junk
        (aioquic keeps such a connection until its idle timeout; the endpoint drops it at once)."""
        return self._state is QuicConnectionState.FIRSTFLIGHT

    def closing(self) -> ConnectionTerminated | None:
        """Why the connection is closing, as soon as either side closes it; None while it is open.

        aioquic sets this at once but emits the ``ConnectionTerminated`` event only after the closing period (3 PTO),
        so pending requests would hang that long; the endpoint fails them as soon as this is set.
        """
        return self._close_event
