"""The QUIC data path over real UDP sockets on 127.0.0.1: round trips, authentication, limits, failures, reuse."""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import pytest
import structlog
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec

from p2p.identity import Identity, PeerId
from p2p.quic import endpoint as quic
from p2p.quic import tls
from p2p.quic.adapter import AuthQuicConnection
from p2p.quic.endpoint import Endpoint, ErrorCode
from p2p.quic.events import EndpointEvent, PathClosed, PathOpened

ROOT = Path(__file__).resolve().parents[2]
LOOPBACK = "127.0.0.1"


async def until(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    """Wait for ``condition`` to hold, looking again every 20 ms."""
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.02)


def run(coro: Awaitable[Any], timeout: float = 20.0) -> Any:
    async def bounded() -> Any:
        async with asyncio.timeout(timeout):
            return await coro

    return asyncio.run(bounded())


async def echo_with_caller(peer: PeerId, data: bytes) -> bytes:
    """Reply with the caller's verified peer id and the request, so tests see what the server learned."""
    return str(peer).encode() + b"|" + data


@asynccontextmanager
async def endpoints(
    server_handler: quic.Handler | None = echo_with_caller, **options: Any
) -> AsyncIterator[tuple[Endpoint, Endpoint]]:
    """A serving endpoint and a dialling endpoint (which also serves, by echo), closed afterwards."""
    server = await Endpoint.bind(Identity.generate(), LOOPBACK, 0, handler=server_handler, **options)
    client = await Endpoint.bind(Identity.generate(), LOOPBACK, 0, handler=echo_with_caller, **options)
    try:
        yield server, client
    finally:
        await client.close()
        await server.close()


@contextmanager
def spawn_server(mode: str) -> Iterator[tuple[tuple[str, int], PeerId, subprocess.Popen[str]]]:
    """An echo server in another process; a request of b"die" makes it exit without a word."""
    script = textwrap.dedent(
        """
        import asyncio, os, sys
        from p2p.identity import Identity
        from p2p.quic.endpoint import Endpoint

        async def handler(peer, data):
            if data == b"die":
                os._exit(0)
            return data

        async def main():
            ident = Identity.generate()
            endpoint = await Endpoint.bind(ident, "127.0.0.1", 0, handler=handler)
            print("READY", endpoint.local_addr[1], ident.peer_id, flush=True)
            await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
            await endpoint.close()

        asyncio.run(main())
        """
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-c", script, mode], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("READY"):
                _, port, peer = line.split()
                break
        else:
            raise RuntimeError("server process exited before it was ready")
        yield (LOOPBACK, int(port)), PeerId.from_string(peer), proc
    finally:
        if proc.poll() is None:
            assert proc.stdin is not None
            proc.stdin.close()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def impostor_certificate(victim: Identity, now: float) -> tls.HostCertificate:
    """Victim's genuine libp2p extension, copied onto a certificate for the impostor's own key."""
    genuine = tls.make_certificate(victim, now=now).certificate.extensions.get_extension_for_oid(tls.EXTENSION_OID)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(x509.NameOID.COMMON_NAME, "impostor")])
    cert = (
        x509.CertificateBuilder()
        .serial_number(7)
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .not_valid_before(dt.datetime.fromtimestamp(now - 60, dt.timezone.utc))
        .not_valid_after(dt.datetime.fromtimestamp(now + 3600, dt.timezone.utc))
        .add_extension(genuine.value, critical=True)
        .sign(key, hashes.SHA256())
    )
    return tls.HostCertificate(cert, key, victim.peer_id)


async def bind_impostor(
    monkeypatch: pytest.MonkeyPatch, victim: Identity, handler: quic.Handler | None
) -> Endpoint:
    with monkeypatch.context() as patch:
        patch.setattr(quic, "make_certificate", lambda identity, now: impostor_certificate(victim, now))
        return await Endpoint.bind(Identity.generate(), LOOPBACK, 0, handler=handler)


