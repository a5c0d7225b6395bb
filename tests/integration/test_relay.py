"""The relay over real sockets on 127.0.0.1: HTTP routes, login, forwarding, QUIC through it, abuse, restarts."""

from __future__ import annotations

import asyncio
import base64
import collections
import datetime as dt
import ipaddress
import json
import logging
import math
import os
import random
import signal
import socket
import ssl
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import structlog
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from experts.embedded import EMBEDDED_MODEL
from experts.errors import TrustError
from p2p.identity import Identity, PeerId
from p2p.quic.endpoint import Endpoint
from relay.client import Backoff, RelayClient, RelaySettings, attach
from relay.protocol import (
    SUBPROTOCOL,
    ClientAuth,
    Error,
    RecvPacket,
    Refused,
    SendPacket,
    ServerAuthOk,
    ServerChallenge,
    decode,
)
from relay.server import RelayLimits, RelayServer, tls_context
from relay.session import SessionLimits
from tests.support import async_until, moeswarm, run_bounded, until

ROOT = Path(__file__).resolve().parents[2]
LOOPBACK = "127.0.0.1"
FAST = Backoff(first=0.05, cap=0.5)
pytestmark = pytest.mark.timeout(60)


run = partial(run_bounded, timeout=30.0)
CLIENT_EVENTS = {"relay.connected", "relay.disconnected", "relay.refused", "relay.connect_failed", "relay.client_failed"}


@asynccontextmanager
async def relay(identity: Identity | None = None, port: int = 0, **limits: Any) -> AsyncIterator[RelayServer]:
    server = RelayServer(identity or Identity.generate(), RelayLimits(**limits))
    await server.start(LOOPBACK, port)
    try:
        yield server
    finally:
        await server.close()


@asynccontextmanager
async def clients(url: str, n: int, **options: Any) -> AsyncIterator[list[tuple[RelayClient, asyncio.Queue]]]:
    """``n`` connected RelayClients, each with a queue of the (src, data) packets it received."""
    made = []
    for _ in range(n):
        inbox: asyncio.Queue[tuple[PeerId, bytes]] = asyncio.Queue()
        client = RelayClient(Identity.generate(), url, on_packet=lambda s, d, q=inbox: q.put_nowait((s, d)),
                             backoff=FAST, **options)  # fmt: skip
        client.start()
        made.append((client, inbox))
    try:
        for client, _ in made:
            await client.wait_connected(10)
        yield made
    finally:
        for client, _ in made:
            await client.close()


async def login(url: str, identity: Identity, *, forge: Callable[[ServerChallenge], ClientAuth] | None = None,
                **options: Any) -> tuple[ClientConnection, Any]:  # fmt: skip
    """A hand-driven WebSocket login: the connection and the relay's answer (ServerAuthOk or Refused)."""
    ws = await connect(url, subprotocols=[SUBPROTOCOL], compression=None, **options)
    challenge = decode(await ws.recv())
    assert isinstance(challenge, ServerChallenge)
    auth = forge(challenge) if forge else ClientAuth(identity.peer_id, identity.sign(challenge.signed_message()))
    await ws.send(auth.encode())
    return ws, decode(await ws.recv())


async def http_get(port: int, path: str, tls: ssl.SSLContext | None = None) -> tuple[int, bytes]:
    reader, writer = await asyncio.open_connection(LOOPBACK, port, ssl=tls)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: {LOOPBACK}\r\nConnection: close\r\n\r\n".encode())
    head = await reader.readuntil(b"\r\n\r\n")
    body = await reader.read()
    writer.close()
    return int(head.split()[1]), body


async def echo_with_caller(peer: PeerId, data: bytes) -> bytes:
    return str(peer).encode() + b"|" + data


def test_healthz_and_routes() -> None:
    """/healthz answers 200 ok, other paths 404, and a plain GET of /relay asks for an upgrade (426)."""

    async def scenario() -> None:
        async with relay() as server:
            port = server.address[1]
            assert await http_get(port, "/healthz") == (200, b"ok\n")
            assert (await http_get(port, "/metrics"))[0] == 404
            assert (await http_get(port, "/relay"))[0] == 426

    run(scenario())


