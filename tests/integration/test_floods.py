"""Floods against real processes: a worker under slow-loris streams and a request flood from many identities, a
worker under a QUIC Initial flood, a relay under 1,100 idle WebSocket connections. Memory stays under the bounds of
docs/architecture.md ("Limits") and real clients are still served (bit-exact) throughout.

Every attack is bounded by count and by time; nothing asserts how fast anything is.
"""

from __future__ import annotations

import asyncio
import os
import socket
import ssl
import time
from pathlib import Path

import numpy as np
import pytest
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection
from websockets.asyncio.client import connect

from experts import codecs
from experts.codecs import Codec
from experts.embedded import EMBEDDED_MODEL
from experts.gguf_model import GGUFModel
from experts.hosting import open_experts
from node.launcher import Cluster, NodeProcess
from p2p.identity import Identity, PeerId
from p2p.quic.endpoint import ALPN, Endpoint, RemoteError, TransportError
from p2p.quic.errors import ErrorCode
from p2p.wire import messages as wire
from relay.client import RelayClient
from relay.protocol import SUBPROTOCOL
from tests.support.engine import kernel
from tests.support.idle_sockets import closed_by_peer
from tests.support.processes import wait_for_log

pytestmark = pytest.mark.slow
MiB = 1 << 20
# The worker's caps in these tests (flags of `moeswarm worker`) and the RSS bounds they imply (docs: "Limits").
REQUEST_BUFFER, PER_PEER = 32 * MiB, 4 * MiB
# Over the baseline: a held request byte exists up to 3 times (arriving, whole, decoded), plus connection state.
SLOW_LORIS_BOUND = 3 * REQUEST_BUFFER + 32 * MiB
INITIAL_FLOOD_BOUND = 64 * MiB  # over the baseline, after 30,000 Initials
FLOOD_CONCURRENT, FLOOD_ROUNDS = 40, 3  # per flooding identity: past the worker's 32 dispatches in flight per peer


@pytest.fixture(scope="module")
def model() -> GGUFModel:
    return GGUFModel(EMBEDDED_MODEL)


def rss(node: NodeProcess) -> int:
    """The process's resident set (VmRSS), bytes."""
    assert node.proc is not None
    for line in Path(f"/proc/{node.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS line")


def start_worker(cluster: Cluster, model: GGUFModel) -> tuple[NodeProcess, tuple[str, int], PeerId]:
    boot = cluster.start("bootstrap", "bootstrap", "--listen", "127.0.0.1:0").wait_ready()["dht_addrs"][0]
    worker = cluster.start(
        "worker", "worker", "--model", str(model.path), "--bootstrap", boot, "--max-datagram", "16384",
        "--request-buffer", f"{REQUEST_BUFFER}", "--request-buffer-per-peer", f"{PER_PEER}",
    )
    info = worker.wait_ready()
    host, port = info["quic_addr"].rsplit(":", 1)
    return worker, (host, int(port)), PeerId.from_string(info["peer_id"])


class Valid:
    """A real backbone's dispatch for one MoE layer and the bits a local run of the same kernel gives."""

    def __init__(self, model: GGUFModel, seed: int) -> None:
        cfg, rng = model.cfg, np.random.default_rng(seed)
        self.layer = next(layer for layer in model.layers if cfg.is_moe(layer))
        n, k = 3, cfg.n_expert_used
        ids = np.stack([rng.choice(cfg.n_expert, k, replace=False) for _ in range(n)]).astype(np.int32)
        w = rng.random((n, k), dtype=np.float32)
        self.x = rng.standard_normal((n, cfg.n_embd), dtype=np.float32)
        self.request = wire.DispatchRequest(
            dispatch_id=os.urandom(16), model_id=wire.model_id_of(bytes.fromhex(model.digest)), layer=self.layer,
            codec=Codec.F32, n_tokens=n, top_k=k, expert_ids=tuple(int(e) for e in ids.ravel()),
            router_weights=tuple(float(v) for v in w.ravel()), hidden=codecs.encode(Codec.F32, self.x),
        ).encode()
        source = open_experts(model, kernel())[0]
        self.expected, _ = source.partial_sum(self.layer, self.x, ids, w, ids >= 0)
        self.n_embd = cfg.n_embd

    async def check(self, ep: Endpoint, addr, peer: PeerId) -> None:
        """Send the dispatch; its reply must be the local bits exactly."""
        reply = wire.decode(await ep.request(addr, peer, self.request, timeout=30))
        assert isinstance(reply, wire.DispatchReply), reply
        got = codecs.decode(Codec.F32, reply.partial, reply.n_tokens, self.n_embd)
        assert np.array_equal(got, self.expected)


