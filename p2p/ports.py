"""Binding a node's ports: a port another process holds is the operator's to fix, so it is one clear UsageError.

Every socket a node listens on (QUIC over UDP, the DHT and HTTP over TCP) is bound inside :func:`binding`, which turns
the operating system's ``EADDRINUSE`` / ``EADDRNOTAVAIL`` / ``EACCES`` into :class:`PortError` naming the protocol, the
address and what to do; the CLI prints it as one ``error:`` line.

libp2p's TCP listener sets ``SO_REUSEPORT`` (for TCP hole punching), so two processes of the same user can listen on
one DHT port and the kernel splits the connections between them: :func:`check_free` binds the port once without
that option first, which fails while anyone listens there. A worker runs the same check on its ports before it loads.
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Iterator
from contextlib import contextmanager

from experts.errors import UsageError


class PortError(UsageError):
    """A port this node was told to listen on cannot be bound (in use, not an address of this machine, privileged)."""


def _where(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@contextmanager
def binding(proto: str, host: str, port: int, what: str) -> Iterator[None]:
    """Run a bind of ``proto`` ("UDP", "TCP") ``host:port`` for ``what`` ("QUIC", "the DHT", "HTTP"); an OSError the
    operator can fix becomes :class:`PortError`, any other propagates."""
    try:
        yield
    except OSError as exc:
        where = f"{proto} {_where(host, port)} ({what})"
        if exc.errno == errno.EADDRINUSE:
            raise PortError(f"{where} is already in use by another process: stop that process, or choose another port (port 0 picks a free one)") from None
        if exc.errno == errno.EADDRNOTAVAIL:
            raise PortError(f"{where}: {host} is not an address of this machine; listen on one of its addresses, or 0.0.0.0 for all") from None
        if exc.errno == errno.EACCES:
            raise PortError(f"{where}: permission denied (ports below 1024 need privileges); choose a port above 1023") from None
        raise


def check_free(proto: str, host: str, port: int, what: str) -> None:
    """Raise :class:`PortError` if ``proto`` ("TCP", "UDP") ``host:port`` cannot be bound now (port 0: nothing to
    check): before a node spends minutes loading a model, and for TCP before libp2p (whose ``SO_REUSEPORT`` would
    share a taken port). ``SO_REUSEADDR`` only lets a TCP check pass over connections in TIME_WAIT (a node restarted
    on its port); a process listening there still fails it."""
    if port == 0:
        return
    kind = socket.SOCK_STREAM if proto == "TCP" else socket.SOCK_DGRAM
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, kind) as sock:
        if kind == socket.SOCK_STREAM:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        with binding(proto, host, port, what):
            sock.bind((host, port))
