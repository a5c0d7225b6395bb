"""What the QUIC data path (``p2p.quic.endpoint``) can fail with: its application error codes and exception hierarchy.

Kept apart from the aioquic edge so the error vocabulary reads in one place; ``p2p.quic.endpoint`` re-exports every name,
so callers keep importing them from there.
"""

from __future__ import annotations

from enum import IntEnum

from experts.errors import MoeSwarmError
from p2p.identity import PeerId

Address = tuple[str, int]


class ErrorCode(IntEnum):
    """Application error codes on our streams (RESET_STREAM/STOP_SENDING) and connections (CONNECTION_CLOSE)."""

    NO_ERROR = 0
    MESSAGE_TOO_LARGE = 1
    HANDLER_FAILED = 2
    NO_HANDLER = 3
    CANCELLED = 4
    PEER_AUTH_FAILED = 5
    PROTOCOL_VIOLATION = 6
    OVERLOADED = 7  # the serving endpoint's budget (p2p.quic.budget) has no room for this request: retry later or elsewhere


class TransportError(MoeSwarmError):
    """A request on the data path failed."""


class TransportTimeout(TransportError, TimeoutError):
    """No reply within the caller's timeout."""


class PeerAuthError(TransportError):
    """The peer's certificate did not prove the expected peer id, or the peer refused ours."""


class ConnectionLost(TransportError):
    """The connection to a peer ended (closed, idle timeout, endpoint closed) while a request was pending."""

    def __init__(self, peer: PeerId | None, addr: Address | None, reason: str) -> None:
        super().__init__(f"connection to {peer or 'unverified peer'} at {addr} lost: {reason}")
        self.peer = peer
        self.addr = addr
        self.reason = reason


class MessageTooLarge(TransportError):
    """A request or reply exceeds this endpoint's or the peer's ``max_message``."""


class RemoteError(TransportError):
    """The peer reset the stream: its handler failed, it has no handler, or it broke off."""

    def __init__(self, peer: PeerId | None, code: int) -> None:
        name = ErrorCode(code).name if code in ErrorCode._value2member_map_ else str(code)
        super().__init__(f"{peer} reset the request stream: {name}")
        self.peer = peer
        self.code = code
