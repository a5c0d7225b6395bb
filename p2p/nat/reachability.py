"""Reachability: what address the internet sees us at, whether strangers can reach us there, and what NAT we are behind.

Theory of operation (AutoNAT-style, on the QUIC socket itself). A node A asks peers for its **observed address**
(``Observe`` -> ``Observed``): what source address A's datagram arrived from. Two observers at different IPs that
see the same address mean an endpoint-independent mapping (a cone NAT, punchable); different addresses mean the
mapping depends on the destination (SYMMETRIC). A then asks one observer B for a **dial-back** (``DialBack``): B
picks a helper C that A has not talked to and at another IP than A and B (``DialBackAsk``), and C sends one
``Probe`` to the address B saw A at. A NAT or stateful firewall drops a datagram from a host A never sent to, so
a probe that arrives means PUBLIC; B's ``DialBackStatus`` names C, so A can tell "C's probe did not arrive" (NAT)
from "nobody could try" (no conclusion). ``classify`` turns the evidence into a ``Verdict``; it is a pure function.

Why raw UDP datagrams on the QUIC socket rather than QUIC requests: the mapping we want to learn is that of the
QUIC socket's 5-tuples, so the frames must use that socket; a probe must be able to reach a node that has no
connection with the prober (that is the test); and the frames work before any QUIC connection exists, without a
handshake per question, and without touching the application's request handler. The cost is that UDP is
spoofable, so every frame is signed by its sender (Ed25519, the node's identity key, domain-separated), replies
must echo the request's random 16-byte nonce and come from the address we asked, and a probe counts only from a
signer other than B at an IP we have not contacted (``contact_memory``). Requests are padded to ``MIN_REQUEST``
bytes, which is at least every reply they cause, so no one can use a node to amplify traffic; a helper sends one
probe per ask, no larger than the ask, and only to the address B *observed*, never to one A claims.

Frames use the signed envelope of ``p2p.nat.envelope`` (magic 0x0D "RC"). Sans-IO: no sockets, no asyncio; the clock
(``now``) and the randomness are parameters.
"""

from __future__ import annotations

import collections
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from enum import IntEnum, StrEnum
from typing import ClassVar, Self

import structlog

from p2p.backoff import Backoff
from p2p.identity import Identity, PeerId
from p2p.nat.envelope import (
    HEADER,
    KEY_LEN,
    NONCE_LEN,
    Address,
    Frame,
    FrameError,
    InvalidField,
    Reader,
    SignedCodec,
    check_nonce,
    encode_addr,
    encode_ip,
)
from p2p.ratelimit import RateLimiter

MIN_REQUEST = 176  # requests are padded to this: no reply or probe they cause is larger
MAX_AVOID = 8
MAGIC = b"\x0dRC"
CONTEXT = b"moeswarm/reachability/v1\n"

log = structlog.get_logger("p2p.nat.reachability")


# --- reachability frames --------------------------------------------------------------------------------------------


class ReachType(IntEnum):
    """Frame types of the reachability protocol; a number, once used, is never reused (0 is reserved)."""

    OBSERVE = 1
    OBSERVED = 2
    DIAL_BACK = 3
    DIAL_BACK_STATUS = 4
    DIAL_BACK_ASK = 5
    PROBE = 6


class DialStatus(IntEnum):
    ACCEPTED = 1  # a helper was asked to probe; ``helper`` names it
    NO_HELPER = 2  # no known peer qualifies as a helper
    BUSY = 3  # rate limited


@dataclass(frozen=True)
class Observe:
    """A -> B: "from which address did this datagram come?" (padded: the reply is no larger)."""

    TYPE: ClassVar[int] = ReachType.OBSERVE
    MIN_SIZE: ClassVar[int] = MIN_REQUEST
    nonce: bytes

    def __post_init__(self) -> None:
        check_nonce(self.nonce)

    def body(self) -> bytes:
        return self.nonce

    @classmethod
    def parse(cls, r: Reader) -> Self:
        return cls(r.take(NONCE_LEN, "nonce"))


@dataclass(frozen=True)
class Observed:
    """B -> A: the source address of A's ``Observe``."""

    TYPE: ClassVar[int] = ReachType.OBSERVED
    MIN_SIZE: ClassVar[int] = 0
    nonce: bytes
    observed: Address

    def __post_init__(self) -> None:
        check_nonce(self.nonce)
        encode_addr(self.observed)

    def body(self) -> bytes:
        return self.nonce + encode_addr(self.observed)

    @classmethod
    def parse(cls, r: Reader) -> Self:
        return cls(r.take(NONCE_LEN, "nonce"), r.addr("observed"))


