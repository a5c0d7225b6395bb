"""The serve budget (p2p.quic.budget) alone and under RequestStreams: per-connection refusals, global eviction of the
stalest incomplete streams, never of complete ones, and the request deadline; a hand-moved clock, no sockets."""

from __future__ import annotations

import pytest

from p2p.identity import Identity
from p2p.quic.budget import ServeBudget, ServeLimits
from p2p.quic.errors import ErrorCode
from p2p.quic.streams import AbortStream, RequestReceived, RequestStreams, StreamsEvicted

PEER_A, PEER_B = Identity.generate().peer_id, Identity.generate().peer_id
LIMITS = ServeLimits(max_bytes=1000, max_bytes_per_conn=600, max_streams=4, max_streams_per_conn=3, request_deadline=30.0)


def test_per_connection_caps_refuse_without_charging():
    """A stream or a byte past one connection's share is refused with a reason, and nothing of it is charged."""
    budget = ServeBudget(LIMITS)
    for sid in range(3):
        assert not budget.charge("a", sid, 100, now=0.0).refused
    assert "request streams open" in budget.charge("a", 3, 1, now=0.0).refused
    assert "request bytes" in budget.charge("a", 0, 400, now=0.0).refused
    assert budget.held("a") == (3, 300)
    assert not budget.charge("b", 0, 100, now=0.0).refused  # another connection is not affected


def test_global_caps_evict_the_stalest_incomplete_streams():
    """Past the endpoint's byte cap the least recently fed incomplete stream of any connection makes room."""
    budget = ServeBudget(LIMITS)
    budget.charge("a", 0, 500, now=0.0)  # the slow-loris: nothing since t=0
    budget.charge("b", 0, 400, now=5.0)
    charge = budget.charge("c", 0, 300, now=6.0)
    assert charge.refused == "" and charge.evicted == (("a", 0),)
    assert budget.held("a") == (0, 0) and budget.size == 700 and budget.evictions == 1


def test_a_slot_is_freed_by_eviction_too():
    """Past the endpoint's stream cap a new stream evicts the stalest incomplete one."""
    budget = ServeBudget(LIMITS)
    for i, owner in enumerate("abcd"):
        budget.charge(owner, 0, 1, now=float(i))
    assert budget.charge("e", 0, 1, now=9.0).evicted == (("a", 0),)
    assert budget.streams == 4


def test_complete_requests_are_never_evicted():
    """When complete requests (being served) fill the budget, the newcomer is refused instead."""
    budget = ServeBudget(LIMITS)
    budget.charge("a", 0, 500, now=0.0)
    budget.complete("a", 0)
    budget.charge("b", 0, 450, now=1.0)
    budget.complete("b", 0)
    charge = budget.charge("c", 0, 100, now=2.0)
    assert "all complete" in charge.refused and charge.evicted == ()
    budget.release("a", 0)
    assert not budget.charge("c", 0, 100, now=3.0).refused


def test_release_all_forgets_a_closed_connection():
    """A closed connection's streams and bytes are all returned."""
    budget = ServeBudget(LIMITS)
    budget.charge("a", 0, 100, now=0.0)
    budget.charge("a", 4, 200, now=0.0)
    budget.release_all("a")
    assert (budget.streams, budget.size, budget.held("a")) == (0, 0, (0, 0))


def test_limits_must_be_positive():
    """A zero cap is a configuration mistake, refused at once."""
    with pytest.raises(ValueError):
        ServeLimits(max_bytes=0)


def serving(peer, budget):
    return RequestStreams(peer, is_client=False, max_message=10_000, serving=True, stream_timeout=5.0, budget=budget)


def test_request_streams_evict_across_connections_and_answer_the_newcomer():
    """A slow-loris stream on one connection is evicted (OVERLOADED) when another connection's request needs the
    room; the newcomer's request completes."""
    budget = ServeBudget(LIMITS)
    loris, honest = serving(PEER_A, budget), serving(PEER_B, budget)
    assert loris.stream_data(0, b"x" * 600, False, now=0.0) == []
    out = honest.stream_data(0, b"y" * 500, True, now=1.0)
    assert out[0] == StreamsEvicted(((loris, 0),))
    assert out[1] == RequestReceived(0, b"y" * 500)
    assert loris.evict(0) == [AbortStream(0, ErrorCode.OVERLOADED)]
    assert loris.buffered() == 0 and budget.held(loris) == (0, 0)


def test_request_streams_refuse_past_their_share_and_release_on_reply():
    """A connection past its share gets OVERLOADED; answering a request returns its bytes to the budget."""
    budget = ServeBudget(LIMITS)
    streams = serving(PEER_A, budget)
    assert isinstance(streams.stream_data(0, b"a" * 500, True, now=0.0)[0], RequestReceived)
    assert streams.stream_data(4, b"b" * 200, True, now=0.0) == [AbortStream(4, ErrorCode.OVERLOADED)]
    streams.reply(0, b"done")
    assert budget.held(streams) == (0, 0)
    assert isinstance(streams.stream_data(8, b"c" * 200, True, now=0.0)[0], RequestReceived)


def test_a_trickling_request_is_cut_at_the_deadline():
    """A stream that keeps sending a byte at a time but never finishes is reset at request_deadline and freed."""
    budget = ServeBudget(LIMITS)
    streams = serving(PEER_A, budget)
    now = 0.0
    while now < LIMITS.request_deadline - 1:
        assert streams.stream_data(0, b".", False, now=now) == []
        assert streams.handle_timer(now) == []
        now += 4.0  # inside the 5 s idle timeout every time
    assert streams.get_timer() == LIMITS.request_deadline
    assert streams.handle_timer(LIMITS.request_deadline) == [AbortStream(0, ErrorCode.CANCELLED)]
    assert budget.held(streams) == (0, 0)
