"""A worker node's lifecycle as a table (sans-IO).

Theory of operation. A worker starts LOADING (slice warmed, endpoint bound, records announced); once it serves
and is announced it is SERVING. SIGTERM or SIGINT moves it to DRAINING: it withdraws its DHT records, answers
new dispatch requests with ``ErrorCode.DRAINING`` (backbones then ask another replica) and finishes the ones in
flight, within a deadline. Then it is CLOSED. A failure while LOADING or SERVING closes it at once. Any other
move is a bug in the caller and raises ``LocalProtocolError``::

    LOADING  --> SERVING    worker.ready
    LOADING  --> CLOSED     (start-up failed)
    SERVING  --> DRAINING   worker.draining
    SERVING  --> CLOSED     (serving failed)
    DRAINING --> CLOSED     worker.closed
"""

from __future__ import annotations

from enum import StrEnum

from experts.errors import LocalProtocolError


class State(StrEnum):
    LOADING = "loading"
    SERVING = "serving"
    DRAINING = "draining"
    CLOSED = "closed"


TRANSITIONS: dict[State, frozenset[State]] = {
    State.LOADING: frozenset({State.SERVING, State.CLOSED}),
    State.SERVING: frozenset({State.DRAINING, State.CLOSED}),
    State.DRAINING: frozenset({State.CLOSED}),
    State.CLOSED: frozenset(),
}


class Lifecycle:
    """Where a worker node is in ``TRANSITIONS``."""

    def __init__(self) -> None:
        self.state = State.LOADING

    def move(self, to: State) -> None:
        if to not in TRANSITIONS[self.state]:
            raise LocalProtocolError(f"a worker node cannot go from {self.state} to {to}")
        self.state = to