async def slow_loris(ep: Endpoint, addr, peer: PeerId, streams: int, size: int) -> None:
    """Open ``streams`` request streams to ``peer`` and send ``size`` bytes on each, never a FIN (test only: drives
    the endpoint's connection below its request API)."""
    await ep.connect(addr, peer, timeout=30)
    conn = next(c for c in ep._conns if c.peer == peer)
    assert conn.streams is not None
    for _ in range(streams):
        stream_id = conn.streams._next_id
        conn.streams._next_id += 4
        conn.quic.send_stream_data(stream_id, bytes(size), end_stream=False)
    ep._pump(conn)


def test_slow_loris_and_request_flood_from_many_identities(model, tmp_path):
    """40 identities each open 16 streams of 1 MiB that never finish (640 MiB wanted against a 32 MiB buffer) and
    30 more flood small dispatches, 40 at a time each; the worker's RSS stays under baseline + SLOW_LORIS_BOUND, refusals are
    OVERLOADED (error replies and stream resets), and a valid backbone's dispatches are answered bit-exact before, during and after."""
    valid = Valid(model, seed=1)
    with Cluster(tmp_path) as cluster:
        worker, addr, peer = start_worker(cluster, model)

        async def attack() -> tuple[int, int, dict[str, int], list[str]]:
            honest = await Endpoint.bind(Identity.generate(), "127.0.0.1", 0, handler=None, max_datagram_size=16384)
            attackers = [await Endpoint.bind(Identity.generate(), "127.0.0.1", 0, handler=None, max_datagram_size=16384) for _ in range(70)]
            outcomes: dict[str, int] = {}
            lost: list[str] = []  # what the transport errors said (the assertion's message)
            handshakes: list[str] = []  # why a flooding identity's handshake did not finish
            try:
                for _ in range(3):
                    await valid.check(honest, addr, peer)
                baseline = rss(worker)
                peak = baseline

                async def flood(ep: Endpoint) -> None:
                    # A new identity's handshake may not finish while the slow-loris streams hold the worker: in two
                    # full-suite runs a few dials idled out (10 s, never verified; their requests failed together).
                    # Counted apart; every request on an established connection must be answered or refused.
                    try:
                        await ep.connect(addr, peer, timeout=30)
                    except TransportError as exc:
                        outcomes["no handshake"] = outcomes.get("no handshake", 0) + 1
                        handshakes.append(str(exc))
                        return
                    await asyncio.gather(*(one(ep) for _ in range(FLOOD_CONCURRENT)))

                async def one(ep: Endpoint) -> None:
                    for _ in range(FLOOD_ROUNDS):
                        try:
                            reply = wire.decode(await ep.request(addr, peer, valid.request, timeout=30))
                            key = reply.code.name if isinstance(reply, wire.ErrorReply) else "answered"
                        except RemoteError as exc:
                            key = ErrorCode(exc.code).name
                        except TransportError as exc:
                            key = type(exc).__name__
                            lost.append(str(exc))
                        outcomes[key] = outcomes.get(key, 0) + 1

                deadline = time.monotonic() + 120
                await asyncio.gather(*(slow_loris(ep, addr, peer, 16, MiB) for ep in attackers[:40]))
                floods = [asyncio.ensure_future(flood(ep)) for ep in attackers[40:]]
                for _ in range(30):  # the honest backbone, throughout the attack
                    await valid.check(honest, addr, peer)
                    peak = max(peak, rss(worker))
                    await asyncio.sleep(0.1)
                    if all(f.done() for f in floods) or time.monotonic() > deadline:
                        break
                await asyncio.wait_for(asyncio.gather(*floods), timeout=max(1.0, deadline - time.monotonic()))
                for _ in range(3):
                    await valid.check(honest, addr, peer)
                print(f"handshakes not finished: {sorted(set(handshakes))}")
                return baseline, max(peak, rss(worker)), outcomes, sorted(set(lost))
            finally:
                for ep in (honest, *attackers):
                    await ep.close()

        baseline, peak, outcomes, lost = asyncio.run(attack())
        print(f"worker RSS baseline {baseline / MiB:.0f} MiB, peak {peak / MiB:.0f} MiB (bound +{SLOW_LORIS_BOUND / MiB:.0f}); flood outcomes {outcomes}")
        assert peak < baseline + SLOW_LORIS_BOUND
        assert outcomes.get("answered", 0) > 0 and outcomes.get("OVERLOADED", 0) > 0
        assert set(outcomes) <= {"answered", "OVERLOADED", "no handshake"}, lost  # every flood request answered or refused, none lost
        assert outcomes.get("no handshake", 0) <= (70 - 40) // 2, outcomes  # most flooding identities got through
        wait_for_log(worker.log_file, "quic.request_evicted", timeout=10)  # the slow-loris streams made way
        wait_for_log(worker.log_file, "quic.overloaded", "peer=", timeout=10)  # and their newest were refused


