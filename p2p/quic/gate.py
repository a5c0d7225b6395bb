"""Which new QUIC clients get connection state: the endpoint's answer to an Initial flood, sans-IO.

Theory of operation. A server connection costs ~30 KB from the first Initial on, and a genuine Initial also costs a
TLS key exchange and a signature; an attacker can send thousands a second without ever completing a handshake.
``p2p.quic.endpoint.Endpoint`` drops Initials whose packet does not decrypt at once (no state survives them) and asks this gate
about every other new client, given how many unverified (half-open) connections it holds:

=================  ===========================  ============================================
Initial carries    half-open below the cap      half-open at or above the cap
=================  ===========================  ============================================
no token           ACCEPT                       RETRY (stateless, RFC 9000 8.1.2); DROP if
                                                the address is not an IP (relayed: no
                                                address to validate)
our valid token    ACCEPT                       ACCEPT below twice the cap (validated
                                                clients get a second share), else DROP
an invalid token   DROP                         DROP
=================  ===========================  ============================================

So a normal dial costs one round trip, a flood gets Retry packets (smaller than the Initials: no amplification)
instead of state, and a real client that follows the Retry still gets in. Refusals are counted and logged at most
once per ``log_interval`` seconds (a flood must not flood the log). Time is a parameter.
"""

from __future__ import annotations

from enum import Enum

import structlog

log = structlog.get_logger("p2p.quic.endpoint")

MAX_HALF_OPEN = 64  # unverified connections held before new clients must pass a Retry


class Admit(Enum):
    ACCEPT = "accept"
    RETRY = "retry"
    DROP = "drop"


class InitialGate:
    """The table in the module docstring, with a refusal counter."""

    def __init__(self, max_half_open: int = MAX_HALF_OPEN, *, log_interval: float = 1.0) -> None:
        if max_half_open < 1:
            raise ValueError("max_half_open must be at least 1")
        self.max_half_open = max_half_open
        self.log_interval = log_interval
        self.refused = 0
        self._logged_at = float("-inf")

    def admit(self, *, token: bool | None, routable: bool, half_open: int, now: float) -> Admit:
        """``token``: None if the Initial carries none, else whether it is a valid token of ours; ``routable``:
        the source is an IP address (a Retry can reach it)."""
        if token is False:
            return Admit.DROP
        if half_open < self.max_half_open:
            return Admit.ACCEPT
        if token:
            if half_open < 2 * self.max_half_open:
                return Admit.ACCEPT
            return self._refuse(Admit.DROP, "half-open limit, validated clients too", now)
        if routable:
            return self._refuse(Admit.RETRY, "half-open limit: Retry sent", now)
        return self._refuse(Admit.DROP, "half-open limit: relayed Initial dropped", now)

    def _refuse(self, verdict: Admit, reason: str, now: float) -> Admit:
        self.refused += 1
        if now - self._logged_at >= self.log_interval:
            log.warning("quic.half_open_full", reason=reason, refused=self.refused, limit=self.max_half_open)
            self._logged_at = now
        return verdict