def test_forged_logins_are_refused_and_the_real_peer_keeps_its_id() -> None:
    """A wrong signature and a claim to a connected peer's id are refused; the real peer still gets its packets."""

    async def scenario() -> None:
        async with relay() as server, clients(server.url, 2) as [(victim, inbox), (sender, _)]:
            mallory = Identity.generate()
            forgeries = [
                lambda ch: ClientAuth(mallory.peer_id, bytes(64)),  # a wrong signature
                lambda ch: ClientAuth(victim.peer_id, mallory.sign(ch.signed_message())),  # someone else's id
            ]
            for forge in forgeries:
                ws, answer = await login(server.url, mallory, forge=forge)
                assert answer == Refused("signature does not prove the claimed peer id")
                with pytest.raises(ConnectionClosed):
                    await ws.recv()
                assert ws.close_code == 1008
            await async_until(lambda: server.stats.refused == 2)
            assert set(server.clients()) == {victim.peer_id, sender.peer_id}
            sender.send(victim.peer_id, b"still yours")
            assert await inbox.get() == (sender.peer_id, b"still yours")

    run(scenario())


def test_two_clients_exchange_packets_and_learn_of_departures() -> None:
    """Packets flow both ways with the relay-verified source; senders hear PeerGone for absent and departed peers."""

    async def scenario() -> None:
        async with relay() as server, clients(server.url, 2) as [(a, a_in), (b, b_in)]:
            gone: asyncio.Queue[PeerId] = asyncio.Queue()
            a.on_peer_gone = gone.put_nowait
            for i in range(50):
                a.send(b.peer_id, b"a%d" % i)
                b.send(a.peer_id, b"b%d" % i)
            assert [await b_in.get() for _ in range(50)] == [(a.peer_id, b"a%d" % i) for i in range(50)]
            assert [await a_in.get() for _ in range(50)] == [(b.peer_id, b"b%d" % i) for i in range(50)]
            nobody = Identity.generate().peer_id
            a.send(nobody, b"hello?")
            assert await gone.get() == nobody
            await b.close()
            assert await gone.get() == b.peer_id
            assert server.stats.dropped["no_such_peer"] == 1

    run(scenario())


def test_second_connection_replaces_the_first() -> None:
    """A new login for the same peer id closes the old connection; packets go to the new one."""

    async def scenario() -> None:
        async with relay() as server, clients(server.url, 1) as [(sender, _)]:
            me = Identity.generate()
            old, answer = await login(server.url, me)
            assert answer == ServerAuthOk()
            new, answer = await login(server.url, me)
            assert answer == ServerAuthOk()
            assert decode(await old.recv()) == Error("replaced by a newer connection for the same peer id")
            with pytest.raises(ConnectionClosed):
                await old.recv()
            sender.send(me.peer_id, b"to the new one")
            assert decode(await new.recv()) == RecvPacket(sender.peer_id, b"to the new one")
            await new.close()

    run(scenario())


def test_client_cap_answers_503() -> None:
    """Past max_clients connections, the relay answers HTTP 503 instead of upgrading."""

    async def scenario() -> None:
        async with relay(max_clients=2) as server:
            first, _ = await login(server.url, Identity.generate())
            second, _ = await login(server.url, Identity.generate())
            with pytest.raises(InvalidStatus) as info:
                await login(server.url, Identity.generate())
            assert info.value.response.status_code == 503
            await first.close()
            await async_until(lambda: len(server.clients()) == 1)
            third, answer = await login(server.url, Identity.generate())
            assert answer == ServerAuthOk()
            await second.close()
            await third.close()

    run(scenario())


