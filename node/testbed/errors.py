"""The testbed's exceptions; the CLI turns each into one line (they are MoeSwarmErrors)."""

from __future__ import annotations

import os

from experts.errors import UsageError


class TestbedError(UsageError):
    """Building, using or removing a testbed failed; the message says which step and how to clean up."""

    __test__ = False  # not a pytest test class despite the name


class NotRootError(TestbedError):
    """Network namespaces and iptables need root."""


class DelayDaemonDied(TestbedError):
    """A link's delay daemon is gone: that link now drops every packet (there is no bypass)."""


class NetlinkError(TestbedError):
    """The kernel refused a netlink request."""

    def __init__(self, errno: int, seq: int):
        self.errno = errno
        self.seq = seq
        super().__init__(f"netlink request {seq} refused: {os.strerror(errno)} (errno {errno})")


class NetlinkFormatError(TestbedError):
    """Bytes from the netlink socket do not parse as the messages they claim to be."""
