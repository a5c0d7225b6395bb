"""Build and remove a real-NAT testbed out of network namespaces (root only). The topology itself is ``topology.py``.

Everything a run creates is named ``msw<id>-<role>`` and listed in a state file (``/run/moeswarm-testbed/<prefix>.json``,
written *before* the first namespace exists), so removal finds exactly what this run made: on ``down()``, on leaving
the ``with`` block (also through an exception or Ctrl-C), at interpreter exit, or later with ``down_stale()`` when the
owning process was killed. Veths are created directly inside the run's namespaces and never exist in the host's, so
the host's interfaces, routes and iptables are never touched; deleting the namespaces deletes the veths. Processes
inside a namespace keep it alive after ``ip netns del``, so removal kills them first.

Sockets for tests are made inside a namespace from a short-lived thread that joined it (``setns`` affects only the
calling thread), so a test needs no helper processes; the testbed closes them on removal, since an open socket too
keeps its namespace alive.
"""

from __future__ import annotations

import atexit
import ctypes
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import structlog

from .errors import DelayDaemonDied, NotRootError, TestbedError
from .topology import BRIDGE, LAN_IF, PREFIX_RE, SWITCH, WAN_IF, WORKER_IF, Kind, Nat, Plan, describe, iptables_rules, link_commands, link_delays, new_prefix, normalize_prefix, plan, sysctls

log = structlog.get_logger("node.testbed")

STATE_ROOT = Path(os.environ.get("MOESWARM_TESTBED_DIR", "/run/moeswarm-testbed"))
NETNS_DIR = Path("/run/netns")
CLONE_NEWNET = 0x40000000
READY_TIMEOUT = 30.0
KILL_GRACE = 2.0


def require_root() -> None:
    """Raise a one-line error unless we are root and have `ip` and `iptables-restore`."""
    if os.geteuid() != 0:
        raise NotRootError("the testbed needs root (network namespaces and iptables): run as root, e.g. with sudo")
    missing = [tool for tool in ("ip", "iptables-restore") if shutil.which(tool) is None]
    if missing:
        raise TestbedError(f"the testbed needs {' and '.join(missing)}: apt-get install -y iproute2 iptables")


def _run(cmd: list[str], stdin: str | None = None) -> str:
    p = subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=60)
    if p.returncode != 0:
        raise TestbedError(f"`{' '.join(cmd)}` failed with code {p.returncode}: {p.stderr.strip()}")
    return p.stdout


def _setns(name: str) -> None:
    fd = os.open(NETNS_DIR / name, os.O_RDONLY)
    try:
        if hasattr(os, "setns"):  # Python >= 3.12
            os.setns(fd, CLONE_NEWNET)
        elif ctypes.CDLL(None, use_errno=True).setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {name}: {os.strerror(err)}")
    finally:
        os.close(fd)


def in_netns(name: str, fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args) run on a fresh thread that joined netns `name`; sockets it creates stay in that namespace."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            _setns(name)
            box["value"] = fn(*args)
        except BaseException as exc:  # re-raised in the caller's thread
            box["error"] = exc

    t = threading.Thread(target=target, name=f"netns-{name}")
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def _write_sysctls(values: dict[str, str]) -> None:
    for key, value in values.items():
        Path("/proc/sys", key).write_text(value)


def list_netns() -> list[str]:
    return [line.split()[0] for line in _run(["ip", "netns", "list"]).splitlines() if line.strip()]


def netns_pids(name: str) -> list[int]:
    p = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True, timeout=30)
    return [int(x) for x in p.stdout.split()] if p.returncode == 0 else []


