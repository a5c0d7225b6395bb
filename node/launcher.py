"""Start node processes (`python -m node ...`), wait until they serve, and always stop them.

Used by the demo, the integration tests and the testbed. Every child runs in its own
session so a Ctrl-C at the terminal reaches only the launcher, which then stops the
children in order (SIGTERM: workers withdraw their records; SIGKILL after a grace period).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from experts.errors import MoeSwarmError

LOOPBACK_DATAGRAM = 16384  # a swarm all on loopback: large QUIC datagrams cut per-packet cost (docs/FIELD-NOTES.md)


class LaunchError(MoeSwarmError):
    """A node process exited or did not become ready in time; the message quotes its log."""


@dataclass
class NodeProcess:
    name: str
    args: list[str]
    workdir: Path
    env: dict[str, str] | None = None
    prefix: list[str] = field(default_factory=list)  # e.g. ["ip", "netns", "exec", NS] in the testbed
    module: str = "node"  # `python -m MODULE`: tests swap in doubles (e.g. a malicious worker)
    proc: subprocess.Popen | None = None

    @property
    def ready_file(self) -> Path:
        return self.workdir / f"{self.name}.ready.json"

    @property
    def log_file(self) -> Path:
        return self.workdir / f"{self.name}.log"

    def start(self) -> NodeProcess:
        self.ready_file.unlink(missing_ok=True)
        cmd = [*self.prefix, sys.executable, "-m", self.module, *self.args, "--data-dir", str(self.workdir / self.name), "--ready-file", str(self.ready_file)]
        env = {**os.environ, **(self.env or {})}
        with open(self.log_file, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=log, stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        return self

    def wait_ready(self, timeout: float = 60.0) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.ready_file.exists():
                return json.loads(self.ready_file.read_text())
            if self.proc is not None and self.proc.poll() is not None:
                raise LaunchError(f"{self.name} exited with code {self.proc.returncode}:\n{self.tail()}")
            time.sleep(0.1)
        raise LaunchError(f"{self.name} not ready after {timeout:.0f} s:\n{self.tail()}")

    def tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, grace: float = 10.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        """SIGKILL (the test of a peer vanishing mid-dispatch)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@dataclass
class Cluster:
    """Processes started together and stopped together (reverse order), also on errors and Ctrl-C."""

    workdir: Path
    nodes: list[NodeProcess] = field(default_factory=list)

    def start(self, name: str, *args: str, **kw) -> NodeProcess:
        node = NodeProcess(name, list(args), self.workdir, **kw).start()
        self.nodes.append(node)
        return node

    def stop(self) -> None:
        for node in reversed(self.nodes):
            node.stop()

    def __enter__(self) -> Cluster:
        self.workdir.mkdir(parents=True, exist_ok=True)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_local_swarm(cluster: Cluster, model_path: Path, bounds: Sequence[tuple[int, int]], *, kernel: str, max_datagram: int, ready_timeout: float = 60.0) -> tuple[dict, list[dict]]:
    """A DHT bootstrap node and one worker per ``(first, stop)`` expert range of *bounds*, on loopback, each worker
    with one compute thread; returns the bootstrap's and the workers' ready records.

    Shared by ``moeswarm demo`` and ``moeswarm bench swarm``, so the benchmark measures the swarm the demo shows."""
    boot = cluster.start("bootstrap", "bootstrap", "--listen", "127.0.0.1:0").wait_ready()
    addr = boot["dht_addrs"][0]
    procs = [
        cluster.start(f"worker{i}", "worker", "--model", str(model_path), "--experts", f"{a}-{b - 1}", "--bootstrap", addr, "--max-datagram", str(max_datagram), "--kernel", kernel, "--threads", "1")
        for i, (a, b) in enumerate(bounds)
    ]
    return boot, [p.wait_ready(ready_timeout) for p in procs]
