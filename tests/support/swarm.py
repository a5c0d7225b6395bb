"""A :class:`node.launcher.Cluster` for tests that stops its nodes by tier, each tier at once.

``Cluster.stop`` stops node after node (reverse start order), each SIGTERM waited out before the next: with two or
three workers that was ~6 s per test of mostly waiting (a worker withdraws its records, drains, closes). Here the
clients (backbones, gateways) get SIGTERM together, then the servers (workers, joiners), then the infrastructure
(bootstraps, relays): the order that matters is kept — a worker still reaches the bootstrap to withdraw its
records, a gateway stops before the workers it dispatches to — and nodes of one tier wait on each other no more.
"""

from __future__ import annotations

import signal
import subprocess
import time

import click

from node.cli.root import main as cli
from node.launcher import Cluster, NodeProcess

COMMANDS = frozenset(cli.list_commands(click.Context(cli)))
INFRASTRUCTURE, SERVERS = frozenset({"bootstrap", "relay"}), frozenset({"worker", "join"})
GRACE_S = 10.0  # as NodeProcess.stop: then SIGKILL


def command(node: NodeProcess) -> str:
    """The `moeswarm` command a node runs (its first argument that names one: global options come before it)."""
    return next((a for a in node.args if a in COMMANDS), "")


def tier(node: NodeProcess) -> int:
    """0 for what the others need while they stop, 1 for workers, 2 for everything that uses workers."""
    name = command(node)
    return 0 if name in INFRASTRUCTURE else 1 if name in SERVERS else 2


def stop_together(nodes: list[NodeProcess], grace: float = GRACE_S) -> None:
    """SIGTERM every running node of *nodes* at once, wait up to *grace* s for all, SIGKILL those still running."""
    running = [n for n in nodes if n.proc is not None and n.proc.poll() is None]
    for node in running:
        assert node.proc is not None
        node.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for node in running:
        assert node.proc is not None
        try:
            node.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            node.kill()


class Swarm(Cluster):
    """``Cluster`` whose ``stop`` stops clients, then workers, then bootstraps and relays, each tier at once."""

    def stop(self) -> None:
        for level in (2, 1, 0):
            stop_together([n for n in self.nodes if tier(n) == level])