@asynccontextmanager
async def relayed_endpoints(url: str, expected_relay: PeerId | None = None,
                            ) -> AsyncIterator[tuple[Endpoint, Endpoint, Any, Any]]:  # fmt: skip
    """A serving and a calling QUIC endpoint, each with its own RelayClient attached."""
    ids = Identity.generate(), Identity.generate()
    server = await Endpoint.bind(ids[0], LOOPBACK, 0, handler=echo_with_caller, idle_timeout=8)
    caller = await Endpoint.bind(ids[1], LOOPBACK, 0, handler=echo_with_caller, idle_timeout=8)
    links = [RelayClient(i, url, backoff=FAST, expected_relay=expected_relay) for i in ids]
    paths = [attach(endpoint, link) for endpoint, link in zip((server, caller), links, strict=True)]
    for link in links:
        link.start()
    try:
        for link in links:
            await link.wait_connected(10)
        yield server, caller, paths[0], paths[1]
    finally:
        for link in links:
            await link.close()
        await caller.close()
        await server.close()


def test_quic_request_over_the_relay() -> None:
    """An authenticated QUIC request/response between endpoints that reach each other only through the relay."""

    async def scenario() -> None:
        async with relay() as server, relayed_endpoints(server.url) as (serving, caller, serving_path, caller_path):
            vaddr = caller_path.address(serving.peer_id)
            assert vaddr[0] == f"relay:{serving.peer_id}"  # not an IP: the endpoint can only route it to the relay
            payload = os.urandom(6000)
            reply = await caller.request(vaddr, serving.peer_id, payload, timeout=10)
            assert reply == str(caller.peer_id).encode() + b"|" + payload  # the server verified who called
            assert caller.connections() == {serving.peer_id: vaddr}
            assert serving.connections() == {caller.peer_id: serving_path.address(caller.peer_id)}
            back = await serving.request(serving_path.address(caller.peer_id), caller.peer_id, b"back", timeout=10)
            assert back == str(serving.peer_id).encode() + b"|back"
            assert server.stats.forwarded > 0

    run(scenario())


def _bad_websocket_frames(rng: random.Random) -> list[bytes]:
    """Client frames that break RFC 6455 itself (each is sent raw after a valid upgrade)."""
    mask = bytes(4)
    return [
        b"\x82\xff" + (1 << 62).to_bytes(8, "big") + mask,  # absurd 64-bit length
        b"\x82\xfe\xff\xff" + mask + rng.randbytes(100),  # 65535 > max_size
        b"\x82\x05hello",  # unmasked client frame
        b"\x83\x80" + mask,  # reserved opcode
        b"\xc2\x80" + mask,  # RSV1 without an extension
        b"\x81\x82" + mask + b"\xff\xfe",  # text frame that is not UTF-8
        b"\x82\xe4" + mask + rng.randbytes(10),  # length 100, then the client ends its side (last: EOF follows)
    ]


