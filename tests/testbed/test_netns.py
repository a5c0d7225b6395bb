"""The namespace testbed for real: NAT mapping and filtering, hole punching, WAN delay, and clean removal (root)."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from node.testbed import DelayDaemonDied, Testbed, list_netns, stale, teardown
from node.testbed.netns import state_file
from tests.support import MOESWARM, until

from .conftest import why_no_testbed

pytestmark = [pytest.mark.skipif(why_no_testbed() is not None, reason=why_no_testbed() or ""), pytest.mark.timeout(120)]

PORT = 9000
PY = [sys.executable, "-c"]


class Echo:
    """'What address do you see': answers each datagram with b"ip:port|" + the datagram, from a thread."""

    def __init__(self, tb: Testbed, role: str):
        self.addr = (tb.addr(role), PORT)
        self.sock = tb.socket(role)
        self.sock.bind(("0.0.0.0", PORT))
        self.sock.settimeout(0.05)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                data, (ip, port) = self.sock.recvfrom(2048)
            except TimeoutError:
                continue
            except OSError:  # the testbed closed the socket (a test failed before close())
                return
            self.sock.sendto(f"{ip}:{port}|".encode() + data, (ip, port))

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def udp(tb: Testbed, role: str) -> socket.socket:
    sock = tb.socket(role)
    sock.bind(("0.0.0.0", 0))
    return sock


def recv_within(sock: socket.socket, timeout: float, expect: bytes | None = None) -> tuple[bytes, tuple[str, int]] | None:
    """The next datagram (containing `expect`, if given) within `timeout` seconds, or None."""
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            data, src = sock.recvfrom(2048)
        except TimeoutError:
            return None
        if expect is None or expect in data:
            return data, src
    return None


def seen_as(sock: socket.socket, echo: Echo, timeout: float = 2.0) -> tuple[str, int]:
    """The public (address, port) `echo` sees `sock` as (STUN, in short)."""
    nonce = secrets.token_hex(4).encode()
    for _ in range(3):
        sock.sendto(nonce, echo.addr)
        got = recv_within(sock, timeout / 3, nonce)
        if got:
            ip, port = got[0].split(b"|")[0].decode().split(":")
            return ip, int(port)
    raise AssertionError(f"no answer from echo {echo.addr}")


def punch(a: socket.socket, a_public: tuple[str, int], b: socket.socket, b_public: tuple[str, int], timeout: float = 2.0) -> bool:
    """Both sides send to the other's public address every 20 ms at the same time; True once each has heard the other."""
    heard = {a: False, b: False}
    a.setblocking(False)
    b.setblocking(False)
    deadline = time.monotonic() + timeout
    while not all(heard.values()) and time.monotonic() < deadline:
        a.sendto(b"punch", b_public)
        b.sendto(b"punch", a_public)
        time.sleep(0.02)  # not a synchronisation: the punch itself is a send every 20 ms until both hear the other
        for sock, peer in ((a, b_public), (b, a_public)):
            try:
                while True:
                    data, src = sock.recvfrom(2048)
                    heard[sock] |= src == peer and data == b"punch"
            except BlockingIOError:
                pass
    return all(heard.values())


def rtt(sock: socket.socket, echo: Echo) -> float:
    nonce = secrets.token_hex(4).encode()
    start = time.monotonic()
    sock.sendto(nonce, echo.addr)
    assert recv_within(sock, 2.0, nonce), "echo did not answer"
    return time.monotonic() - start


def netns_inodes(tb: Testbed) -> set[int]:
    return {os.stat(f"/run/netns/{name}").st_ino for name in tb.plan.namespaces}


def holders(inodes: set[int]) -> list[str]:
    """Threads anywhere on the machine still inside one of these namespaces (each would keep it and its veths alive)."""
    out = []
    for link in Path("/proc").glob("[0-9]*/task/[0-9]*/ns/net"):
        try:
            if os.stat(link).st_ino in inodes:
                out.append(str(link))
        except OSError:
            pass
    return out


