"""What every long-running node process shares: data directory, key, ready file, graceful stop."""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path

from experts.atomic import write_atomic
from experts.errors import UsageError
from experts.home import moeswarm_home
from p2p.identity import Identity


def data_dir(path: str | None, role: str) -> Path:
    d = Path(path) if path else moeswarm_home() / role
    d.mkdir(parents=True, exist_ok=True)
    return d


def load_identity(directory: Path) -> Identity:
    return Identity.load_or_create(directory / "key.pem")


def write_ready(path: str | None, info: dict) -> None:
    """Atomically publish how to reach this node (for launchers and tests waiting on it)."""
    if not path:
        return
    write_atomic(path, json.dumps(info))


def parse_hostport(text: str) -> tuple[str, int]:
    """``"HOST:PORT"`` (IPv6 in brackets) as given on the command line; a UsageError saying the form otherwise."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise UsageError(f"address {text!r} must be HOST:PORT, e.g. 127.0.0.1:4433")
    return host.strip("[]"), int(port)


async def until_stopped() -> None:
    """Wait for SIGINT or SIGTERM, so callers can shut down gracefully (withdraw, close) in a finally."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