async def _raw_upgrade(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection(LOOPBACK, port)
    key = base64.b64encode(os.urandom(16)).decode()
    writer.write(
        f"GET /relay HTTP/1.1\r\nHost: {LOOPBACK}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n"
        f"Sec-WebSocket-Protocol: {SUBPROTOCOL}\r\n\r\n".encode()
    )
    assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 101")
    return reader, writer


async def _garbage_session(url: str, frames: list[bytes | str], authenticate: bool) -> tuple[int, int | None]:
    """Send ``frames`` (then a text frame, a sure violation) on one connection and wait for the relay to hang up;
    how many frames were sent, and the relay's close code."""
    if authenticate:
        ws, _ = await login(url, Identity.generate())
    else:
        ws = await connect(url, subprotocols=[SUBPROTOCOL], compression=None)
    sent = 0
    try:
        for frame in [*frames, "end"]:
            await ws.send(frame)
            sent += 1
    except ConnectionClosed:
        pass
    await asyncio.wait_for(ws.wait_closed(), 5)
    return sent, ws.close_code


def test_a_thousand_malformed_frames_leave_honest_clients_served(caplog: pytest.LogCaptureFixture) -> None:
    """Random binary, truncated and bit-flipped frames, text frames and broken WebSocket framing: the relay drops
    the offenders and keeps forwarding between honest clients throughout."""
    codes: collections.Counter[int | None] = collections.Counter()

    async def scenario() -> None:
        rng = random.Random(1234)
        async with relay() as server, clients(server.url, 2) as [(a, _), (b, b_in)]:
            stop = asyncio.Event()

            async def honest_traffic() -> int:
                n = 0
                while not stop.is_set():
                    a.send(b.peer_id, b"%d" % n)
                    assert await asyncio.wait_for(b_in.get(), 5) == (a.peer_id, b"%d" % n)
                    n += 1
                return n

            traffic = asyncio.create_task(honest_traffic())
            valid = SendPacket(b.peer_id, b"x" * 40).encode()
            sent = 0
            while sent < 860:
                frames: list[bytes | str] = []
                for _ in range(8):
                    kind = rng.randrange(4)
                    if kind == 0:
                        frames.append(rng.randbytes(rng.randrange(0, 200)))
                    elif kind == 1:
                        frames.append(valid[: rng.randrange(0, 33)])
                    elif kind == 2:
                        flipped = bytearray(valid)
                        flipped[rng.randrange(33)] ^= 1 << rng.randrange(8)  # type or destination
                        frames.append(bytes(flipped))
                    else:
                        frames.append("text " * rng.randrange(1, 20))
                n, code = await _garbage_session(server.url, frames, authenticate=rng.random() < 0.7)
                sent += n
                codes[code] += 1
            for round_ in range(20):
                bad_frames = _bad_websocket_frames(rng)
                for i, bad in enumerate(bad_frames):
                    reader, writer = await _raw_upgrade(server.address[1])
                    writer.write(bad)
                    if round_ % 2 or i == len(bad_frames) - 1:
                        writer.write_eof()
                    await asyncio.wait_for(reader.read(), 5)  # the relay closes the connection
                    writer.close()
                    sent += 1
            assert sent >= 1000
            stop.set()
            exchanged = await traffic
            assert exchanged > 0
            await async_until(lambda: set(server.clients()) == {a.peer_id, b.peer_id})
            async with clients(server.url, 1) as [(late, late_in)]:
                a.send(late.peer_id, b"welcome")
                assert await late_in.get() == (a.peer_id, b"welcome")

    run(scenario(), timeout=40)
    assert set(codes) == {1008}  # every offender closed for a policy violation; 1011 would be a crash
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]  # e.g. "connection handler failed"


def test_a_receiver_that_does_not_read_costs_a_bounded_queue() -> None:
    """Flooding a peer that never reads fills its queue to the cap and no further; the excess is dropped and
    counted, and other peers are still served."""

    async def scenario() -> None:
        fast = SessionLimits(rate_bytes=1e10, burst_bytes=1e10, rate_packets=1e7, burst_packets=1e7)
        caps = {"queue_packets": 32, "queue_bytes": 256 << 10}
        async with relay(session=fast, **caps) as server, clients(server.url, 3) as [(a, _), (c, _), (d, d_in)]:
            sock = socket.create_connection(server.address)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before the kernel tunes it up
            sleeper, answer = await login(server.url, Identity.generate(), sock=sock, max_queue=1)
            assert answer == ServerAuthOk()
            sleeper_id = server.clients()[-1]
            packet = bytes(16000)
            worst = (0, 0)
            for i in range(1500):  # 24 MB: far beyond every buffer on the way
                a.send(sleeper_id, packet)
                if i % 16 == 0:
                    # Not a synchronisation: pacing the flood so the relay reads it while we sample its queue.
                    await asyncio.sleep(0.002)
                    worst = max(worst, server.queued(sleeper_id))
                if server.stats.dropped["queue_full"] > 20:
                    break
            await async_until(lambda: server.stats.dropped["queue_full"] > 20)
            assert worst[0] <= 32 and worst[1] <= 256 << 10
            assert server.queued(sleeper_id)[1] <= 256 << 10
            c.send(d.peer_id, b"unaffected")
            assert await d_in.get() == (c.peer_id, b"unaffected")
            sleeper.transport.abort()

    run(scenario())