def _start_time(pid: int) -> int | None:
    """Kernel start time of `pid` (tells a live owner from a reused pid), or None if there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def pid_in_netns(pid: int, name: str) -> bool:
    """Is process `pid` alive (not a zombie) and inside namespace `name`?"""
    try:
        return os.stat(f"/proc/{pid}/ns/net").st_ino == os.stat(NETNS_DIR / name).st_ino
    except OSError:
        return False


def state_file(prefix: str) -> Path:
    return STATE_ROOT / f"{prefix}.json"


def read_state(prefix: str) -> dict:
    try:
        return json.loads(state_file(prefix).read_text())
    except FileNotFoundError:
        raise TestbedError(f"no testbed named {prefix!r} is up (no {state_file(prefix)})") from None


def _write_state(prefix: str, state: dict) -> None:
    STATE_ROOT.mkdir(parents=True, exist_ok=True)
    tmp = state_file(prefix).with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=1))
    tmp.replace(state_file(prefix))


def list_states() -> list[str]:
    return sorted(p.name.removesuffix(".json") for p in STATE_ROOT.glob("msw*-.json")) if STATE_ROOT.is_dir() else []


def exists(prefix: str) -> bool:
    """Does anything of testbed `prefix` exist (its state file or a namespace)?"""
    return state_file(prefix).exists() or any(n.startswith(prefix) for n in list_netns())


def teardown(prefix: str, namespaces: list[str] | None = None, procs: Sequence[subprocess.Popen] = ()) -> None:
    """Kill every process in the run's namespaces, delete the namespaces and the run's state. Idempotent."""
    if not PREFIX_RE.match(prefix):
        raise TestbedError(f"refusing to remove {prefix!r}: not a testbed prefix")
    existing = set(list_netns())
    names = [n for n in (namespaces if namespaces is not None else sorted(existing)) if n.startswith(prefix) and n in existing]
    _kill_all(names, procs)
    errors = []
    for name in names:
        p = subprocess.run(["ip", "netns", "del", name], capture_output=True, text=True, timeout=30)
        if p.returncode != 0:
            errors.append(f"{name}: {p.stderr.strip()}")
    if errors:
        raise TestbedError(f"could not delete namespaces of {prefix}: {'; '.join(errors)} (retry: moeswarm testbed down --all-stale)")
    state_file(prefix).unlink(missing_ok=True)
    shutil.rmtree(STATE_ROOT / prefix, ignore_errors=True)
    log.info("testbed.down", name=prefix, namespaces=len(names))


def _kill_all(names: list[str], procs: Sequence[subprocess.Popen]) -> None:
    """SIGTERM every process inside `names`, SIGKILL what is left after a grace period, reap our own children."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = {pid for name in names for pid in netns_pids(name)}
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + (KILL_GRACE if sig == signal.SIGTERM else 5.0)
        while pids and time.monotonic() < deadline:
            for proc in procs:
                proc.poll()  # reap, so a dead child stops counting
            pids = {pid for pid in pids if any(pid_in_netns(pid, n) for n in names)}
            time.sleep(0.02)
        if not pids:
            break
    for proc in procs:
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            log.warning("testbed.unreaped", pid=proc.pid)


def stale() -> list[str]:
    """Prefixes of testbeds whose owning process is gone (``moeswarm testbed up`` ones have none) or that lost their state."""
    prefixes = set(list_states()) | {n[: n.index("-") + 1] for n in list_netns() if n.startswith("msw") and "-" in n}
    out = []
    for prefix in sorted(p for p in prefixes if PREFIX_RE.match(p)):
        try:
            owner = json.loads(state_file(prefix).read_text()).get("owner")
        except FileNotFoundError:
            owner = None
        if owner is None or _start_time(owner[0]) != owner[1]:
            out.append(prefix)
    return out


def down_stale() -> list[str]:
    """Remove every stale testbed (see ``stale``); returns their prefixes."""
    removed = stale()
    for prefix in removed:
        teardown(prefix)
    return removed


