"""What a joining worker should host, and which address it may announce: the decisions of ``moeswarm join``.

Pure: the caller looks the swarm up (``node.status.coverage.build_coverage``), reads ``/proc/meminfo`` and sizes the
model (``experts.hosting.packed_bytes``); this module only decides.

Theory of operation. A worker hosts one contiguous layer range x one contiguous expert range (the shape of a
``HostedSlice`` record). What the swarm lacks most is the set of experts with the fewest hosts in their weakest
layer; ``choose_part`` takes the longest run of those (lowest start on a tie) and, memory permitting, every layer
of the part the file holds. When the budget is short it first narrows the expert run, still across every layer
(each layer keeps the same share of hosts), and only when not one expert of every layer fits it hosts fewer
layers: the ones least covered for those experts. Memory extra to the run buys nothing the swarm lacks, so the
part never grows past it.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass

from experts.errors import UsageError
from experts.gguf_model import ExpertRange
from node.status.coverage import Coverage

MEMORY_SHARE = 0.5  # of MemAvailable a worker takes by default: the rest stays for the OS, the DHT and other work


@dataclass(frozen=True)
class Part:
    """The layers x experts to host, and how many hosts the least covered of them had (the swarm's need)."""

    layers: range
    experts: ExpertRange
    hosts_before: int

    def describe(self) -> str:
        return f"layers {self.layers.start}-{self.layers.stop - 1} experts {self.experts.start}-{self.experts.stop - 1}"


def host_counts(coverage: Coverage, moe_layers: Sequence[int]) -> dict[int, list[int]]:
    """Per MoE layer, how many hosts serve each expert (from the coverage map's cells)."""
    counts = {layer: [0] * coverage.n_expert for layer in moe_layers}
    for cell in coverage.cells:
        if cell.layer in counts:
            for e in range(cell.start, cell.stop):
                counts[cell.layer][e] = len(cell.hosts)
    return counts


def _longest_run(values: Sequence[int], within: range) -> range:
    """The longest run of indices in *within* whose value is the minimum over *within* (first on a tie)."""
    low = min(values[i] for i in within)
    best = range(within.start, within.start)
    start = None
    for i in [*within, within.stop]:
        inside = i < within.stop and values[i] == low
        if inside and start is None:
            start = i
        elif not inside and start is not None:
            if i - start > len(best):
                best = range(start, i)
            start = None
    return best


def choose_part(counts: dict[int, list[int]], layers: range, experts: ExpertRange, unit_bytes: int, budget: int) -> Part:
    """The least covered layers x experts within *layers* x *experts* (what the file holds) that fit *budget*.

    *counts*: hosts per expert of each MoE layer in *layers* (``host_counts``); *unit_bytes*: what one expert of one
    layer takes (its packed bytes, the largest over the layers). A UsageError when not one expert fits.
    """
    moe = [layer for layer in layers if layer in counts]
    if not moe:
        raise UsageError(f"layers {layers.start}-{layers.stop - 1} of this file have no experts to host")
    span = range(experts.start, experts.stop)
    weakest = [min(counts[layer][e] for layer in moe) for e in range(max(span.stop, 1))]
    run = _longest_run(weakest, span)
    fit = budget // max(unit_bytes, 1)  # layer-experts that fit
    if fit < 1:
        raise UsageError(f"the memory this worker may use ({budget / 2**20:.1f} MB) does not hold one expert of one layer ({unit_bytes / 2**20:.1f} MB); give more with --memory")
    if fit >= len(moe):  # every layer, as many experts of the run as fit
        width = min(len(run), fit // len(moe))
        return Part(layers, ExpertRange(run.start, run.start + width), weakest[run.start])
    width = min(len(run), fit)
    depth = fit // width
    chosen = ExpertRange(run.start, run.start + width)
    # Windows of `depth` MoE layers, scored by the hosts their chosen experts already have (fewest first).
    windows = [moe[i : i + depth] for i in range(len(moe) - depth + 1)]
    best = min(windows, key=lambda w: sum(counts[layer][e] for layer in w for e in range(chosen.start, chosen.stop)))
    return Part(range(best[0], best[-1] + 1), chosen, min(counts[layer][e] for layer in best for e in range(chosen.start, chosen.stop)))


def memory_available(meminfo: str) -> int:
    """``MemAvailable`` of a ``/proc/meminfo`` text, in bytes (what Linux says can be used without swapping)."""
    for line in meminfo.splitlines():
        name, _, value = line.partition(":")
        if name == "MemAvailable":
            amount, _, unit = value.strip().partition(" ")
            return int(amount) * (1024 if unit.strip() == "kB" else 1)
    raise UsageError("/proc/meminfo has no MemAvailable line; give the memory this worker may use with --memory")


def default_budget(meminfo: str, share: float = MEMORY_SHARE) -> int:
    return int(memory_available(meminfo) * share)


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None  # a DNS name


def is_loopback_host(host: str) -> bool:
    ip = _ip(host)
    return host == "localhost" if ip is None else ip.is_loopback


def check_advertise(advertise_host: str, bootstrap_host: str) -> None:
    """Refuse to announce an address that the swarm behind *bootstrap_host* cannot dial (a UsageError, one line).

    A wildcard is no address at all (nor is it a bootstrap's); a loopback address reaches only this machine, so it is
    refused unless the bootstrap is on loopback too (a swarm on one machine).
    """
    boot = _ip(bootstrap_host)
    if boot is not None and boot.is_unspecified:
        raise UsageError(f"the bootstrap address names the wildcard {bootstrap_host} (what a bootstrap started with a wildcard --listen prints): put the bootstrap machine's address in its place")
    ip = _ip(advertise_host)
    if ip is not None and ip.is_unspecified:
        raise UsageError(f"refusing to announce the wildcard address {advertise_host} to the swarm at {bootstrap_host}: nobody can dial it; give --advertise HOST:PORT with this machine's address as the others reach it (or leave --advertise out to use the address that routes to the bootstrap)")
    if is_loopback_host(advertise_host) and not is_loopback_host(bootstrap_host):
        raise UsageError(f"refusing to announce the loopback address {advertise_host} to the swarm at {bootstrap_host}, which is on another machine: only this machine could dial it; give --advertise HOST:PORT with this machine's address as the others reach it")