def assert_gone(prefix: str, inodes: set[int] = frozenset()) -> None:
    assert not [n for n in list_netns() if n.startswith(prefix)], "namespaces left behind"
    host_links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    assert prefix not in host_links, "a veth was left in the host namespace"
    assert not state_file(prefix).exists()
    assert not holders(set(inodes)), "a process still holds a removed namespace"


@pytest.fixture(scope="module")
def nat():
    """No delay; cone router-a, symmetric router-b, cone router-c; echo servers on three public hosts."""
    with Testbed(routers=("cone", "symmetric", "cone")) as tb:
        echoes = {role: Echo(tb, role) for role in ("pub-bootstrap", "pub-relay", "pub-worker")}
        yield tb, echoes
        for echo in echoes.values():
            echo.close()


def test_cone_router_keeps_one_mapping_for_every_destination(nat):
    """Behind the cone router, one socket looks the same (router address, one port) to two public hosts."""
    tb, echoes = nat
    sock = udp(tb, "worker-a")
    first, second = seen_as(sock, echoes["pub-bootstrap"]), seen_as(sock, echoes["pub-relay"])
    assert first == second
    assert first[0] == tb.addr("router-a")


def test_symmetric_router_maps_each_destination_to_its_own_port(nat):
    """Behind the symmetric router, one socket gets a different public port per destination."""
    tb, echoes = nat
    sock = udp(tb, "worker-b")
    seen = [seen_as(sock, echoes[role]) for role in ("pub-bootstrap", "pub-relay", "pub-worker")]
    assert {ip for ip, _ in seen} == {tb.addr("router-b")}
    assert len({port for _, port in seen}) > 1


def test_router_drops_unsolicited_input_and_passes_replies(nat):
    """A mapped port takes nothing from hosts the worker has not sent to; after it sends to X, X gets through."""
    tb, echoes = nat
    worker = udp(tb, "worker-a")
    mapped = seen_as(worker, echoes["pub-bootstrap"])
    stranger = udp(tb, "pub-relay")
    stranger.sendto(b"unsolicited", mapped)
    same_host_other_port = udp(tb, "pub-bootstrap")
    same_host_other_port.sendto(b"unsolicited", mapped)
    assert recv_within(worker, 0.5, b"unsolicited") is None
    worker.sendto(b"hello", (tb.addr("pub-relay"), stranger.getsockname()[1]))
    got = recv_within(stranger, 2.0, b"hello")
    assert got and got[1] == mapped
    stranger.sendto(b"reply", mapped)
    assert recv_within(worker, 2.0, b"reply")


def test_hole_punch_between_cone_worker_and_public_worker(nat):
    """Simultaneous sends between the worker behind the cone NAT and the public worker open a direct path."""
    tb, echoes = nat
    worker, public = udp(tb, "worker-a"), udp(tb, "pub-worker")
    worker_public = seen_as(worker, echoes["pub-bootstrap"])
    assert punch(worker, worker_public, public, (tb.addr("pub-worker"), public.getsockname()[1]))


def test_hole_punch_between_two_cone_workers(nat):
    """Two workers behind different cone NATs punch through both routers' filters."""
    tb, echoes = nat
    a, c = udp(tb, "worker-a"), udp(tb, "worker-c")
    assert punch(a, seen_as(a, echoes["pub-bootstrap"]), c, seen_as(c, echoes["pub-bootstrap"]))


def test_hole_punch_fails_against_the_symmetric_nat(nat):
    """The symmetric NAT's fresh port per destination defeats punching from a filtering cone NAT (needs a relay)."""
    tb, echoes = nat
    a, b = udp(tb, "worker-a"), udp(tb, "worker-b")
    assert not punch(a, seen_as(a, echoes["pub-bootstrap"]), b, seen_as(b, echoes["pub-bootstrap"]), timeout=1.0)