def initials(count: int, real: int) -> list[bytes]:
    """``count`` datagrams that parse as QUIC v1 Initials: ``real`` genuine client first flights (the worker can
    decrypt and answer them), the rest the same header with a fresh destination id and a random payload."""
    config = QuicConfiguration(is_client=True, alpn_protocols=[ALPN], verify_mode=ssl.CERT_NONE)
    genuine = []
    for _ in range(real):
        client = QuicConnection(configuration=config)
        client.connect(("127.0.0.1", 9), now=0.0)
        genuine.append(client.datagrams_to_send(now=0.0)[0][0])
    template = genuine[0]
    dcid_at = 6  # long header: flags, version (4), dcid length, dcid
    junk = []
    for _ in range(count - real):
        d = bytearray(template)
        d[dcid_at : dcid_at + 8] = os.urandom(8)
        d[40:] = os.urandom(len(d) - 40)
        junk.append(bytes(d))
    return genuine + junk


def test_quic_initial_flood_leaves_memory_bounded_and_clients_served(model, tmp_path):
    """30,000 datagrams that look like Initials (300 genuine first flights that never continue, the rest junk)
    from a raw UDP socket: the worker's RSS afterwards stays under baseline + INITIAL_FLOOD_BOUND, it answered the
    excess genuine ones with a Retry, and a real client (which follows that Retry) is served bit-exact."""
    valid = Valid(model, seed=2)
    datagrams = initials(30_000, real=300)
    with Cluster(tmp_path) as cluster:
        worker, addr, peer = start_worker(cluster, model)

        async def flood() -> tuple[int, int]:
            client = await Endpoint.bind(Identity.generate(), "127.0.0.1", 0, handler=None, max_datagram_size=16384)
            try:
                await valid.check(client, addr, peer)
                baseline = rss(worker)
                with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
                    udp.setblocking(False)
                    deadline = time.monotonic() + 60
                    for i, datagram in enumerate(datagrams):
                        try:
                            udp.sendto(datagram, addr)
                        except BlockingIOError:
                            pass  # a flood does not wait for the socket either
                        if i % 64 == 0:  # paced so the worker reads them, rather than the kernel dropping most
                            await asyncio.sleep(0.01)
                        if time.monotonic() > deadline:
                            break
                late = await Endpoint.bind(Identity.generate(), "127.0.0.1", 0, handler=None, max_datagram_size=16384)
                try:
                    await valid.check(late, addr, peer)  # a new connection while the genuine half-opens are held
                finally:
                    await late.close()
                await valid.check(client, addr, peer)
                return baseline, rss(worker)
            finally:
                await client.close()

        baseline, after = asyncio.run(flood())
        print(f"worker RSS before the flood {baseline / MiB:.0f} MiB, after {after / MiB:.0f} MiB (bound +{INITIAL_FLOOD_BOUND / MiB:.0f})")
        assert after < baseline + INITIAL_FLOOD_BOUND
        wait_for_log(worker.log_file, "quic.half_open_full", "Retry sent", timeout=10)


IDLE = 1_100
IPS = [f"127.0.0.{i}" for i in range(2, 19)]  # 17 loopback addresses: ~65 each, past the per-IP cap of 64


def test_idle_websockets_do_not_keep_a_real_client_out(tmp_path):
    """1,100 idle unauthenticated WebSocket connections from 17 loopback IPs (past the per-IP cap and the relay's
    1,024 in all): the relay evicts the oldest idle ones, and a real client from another IP still authenticates."""
    with Cluster(tmp_path) as cluster:
        relay = cluster.start("relay", "relay", "--listen", "127.0.0.1:0")
        url = relay.wait_ready()["url"]

        async def attack() -> tuple[int, int]:
            idle = []
            try:
                deadline = time.monotonic() + 120
                for i in range(IDLE):
                    # no 503 (InvalidStatus) either: eviction always makes room for a newcomer among idle peers
                    ws = await connect(url, subprotocols=[SUBPROTOCOL], local_addr=(IPS[i % len(IPS)], 0), open_timeout=10, ping_interval=None, max_queue=1)
                    idle.append(ws)
                    if time.monotonic() > deadline:
                        break
                async with RelayClient(Identity.generate(), url) as client:
                    await client.wait_connected(15)
                closed = await closed_by_peer(idle)
                return len(idle), closed
            finally:
                await asyncio.gather(*(ws.close() for ws in idle), return_exceptions=True)

        opened, evicted = asyncio.run(attack())
        print(f"idle connections opened {opened}, closed by the relay {evicted}")
        assert opened == IDLE
        assert evicted >= IDLE - 1024  # at least what exceeded the global cap made way
        wait_for_log(relay.log_file, "relay.client_connected", timeout=10)
        wait_for_log(relay.log_file, "relay.evicted", timeout=10)
