"""Runs ``p2p.nat.reachability`` on an endpoint's UDP socket: answers other nodes and keeps our own verdict fresh.

``check()`` asks ``observers`` peers (at different IPs; two suffice, and every peer we ask can no longer serve as
a dial-back helper) where they see us, then one that answered for a dial-back, and returns the verdict.
``start()`` repeats that every ``recheck`` seconds and, in between, asks one observer every ``refresh`` seconds:
that keeps our NAT mapping alive (UDP conntrack forgets an unanswered flow after ~30 s, an answered one after
~120 s) and notices a changed mapping, which triggers a full check at once.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence

import structlog

from p2p.identity import PeerId
from p2p.nat.envelope import Address
from p2p.nat.reachability import MAGIC, UNKNOWN, Reachability, Send, Verdict, choose_observers
from p2p.nat.udp_edge import EndpointTap

log = structlog.get_logger("p2p.nat.reachability")

PeerList = Callable[[], Sequence[tuple[PeerId, Address]]]
HELPERS_REFRESH = 1.0  # seconds between reads of ``peers()`` for the helpers we name to others


class ReachabilityService:
    """``peers()``: public peers we may ask (observers, dial-back servers) and name as helpers for others."""

    def __init__(
        self,
        tap: EndpointTap,
        core: Reachability,
        *,
        peers: PeerList,
        observers: int = 2,
        recheck: float = 300.0,
        refresh: float = 20.0,
        on_change: Callable[[Verdict], None] | None = None,
    ) -> None:
        self.tap = tap
        self.core = core
        self._peers = peers
        self._observers = observers
        self._recheck = recheck
        self._refresh = refresh
        self._loop = asyncio.get_running_loop()
        self._progress = asyncio.Event()
        self._reported: Verdict = UNKNOWN
        self._checked = False
        self.on_change = on_change  # called with each verdict whose kind or addresses differ from the last
        self._tasks: list[asyncio.Task[None]] = []
        self._next_observer = 0
        self._helpers_at = -HELPERS_REFRESH
        tap.on_frames(MAGIC, self._on_frame)
        self._tasks.append(self._loop.create_task(self._timers()))

    @property
    def verdict(self) -> Verdict:
        return self.core.verdict(self._loop.time())

    def start(self) -> None:
        """Check now (unless ``check()`` ran already), then keep the verdict (and our NAT mapping) fresh in the
        background."""
        self._tasks.append(self._loop.create_task(self._maintain()))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()

    async def check(self) -> Verdict:
        """Observe from several peers, ask one of them for a dial-back; the verdict once every answer is in."""
        now = self._loop.time()
        self._refresh_helpers(now, force=True)
        for ip in self.tap.remote_ips():
            self.core.note_contacted(ip, now)
        chosen = choose_observers(self.core.helpers, self._observers)
        for peer, addr in chosen:
            self._send(self.core.observe(peer, addr, now))
        await self._settled()
        answered = {o.observer for o in self.core.observations()}
        server = next(((p, a) for p, a in chosen if p in answered), None)
        if server is not None:
            self._send(self.core.dial_back(*server, self._loop.time()))
            await self._settled()
        return self._report()

    # --- internals ------------------------------------------------------------------------------------------

    def _on_frame(self, data: bytes, addr: Address) -> None:
        now = self._loop.time()
        self._refresh_helpers(now)
        self._send(self.core.datagram_received(data, addr, now))

    def _refresh_helpers(self, now: float, *, force: bool = False) -> None:
        if force or now - self._helpers_at >= HELPERS_REFRESH:
            self.core.helpers = list(self._peers())
            self._helpers_at = now

    def _send(self, sends: list[Send]) -> None:
        for send in sends:
            self.tap.sendto(send.data, send.addr)
        self._progress.set()

    async def _settled(self) -> None:
        while self.core.busy:
            self._progress.clear()
            await self._progress.wait()

    async def _timers(self) -> None:
        while True:
            at = self.core.get_timer()
            self._progress.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(None if at is None else max(0.0, at - self._loop.time())):
                    await self._progress.wait()
            self._send(self.core.handle_timer(self._loop.time()))

    async def _maintain(self) -> None:
        verdict = self._reported if self._checked else await self.check()
        while True:
            deadline = self._loop.time() + self._recheck
            while self._loop.time() < deadline:
                await asyncio.sleep(self._refresh)
                if await self._refreshed_address_changed(verdict):
                    break
            verdict = await self.check()

    async def _refreshed_address_changed(self, verdict: Verdict) -> bool:
        """Ask one observer again (keeps the mapping alive); True if it now sees us elsewhere."""
        candidates = choose_observers(list(self._peers()), self._observers)
        if not candidates:
            return False
        peer, addr = candidates[self._next_observer % len(candidates)]
        self._next_observer += 1
        self._send(self.core.observe(peer, addr, self._loop.time()))
        await self._settled()
        seen = next((o.observed for o in self.core.observations() if o.observer == peer), None)
        return seen is not None and bool(verdict.addresses) and seen not in verdict.addresses

    def _report(self) -> Verdict:
        verdict = self.verdict
        changed = (verdict.kind, verdict.addresses) != (self._reported.kind, self._reported.addresses)
        if changed or not self._checked:
            log.info(
                "reachability.verdict",
                kind=verdict.kind.name,
                addresses=[f"{h}:{p}" for h, p in verdict.addresses],
                reason=verdict.reason,
            )
        self._reported, self._checked = verdict, True
        if changed and self.on_change is not None:
            self.on_change(verdict)
        return verdict
