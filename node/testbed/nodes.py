"""Swarm nodes as real processes inside a testbed: the bootstrap, the relay, workers, and one backbone run.

Shared by the benchmarks that measure the swarm across the emulated WAN (``bench paths``, ``bench wan``), so they
all start nodes the same way: each on its namespace's WAN/LAN address, with the embedded model unless told otherwise.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from experts.embedded import EMBEDDED_MODEL
from node.launcher import Cluster, NodeProcess

from .errors import TestbedError
from .netns import Testbed

DHT_PORT = 4001
RELAY_PORT = 8080
QUIC_PORT = 4433


@dataclass
class SwarmInTestbed:
    """Nodes of one swarm in testbed `tb`, owned by `cluster` (stopped with it)."""

    tb: Testbed
    cluster: Cluster
    model: Path = EMBEDDED_MODEL
    bootstrap: str | None = None
    relay_url: str | None = None

    def start(self, name: str, role: str, *args: str) -> NodeProcess:
        return self.cluster.start(name, *args, prefix=self.tb.exec_prefix(role))

    def start_bootstrap(self, role: str = "pub-bootstrap") -> str:
        ip = self.tb.addr(role)
        self.bootstrap = self.start("bootstrap", role, "bootstrap", "--listen", f"{ip}:{DHT_PORT}").wait_ready()["dht_addrs"][0]
        return self.bootstrap

    def start_relay(self, role: str = "pub-relay") -> str:
        """The relay, also a reachability helper (announced in the DHT) once the bootstrap node runs."""
        helper = ("--bootstrap", self.bootstrap) if self.bootstrap else ()
        self.relay_url = self.start("relay", role, "relay", "--listen", f"{self.tb.addr(role)}:{RELAY_PORT}", *helper).wait_ready()["url"]
        return self.relay_url

    @property
    def common(self) -> tuple[str, ...]:
        if self.bootstrap is None:
            raise TestbedError("start the bootstrap node first")
        return ("--model", str(self.model), "--bootstrap", self.bootstrap)

    def start_worker(self, name: str, role: str, *extra: str, path: str = "direct") -> NodeProcess:
        """A worker in `role` that is reached `path`: "direct" listens on its address and announces it; "relay"
        checks its reachability and announces the relay unless it finds itself public; "relay-only" is always
        reached through the relay. The QUIC port is QUIC_PORT in every case (so a router can forward it)."""
        ip = self.tb.addr(role)
        where = {
            "direct": ("--listen", f"{ip}:{QUIC_PORT}"),
            "relay": ("--relay", self.relay_url or "", "--listen", f"0.0.0.0:{QUIC_PORT}"),
            "relay-only": ("--relay", self.relay_url or "", "--relay-only", "--listen", f"0.0.0.0:{QUIC_PORT}"),
        }[path]
        return self.start(name, role, "worker", *self.common, *where, "--dht-listen", f"{ip}:0", *extra)

    def backbone_args(self, role: str = "backbone") -> tuple[str, ...]:
        """Options every backbone command run in `role` needs: this swarm and its addresses."""
        ip = self.tb.addr(role)
        return (*self.common, "--listen", f"{ip}:0", "--dht-listen", f"{ip}:0")

    def generate(self, name: str, prompt: str, n_tokens: int, *extra: str, role: str = "backbone", timeout: float = 900) -> dict:
        """One `backbone generate --json` run in `role`; its JSON result. Raises TestbedError with its stderr on failure."""
        p = self.tb.run(role, sys.executable, "-m", "node", "backbone", "generate", *self.backbone_args(role), "--data-dir", str(self.cluster.workdir / name), "--tokens", str(n_tokens), "--json", *extra, prompt,
                        capture_output=True, text=True, timeout=timeout)  # fmt: skip
        if p.returncode != 0:
            raise TestbedError(f"backbone run {name!r} failed (code {p.returncode}): {p.stderr[-1500:]}")
        return json.loads(p.stdout.strip().splitlines()[-1])