@dataclass(frozen=True)
class DialBack:
    """A -> B: "have a peer at none of the ``avoid`` IPs send a probe to where you see me"."""

    TYPE: ClassVar[int] = ReachType.DIAL_BACK
    MIN_SIZE: ClassVar[int] = MIN_REQUEST
    nonce: bytes
    avoid: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        check_nonce(self.nonce)
        if not isinstance(self.avoid, tuple) or len(self.avoid) > MAX_AVOID:
            raise ValueError(f"avoid holds at most {MAX_AVOID} IPs, as a tuple")
        for ip in self.avoid:
            encode_ip(ip)

    def body(self) -> bytes:
        return self.nonce + bytes([len(self.avoid)]) + b"".join(encode_ip(ip) for ip in self.avoid)

    @classmethod
    def parse(cls, r: Reader) -> Self:
        nonce = r.take(NONCE_LEN, "nonce")
        n = r.u8("avoid")
        if n > MAX_AVOID:
            raise InvalidField(f"avoid: {n} IPs, at most {MAX_AVOID}")
        return cls(nonce, tuple(r.ip("avoid") for _ in range(n)))


@dataclass(frozen=True)
class DialBackStatus:
    """B -> A: whether B asked a helper, and which."""

    TYPE: ClassVar[int] = ReachType.DIAL_BACK_STATUS
    MIN_SIZE: ClassVar[int] = 0
    nonce: bytes
    status: DialStatus
    helper: PeerId | None = None

    def __post_init__(self) -> None:
        check_nonce(self.nonce)
        DialStatus(self.status)
        if (self.helper is None) == (self.status == DialStatus.ACCEPTED):
            raise ValueError("a helper is named exactly when the status is ACCEPTED")

    def body(self) -> bytes:
        return self.nonce + bytes([self.status]) + (self.helper.public_bytes if self.helper else b"")

    @classmethod
    def parse(cls, r: Reader) -> Self:
        nonce, status = r.take(NONCE_LEN, "nonce"), r.u8("status")
        if status not in DialStatus._value2member_map_:
            raise InvalidField(f"status {status} is not a DialStatus")
        return cls(nonce, DialStatus(status), r.peer("helper") if status == DialStatus.ACCEPTED else None)


@dataclass(frozen=True)
class _Targeted:
    """Fields shared by the ask and the probe it causes (so a probe is never larger than its ask)."""

    TYPE: ClassVar[int]
    MIN_SIZE: ClassVar[int] = 0
    nonce: bytes
    target: Address
    requester: PeerId

    def __post_init__(self) -> None:
        check_nonce(self.nonce)
        encode_addr(self.target)

    def body(self) -> bytes:
        return self.nonce + encode_addr(self.target) + self.requester.public_bytes

    @classmethod
    def parse(cls, r: Reader) -> Self:
        return cls(r.take(NONCE_LEN, "nonce"), r.addr("target"), r.peer("requester"))


@dataclass(frozen=True)
class DialBackAsk(_Targeted):
    """B -> C: "send a probe to ``target``, where I see ``requester``"."""

    TYPE: ClassVar[int] = ReachType.DIAL_BACK_ASK


@dataclass(frozen=True)
class Probe(_Targeted):
    """C -> A: the dial-back itself."""

    TYPE: ClassVar[int] = ReachType.PROBE


CODEC = SignedCodec(MAGIC, CONTEXT, (Observe, Observed, DialBack, DialBackStatus, DialBackAsk, Probe))
_REQUESTS = frozenset((ReachType.OBSERVE, ReachType.DIAL_BACK, ReachType.DIAL_BACK_ASK))
_NONCE_AT = HEADER.size + KEY_LEN  # every body starts with its nonce


# --- the decision ---------------------------------------------------------------------------------------------------


class NatKind(IntEnum):
    """What a node is behind (an IntEnum: it travels in ``p2p.nat.holepunch`` frames)."""

    UNKNOWN = 0
    PUBLIC = 1  # a stranger's datagram reached our observed address
    NAT = 2  # one mapping for every destination, strangers filtered: hole punching works
    SYMMETRIC = 3  # a different mapping per destination: punching cannot predict the port


class Outcome(StrEnum):
    ARRIVED = "arrived"
    FAILED = "failed"  # a helper was asked and its probe did not arrive in time
    INCONCLUSIVE = "inconclusive"  # nobody could try (no helper, no answer)


@dataclass(frozen=True)
class Observation:
    observer: PeerId
    observer_addr: Address
    observed: Address
    at: float