def test_relay_restart_clients_reconnect_and_quic_works_again() -> None:
    """Stopping the relay and starting it again on the same port: clients reconnect, QUIC requests flow again."""

    async def scenario() -> None:
        identity = Identity.generate()
        async with relay(identity) as first:
            port, url = first.address[1], first.url
            async with relayed_endpoints(url, expected_relay=identity.peer_id) as (serving, caller, s_path, c_path):
                vaddr = c_path.address(serving.peer_id)
                assert (await caller.request(vaddr, serving.peer_id, b"1", timeout=10)).endswith(b"|1")
                links = [s_path.client, c_path.client]
                await first.close()
                await async_until(lambda: not any(link.connected for link in links))
                async with relay(identity, port=port) as second:
                    for link in links:
                        await link.wait_connected(10)
                    assert set(second.clients()) == {serving.peer_id, caller.peer_id}
                    reply = await caller.request(vaddr, serving.peer_id, b"x" * 6000, timeout=10)
                    assert reply == str(caller.peer_id).encode() + b"|" + b"x" * 6000

    run(scenario())


def _self_signed(directory: Path) -> tuple[str, str]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(x509.NameOID.COMMON_NAME, "relay test")])
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(1)
        .not_valid_before(now - dt.timedelta(minutes=1))
        .not_valid_after(now + dt.timedelta(hours=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(LOOPBACK))]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return str(cert_path), str(key_path)


def test_tls(tmp_path: Path) -> None:
    """With a certificate the relay serves https:// health checks and wss:// clients that trust it (given as a
    context, or as a CA file in RelaySettings); a client with only the system store refuses it for the certificate
    itself, not for anything else."""

    async def scenario() -> None:
        cert, key = _self_signed(tmp_path)
        trust = ssl.create_default_context(cafile=cert)
        server = RelayServer(Identity.generate())
        await server.start(LOOPBACK, 0, tls=tls_context(cert, key))
        try:
            assert server.url.startswith("wss://")
            assert await http_get(server.address[1], "/healthz", tls=trust) == (200, b"ok\n")
            async with clients(server.url, 2, tls=trust) as [(a, _), (b, b_in)]:
                a.send(b.peer_id, b"sealed")
                assert await b_in.get() == (a.peer_id, b"sealed")
                async with RelaySettings(ca_file=Path(cert)).client(Identity.generate(), server.url) as c:
                    await c.wait_connected(10)
                    c.send(b.peer_id, b"by CA file")
                    assert await b_in.get() == (c.peer_id, b"by CA file")
            with structlog.testing.capture_logs() as logs:
                async with RelayClient(Identity.generate(), server.url, backoff=FAST) as refused:  # system CAs only
                    await async_until(lambda: any(e["event"] == "relay.connect_failed" for e in logs))
                    assert not refused.connected
            failures = [e for e in logs if e["event"] in CLIENT_EVENTS]
            assert failures and all(e["event"] == "relay.connect_failed" for e in failures), failures
            assert all("CERTIFICATE_VERIFY_FAILED" in e["error"] for e in failures), failures
        finally:
            await server.close()

    run(scenario())


