"""Common mistakes, made with the real CLI in subprocesses: each exits != 0 with one ``error:`` line that names the
problem and what to do, and no traceback; a bad bootstrap is found before the model loads."""

from __future__ import annotations

import socket
import subprocess

import pytest

from experts.embedded import EMBEDDED_MODEL
from node.launcher import Cluster
from p2p.identity import Identity
from tests.support import moeswarm

pytestmark = pytest.mark.slow
MODEL = str(EMBEDDED_MODEL)


def one_error_line(p: subprocess.CompletedProcess, *needles: str) -> str:
    """The command failed with exactly one ``error:`` line holding every needle, and printed no traceback."""
    out = p.stdout + p.stderr
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert p.returncode != 0, out
    assert len(errors) == 1 and "Traceback" not in out, out
    assert all(n in errors[0] for n in needles), errors[0]
    return errors[0]


@pytest.fixture
def held_udp():
    """A UDP port this test holds (as another program would)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


@pytest.fixture
def held_tcp():
    """A TCP port this test listens on (a web server, another gateway)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


@pytest.fixture(scope="module")
def bootstrap(tmp_path_factory) -> dict:
    """A running bootstrap node (its DHT port is a real libp2p listener, with SO_REUSEPORT)."""
    with Cluster(tmp_path_factory.mktemp("boot")) as cluster:
        yield cluster.start("bootstrap", "bootstrap", "--listen", "127.0.0.1:0").wait_ready()


def test_quic_port_in_use(held_udp, tmp_path):
    """A worker told to listen on a UDP port another process holds says so, with the way out, before it loads."""
    p = moeswarm("worker", "--model", MODEL, "--listen", f"127.0.0.1:{held_udp}", "--data-dir", str(tmp_path))
    one_error_line(p, f"UDP 127.0.0.1:{held_udp} (QUIC)", "already in use", "port 0")
    assert "worker.loading" not in p.stderr


@pytest.mark.parametrize("command", [["backbone", "serve"], ["worker", "--model", MODEL]])
def test_http_port_in_use(held_tcp, tmp_path, command):
    """The gateway's port and a worker's --http port, taken: one line naming the TCP address."""
    p = moeswarm(*command, "--http", f"127.0.0.1:{held_tcp}", "--data-dir", str(tmp_path))
    one_error_line(p, f"TCP 127.0.0.1:{held_tcp} (HTTP)", "already in use")
    assert "worker.loading" not in p.stderr


def test_dht_port_of_another_node_is_not_shared(bootstrap, tmp_path):
    """libp2p listens with SO_REUSEPORT, which would let a second node share the bootstrap's DHT port silently: the
    worker refuses it instead, before it loads."""
    port = bootstrap["dht_addrs"][0].split("/")[4]
    p = moeswarm("worker", "--model", MODEL, "--dht-listen", f"127.0.0.1:{port}", "--data-dir", str(tmp_path))
    one_error_line(p, f"TCP 127.0.0.1:{port} (the DHT)", "already in use")
    assert "worker.loading" not in p.stderr


@pytest.mark.parametrize("command", [["worker", "--model", MODEL], ["backbone", "serve", "--http", "127.0.0.1:0"]])
def test_bootstrap_unreachable_is_found_before_loading(held_tcp, tmp_path, command):
    """A bootstrap address nobody listens on is retried for --bootstrap-wait, then named, before the model loads."""
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]  # closed again: connections are refused
    addr = f"/ip4/127.0.0.1/tcp/{port}/p2p/{Identity.generate().peer_id}"
    p = moeswarm(*command, "--bootstrap", addr, "--bootstrap-wait", "2", "--data-dir", str(tmp_path))
    one_error_line(p, addr, "unreachable", "connection refused")
    assert "worker.loading" not in p.stderr and "gateway.ready" not in p.stderr


def test_bootstrap_with_another_peer_id(bootstrap, tmp_path):
    """The bootstrap's address with another key's peer id: it answers, the handshake fails, the line says which id
    to use, and nothing was loaded."""
    port = bootstrap["dht_addrs"][0].split("/")[4]
    addr = f"/ip4/127.0.0.1/tcp/{port}/p2p/{Identity.generate().peer_id}"
    p = moeswarm("worker", "--model", MODEL, "--bootstrap", addr, "--data-dir", str(tmp_path))
    one_error_line(p, addr, "but not as peer", "join with")
    assert "worker.loading" not in p.stderr


def test_bootstrap_address_without_peer_id(tmp_path):
    """A multiaddr without its /p2p/ part is refused with the expected form."""
    p = moeswarm("worker", "--model", MODEL, "--bootstrap", "/ip4/127.0.0.1/tcp/4001", "--data-dir", str(tmp_path))
    one_error_line(p, "must look like /ip4/127.0.0.1/tcp/4001/p2p/")