def test_one_byte_round_trip_and_server_learns_caller() -> None:
    """One byte (and then zero) goes out and comes back; the server's handler gets the client's verified peer id."""

    async def scenario() -> None:
        async with endpoints() as (server, client):
            reply = await client.request(server.local_addr, server.peer_id, b"x", timeout=5)
            assert reply == str(client.peer_id).encode() + b"|x"
            empty = await client.request(server.local_addr, server.peer_id, b"", timeout=5)
            assert empty == str(client.peer_id).encode() + b"|"

    run(scenario())


def test_one_megabyte_round_trip() -> None:
    """A 1 MiB request and its 1 MiB reply arrive intact at the default datagram size."""
    payload = os.urandom(1 << 20)

    async def scenario() -> None:
        async with endpoints() as (server, client):
            reply = await client.request(server.local_addr, server.peer_id, payload, timeout=15)
            assert reply == str(client.peer_id).encode() + b"|" + payload

    run(scenario())


def test_concurrent_requests_get_their_own_replies() -> None:
    """64 requests of different sizes sent at once, before any connection exists, share one dial and each get
    their own reply."""
    payloads = [os.urandom(1 + 997 * i) for i in range(64)]

    async def scenario() -> list[dict[str, Any]]:
        with structlog.testing.capture_logs() as logs:
            async with endpoints(max_datagram_size=16384) as (server, client):
                replies = await asyncio.gather(
                    *(client.request(server.local_addr, server.peer_id, p, timeout=15) for p in payloads)
                )
                prefix = str(client.peer_id).encode() + b"|"
                assert replies == [prefix + p for p in payloads]
        return logs

    logs = run(scenario())
    assert len([e for e in logs if e["event"] == "quic.connected"]) == 2  # one dial shared by all 64


def test_persistent_connection_is_reused_both_ways() -> None:
    """Many requests, in both directions, cost one handshake: each side logs quic.connected exactly once."""

    async def scenario() -> list[dict[str, Any]]:
        with structlog.testing.capture_logs() as logs:
            async with endpoints() as (server, client):
                for i in range(20):
                    await client.request(server.local_addr, server.peer_id, b"%d" % i, timeout=5)
                back = await server.request(client.local_addr, client.peer_id, b"back", timeout=5)
                assert back == str(server.peer_id).encode() + b"|back"
        return logs

    logs = run(scenario())
    connected = [e for e in logs if e["event"] == "quic.connected"]
    assert sorted(e["role"] for e in connected) == ["client", "server"]
    assert len([e for e in logs if e["event"] == "quic.closed"]) == 2


def test_keepalive_holds_connection_past_idle_timeout() -> None:
    """With keepalive PINGs a quiet connection outlives the idle timeout and is reused, not re-dialled."""

    async def scenario() -> list[dict[str, Any]]:
        with structlog.testing.capture_logs() as logs:
            async with endpoints(idle_timeout=0.6) as (server, client):
                await client.request(server.local_addr, server.peer_id, b"a", timeout=5)
                await asyncio.sleep(1.5)
                await client.request(server.local_addr, server.peer_id, b"b", timeout=5)
        return logs

    logs = run(scenario())
    assert len([e for e in logs if e["event"] == "quic.connected"]) == 2


def test_wrong_expected_peer_id_is_refused() -> None:
    """Dialling a real server while expecting another peer id fails with PeerAuthError naming both ids."""
    calls: list[bytes] = []

    async def handler(peer: PeerId, data: bytes) -> bytes:
        calls.append(data)
        return data

    async def scenario() -> None:
        async with endpoints(handler) as (server, client):
            someone_else = Identity.generate().peer_id
            with pytest.raises(quic.PeerAuthError) as info:
                await client.request(server.local_addr, someone_else, b"hello", timeout=5)
            assert str(someone_else) in str(info.value) and str(server.peer_id) in str(info.value)
            assert client.connections() == {}
            # the right id still works
            assert await client.request(server.local_addr, server.peer_id, b"ok", timeout=5) == b"ok"
        assert calls == [b"ok"]

    run(scenario())


def test_impostor_server_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """A server presenting the victim's extension on its own certificate key cannot pass as the victim."""
    victim = Identity.generate()

    async def scenario() -> None:
        impostor = await bind_impostor(monkeypatch, victim, echo_with_caller)
        client = await Endpoint.bind(Identity.generate(), LOOPBACK, 0, handler=None)
        try:
            with pytest.raises(quic.PeerAuthError, match="did not sign"):
                await client.request(impostor.local_addr, victim.peer_id, b"secret", timeout=5)
        finally:
            await client.close()
            await impostor.close()

    run(scenario())


