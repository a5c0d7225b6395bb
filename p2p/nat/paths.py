"""Which path we use to each peer (relay, punching, direct) and when we may try to punch again.

Theory of operation. Every peer starts on the RELAY path (a QUIC connection carried by the WebSocket relay). A
hole punch moves it to PUNCHING; a direct QUIC connection verified on the punched path makes it DIRECT; a failed
punch, or a direct path that dies, puts it back on RELAY. All moves are the rows of ``TRANSITIONS``; any other
(state, event) pair is a bug in the caller and raises ``InvalidTransition``. Each row names the structlog event
it logs, so the table is also the list of what operators see::

    RELAY    --PUNCH_STARTED-->    PUNCHING   path.punch_started
    PUNCHING --PUNCH_SUCCEEDED-->  DIRECT     path.upgraded
    PUNCHING --PUNCH_FAILED-->     RELAY      path.punch_failed   backoff grows
    PUNCHING --PUNCH_SKIPPED-->    RELAY      path.punch_skipped  the peer is behind a symmetric NAT: wait ``skip``
    RELAY    --PUNCH_SKIPPED-->    RELAY      path.punch_skipped  we are behind a symmetric NAT: wait ``skip``
    DIRECT   --DIRECT_LOST-->      RELAY      path.downgraded     backoff grows, unless the path was stable

No flapping: every move back to RELAY sets ``retry_at`` and ``may_punch`` is false before it. The delay doubles
with each consecutive failure (``Backoff``); a direct path that lasted ``stable_after`` seconds resets the count.
Sans-IO: time is a parameter.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import structlog

from experts.errors import LocalProtocolError
from p2p import backoff
from p2p.identity import PeerId
from p2p.nat.envelope import Address

log = structlog.get_logger("p2p.nat.paths")


class PathState(StrEnum):
    RELAY = "relay"
    PUNCHING = "punching"
    DIRECT = "direct"


class PathEvent(StrEnum):
    PUNCH_STARTED = "punch_started"
    PUNCH_SUCCEEDED = "punch_succeeded"
    PUNCH_FAILED = "punch_failed"
    PUNCH_SKIPPED = "punch_skipped"
    DIRECT_LOST = "direct_lost"


class Retry(StrEnum):
    """What a transition does to the peer's backoff."""

    KEEP = "keep"
    GROW = "grow"  # one more failure (a direct path that lived ``stable_after`` counts as the first)
    SKIP = "skip"  # wait ``Backoff.skip``


S, E, R = PathState, PathEvent, Retry
TRANSITIONS: dict[tuple[PathState, PathEvent], tuple[PathState, Retry, str]] = {
    (S.RELAY, E.PUNCH_STARTED): (S.PUNCHING, R.KEEP, "path.punch_started"),
    (S.PUNCHING, E.PUNCH_SUCCEEDED): (S.DIRECT, R.KEEP, "path.upgraded"),
    (S.PUNCHING, E.PUNCH_FAILED): (S.RELAY, R.GROW, "path.punch_failed"),
    (S.PUNCHING, E.PUNCH_SKIPPED): (S.RELAY, R.SKIP, "path.punch_skipped"),
    (S.RELAY, E.PUNCH_SKIPPED): (S.RELAY, R.SKIP, "path.punch_skipped"),
    (S.DIRECT, E.DIRECT_LOST): (S.RELAY, R.GROW, "path.downgraded"),
}
del S, E, R


class InvalidTransition(LocalProtocolError):
    """The caller applied an event that the peer's current state does not allow (a local bug)."""


@dataclass(frozen=True)
class Backoff(backoff.Backoff):
    """When to punch again: ``first * factor**(failures-1)`` capped at ``cap`` after failures; ``skip`` after a
    skip (our or the peer's NAT may change, so skipping is not forever)."""

    first: float = 30.0
    cap: float = 1800.0
    stable_after: float = 300.0  # a direct path that lived this long was no failure
    skip: float = 600.0


@dataclass
class PeerPath:
    state: PathState = PathState.RELAY
    failures: int = 0  # consecutive failed punches and short-lived direct paths
    retry_at: float = 0.0  # no punch before this
    since: float = 0.0  # when the current state began
    direct: Address | None = None
    reason: str = ""  # why the last change happened


class PathTable:
    """The path state of every peer we have punched (or tried to); others are on RELAY with no backoff."""

    def __init__(self, backoff: Backoff = Backoff()) -> None:
        self.backoff = backoff
        self._peers: dict[PeerId, PeerPath] = {}

    def get(self, peer: PeerId) -> PeerPath:
        return self._peers.get(peer) or PeerPath()

    def state(self, peer: PeerId) -> PathState:
        return self.get(peer).state

    def may_punch(self, peer: PeerId, now: float) -> bool:
        path = self.get(peer)
        return path.state is PathState.RELAY and now >= path.retry_at

    def peers(self, state: PathState) -> list[PeerId]:
        return [peer for peer, path in self._peers.items() if path.state is state]

    def apply(
        self, peer: PeerId, event: PathEvent, now: float, reason: str = "", direct: Address | None = None
    ) -> PeerPath:
        """Move ``peer`` along its ``TRANSITIONS`` row for ``event`` (logging the row's event) and return its path."""
        path = self._peers.setdefault(peer, PeerPath())
        row = TRANSITIONS.get((path.state, event))
        if row is None:
            raise InvalidTransition(f"{event} is not allowed for {peer} in state {path.state}")
        target, retry, log_event = row
        previous, lived = path.state, now - path.since
        if retry is Retry.SKIP:
            path.retry_at = now + self.backoff.skip
        elif retry is Retry.GROW:
            stable = previous is PathState.DIRECT and self.backoff.lasted(lived)
            path.failures = 1 if stable else path.failures + 1
            path.retry_at = now + self.backoff.delay(path.failures - 1)
        path.direct = direct if target is PathState.DIRECT else None
        path.state, path.since, path.reason = target, now, reason
        fields: dict[str, object] = {"peer": str(peer), "from_state": str(previous), "to_state": str(target), "reason": reason}
        if direct is not None:
            fields["addr"] = f"{direct[0]}:{direct[1]}"
        if target is PathState.RELAY:
            fields["retry_in"] = round(path.retry_at - now, 3)
        if previous is PathState.DIRECT:
            fields["lived"] = round(lived, 3)
        log.info(log_event, **fields)
        return path