@dataclass(frozen=True)
class DialBackResult:
    server: PeerId
    helper: PeerId | None
    outcome: Outcome
    at: float
    detail: str


@dataclass(frozen=True)
class Verdict:
    kind: NatKind
    addresses: tuple[Address, ...]  # observed addresses, newest first
    reason: str


UNKNOWN = Verdict(NatKind.UNKNOWN, (), "no observations yet")


def classify(
    observations: Iterable[Observation], dial_backs: Iterable[DialBackResult], now: float, max_age: float
) -> Verdict:
    """The verdict from the evidence younger than ``max_age`` seconds.

    PUBLIC if a fresh dial-back arrived (a later failure does not erase it until it ages out: a lost probe must not
    demote a public node). Otherwise the mapping decides: fewer than two observer IPs -> UNKNOWN; observed
    addresses that differ between observer IPs -> SYMMETRIC; one address everywhere -> NAT if a dial-back failed,
    else UNKNOWN (stable mapping, but no one could test the filter).
    """
    latest: dict[str, Observation] = {}
    for obs in sorted((o for o in observations if now - o.at <= max_age), key=lambda o: o.at):
        latest[obs.observer_addr[0]] = obs
    by_time = sorted(latest.values(), key=lambda o: o.at, reverse=True)
    addresses = tuple(dict.fromkeys(o.observed for o in by_time))[:4]
    fresh = [d for d in dial_backs if now - d.at <= max_age and d.outcome is not Outcome.INCONCLUSIVE]
    arrived = [d for d in fresh if d.outcome is Outcome.ARRIVED]
    if arrived:
        return Verdict(NatKind.PUBLIC, addresses, f"dial-back from {arrived[-1].helper} arrived")
    if len(latest) < 2:
        return Verdict(NatKind.UNKNOWN, addresses, f"observed by {len(latest)} peer IP(s); 2 are needed")
    if len(addresses) > 1:
        seen = ", ".join(f"{o.observer_addr[0]} saw {o.observed[0]}:{o.observed[1]}" for o in by_time)
        return Verdict(NatKind.SYMMETRIC, addresses, f"mapping depends on the destination ({seen})")
    where = f"{addresses[0][0]}:{addresses[0][1]}"
    if fresh:
        return Verdict(NatKind.NAT, addresses, f"one mapping {where} for {len(latest)} peers; {fresh[-1].detail}")
    return Verdict(NatKind.UNKNOWN, addresses, f"one mapping {where} for {len(latest)} peers; no dial-back concluded")


# --- the protocol engine --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ReachabilityConfig:
    rto: float = 0.5  # first retransmission timeout; doubles per attempt
    attempts: int = 3  # sends of one request before giving up
    probe_wait: float = 2.0  # after B accepted, how long A waits for C's probe
    max_age: float = 300.0  # evidence older than this no longer counts
    contact_memory: float = 180.0  # a NAT may admit an IP this long after we sent to it (UDP conntrack 120 s)
    serve_rate: float = 50.0  # frames answered per second, all sources together
    serve_burst: float = 100.0
    source_rate: float = 2.0  # requests answered per second per source IP; probes sent per second per target IP
    source_burst: float = 10.0


@dataclass(frozen=True)
class Send:
    """Send ``data`` from the QUIC socket to ``addr``."""

    addr: Address
    data: bytes


@dataclass(eq=False)
class _Pending:
    """An ``Observe`` or ``DialBack`` we sent, waiting for its answer (and, for a dial-back, for the probe)."""

    kind: ReachType
    peer: PeerId
    addr: Address
    data: bytes
    due: float  # next retransmission, or the end of the probe wait
    attempts: int = 1
    helper: PeerId | None = None  # set once B accepted