def test_impostor_client_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """A client presenting the victim's extension on its own key is refused before its request is read."""
    victim = Identity.generate()
    calls: list[PeerId] = []

    async def handler(peer: PeerId, data: bytes) -> bytes:
        calls.append(peer)
        return data

    async def scenario() -> None:
        server = await Endpoint.bind(Identity.generate(), LOOPBACK, 0, handler=handler)
        impostor = await bind_impostor(monkeypatch, victim, None)
        try:
            with pytest.raises(quic.PeerAuthError, match="refused our certificate"):
                await impostor.request(server.local_addr, server.peer_id, b"pay me", timeout=5)
            assert server.connections() == {}
        finally:
            await impostor.close()
            await server.close()

    run(scenario())
    assert calls == []


def test_client_without_certificate_is_refused() -> None:
    """aioquic lets a client answer the certificate request with none; our server refuses such a client."""

    async def scenario() -> None:
        async with endpoints() as (server, client):
            client._configs[True].certificate = None  # reach in: a well-behaved Endpoint always has one
            client._configs[True].private_key = None
            with pytest.raises(quic.PeerAuthError, match="refused our certificate: peer presented 0 certificates"):
                await client.request(server.local_addr, server.peer_id, b"hi", timeout=5)

    run(scenario())


def test_oversized_request_is_refused_locally() -> None:
    """A request above our own max_message is refused before anything is sent."""

    async def scenario() -> None:
        async with endpoints(max_message=1000) as (server, client):
            with pytest.raises(quic.MessageTooLarge):
                await client.request(server.local_addr, server.peer_id, b"x" * 1001, timeout=5)
            assert client.connections() == {}

    run(scenario())


def test_peer_refuses_request_above_its_max_message() -> None:
    """A server with a smaller max_message resets the stream; its handler never runs; the connection lives on."""
    sizes: list[int] = []

    async def handler(peer: PeerId, data: bytes) -> bytes:
        sizes.append(len(data))
        return b"ok"

    async def scenario() -> None:
        server = await Endpoint.bind(Identity.generate(), LOOPBACK, 0, handler=handler, max_message=10_000)
        client = await Endpoint.bind(Identity.generate(), LOOPBACK, 0, handler=None)
        try:
            with pytest.raises(quic.MessageTooLarge, match="refused"):
                await client.request(server.local_addr, server.peer_id, b"x" * 200_000, timeout=5)
            assert await client.request(server.local_addr, server.peer_id, b"x" * 10_000, timeout=5) == b"ok"
        finally:
            await client.close()
            await server.close()

    run(scenario())
    assert sizes == [10_000]


