"""`moeswarm join`'s decisions: the part to host from a coverage map, the default memory, the address it may announce."""

from __future__ import annotations

import pytest

from experts.errors import UsageError
from experts.gguf_model import ExpertRange
from node.status.coverage import build_coverage
from node.worker.placement import Part, check_advertise, choose_part, default_budget, host_counts, memory_available
from p2p.dht.records import HostedSlice, HostRecord, issue
from p2p.identity import Identity

DIGEST = "ab" * 32
MB = 1 << 20


def record(layer: int, *ranges: tuple[int, int]) -> HostRecord:
    return issue(Identity.generate(), HostedSlice(DIGEST, layer, ranges, quic_addr="127.0.0.1:9"), seq=1, now=1000.0, ttl=600.0)[0]


def counts_for(n_layer: int, n_expert: int, hosts: dict[int, list[tuple[int, int]]]) -> dict[int, list[int]]:
    records = {layer: [record(layer, r) for r in ranges] for layer, ranges in hosts.items()}
    return host_counts(build_coverage(DIGEST, n_layer, n_expert, records, 1000.0), range(n_layer))


def test_picks_the_experts_no_one_hosts_across_every_layer():
    """Hosts with experts 0-15 of every layer leave 16-31: a joiner with room for them takes exactly those."""
    counts = counts_for(4, 32, {layer: [(0, 16)] for layer in range(4)})
    assert choose_part(counts, range(4), ExpertRange(0, 32), MB, 1024 * MB) == Part(range(4), ExpertRange(16, 32), 0)


def test_empty_swarm_takes_everything_that_fits():
    """With no hosts at all every expert is equally lacking: the joiner takes as many as its memory holds, from 0."""
    counts = counts_for(2, 8, {})
    assert choose_part(counts, range(2), ExpertRange(0, 8), MB, 100 * MB).experts == ExpertRange(0, 8)
    assert choose_part(counts, range(2), ExpertRange(0, 8), MB, 6 * MB) == Part(range(2), ExpertRange(0, 3), 0)


def test_longest_gap_wins_and_a_layer_gap_counts():
    """Experts hosted on every layer but one are lacking (their weakest layer has no host); the longest such run wins."""
    hosts = {0: [(0, 4), (6, 8)], 1: [(0, 8)]}  # 4-5 lack hosts on layer 0 only
    counts = counts_for(2, 16, hosts)  # 8-15 lack hosts everywhere: the longer run
    assert choose_part(counts, range(2), ExpertRange(0, 16), MB, 100 * MB).experts == ExpertRange(8, 16)
    counts = counts_for(2, 8, hosts)
    assert choose_part(counts, range(2), ExpertRange(0, 8), MB, 100 * MB).experts == ExpertRange(4, 6)


def test_short_memory_hosts_the_least_covered_layers():
    """When not one expert of every layer fits, the joiner takes fewer layers: those with the fewest hosts."""
    counts = counts_for(4, 4, {0: [(0, 4)], 1: [(0, 4)], 3: [(0, 4)]})  # layer 2 has no host
    assert choose_part(counts, range(4), ExpertRange(0, 4), MB, 3 * MB) == Part(range(2, 3), ExpertRange(0, 3), 0)


def test_stays_within_the_part_the_file_holds():
    """A slice holds experts 8-15 only: the part is chosen inside it even when other experts lack more."""
    counts = counts_for(2, 16, {0: [(8, 12)], 1: [(8, 12)]})
    assert choose_part(counts, range(2), ExpertRange(8, 16), MB, 100 * MB).experts == ExpertRange(12, 16)


def test_memory_too_small_for_one_expert_is_one_line():
    """A budget below one expert's bytes is a UsageError that names both sizes."""
    with pytest.raises(UsageError, match="does not hold one expert"):
        choose_part(counts_for(1, 4, {}), range(1), ExpertRange(0, 4), 10 * MB, MB)


def test_default_budget_is_a_share_of_mem_available():
    """MemAvailable is read in kB; the default budget is half of it; a meminfo without it asks for --memory."""
    meminfo = "MemTotal:       16000000 kB\nMemFree:         1000000 kB\nMemAvailable:    8000000 kB\n"
    assert memory_available(meminfo) == 8_000_000 * 1024
    assert default_budget(meminfo) == 4_000_000 * 1024
    with pytest.raises(UsageError, match="--memory"):
        memory_available("MemTotal: 1 kB\n")


@pytest.mark.parametrize(
    ("advertise", "bootstrap", "refused"),
    [
        ("0.0.0.0", "127.0.0.1", "wildcard"),
        ("::", "192.0.2.7", "wildcard"),
        ("127.0.0.1", "198.51.100.7", "loopback"),
        ("[::1]", "198.51.100.7", "loopback"),
        ("localhost", "bootstrap.example.org", "loopback"),
        ("127.0.0.1", "0.0.0.0", "bootstrap address names the wildcard"),
        ("127.0.0.1", "127.0.0.1", None),
        ("10.0.0.2", "198.51.100.7", None),
        ("192.0.2.2", "localhost", None),
    ],
)
def test_advertise_addresses_others_cannot_dial_are_refused(advertise, bootstrap, refused):
    """A wildcard is never announced; loopback only to a bootstrap on loopback too."""
    if refused is None:
        check_advertise(advertise, bootstrap)
    else:
        with pytest.raises(UsageError, match=refused):
            check_advertise(advertise, bootstrap)