def test_a_ca_file_that_is_no_certificate_is_refused_in_one_line(tmp_path: Path) -> None:
    """--relay-ca pointing at something other than a PEM certificate is a TrustError naming the file."""
    junk = tmp_path / "ca.pem"
    junk.write_text("not a certificate\n")
    with pytest.raises(TrustError, match="ca.pem as a relay CA"):
        RelaySettings(ca_file=junk).tls()
    result = moeswarm("worker", "--model", str(EMBEDDED_MODEL), "--relay-ca", str(junk), env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and "ca.pem as a relay CA" in result.stderr, result.stderr


@dataclass(frozen=True)
class RecordingBackoff(Backoff):
    """The relay client's backoff, noting which attempt number each wait was for."""

    attempts: list[int] = field(default_factory=list)

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        self.attempts.append(attempt)
        return super().delay(attempt, rng)


def test_reconnect_backoff_starts_over_after_an_accepted_connection() -> None:
    """After an outage of several failed attempts and a reconnection the relay accepted, the next drop waits the
    first delay again, however short the connection was (not the outage's long one)."""

    async def scenario() -> None:
        identity = Identity.generate()
        backoff = RecordingBackoff(first=0.02, cap=0.2, stable_after=math.inf)
        async with relay(identity) as first:
            port = first.address[1]
            async with RelayClient(Identity.generate(), first.url, backoff=backoff) as link:
                await link.wait_connected(10)
                await first.close()
                await async_until(lambda: len(backoff.attempts) >= 5)  # the relay is down: attempts 0, 1, 2, ...
                assert backoff.attempts[:5] == [0, 1, 2, 3, 4]
                async with relay(identity, port=port) as second:
                    await link.wait_connected(10)
                    before = len(backoff.attempts)
                    await second.close()  # at once: the connection lasted far less than any stable_after
                    await async_until(lambda: len(backoff.attempts) > before)
                    assert backoff.attempts[before] == 0

    run(scenario())


@asynccontextmanager
async def cutting_proxy(upstream: tuple[str, int]) -> AsyncIterator[tuple[int, Callable[[], None]]]:
    """A TCP forwarder to ``upstream``: its port, and a function that cuts every connection through it (no
    WebSocket close, no FIN from the relay: what a proxy that dies or restarts does) while it keeps listening."""
    live: set[asyncio.StreamWriter] = set()

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.transport.abort()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(*upstream)
        live.update((writer, up_writer))
        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    def cut() -> None:
        for w in list(live):
            w.transport.abort()
        live.clear()

    server = await asyncio.start_server(handle, LOOPBACK, 0)
    try:
        yield server.sockets[0].getsockname()[1], cut
    finally:
        cut()
        server.close()
        await server.wait_closed()


def test_a_cut_connection_is_logged_as_lost_and_a_relay_close_as_the_relays() -> None:
    """A connection cut in between (a proxy) is "lost without a close from the relay", with no connect failure
    logged when the reconnection succeeds; the relay shutting down is "closed by the relay" with its code."""

    async def scenario() -> None:
        async with relay() as server, cutting_proxy(server.address) as (port, cut):
            url = f"ws://{LOOPBACK}:{port}/relay"
            with structlog.testing.capture_logs() as logs:
                async with RelayClient(Identity.generate(), url, backoff=FAST) as link:
                    await link.wait_connected(10)
                    cut()
                    await async_until(lambda: sum(e["event"] == "relay.connected" for e in logs) == 2)
                    await server.close()
                    await async_until(lambda: sum(e["event"] == "relay.disconnected" for e in logs) == 2)
        events = [e for e in logs if e["event"] in CLIENT_EVENTS]
        names = [e["event"] for e in events]
        assert names[:4] == ["relay.connected", "relay.disconnected", "relay.connected", "relay.disconnected"], names
        assert events[1]["reason"].startswith("connection lost without a close from the relay"), events[1]
        assert events[3]["reason"] == "closed by the relay (code 1001)", events[3]
        assert not [e for e in events if e["event"] == "relay.client_failed"]

    run(scenario())


def test_relay_command_runs_and_stops_on_sigterm(tmp_path: Path) -> None:
    """`moeswarm relay` serves /healthz, reports its URL and peer id, and exits cleanly on SIGTERM."""
    ready = tmp_path / "ready.json"
    code = "import sys; import node.cli.relay; from node.cli.root import main; sys.exit(main())"
    cmd = [sys.executable, "-c", code, "relay", "--listen", f"{LOOPBACK}:0", "--data-dir", str(tmp_path / "d"),
           "--ready-file", str(ready)]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        until(lambda: ready.exists() or proc.poll() is not None, timeout=20, what="relay ready or exited")
        assert ready.exists(), "relay exited or never became ready"
        info = json.loads(ready.read_text())
        assert info["peer_id"] == str(Identity.load_or_create(tmp_path / "d" / "key.pem").peer_id)
        port = int(info["url"].rsplit(":", 1)[1].split("/")[0])
        assert run(http_get(port, "/healthz")) == (200, b"ok\n")
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=10)
        assert proc.returncode == 0
        assert json.loads(out.strip().splitlines()[-1]) == info
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
