"""The stage chooser (issue 26): the chain covering every layer with the least estimated latency; gaps, overlaps,
ties, more cheap hops against fewer dear ones, and replacements of a lost stage."""

from __future__ import annotations

import pytest

from node.stage.chooser import Candidate, NoChain, choose_chain, choose_replacement, estimated_ms

N = 24


def c(peer: str, a: int, b: int, rtt: float, price: int = 0) -> Candidate:
    """A stage over layers a..b (inclusive, as the CLI writes them)."""
    return Candidate(peer, range(a, b + 1), rtt, price)


def spans(chain: list[Candidate]) -> list[tuple[str, str]]:
    return [(x.peer, x.span) for x in chain]


def test_the_lowest_rtt_stage_of_each_range_is_chained_in_layer_order():
    """Two replicas per half: the faster of each, in layer order, whatever order the lookup gave."""
    found = [c("b2", 12, 23, 9.0), c("a1", 0, 11, 30.0), c("b1", 12, 23, 4.0), c("a2", 0, 11, 20.0)]
    assert spans(choose_chain(found, N)) == [("a2", "0-11"), ("b1", "12-23")]


def test_a_gap_is_no_chain_and_says_where_it_breaks():
    """Layers 12-13 have no stage: NoChain names the layer the chain stops at and the stages it saw."""
    with pytest.raises(NoChain, match="up to layer 11, none starts at layer 12 of 24 .*0-11, 14-23"):
        choose_chain([c("a", 0, 11, 1.0), c("b", 14, 23, 1.0)], N)
    with pytest.raises(NoChain, match="no reachable stage starts at layer 0"):
        choose_chain([c("b", 12, 23, 1.0)], N)
    with pytest.raises(NoChain, match="stages found: none"):
        choose_chain([], N)


def test_a_chain_must_end_at_the_last_layer():
    """Stages covering 0..19 of 24 layers are no chain."""
    with pytest.raises(NoChain, match="up to layer 19, none starts at layer 20"):
        choose_chain([c("a", 0, 9, 1.0), c("b", 10, 19, 1.0)], N)


def test_overlapping_stages_are_chained_only_where_they_meet():
    """0-15 and 12-23 overlap and do not meet (a stage runs exactly its layers): the chain goes through 0-11."""
    found = [c("wide", 0, 15, 1.0), c("tail", 12, 23, 1.0), c("head", 0, 11, 50.0)]
    assert spans(choose_chain(found, N)) == [("head", "0-11"), ("tail", "12-23")]
    with pytest.raises(NoChain):
        choose_chain([c("wide", 0, 15, 1.0), c("tail", 12, 23, 1.0)], N)


def test_more_cheap_hops_beat_fewer_dear_ones_and_the_hop_cost_can_turn_it():
    """Three hops of 2 ms (9 ms with 1 ms per hop) beat two of 10 ms (22 ms); at 20 ms per hop the two win (60 < 66)."""
    found = [c("x", 0, 11, 10.0), c("y", 12, 23, 10.0), c("p", 0, 7, 2.0), c("q", 8, 15, 2.0), c("r", 16, 23, 2.0)]
    chain = choose_chain(found, N)
    assert [x.peer for x in chain] == ["p", "q", "r"] and estimated_ms(chain) == 9.0
    assert [x.peer for x in choose_chain(found, N, hop_ms=20.0)] == ["x", "y"]
    whole = [*found, c("all", 0, 23, 12.0)]
    assert [x.peer for x in choose_chain(whole, N, hop_ms=20.0)] == ["all"]  # 32 ms in one hop


def test_ties_go_to_fewer_hops_then_the_lower_price_then_the_peer_id():
    """Equal latency: one hop over two; then the cheaper; then the lower peer id (every client picks the same)."""
    one = c("one", 0, 23, 3.0)
    two = [c("h", 0, 11, 1.0), c("t", 12, 23, 1.0)]  # 2 x (1 + 1) = 3 + 1: the same estimate as `one`
    assert [x.peer for x in choose_chain([*two, one], N)] == ["one"]
    assert [x.peer for x in choose_chain([c("dear", 0, 23, 3.0, price=5), c("cheap", 0, 23, 3.0, price=1)], N)] == ["cheap"]
    assert [x.peer for x in choose_chain([c("zz", 0, 23, 3.0), c("aa", 0, 23, 3.0)], N)] == ["aa"]


def test_stages_outside_the_model_are_ignored():
    """A stage past the trunk or an empty one is never chained."""
    found = [c("deep", 0, 30, 0.1), Candidate("empty", range(0), 0.1), c("ok", 0, 23, 5.0)]
    assert [x.peer for x in choose_chain(found, N)] == ["ok"]


def test_a_lost_stage_is_replaced_by_the_fastest_other_stage_of_the_same_layers():
    """Only the same range, never an excluded (lost) peer; None when nobody else runs it."""
    found = [c("lost", 12, 23, 1.0), c("slow", 12, 23, 9.0), c("fast", 12, 23, 3.0), c("other", 0, 11, 0.1), c("part", 12, 17, 0.1)]
    assert choose_replacement(found, range(12, 24), exclude={"lost"}) == found[2]
    assert choose_replacement(found, range(12, 24), exclude={"lost", "fast", "slow"}) is None
