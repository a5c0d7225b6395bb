"""``p2p.quic.adapter.AuthQuicConnection``'s ACK policy, in memory: a client and a server connection pass datagrams
by hand with a hand-moved clock (aioquic's own test style), so the count of datagrams per request/reply is exact."""

from __future__ import annotations

import ssl

from aioquic.quic import events
from aioquic.quic.configuration import QuicConfiguration

from p2p.identity import Identity
from p2p.quic.adapter import ACK_DELAY, AuthQuicConnection
from p2p.quic.endpoint import ALPN, CID_LENGTH
from p2p.quic.tls import make_certificate

CLIENT_ADDR, SERVER_ADDR = ("10.0.0.1", 1000), ("10.0.0.2", 2000)
SIZE = 12288  # a reference-shape dispatch: one datagram at 16384


def connection(is_client: bool, datagram: int, now: float, **kwargs) -> AuthQuicConnection:
    host = make_certificate(Identity.generate(), now=now)
    config = QuicConfiguration(
        alpn_protocols=[ALPN],
        is_client=is_client,
        certificate=host.certificate,
        private_key=host.private_key,
        verify_mode=ssl.CERT_NONE,
        max_datagram_size=datagram,
        connection_id_length=CID_LENGTH,
    )
    return AuthQuicConnection(window_cap=1 << 24, max_streams=64, conn_window=1 << 24, configuration=config, **kwargs)


class Pair:
    """Two connected ``AuthQuicConnection``s and a count of the 1-RTT datagrams each sent."""

    def __init__(self, datagram: int = 16384) -> None:
        self.now = 1000.0
        self.client = connection(True, datagram, self.now)
        self.client.connect(SERVER_ADDR, now=self.now)
        first = self.client.datagrams_to_send(now=self.now)
        self.server = connection(False, datagram, self.now, original_destination_connection_id=self.client.original_destination_connection_id)
        for data, _ in first:
            self.server.receive_datagram(data, CLIENT_ADDR, now=self.now)
        self.sent = {"client": 0, "server": 0}
        self.flush()
        assert any(isinstance(e, events.HandshakeCompleted) for e in self.drain(self.client))
        self.drain(self.server)
        self.advance(0.1)  # let the handshake's ACKs settle
        self.sent = {"client": 0, "server": 0}

    def flush(self) -> None:
        """Deliver what either side has to send until both are quiet (no loss, no delay)."""
        moved = True
        while moved:
            moved = False
            for name, src, dst, addr in (("client", self.client, self.server, CLIENT_ADDR), ("server", self.server, self.client, SERVER_ADDR)):
                for data, _ in src.datagrams_to_send(now=self.now):
                    self.sent[name] += 1
                    dst.receive_datagram(data, addr, now=self.now)
                    moved = True

    def advance(self, seconds: float) -> None:
        """Move the clock, firing each side's timers on the way."""
        end = self.now + seconds
        while True:
            timers = [t for t in (self.client.get_timer(), self.server.get_timer()) if t is not None and t <= end]
            if not timers:
                break
            self.now = max(self.now, min(timers))
            for conn in (self.client, self.server):
                if (t := conn.get_timer()) is not None and t <= self.now:
                    conn.handle_timer(now=self.now)
            self.flush()
        self.now = end

    @staticmethod
    def drain(conn: AuthQuicConnection) -> list[events.QuicEvent]:
        out = []
        while (event := conn.next_event()) is not None:
            out.append(event)
        return out

    def exchange(self, stream_id: int, think: float) -> bytes:
        """One request and its reply, the server answering ``think`` seconds after the request arrived."""
        self.client.send_stream_data(stream_id, bytes(SIZE), end_stream=True)
        self.flush()
        got = [e for e in self.drain(self.server) if isinstance(e, events.StreamDataReceived)]
        assert sum(len(e.data) for e in got) == SIZE and got[-1].end_stream
        self.advance(think)
        self.server.send_stream_data(stream_id, b"r" * SIZE, end_stream=True)
        self.flush()
        reply = b"".join(e.data for e in self.drain(self.client) if isinstance(e, events.StreamDataReceived))
        return reply


def test_acks_ride_on_requests_and_replies() -> None:
    """Back-to-back request/reply exchanges (the server answering in 2 ms, past aioquic's 1 ms ACK delay) cost one
    datagram each way per exchange: each message carries the ACK of the one before (aioquic alone sends a lone ACK of
    every message, two extra datagrams per round trip)."""
    pair = Pair()
    for i in range(20):
        assert pair.exchange(4 * i, think=0.002) == b"r" * SIZE
        pair.advance(0.002)  # the backbone's forward until its next dispatch
    assert pair.sent == {"client": 20, "server": 20}
    pair.advance(1.0)
    assert pair.sent == {"client": 21, "server": 20}  # the last reply's ACK, alone, within ACK_DELAY


def test_a_lone_ack_still_goes_within_ack_delay() -> None:
    """A peer that sends nothing more gets its ACK after ACK_DELAY, below the 25 ms max_ack_delay aioquic advertises."""
    pair = Pair()
    pair.client.send_stream_data(0, b"x", end_stream=False)
    pair.flush()
    assert pair.sent == {"client": 1, "server": 0}
    pair.advance(ACK_DELAY * 0.9)
    assert pair.sent["server"] == 0
    pair.advance(ACK_DELAY * 0.2)
    assert pair.sent["server"] == 1
    assert ACK_DELAY < 0.025


def test_bulk_data_is_acknowledged_as_promptly_as_before() -> None:
    """Two or more unacknowledged packets get aioquic's own 1 ms delay: a message over many datagrams (1200 bytes
    each) is acknowledged within 1 ms, so its sender's congestion window keeps growing."""
    pair = Pair(datagram=1200)
    pair.client.send_stream_data(0, bytes(SIZE), end_stream=True)
    pair.flush()
    assert pair.sent["client"] >= 2 and pair.sent["server"] == 0  # the first paced burst
    pair.advance(0.0011)
    assert pair.sent["server"] >= 1