def test_delay_gives_at_least_the_configured_round_trip():
    """Every round trip across the WAN, from behind a NAT or between public hosts, takes at least the RTT."""
    with Testbed(rtt_ms=40) as tb:
        echo = Echo(tb, "pub-relay")
        behind_nat, public = udp(tb, "worker-a"), udp(tb, "pub-worker")
        samples = [rtt(sock, echo) for _ in range(10) for sock in (behind_nat, public)]
        echo.close()
        tb.check()
    assert min(samples) >= 0.040


def test_per_link_delays_set_each_pairs_round_trip():
    """With the backbone's link at 0 ms and workers' at 20/80 ms, each worker is that far from it, and 100 ms from each other."""
    with Testbed(rtt_ms=0, links={"backbone": 0, "pub-worker": 20, "pub-worker-2": 80}, public_workers=2) as tb:
        assert sorted(tb.delay_pids) == ["pub-worker", "pub-worker-2"]  # no daemon where nothing is delayed
        echo, far = Echo(tb, "backbone"), Echo(tb, "pub-worker-2")
        near, other = udp(tb, "pub-worker"), udp(tb, "pub-worker-2")
        to_near = [rtt(near, echo) for _ in range(5)]
        to_far = [rtt(other, echo) for _ in range(5)]
        between = [rtt(near, far) for _ in range(5)]
        echo.close()
        far.close()
        assert tb.rtt("backbone", "pub-worker-2") == 80 and tb.rtt("pub-worker", "pub-worker-2") == 100
    assert 0.020 <= min(to_near) < 0.080 <= min(to_far) and min(between) >= 0.100


def test_killed_delay_daemon_stops_its_link():
    """With router-a's delay daemon killed, nothing reaches worker-a (no bypass) and check() says so; other links still work."""
    with Testbed(rtt_ms=20) as tb:
        echo = Echo(tb, "pub-relay")
        worker, public = udp(tb, "worker-a"), udp(tb, "pub-worker")
        rtt(worker, echo)
        os.kill(tb.delay_pids["router-a"], signal.SIGKILL)
        with pytest.raises(DelayDaemonDied, match="router-a"):
            until(lambda: tb.check() and False, timeout=5, interval=0.02, what="check() raising for the dead daemon")
        for _ in range(3):
            worker.sendto(b"anyone", echo.addr)
        assert recv_within(worker, 1.0) is None
        rtt(public, echo)
        echo.close()


def test_loss_drops_some_packets_but_not_all():
    """At 50% loss per direction, some of 100 concurrent round trips come back and some do not."""
    with Testbed(loss_pct=50) as tb:
        echo = Echo(tb, "pub-relay")
        sock = udp(tb, "worker-a")
        for i in range(100):
            sock.sendto(b"n%d" % i, echo.addr)
        replies = 0
        while recv_within(sock, 0.5):
            replies += 1
        echo.close()
    assert 0 < replies < 100


def test_down_removes_everything_including_open_sockets():
    """After the with block: no namespace, no veth in the host, no state, no process inside, test sockets closed."""
    with Testbed(rtt_ms=20) as tb:
        inodes = netns_inodes(tb)
        sock = udp(tb, "worker-a")
        assert set(tb.plan.namespaces) <= set(list_netns())
        assert len(tb.delay_pids) == 6
    assert sock.fileno() == -1
    assert_gone(tb.prefix, inodes)
    tb.down()  # idempotent


def test_down_runs_when_the_body_raises():
    """An exception inside the with block still removes the testbed, daemons included."""
    with pytest.raises(RuntimeError, match="boom"):
        with Testbed(rtt_ms=20) as tb:
            inodes = netns_inodes(tb)
            raise RuntimeError("boom")
    assert_gone(tb.prefix, inodes)