class Reachability:
    """Both sides of the protocol for one node: asks (``observe``, ``dial_back``) and answers whoever asks.

    Feed it every frame with ``datagram_received`` and call ``handle_timer`` at ``get_timer()``; send what they
    return. ``verdict(now)`` is the current conclusion. ``helpers`` are the peers this node may ask to probe for
    others (public peers it knows, e.g. from the DHT).
    """

    def __init__(
        self,
        identity: Identity,
        config: ReachabilityConfig = ReachabilityConfig(),
        *,
        rng: Callable[[int], bytes] = os.urandom,
    ) -> None:
        self.identity = identity
        self.peer_id = identity.peer_id
        self.config = config
        self.helpers: list[tuple[PeerId, Address]] = []
        self._rng = rng
        self._pending: dict[bytes, _Pending] = {}
        self._observations: dict[PeerId, Observation] = {}
        self._dial_backs: collections.deque[DialBackResult] = collections.deque(maxlen=16)
        self._contacted: dict[str, float] = {}
        self._next_helper = 0
        self._total = RateLimiter(config.serve_rate, config.serve_burst, max_keys=1)
        self._per_source = RateLimiter(config.source_rate, config.source_burst)
        self._per_target = RateLimiter(config.source_rate, config.source_burst)  # probes sent to one IP
        self._retransmit = Backoff(first=config.rto)  # uncapped: ``attempts`` bounds it

    # --- asking ---------------------------------------------------------------------------------------------

    def observe(self, peer: PeerId, addr: Address, now: float) -> list[Send]:
        """Ask ``peer`` at ``addr`` where it sees us."""
        return self._ask(ReachType.OBSERVE, peer, addr, now, lambda nonce: Observe(nonce))

    def dial_back(self, peer: PeerId, addr: Address, now: float) -> list[Send]:
        """Ask ``peer`` at ``addr`` for a dial-back by a peer we have not contacted."""
        self._forget_contacts(now)
        avoid = tuple(sorted(self._contacted, key=self._contacted.__getitem__, reverse=True))[:MAX_AVOID]
        return self._ask(ReachType.DIAL_BACK, peer, addr, now, lambda nonce: DialBack(nonce, avoid))

    def note_contacted(self, ip: str, now: float) -> None:
        """Tell that this socket sent to ``ip`` (e.g. a QUIC peer): its datagrams prove nothing for a while."""
        self._contacted.pop(ip, None)
        self._contacted[ip] = now

    @property
    def busy(self) -> bool:
        """Whether a request is still waiting for its answer (or a dial-back for its probe)."""
        return bool(self._pending)

    def observations(self) -> list[Observation]:
        return list(self._observations.values())

    def dial_backs(self) -> list[DialBackResult]:
        return list(self._dial_backs)

    def verdict(self, now: float) -> Verdict:
        return classify(self._observations.values(), self._dial_backs, now, self.config.max_age)

    def get_timer(self) -> float | None:
        return min((p.due for p in self._pending.values()), default=None)

    def handle_timer(self, now: float) -> list[Send]:
        out: list[Send] = []
        for nonce, p in list(self._pending.items()):
            if p.due > now:
                continue
            if p.helper is not None:
                del self._pending[nonce]
                detail = f"dial-back from {p.helper} did not arrive within {self.config.probe_wait} s"
                self._dial_backs.append(DialBackResult(p.peer, p.helper, Outcome.FAILED, now, detail))
            elif p.attempts < self.config.attempts:
                p.attempts += 1
                p.due = now + self._retransmit.delay(p.attempts - 1)
                out.append(Send(p.addr, p.data))
            else:
                del self._pending[nonce]
                log.debug("reachability.no_answer", peer=str(p.peer), addr=p.addr, request=p.kind.name)
                if p.kind == ReachType.DIAL_BACK:
                    detail = f"{p.peer} did not answer the dial-back request"
                    self._dial_backs.append(DialBackResult(p.peer, None, Outcome.INCONCLUSIVE, now, detail))
        return out

    def _ask(
        self, kind: ReachType, peer: PeerId, addr: Address, now: float, make: Callable[[bytes], Frame]
    ) -> list[Send]:
        nonce = self._rng(NONCE_LEN)
        data = CODEC.encode(make(nonce), self.identity)
        self._pending[nonce] = _Pending(kind, peer, addr, data, now + self.config.rto)
        self.note_contacted(addr[0], now)
        return [Send(addr, data)]

    # --- receiving ------------------------------------------------------------------------------------------

    def datagram_received(self, data: bytes, addr: Address, now: float) -> list[Send]:
        """Handle one frame from ``addr``; malformed, unexpected or excess input is logged and dropped.

        Checking a signature costs far more than receiving a datagram, so requests pass the rate limits and
        answers must match a pending nonce *before* the signature is checked.
        """
        self._forget_contacts(now)
        if not self._worth_verifying(data, addr, now):
            return []
        try:
            sender, frame = CODEC.decode(data)
        except FrameError as exc:
            log.debug("reachability.bad_frame", addr=addr, error=f"{type(exc).__name__}: {exc}")
            return []
        if sender == self.peer_id:
            return []
        if isinstance(frame, Observe):
            return [Send(addr, CODEC.encode(Observed(frame.nonce, addr), self.identity))]
        if isinstance(frame, DialBack):
            return self._serve_dial_back(sender, frame, addr)
        if isinstance(frame, DialBackAsk):
            return self._serve_ask(sender, frame, now)
        if isinstance(frame, Probe):
            self._on_probe(sender, frame, addr, now)
        elif isinstance(frame, (Observed, DialBackStatus)):
            self._on_answer(sender, frame, addr, now)
        return []

    def _worth_verifying(self, data: bytes, addr: Address, now: float) -> bool:
        if len(data) < _NONCE_AT + NONCE_LEN:
            return True  # too short for a nonce: decoding refuses it without checking a signature
        if data[4] in _REQUESTS:
            if self._per_source.allow(addr[0], now) and self._total.allow(None, now):
                return True
            log.debug("reachability.rate_limited", addr=addr)
            return False
        return bytes(data[_NONCE_AT : _NONCE_AT + NONCE_LEN]) in self._pending

    def _serve_dial_back(self, requester: PeerId, frame: DialBack, addr: Address) -> list[Send]:
        avoid = {addr[0], *frame.avoid}
        eligible = [(p, a) for p, a in self.helpers if p not in (requester, self.peer_id) and a[0] not in avoid]
        if not eligible:
            status = DialBackStatus(frame.nonce, DialStatus.NO_HELPER)
            return [Send(addr, CODEC.encode(status, self.identity))]
        helper, helper_addr = eligible[self._next_helper % len(eligible)]
        self._next_helper += 1
        ask = DialBackAsk(frame.nonce, addr, requester)
        status = DialBackStatus(frame.nonce, DialStatus.ACCEPTED, helper)
        return [Send(helper_addr, CODEC.encode(ask, self.identity)), Send(addr, CODEC.encode(status, self.identity))]

    def _serve_ask(self, server: PeerId, ask: DialBackAsk, now: float) -> list[Send]:
        if ask.requester == self.peer_id or not self._per_target.allow(ask.target[0], now):
            return []
        probe = Probe(ask.nonce, ask.target, ask.requester)
        log.debug("reachability.probing", target=ask.target, requester=str(ask.requester), server=str(server))
        return [Send(ask.target, CODEC.encode(probe, self.identity))]

    def _on_answer(self, sender: PeerId, frame: Observed | DialBackStatus, addr: Address, now: float) -> None:
        p = self._pending.get(frame.nonce)
        expected = ReachType.OBSERVE if isinstance(frame, Observed) else ReachType.DIAL_BACK
        if p is None or p.kind != expected or p.peer != sender or p.addr != addr or p.helper is not None:
            return
        if isinstance(frame, Observed):
            del self._pending[frame.nonce]
            self._observations[sender] = Observation(sender, addr, frame.observed, now)
        elif frame.status == DialStatus.ACCEPTED:
            p.helper = frame.helper
            p.due = now + self.config.probe_wait
        else:
            del self._pending[frame.nonce]
            detail = f"{sender} found no helper" if frame.status == DialStatus.NO_HELPER else f"{sender} is busy"
            self._dial_backs.append(DialBackResult(sender, None, Outcome.INCONCLUSIVE, now, detail))

    def _on_probe(self, helper: PeerId, probe: Probe, addr: Address, now: float) -> None:
        p = self._pending.get(probe.nonce)
        if p is None or p.kind != ReachType.DIAL_BACK or probe.requester != self.peer_id:
            return
        why = None
        if helper == p.peer or addr[0] == p.addr[0]:
            why = "probe came from the peer we asked, or its IP"
        elif p.helper is not None and helper != p.helper:
            why = f"probe signed by {helper}, but {p.helper} was named"
        elif addr[0] in self._contacted:
            why = f"we sent to {addr[0]} recently: our NAT would admit it anyway"
        if why:
            log.debug("reachability.probe_ignored", helper=str(helper), addr=addr, reason=why)
            return
        del self._pending[probe.nonce]
        detail = f"dial-back from {helper} at {addr[0]} arrived"
        self._dial_backs.append(DialBackResult(p.peer, helper, Outcome.ARRIVED, now, detail))

    def _forget_contacts(self, now: float) -> None:
        horizon = now - self.config.contact_memory
        while self._contacted:
            ip, at = next(iter(self._contacted.items()))
            if at >= horizon:
                break
            del self._contacted[ip]


def choose_observers(peers: Sequence[tuple[PeerId, Address]], count: int) -> list[tuple[PeerId, Address]]:
    """Up to ``count`` peers at pairwise different IPs (observations from one IP say nothing about the mapping)."""
    chosen: dict[str, tuple[PeerId, Address]] = {}
    for peer, addr in peers:
        chosen.setdefault(addr[0], (peer, addr))
    return list(chosen.values())[:count]
