"""What a testbed is made of: namespaces, addresses, links and firewall rules, as data. No I/O here.

One "internet" namespace holds a bridge (the WAN, 10.231.0.0/24). Public hosts and home routers each plug into it
with a veth whose end on their side is called ``wan``. Each router masquerades a LAN (10.231.N.0/24) with one worker
behind it, and filters like a home router: unsolicited WAN input is dropped (``-A INPUT -i wan -j DROP``), and from
the WAN only ESTABLISHED,RELATED traffic is forwarded. That drop rule is what makes hole punching work: without it an
early punch packet leaves a conntrack entry on the router's mapped port and MASQUERADE then remaps the worker's
next packet to a different port.

NAT kinds: ``cone`` is plain MASQUERADE (keeps the source port: endpoint-independent mapping, address-and-port-
dependent filtering); ``symmetric`` is ``MASQUERADE --random-fully`` (a new random port per destination).

Latency: every namespace with a WAN link delays the packets *arriving* on ``wan`` by its link's delay (raw
PREROUTING, so the packet waits before conntrack or NAT ever sees it and the NAT's behaviour is that of a real slow
link). A round trip between two WAN-side hosts (or hosts behind routers) crosses both their ingresses once, so it
costs link(A) + link(B): with every link at RTT/2 any pair is RTT apart; giving the backbone a 0 ms link and workers
20/40/80 ms puts those workers 20/40/80 ms away from it (and a relay at 0 ms next to it, as a provider's edge would
be). Loss is per ingress, i.e. per direction.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass
from enum import StrEnum

from .errors import TestbedError

PREFIX_RE = re.compile(r"^msw[0-9a-z]{1,10}-$")
WAN_NET = "10.231.0"
PREFIXLEN = 24
SWITCH = "inet"
PUBLIC_ROLES = ("pub-bootstrap", "pub-relay", "pub-worker", "backbone")
WAN_IF = "wan"
LAN_IF = "lan"
WORKER_IF = "eth0"
BRIDGE = "br0"
QUEUE = 0


class Kind(StrEnum):
    SWITCH = "switch"
    PUBLIC = "public"
    ROUTER = "router"
    WORKER = "worker"


class Nat(StrEnum):
    CONE = "cone"
    SYMMETRIC = "symmetric"


@dataclass(frozen=True)
class Host:
    """One namespace: `addr` is its address on its uplink (the WAN, or its router's LAN for a worker)."""

    role: str
    kind: Kind
    addr: str | None = None
    lan_addr: str | None = None  # routers: their LAN side (a worker's gateway)
    gateway: str | None = None  # workers: their router's LAN address
    nat: Nat | None = None  # routers
    behind: str | None = None  # workers: their router's role

    @property
    def on_wan(self) -> bool:
        return self.kind in (Kind.PUBLIC, Kind.ROUTER)


@dataclass(frozen=True)
class Plan:
    prefix: str
    hosts: tuple[Host, ...]

    def netns(self, role: str) -> str:
        self.host(role)
        return self.prefix + role

    def host(self, role: str) -> Host:
        for h in self.hosts:
            if h.role == role:
                return h
        raise TestbedError(f"no host {role!r} in this testbed (roles: {', '.join(h.role for h in self.hosts)})")

    @property
    def namespaces(self) -> list[str]:
        return [self.prefix + h.role for h in self.hosts]

    def role_of(self, name: str) -> str:
        """The role for a role name or a full namespace name of this testbed."""
        role = name.removeprefix(self.prefix)
        self.host(role)
        return role


def new_prefix() -> str:
    return f"msw{secrets.token_hex(2)}-"


def normalize_prefix(name: str) -> str:
    """`ab12` -> `mswab12-`; a full `mswab12-` stays as is. Raises TestbedError on anything else."""
    prefix = name if name.startswith("msw") else "msw" + name
    prefix = prefix if prefix.endswith("-") else prefix + "-"
    if not PREFIX_RE.match(prefix):
        raise TestbedError(f"testbed name {name!r} must be 1-10 lowercase letters or digits (namespaces are named msw<NAME>-<role>)")
    return prefix


def router_role(i: int) -> str:
    return f"router-{chr(ord('a') + i)}"


def public_worker_role(i: int) -> str:
    """``pub-worker``, then ``pub-worker-2``, ``pub-worker-3``..."""
    return "pub-worker" if i == 0 else f"pub-worker-{i + 1}"


def plan(prefix: str, routers: tuple[Nat, ...] = (Nat.CONE, Nat.SYMMETRIC), public_workers: int = 1) -> Plan:
    """The standard topology: the four public hosts (plus `public_workers` - 1 more public workers), then one router
    with one worker behind it per entry of `routers`."""
    if not PREFIX_RE.match(prefix):
        raise TestbedError(f"bad testbed prefix {prefix!r}: expected msw<1-10 of [0-9a-z]>-")
    if not 1 <= len(routers) <= 26:
        raise TestbedError(f"a testbed has 1 to 26 routers, not {len(routers)}")
    if not 1 <= public_workers <= 8:
        raise TestbedError(f"a testbed has 1 to 8 public workers, not {public_workers}")
    hosts = [Host(SWITCH, Kind.SWITCH)]
    hosts += [Host(role, Kind.PUBLIC, addr=f"{WAN_NET}.{10 + i}") for i, role in enumerate(PUBLIC_ROLES)]
    hosts += [Host(public_worker_role(i), Kind.PUBLIC, addr=f"{WAN_NET}.{20 + i}") for i in range(1, public_workers)]
    for i, nat in enumerate(routers):
        lan = f"10.231.{i + 1}"
        hosts.append(Host(router_role(i), Kind.ROUTER, addr=f"{WAN_NET}.{101 + i}", lan_addr=f"{lan}.1", nat=Nat(nat)))
        hosts.append(Host(f"worker-{chr(ord('a') + i)}", Kind.WORKER, addr=f"{lan}.2", gateway=f"{lan}.1", behind=router_role(i)))
    return Plan(prefix, tuple(hosts))


def link_delays(p: Plan, rtt_ms: float, links: dict[str, float] | None = None) -> dict[str, float]:
    """One-way ingress delay in ms per WAN-side role: RTT/2 each, except the roles `links` names (see the module doc).

    A worker's role stands for its router's link (the only WAN link on its way)."""
    out = {h.role: rtt_ms / 2 for h in p.hosts if h.on_wan}
    for role, ms in (links or {}).items():
        host = p.host(role)
        if host.kind is Kind.WORKER:
            assert host.behind is not None  # a worker sits behind its router (Plan checks it)
            host = p.host(host.behind)
        if not host.on_wan:
            raise TestbedError(f"{role!r} has no WAN link to delay (give a public host, router or worker)")
        if ms < 0:
            raise TestbedError(f"link delay of {role} must be >= 0 ms, not {ms}")
        out[host.role] = float(ms)
    return out


def link_commands(host: Host) -> list[str]:
    """``ip -batch`` lines configuring `host`'s own interfaces, once its veths exist."""
    lines = ["link set lo up"]
    if host.kind is Kind.SWITCH:
        return lines
    uplink = WORKER_IF if host.kind is Kind.WORKER else WAN_IF
    lines += [f"addr add {host.addr}/{PREFIXLEN} dev {uplink}", f"link set {uplink} up"]
    if host.kind is Kind.ROUTER:
        lines += [f"addr add {host.lan_addr}/{PREFIXLEN} dev {LAN_IF}", f"link set {LAN_IF} up"]
    if host.kind is Kind.WORKER:
        lines.append(f"route add default via {host.gateway}")
    return lines


def sysctls(host: Host) -> dict[str, str]:
    """IPv6 off (no stray router solicitations on the WAN); routers forward."""
    out = {"net/ipv6/conf/all/disable_ipv6": "1", "net/ipv6/conf/default/disable_ipv6": "1"}
    if host.kind is Kind.ROUTER:
        out["net/ipv4/ip_forward"] = "1"
    return out


def iptables_rules(host: Host, delayed: bool) -> str | None:
    """``iptables-restore`` input for `host`, or None if it needs no rules. `delayed`: its WAN ingress goes to NFQUEUE."""
    tables: list[str] = []
    if delayed and host.on_wan:
        # No --queue-bypass: with no daemon bound to the queue the kernel drops the packets.
        tables.append(f"*raw\n-A PREROUTING -i {WAN_IF} -j NFQUEUE --queue-num {QUEUE}\nCOMMIT")
    if host.kind is Kind.ROUTER:
        random_fully = " --random-fully" if host.nat is Nat.SYMMETRIC else ""
        tables.append(f"*nat\n-A POSTROUTING -o {WAN_IF} -j MASQUERADE{random_fully}\nCOMMIT")
        tables.append(
            "*filter\n:INPUT ACCEPT [0:0]\n:FORWARD DROP [0:0]\n:OUTPUT ACCEPT [0:0]\n"
            f"-A INPUT -i {WAN_IF} -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT\n"
            f"-A INPUT -i {WAN_IF} -j DROP\n"
            f"-A FORWARD -i {LAN_IF} -o {WAN_IF} -j ACCEPT\n"
            f"-A FORWARD -i {WAN_IF} -o {LAN_IF} -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT\n"
            "COMMIT"
        )
    return "\n".join(tables) + "\n" if tables else None


def describe(p: Plan) -> dict:
    """The JSON-able view printed by ``moeswarm testbed up``."""
    hosts = {}
    for h in p.hosts:
        entry: dict = {"netns": p.prefix + h.role, "kind": str(h.kind)}
        for key in ("addr", "lan_addr", "gateway", "behind"):
            if getattr(h, key) is not None:
                entry[key] = getattr(h, key)
        if h.nat is not None:
            entry["nat"] = str(h.nat)
        hosts[h.role] = entry
    return {"name": p.prefix, "wan": f"{WAN_NET}.0/{PREFIXLEN}", "hosts": hosts}