OWNER = """
import signal, time
signal.signal(signal.SIGINT, signal.default_int_handler)  # a background job of a shell starts with SIGINT ignored
from node.logs import configure_logging
from node.testbed import Testbed

configure_logging("warning")
with Testbed(rtt_ms=20) as tb:
    print(tb.prefix, flush=True)
    time.sleep(60)  # not a synchronisation: the owner holds its testbed until the test interrupts it
"""


@pytest.fixture
def owner():
    """Another process that builds a testbed (rtt 20 ms) and waits inside its with block; always stopped."""
    proc = subprocess.Popen([*PY, OWNER], stdout=subprocess.PIPE, text=True)
    prefix = ""
    try:
        prefix = proc.stdout.readline().strip()
        assert prefix.startswith("msw"), "the owner process did not build its testbed"
        yield proc, prefix
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if prefix.startswith("msw"):
            teardown(prefix)


def test_ctrl_c_in_the_owner_removes_the_testbed(owner):
    """SIGINT to a process inside its with block tears its testbed down before it exits."""
    proc, prefix = owner
    proc.send_signal(signal.SIGINT)
    proc.wait(30)
    assert_gone(prefix)


def test_killed_owner_leaves_a_stale_testbed_that_down_stale_removes(owner):
    """After SIGKILL of its owner a testbed is stale (a live one is not) and teardown removes it and its daemons."""
    proc, prefix = owner
    with Testbed() as live:
        daemons = [pid for name in list_netns() if name.startswith(prefix) for pid in _pids(name)]
        assert len(daemons) == 6
        proc.kill()
        proc.wait()
        assert prefix in stale() and live.prefix not in stale()
        teardown(prefix)
        assert_gone(prefix)
        assert not [pid for pid in daemons if _alive(pid)]


def _pids(name: str) -> list[int]:
    return [int(p) for p in subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout.split()]


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


CLI = [*MOESWARM, "testbed"]


def test_cli_up_run_down():
    """`testbed up` prints the namespaces as JSON and leaves them up; `run --in` runs there; `down` removes them."""
    name = "t" + secrets.token_hex(3)
    try:
        up = subprocess.run([*CLI, "up", "--rtt-ms", "20", "--name", name], capture_output=True, text=True, timeout=60)
        assert up.returncode == 0, up.stderr
        info = json.loads(up.stdout)
        worker = info["hosts"]["worker-a"]
        assert worker["netns"] in list_netns() and info["hosts"]["router-b"]["nat"] == "symmetric"
        run = subprocess.run([*CLI, "run", "--name", name, "--in", "worker-a", "--", "ip", "-4", "-o", "addr"], capture_output=True, text=True, timeout=60)
        assert run.returncode == 0 and worker["addr"] in run.stdout
        failing = subprocess.run([*CLI, "run", "--name", name, "--in", "pub-relay", "--", "sh", "-c", "exit 7"], timeout=60)
        assert failing.returncode == 7
        down = subprocess.run([*CLI, "down", "--name", name], capture_output=True, text=True, timeout=60)
        assert down.returncode == 0, down.stderr
        assert_gone(info["name"])
    finally:
        subprocess.run([*CLI, "down", "--name", name], capture_output=True, timeout=60)


def test_cli_refuses_non_root_in_one_line():
    """Without root, `testbed up` says so in one line and builds nothing."""
    if shutil.which("setpriv") is None:
        pytest.skip("needs setpriv (util-linux) to drop root")
    # Still allowed to read files (CAP_DAC_READ_SEARCH, nothing else): the checkout may sit in a 0700 directory
    # (e.g. `mktemp -d`) that user 65534 could not otherwise import the code from.
    read_anything = ["--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search"]
    p = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *read_anything, *CLI, "up", "--name", "nonroot"],
                       capture_output=True, text=True, timeout=60, cwd="/")  # fmt: skip
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert p.returncode == 2 and len(lines) == 1 and "needs root" in lines[0], p.stderr
    assert not [n for n in list_netns() if n.startswith("mswnonroot-")]
