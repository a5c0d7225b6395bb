"""The testbed tier: real network namespaces and iptables NAT, so root and the tools must be there (CI runs as root)."""

from __future__ import annotations

import os
import shutil


def why_no_testbed() -> str | None:
    """Why the testbed cannot run here, or None when it can."""
    if os.geteuid() != 0:
        return "the testbed needs root (network namespaces, iptables); CI runs as root"
    for tool in ("ip", "iptables", "iptables-restore"):
        if shutil.which(tool) is None:
            return f"the testbed needs `{tool}` (./dev test installs iproute2 and iptables as root)"
    return None