def test_receive_windows_stop_at_max_message(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stream's receive window grows to max_message + 1 and no further (aioquic alone doubles it without end)."""
    windows: list[int] = []
    write_limits = AuthQuicConnection._write_stream_limits

    def recording(self: AuthQuicConnection, builder: Any, space: Any, stream: Any) -> None:
        write_limits(self, builder, space, stream)
        if not self.configuration.is_client:
            windows.append(stream.max_stream_data_local)

    monkeypatch.setattr(AuthQuicConnection, "_write_stream_limits", recording)
    payload = os.urandom(1_400_000)

    async def scenario() -> None:
        async with endpoints(max_message=1_500_000) as (server, client):
            reply = await client.request(server.local_addr, server.peer_id, payload, timeout=15)
            assert reply.endswith(payload)

    run(scenario())
    assert max(windows) == 1_500_001


def test_reply_above_either_limit_is_refused() -> None:
    """A reply above the client's limit is cut off at the client; one above the server's is never sent."""

    async def big(peer: PeerId, data: bytes) -> bytes:
        return b"r" * int(data)

    async def scenario() -> None:
        server = await Endpoint.bind(Identity.generate(), LOOPBACK, 0, handler=big, max_message=100_000)
        client = await Endpoint.bind(Identity.generate(), LOOPBACK, 0, handler=None, max_message=20_000)
        try:
            with pytest.raises(quic.MessageTooLarge, match="reply from"):
                await client.request(server.local_addr, server.peer_id, b"50000", timeout=5)
            with pytest.raises(quic.MessageTooLarge, match="refused"):
                await client.request(server.local_addr, server.peer_id, b"150000", timeout=5)
            assert await client.request(server.local_addr, server.peer_id, b"20000", timeout=5) == b"r" * 20_000
            assert await client.request(server.local_addr, server.peer_id, b"0", timeout=5) == b""
        finally:
            await client.close()
            await server.close()

    run(scenario())


def test_handler_failure_and_missing_handler_reset_the_stream() -> None:
    """A handler that raises gives the caller RemoteError(HANDLER_FAILED); an endpoint without one, NO_HANDLER."""

    async def broken(peer: PeerId, data: bytes) -> bytes:
        raise RuntimeError("boom")

    async def scenario() -> None:
        async with endpoints(broken) as (server, client):
            with pytest.raises(quic.RemoteError) as info:
                await client.request(server.local_addr, server.peer_id, b"x", timeout=5)
            assert info.value.code == ErrorCode.HANDLER_FAILED
        async with endpoints(None) as (server, client):
            with pytest.raises(quic.RemoteError) as info:
                await client.request(server.local_addr, server.peer_id, b"x", timeout=5)
            assert info.value.code == ErrorCode.NO_HANDLER

    run(scenario())


def test_timeout_raises_and_cancels_the_remote_handler() -> None:
    """A slow handler makes request raise TransportTimeout, and the server's handler is cancelled."""

    async def scenario() -> None:
        stopped = asyncio.Event()

        async def stuck(peer: PeerId, data: bytes) -> bytes:
            try:
                await asyncio.Event().wait()
            finally:
                stopped.set()
            return b""

        async with endpoints(stuck) as (server, client):
            with pytest.raises(quic.TransportTimeout):
                await client.request(server.local_addr, server.peer_id, b"x", timeout=0.3)
            await asyncio.wait_for(stopped.wait(), 5)
            assert list(client.connections()) == [server.peer_id]

    run(scenario())


def test_nobody_listening_times_out() -> None:
    """Dialling a port where nothing answers raises TransportTimeout."""

    async def scenario() -> None:
        async with endpoints() as (server, client):
            silent = await Endpoint.bind(Identity.generate(), LOOPBACK, 0, handler=None)
            addr, peer = silent.local_addr, silent.peer_id
            await silent.close()
            with pytest.raises(quic.TransportTimeout):
                await client.request(addr, peer, b"x", timeout=0.5)

    run(scenario())


def test_server_killed_mid_request_fails_promptly() -> None:
    """When the server process dies mid-request the request fails with ConnectionLost naming the peer,
    from the idle timeout, long before the request's own timeout."""
    with spawn_server("echo") as (addr, peer, proc):

        async def scenario() -> None:
            client = await Endpoint.bind(Identity.generate(), LOOPBACK, 0, handler=None, idle_timeout=1.0)
            try:
                assert await client.request(addr, peer, b"alive?", timeout=10) == b"alive?"
                with pytest.raises(quic.ConnectionLost) as info:
                    await client.request(addr, peer, b"die", timeout=60)
                assert info.value.peer == peer and str(peer) in str(info.value)
                assert client.connections() == {}
            finally:
                await client.close()

        run(scenario(), timeout=60)
        assert proc.wait(timeout=5) == 0


def test_local_close_fails_pending_requests() -> None:
    """Closing the endpoint fails its pending requests with ConnectionLost instead of leaving them hanging."""

    started = asyncio.Event()

    async def stuck(peer: PeerId, data: bytes) -> bytes:
        started.set()
        await asyncio.Event().wait()
        return b""

    async def scenario() -> None:
        async with endpoints(stuck) as (server, client):
            pending = asyncio.create_task(client.request(server.local_addr, server.peer_id, b"x", timeout=30))
            await asyncio.wait_for(started.wait(), 5)  # the request is out and being answered
            await client.close()
            with pytest.raises(quic.ConnectionLost, match="local endpoint closed"):
                await pending

    run(scenario())


def test_datagrams_can_travel_a_virtual_route() -> None:
    """Two endpoints that exchange datagrams only through add_route/datagram_received (as a relay would) talk."""
    a_addr, b_addr = ("relay-for-a", 1), ("relay-for-b", 1)

    async def scenario() -> None:
        async with endpoints() as (server, client):
            loop = asyncio.get_running_loop()
            client.add_route(b_addr, lambda data: loop.call_soon(server.datagram_received, data, a_addr))
            server.add_route(a_addr, lambda data: loop.call_soon(client.datagram_received, data, b_addr))
            payload = os.urandom(100_000)
            reply = await client.request(b_addr, server.peer_id, payload, timeout=10)
            assert reply == str(client.peer_id).encode() + b"|" + payload
            assert client.connections() == {server.peer_id: b_addr}
            assert server.connections() == {client.peer_id: a_addr}

    run(scenario())


def test_immune_to_libp2p_patching_aioquic() -> None:
    """With libp2p imported first (it patches QuicStreamSender.get_frame), a 1 MiB round trip never calls the patch."""
    script = textwrap.dedent(
        """
        import asyncio, os
        import libp2p
        from aioquic.quic.stream import QuicStreamSender

        patched = QuicStreamSender.get_frame
        assert getattr(patched, "_libp2p_keep_pending_fin", False), "libp2p no longer patches aioquic"
        calls = []

        def counting(self, *args, **kwargs):
            calls.append(1)
            return patched(self, *args, **kwargs)

        QuicStreamSender.get_frame = counting

        from p2p.identity import Identity
        from p2p.quic.endpoint import Endpoint

        async def main():
            async def echo(peer, data):
                return data

            server = await Endpoint.bind(Identity.generate(), "127.0.0.1", 0, handler=echo)
            client = await Endpoint.bind(Identity.generate(), "127.0.0.1", 0, handler=None)
            payload = os.urandom(1 << 20)
            reply = await client.request(server.local_addr, server.peer_id, payload, timeout=20)
            await client.close()
            await server.close()
            assert reply == payload
            assert calls == [], f"patched get_frame called {len(calls)} times"
            print("immune ok")

        asyncio.run(main())
        """
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "immune ok" in result.stdout


def test_datagram_size_is_checked() -> None:
    """max_datagram_size outside 1200..16384 is refused at bind (above 16384 aioquic corrupts stream frames)."""

    async def scenario() -> None:
        for size in (1199, 16385):
            with pytest.raises(ValueError, match="max_datagram_size"):
                await Endpoint.bind(Identity.generate(), LOOPBACK, 0, handler=None, max_datagram_size=size)

    run(scenario())


# --- paths: several connections to one peer on one socket, and the socket's datagram filter ----------------------


def virtual_link(a: Endpoint, b: Endpoint) -> tuple[tuple[str, int], dict[str, bool]]:
    """Route datagrams between a and b also through virtual addresses (as a relay would); b's virtual address as a
    sees it, and a gate that drops that link's datagrams while ``gate["open"]`` is False."""
    loop = asyncio.get_running_loop()
    a_v, b_v = ("virtual-a", 1), ("virtual-b", 1)
    gate = {"open": True}

    def carry(to: Endpoint, src: tuple[str, int]) -> Any:
        return lambda data: gate["open"] and loop.call_soon(to.datagram_received, data, src)

    a.add_route(b_v, carry(b, a_v))
    b.add_route(a_v, carry(a, b_v))
    return b_v, gate


def test_dial_path_adds_a_second_connection_and_prefer_path_moves_requests() -> None:
    """dial_path opens a second connection to a connected peer on the same socket; prefer_path picks the one used."""

    async def scenario() -> None:
        async with endpoints(keepalive=False) as (server, client):
            virtual, gate = virtual_link(client, server)
            direct_blocked = {"on": False}
            server.set_datagram_filter(lambda data, addr: direct_blocked["on"] and addr == client.local_addr)
            peer, direct = server.peer_id, server.local_addr
            assert await client.request(direct, peer, b"1", timeout=5) == str(client.peer_id).encode() + b"|1"
            await client.dial_path(peer, virtual, timeout=5)
            assert sorted(client.paths(peer)) == sorted([direct, virtual])
            assert client.connections() == {peer: direct}  # a new path carries nothing until preferred
            assert not client.prefer_path(peer, ("127.0.0.1", 9))

            assert client.prefer_path(peer, virtual)
            direct_blocked["on"] = True
            assert await client.request(direct, peer, b"2", timeout=5) == str(client.peer_id).encode() + b"|2"
            assert client.connections() == {peer: virtual}

            assert client.prefer_path(peer, direct)
            direct_blocked["on"], gate["open"] = False, False
            assert await client.request(virtual, peer, b"3", timeout=5) == str(client.peer_id).encode() + b"|3"
            assert client.connections() == {peer: direct}

    run(scenario())


def test_close_path_fails_its_requests_and_later_ones_use_the_other_path() -> None:
    """close_path ends one connection (its pending request fails) and requests fall back to the remaining path."""
    held, release = asyncio.Event(), asyncio.Event()

    async def hold(peer: PeerId, data: bytes) -> bytes:
        if data == b"hold":
            held.set()
            await release.wait()
        return data

    async def scenario() -> None:
        async with endpoints(hold, keepalive=False) as (server, client):
            virtual, _ = virtual_link(client, server)
            peer, direct = server.peer_id, server.local_addr
            await client.connect(direct, peer, timeout=5)
            await client.dial_path(peer, virtual, timeout=5)
            pending = asyncio.create_task(client.request(direct, peer, b"hold", timeout=10))
            await asyncio.wait_for(held.wait(), 5)
            assert client.close_path(peer, direct, "test: path died")
            with pytest.raises(quic.ConnectionLost, match="test: path died"):
                await pending
            assert not client.close_path(peer, direct, "already closed")
            assert client.paths(peer) == [virtual]
            assert client.connections() == {peer: virtual}
            assert await client.request(direct, peer, b"after", timeout=5) == b"after"
            release.set()

    run(scenario())


def test_dial_path_that_times_out_is_abandoned() -> None:
    """A path dial that times out raises TransportTimeout and is closed: its retransmits cannot open it later."""

    async def scenario() -> None:
        async with endpoints() as (server, client):
            late = await Endpoint.bind(Identity.generate(), LOOPBACK, 0, handler=None)
            late.set_datagram_filter(lambda data, addr: True)  # swallows the client's Initials for now
            try:
                with pytest.raises(quic.TransportTimeout):
                    await client.dial_path(late.peer_id, late.local_addr, timeout=0.5)
                late.set_datagram_filter(None)
                await asyncio.sleep(1.5)  # past the client's next Initial retransmission, were the dial still alive
                assert client.paths(late.peer_id) == [] and late.paths() == []
            finally:
                await late.close()
            await client.close()
            with pytest.raises(quic.ConnectionLost, match="local endpoint closed"):
                await client.dial_path(server.peer_id, server.local_addr, timeout=1)

    run(scenario())


def test_subscribers_see_paths_open_and_close() -> None:
    """subscribe() reports each verified connection as PathOpened and its end as PathClosed (with the reason), on
    both sides; an unsubscribed function hears nothing more."""

    async def scenario() -> None:
        async with endpoints(keepalive=False) as (server, client):
            seen: dict[str, list[EndpointEvent]] = {"client": [], "server": []}
            client.subscribe(seen["client"].append)
            server.subscribe(seen["server"].append)
            virtual, _ = virtual_link(client, server)
            peer, direct = server.peer_id, server.local_addr
            await client.connect(direct, peer, timeout=5)
            await client.dial_path(peer, virtual, timeout=5)
            assert seen["client"] == [PathOpened(peer, direct), PathOpened(peer, virtual)]
            await until(lambda: len(seen["server"]) == 2)
            assert {e.addr for e in seen["server"]} == {client.local_addr, ("virtual-a", 1)}
            assert all(isinstance(e, PathOpened) and e.peer == client.peer_id for e in seen["server"])

            assert client.close_path(peer, virtual, "test: path done")
            closed = seen["client"][2]
            assert isinstance(closed, PathClosed) and (closed.peer, closed.addr) == (peer, virtual)
            assert "test: path done" in closed.reason
            await until(lambda: len(seen["server"]) == 3)
            assert isinstance(seen["server"][2], PathClosed) and seen["server"][2].addr == ("virtual-a", 1)

            client.unsubscribe(seen["client"].append)
            client.unsubscribe(seen["client"].append)  # a second time is ignored
            assert client.close_path(peer, direct, "test: all done")
            await until(lambda: len(seen["server"]) == 4)
            assert len(seen["client"]) == 3

    run(scenario())


def test_datagram_filter_takes_non_quic_datagrams_and_quic_still_works() -> None:
    """The filter sees every socket datagram first: it keeps what it consumes (sent with sendto), QUIC gets the rest."""

    async def scenario() -> None:
        async with endpoints() as (server, client):
            loop = asyncio.get_running_loop()
            ours: asyncio.Future[tuple[bytes, tuple[str, int]]] = loop.create_future()
            passed: list[tuple[str, int]] = []

            def take(data: bytes, addr: tuple[str, int]) -> bool:
                if data.startswith(b"\xffours"):
                    if not ours.done():
                        ours.set_result((data, addr))
                    return True
                passed.append(addr)
                return False

            server.set_datagram_filter(take)
            with pytest.raises(ValueError, match="already has a datagram filter"):
                server.set_datagram_filter(lambda data, addr: True)
            client.sendto(b"\xffours probe", server.local_addr)
            assert await asyncio.wait_for(ours, 5) == (b"\xffours probe", client.local_addr)
            reply = await client.request(server.local_addr, server.peer_id, b"q", timeout=5)
            assert reply == str(client.peer_id).encode() + b"|q"
            assert client.local_addr in passed
            server.set_datagram_filter(None)
            seen = len(passed)
            assert await client.request(server.local_addr, server.peer_id, b"r", timeout=5)
            assert len(passed) == seen

    run(scenario())


def test_more_requests_than_the_stream_cap_all_get_replies() -> None:
    """A connection capped at 8 open request streams carries 40 requests in a row and 30 at once: aioquic raises the
    peer's stream limit as streams finish (regression: the cap once froze the connection after 8 streams)."""

    async def main() -> None:
        limits = quic.ServeLimits(max_streams_per_conn=8)
        async with endpoints(serve_limits=limits) as (server, client):
            addr = server.local_addr
            for i in range(40):
                assert await client.request(addr, server.peer_id, b"%d" % i, timeout=5) == f"{client.peer_id}|{i}".encode()
            replies = await asyncio.gather(*(client.request(addr, server.peer_id, b"x" * 30_000, timeout=10) for _ in range(30)))
            assert all(r.endswith(b"x" * 30_000) for r in replies)

    run(main(), timeout=60)


def test_holes_in_stream_data_cost_the_server_at_most_two_windows() -> None:
    """A client that leaves the first 1,000 bytes of 16 streams unsent (aioquic fills such holes with zeros) gets
    connection credit only a window ahead: the server's aioquic holds at most 2 x max_bytes_per_conn for it, not
    the 16 x 1 MiB it sent (the attack drives aioquic's sender below its API: test only)."""
    window = 1 << 20

    async def main() -> None:
        limits = quic.ServeLimits(max_bytes_per_conn=window)
        async with endpoints(serve_limits=limits, max_message=window) as (server, client):
            await client.connect(server.local_addr, server.peer_id, timeout=5)
            conn = next(iter(client._conns))
            for i in range(16):
                stream_id = 4 * i
                conn.quic.send_stream_data(stream_id, bytes(window - 1000), end_stream=False)
                conn.quic._streams[stream_id].sender._pending.subtract(0, 1000)  # never sent: a hole, for good
            client._pump(conn)
            quic_conn = conn.quic
            await until(lambda: quic_conn._remote_max_data_used >= quic_conn._remote_max_data, timeout=20)
            held = next(c for c in server._conns if c.peer == client.peer_id).quic.held()
            assert window <= held <= 2 * window + 64 * 1024

    run(main(), timeout=60)
