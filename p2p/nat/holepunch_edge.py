"""Runs ``p2p.nat.holepunch`` for one endpoint: moves relayed peers to direct paths and back.

Coordination frames go through the relay link (``RelayTap``), punch and keepalive packets through the QUIC socket
(``EndpointTap``). Whenever a connection opens or closes (the endpoint's ``PathOpened`` / ``PathClosed`` events), a
frame or packet arrives, or the core's timer is due, the manager compares the core's view with the endpoint's
connections: a direct connection that closed is a lost path (``DIRECT -> RELAY``), a connection that the initiator
opened to us while we answered its punch is a success, and (with ``auto``) every peer still reached through the
relay gets a punch attempt when its backoff allows. ``Upgraded`` makes the direct connection the one requests use; ``Downgraded``
closes it, so the endpoint falls back to the relayed connection that stayed open all along.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import structlog

from p2p.identity import PeerId
from p2p.nat.envelope import Address
from p2p.nat.holepunch import (
    PATH_MAGIC,
    Action,
    Dial,
    Downgraded,
    HolePunch,
    SendRelay,
    SendUdp,
    Upgraded,
)
from p2p.nat.paths import PathState
from p2p.nat.reachability import Verdict
from p2p.nat.udp_edge import EndpointTap, RelayLink, RelayTap
from p2p.quic.endpoint import TransportError
from p2p.quic.events import EndpointEvent

log = structlog.get_logger("p2p.nat.holepunch")


class PathManager:
    """``verdict()`` gives this node's current reachability (``ReachabilityService.verdict``). With ``auto``, a
    relayed peer whose punch could not start because that verdict has no address yet is tried again every ``tick``
    seconds (the verdict is read, not announced)."""

    def __init__(
        self,
        tap: EndpointTap,
        relay: RelayLink,
        core: HolePunch,
        *,
        verdict: Callable[[], Verdict],
        auto: bool = True,
        tick: float = 0.5,
    ) -> None:
        self.tap = tap
        self.core = core
        self._auto = auto
        self._verdict = verdict
        self._tick = tick
        self._loop = asyncio.get_running_loop()
        self._wakeup = asyncio.Event()  # something changed: compare again
        self._moved = asyncio.Event()  # the core took an input (``wait_settled`` looks again)
        self._dials: set[asyncio.Task[None]] = set()
        self.relay = RelayTap(relay, self._on_relay_frame)
        tap.on_frames(PATH_MAGIC, self._on_path_packet)
        tap.subscribe(self._on_endpoint_event)
        self._task = self._loop.create_task(self._run())

    @property
    def auto(self) -> bool:
        """Whether relayed peers are punched without a call to ``upgrade``."""
        return self._auto

    @auto.setter
    def auto(self, on: bool) -> None:
        self._auto = on
        self._wakeup.set()

    def state(self, peer: PeerId) -> PathState:
        return self.core.paths.state(peer)

    def upgrade(self, peer: PeerId) -> None:
        """Try to punch to ``peer`` now (if no session runs and its backoff allows)."""
        self._perform(self.core.start(peer, self._verdict(), self._loop.time()))

    async def wait_settled(self, peer: PeerId, timeout: float) -> PathState:
        """The peer's path state once no punch to it runs (or ``TimeoutError``)."""
        async with asyncio.timeout(timeout):
            while self.state(peer) is PathState.PUNCHING:
                self._moved.clear()
                await self._moved.wait()
        return self.state(peer)

    async def close(self) -> None:
        tasks = [self._task, *self._dials]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.tap.unsubscribe(self._on_endpoint_event)
        self.relay.detach()

    # --- inputs ---------------------------------------------------------------------------------------------

    def _on_relay_frame(self, src: PeerId, data: bytes) -> None:
        self._perform(self.core.relay_received(src, data, self._verdict(), self._loop.time()))

    def _on_path_packet(self, data: bytes, addr: Address) -> None:
        self._perform(self.core.udp_received(data, addr, self._loop.time()))

    def _on_endpoint_event(self, event: EndpointEvent) -> None:
        self._wakeup.set()  # compared in _run, not here: the endpoint is mid-way through handling a packet

    async def _run(self) -> None:
        while True:
            now = self._loop.time()
            self._compare(now)
            self._perform(self.core.handle_timer(now))
            self._wakeup.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout_at(self._next_wake(self._loop.time())):
                    await self._wakeup.wait()

    def _compare(self, now: float) -> None:
        """Bring the core in line with the endpoint's connections (see the module docstring)."""
        for peer, addr in self.core.direct().items():
            if addr not in self.tap.paths(peer):
                self._perform(self.core.path_lost(peer, "the direct QUIC connection closed", now))
        for peer, addrs in self.core.awaiting_connection().items():
            arrived = next((a for a in self.tap.paths(peer) if a in addrs), None)
            if arrived is not None:
                self._perform(self.core.connected(peer, arrived, now))
        if self.auto:
            verdict = self._verdict()
            for peer in self.tap.relayed_peers():
                self._perform(self.core.start(peer, verdict, now))

    def _next_wake(self, now: float) -> float | None:
        """When to compare again if nothing happens: the core's timer, or (``auto``) a relayed peer's next chance
        to punch. None: only an event can change anything."""
        times = [self.core.get_timer()]
        if self.auto:
            paths = [self.core.paths.get(peer) for peer in self.tap.relayed_peers()]
            times += [max(p.retry_at, now + self._tick) for p in paths if p.state is PathState.RELAY]
        return min((t for t in times if t is not None), default=None)

    # --- outputs --------------------------------------------------------------------------------------------

    def _perform(self, actions: list[Action]) -> None:
        for action in actions:
            if isinstance(action, SendUdp):
                self.tap.sendto(action.data, action.addr)
            elif isinstance(action, SendRelay):
                self.relay.send(action.peer, action.data)
            elif isinstance(action, Dial):
                task = self._loop.create_task(self._dial(action.peer, action.addr))
                self._dials.add(task)
                task.add_done_callback(self._dials.discard)
            elif isinstance(action, Upgraded):
                self.tap.prefer(action.peer, action.addr)
            elif isinstance(action, Downgraded):
                self.tap.close_path(action.peer, action.addr, action.reason)
        self._wakeup.set()  # every input may have moved the core's timer
        self._moved.set()

    async def _dial(self, peer: PeerId, addr: Address) -> None:
        try:
            await self.tap.dial(peer, addr, timeout=self.core.config.dial_timeout)
        except TransportError as exc:
            self._perform(self.core.dial_failed(peer, f"{type(exc).__name__}: {exc}", self._loop.time()))
        else:
            self._perform(self.core.connected(peer, addr, self._loop.time()))
