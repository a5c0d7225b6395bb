"""A real-NAT testbed in network namespaces: public hosts, home routers (cone and symmetric NAT), workers behind
them, and user-space WAN latency. ``topology.py`` says what it is made of, ``netns.py`` builds and removes it,
``delayd.py`` is the per-link delay daemon (``nfqueue.py`` its messages and schedule)."""

from .errors import DelayDaemonDied, NetlinkError, NetlinkFormatError, NotRootError, TestbedError
from .netns import Testbed, down_stale, in_netns, list_netns, require_root, stale, teardown
from .topology import Host, Kind, Nat, Plan, plan

__all__ = [
    "DelayDaemonDied", "Host", "Kind", "Nat", "NetlinkError", "NetlinkFormatError", "NotRootError", "Plan",
    "Testbed", "TestbedError", "down_stale", "in_netns", "list_netns", "plan", "require_root", "stale", "teardown",
]  # fmt: skip