class Testbed:
    """A running testbed. ``with Testbed(rtt_ms=80) as tb:`` builds it and always removes it.

    `rtt_ms` is the round trip added between any two hosts that talk across the WAN (RTT/2 on each WAN ingress);
    `links` overrides that per host ({role: ms}; a round trip between A and B costs link(A) + link(B), see
    ``topology``); `loss_pct` is the share of packets each WAN ingress drops; `public_workers` > 1 adds public
    workers ``pub-worker-2``... `keep=True` leaves it up after this process exits (``moeswarm testbed up``);
    otherwise removal also runs at interpreter exit.
    """

    __test__ = False  # not a pytest test class despite the name

    def __init__(self, rtt_ms: float = 0.0, loss_pct: float = 0.0, name: str | None = None, routers: tuple[Nat | str, ...] = (Nat.CONE, Nat.SYMMETRIC), keep: bool = False, links: dict[str, float] | None = None, public_workers: int = 1):
        if rtt_ms < 0 or not 0 <= loss_pct < 100:
            raise TestbedError(f"need rtt_ms >= 0 and 0 <= loss_pct < 100, got {rtt_ms} and {loss_pct}")
        self.rtt_ms = float(rtt_ms)
        self.loss_pct = float(loss_pct)
        self.keep = keep
        self._random_name = name is None
        self.plan: Plan = plan(normalize_prefix(name) if name else new_prefix(), tuple(Nat(r) for r in routers), public_workers)
        self.links = dict(links or {})
        self.delays = link_delays(self.plan, self.rtt_ms, self.links)  # one-way ms per WAN ingress
        self.delay_pids: dict[str, int] = {}
        self._procs: list[subprocess.Popen] = []
        self._sockets: list[socket.socket] = []
        self._up = False

    @property
    def prefix(self) -> str:
        return self.plan.prefix

    def delayed(self, role: str) -> bool:
        """Does `role`'s WAN ingress go through a delay daemon?"""
        return self.delays.get(role, 0.0) > 0 or (self.loss_pct > 0 and role in self.delays)

    def rtt(self, a: str, b: str) -> float:
        """The round trip the testbed adds between roles `a` and `b` (workers: their router's link), in ms."""
        return sum(self.delays[h.behind or h.role] for h in (self.plan.host(a), self.plan.host(b)))

    @classmethod
    def attach(cls, name: str) -> Testbed:
        """The testbed `name` that is already up (e.g. from ``moeswarm testbed up``), to run things in it."""
        prefix = normalize_prefix(name)
        state = read_state(prefix)
        tb = cls(state["rtt_ms"], state["loss_pct"], prefix, tuple(state["routers"]), keep=True, links=state.get("links"), public_workers=state.get("public_workers", 1))
        tb.delay_pids = dict(state["delay_pids"])
        tb._up = True
        return tb

    # -- lifecycle -----------------------------------------------------------------------------------------------

    def up(self) -> Testbed:
        require_root()
        if self._up:
            raise TestbedError(f"testbed {self.prefix} is already up")
        for attempt in range(8):
            if not exists(self.prefix):
                break
            if not self._random_name or attempt == 7:
                raise TestbedError(f"a testbed named {self.prefix} already exists: moeswarm testbed down --name {self.prefix}")
            self.plan = replace(self.plan, prefix=new_prefix())  # a random name collided: draw another
        self._up = True
        self._save_state(owned=True)  # before anything exists; owned while building, so not stale even with keep
        if not self.keep:
            atexit.register(self._down_at_exit)
        try:
            self._build()
        except BaseException:
            self.down()
            raise
        self._save_state(owned=not self.keep)
        log.info("testbed.up", name=self.prefix, rtt_ms=self.rtt_ms, loss_pct=self.loss_pct, links=self.links)
        return self

    def down(self) -> None:
        """Remove everything this testbed made. Safe to call twice."""
        if not self._up:
            return
        for sock in self._sockets:
            sock.close()
        self._sockets.clear()
        teardown(self.prefix, self.plan.namespaces, self._procs)
        self._procs.clear()
        self.delay_pids.clear()
        self._up = False
        atexit.unregister(self._down_at_exit)

    def _down_at_exit(self) -> None:
        try:
            self.down()
        except TestbedError as exc:
            log.error("testbed.leftover", name=self.prefix, error=str(exc))

    def __enter__(self) -> Testbed:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()

    def _save_state(self, owned: bool) -> None:
        owner = [os.getpid(), _start_time(os.getpid())] if owned else None
        _write_state(self.prefix, {
            "name": self.prefix, "owner": owner, "rtt_ms": self.rtt_ms, "loss_pct": self.loss_pct, "links": self.links,
            "routers": [str(h.nat) for h in self.plan.hosts if h.kind is Kind.ROUTER],
            "public_workers": sum(1 for h in self.plan.hosts if h.role.startswith("pub-worker")),
            "namespaces": self.plan.namespaces, "delay_pids": self.delay_pids,
        })  # fmt: skip

    def _build(self) -> None:
        p = self.plan
        for name in p.namespaces:
            _run(["ip", "netns", "add", name])
        switch = p.netns(SWITCH)
        _run(["ip", "-n", switch, "link", "add", BRIDGE, "type", "bridge"])
        _run(["ip", "-n", switch, "link", "set", BRIDGE, "up"])
        for h in p.hosts:
            in_netns(p.netns(h.role), _write_sysctls, sysctls(h))
            if h.on_wan:  # the switch-side end is named after the host
                self._veth(p.netns(h.role), WAN_IF, switch, h.role)
                _run(["ip", "-n", switch, "link", "set", h.role, "master", BRIDGE, "up"])
            if h.kind is Kind.WORKER:
                assert h.behind is not None  # a worker sits behind its router (Plan checks it)
                self._veth(p.netns(h.behind), LAN_IF, p.netns(h.role), WORKER_IF)
        for h in p.hosts:
            _run(["ip", "-n", p.netns(h.role), "-batch", "-"], stdin="\n".join(link_commands(h)) + "\n")
        self._start_delay_daemons()
        for h in p.hosts:
            rules = iptables_rules(h, self.delayed(h.role))
            if rules:
                _run(["ip", "netns", "exec", p.netns(h.role), "iptables-restore"], stdin=rules)

    @staticmethod
    def _veth(ns_a: str, if_a: str, ns_b: str, if_b: str) -> None:
        _run(["ip", "link", "add", "name", if_a, "netns", ns_a, "type", "veth", "peer", "name", if_b, "netns", ns_b])

    def _start_delay_daemons(self) -> None:
        logs = STATE_ROOT / self.prefix
        logs.mkdir(parents=True, exist_ok=True)
        starting: dict[str, subprocess.Popen] = {}
        for h in self.plan.hosts:
            if not self.delayed(h.role):
                continue
            cmd = [*self.exec_prefix(h.role), sys.executable, "-m", "node.testbed.delayd",
                   "--delay-ms", repr(self.delays[h.role]), "--loss", repr(self.loss_pct / 100)]  # fmt: skip
            with open(logs / f"{h.role}.delayd.log", "ab") as err:
                proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL, start_new_session=True)
            self._procs.append(proc)
            starting[h.role] = proc
        self._wait_ready(starting, logs)

    def _wait_ready(self, starting: dict[str, subprocess.Popen], logs: Path) -> None:
        deadline = time.monotonic() + READY_TIMEOUT
        pipes = {role: proc.stdout for role, proc in starting.items() if proc.stdout is not None}  # all: stdout=PIPE
        while starting:
            by_fd = {pipes[role].fileno(): role for role in starting}
            readable, _, _ = select.select(list(by_fd), [], [], max(0.0, deadline - time.monotonic()))
            if not readable:
                raise TestbedError(f"delay daemons for {', '.join(starting)} not ready after {READY_TIMEOUT:.0f} s (logs in {logs})")
            for fd in readable:
                role = by_fd[fd]
                proc = starting.pop(role)
                line = pipes[role].readline()
                pipes[role].close()
                if line.strip() != b"ready":
                    tail = (logs / f"{role}.delayd.log").read_text(errors="replace").strip()
                    raise TestbedError(f"delay daemon for {role} failed to start: {tail}")
                self.delay_pids[role] = proc.pid

    # -- using it ------------------------------------------------------------------------------------------------

    def netns(self, role: str) -> str:
        return self.plan.netns(role)

    def addr(self, role: str) -> str:
        """The host's address on its uplink: a WAN address for public hosts and routers, a LAN one for workers."""
        addr = self.plan.host(role).addr
        assert addr is not None  # Plan gives every host an uplink address
        return addr

    def exec_prefix(self, role: str) -> list[str]:
        """Put before a command to run it in `role`'s namespace (``NodeProcess(prefix=...)``)."""
        return ["ip", "netns", "exec", self.netns(role)]

    def run(self, role: str, *cmd: str, **kw: Any) -> subprocess.CompletedProcess:
        """subprocess.run of `cmd` inside `role`'s namespace (same keyword arguments)."""
        return subprocess.run([*self.exec_prefix(role), *cmd], **kw)

    def call(self, role: str, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args) on a thread inside `role`'s namespace."""
        return in_netns(self.netns(role), fn, *args)

    def socket(self, role: str, kind: int = socket.SOCK_DGRAM) -> socket.socket:
        """An IPv4 socket that lives in `role`'s namespace; closed by ``down()``."""
        sock = in_netns(self.netns(role), socket.socket, socket.AF_INET, kind)
        self._sockets.append(sock)
        return sock

    def check(self) -> None:
        """Raise DelayDaemonDied if a link's delay daemon is gone (that link then drops everything)."""
        dead = [role for role, pid in self.delay_pids.items() if not pid_in_netns(pid, self.netns(role))]
        if dead:
            raise DelayDaemonDied(f"delay daemon gone on the WAN link of {', '.join(dead)}: those links drop every packet")

    def describe(self) -> dict:
        return {**describe(self.plan), "rtt_ms": self.rtt_ms, "link_delay_ms": self.delays, "loss_pct": self.loss_pct, "delay_pids": dict(self.delay_pids)}
