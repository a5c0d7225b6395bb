"""A trio event loop in its own thread, callable from asyncio (or any thread) through concurrent futures.

py-libp2p is trio-based and our data path is asyncio: the DHT node lives in one of these, and asyncio code awaits
``asyncio.wrap_future(thread.submit(fn, *args))`` so its own loop never blocks on trio.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import structlog
import trio

from p2p.dht.discovery import DiscoveryClosed, DiscoveryError

log = structlog.get_logger("p2p.dht.kademlia")


class TrioThread:
    """One trio event loop in a daemon thread; other threads hand it calls and get concurrent futures.

    An asyncio caller awaits ``asyncio.wrap_future(submit(...))``, so its loop never blocks, and
    cancelling that await cancels the trio task. Calls still running at stop() fail with
    DiscoveryClosed.
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._thread: threading.Thread | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._nursery: trio.Nursery | None = None
        self._stopping = trio.Event()
        self._stop_requested = False
        self.exited: cf.Future[None] = cf.Future()

    def start(self, serve: Callable[[], Any]) -> cf.Future[None]:
        """Enter the async context manager ``serve()`` (it yields the nursery for calls) in a new thread;
        resolves once entered. stop() makes it exit."""
        ready: cf.Future[None] = cf.Future()
        self._thread = threading.Thread(target=self._main, args=(serve, ready), name=self._name, daemon=True)
        self._thread.start()
        return ready

    def submit(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> cf.Future[Any]:
        future: cf.Future[Any] = cf.Future()

        def spawn() -> None:
            if self._nursery is None or self._stopping.is_set():
                future.set_exception(DiscoveryClosed("the DHT node is stopping"))
            else:
                self._nursery.start_soon(self._run, future, fn, args)

        if self._token is None:
            future.set_exception(DiscoveryError("the DHT node is not running: await start() first"))
            return future
        try:
            self._token.run_sync_soon(spawn)
        except trio.RunFinishedError:
            future.set_exception(DiscoveryClosed("the DHT node has stopped"))
        return future

    def stop(self) -> cf.Future[None]:
        self._stop_requested = True
        if self._thread is None:
            if not self.exited.done():
                self.exited.set_result(None)
        elif self._token is not None:
            try:
                self._token.run_sync_soon(self._stopping.set)
            except trio.RunFinishedError:
                pass  # already gone: exited is (being) resolved
        return self.exited

    def _main(self, serve: Callable[[], Any], ready: cf.Future[None]) -> None:
        try:
            trio.run(self._serve, serve, ready)
        except BaseException as exc:  # reported to whoever waits, never lost in the thread
            if not ready.done():
                ready.set_exception(_unwrap(exc))
            else:
                log.error("dht.node_crashed", error=repr(exc))
        finally:
            self.exited.set_result(None)

    async def _serve(self, serve: Callable[[], Any], ready: cf.Future[None]) -> None:
        async with serve() as nursery:
            self._nursery, self._token = nursery, trio.lowlevel.current_trio_token()
            ready.set_result(None)
            if self._stop_requested:  # close() raced with start()
                self._stopping.set()
            await self._stopping.wait()

    async def _run(self, future: cf.Future[Any], fn: Callable[..., Awaitable[Any]], args: tuple[Any, ...]) -> None:
        token = trio.lowlevel.current_trio_token()
        with trio.CancelScope() as scope:

            def cancel_if_abandoned(done: cf.Future[Any]) -> None:
                if done.cancelled():
                    try:
                        token.run_sync_soon(scope.cancel)
                    except trio.RunFinishedError:
                        pass

            future.add_done_callback(cancel_if_abandoned)
            try:
                result = await fn(*args)
            except Exception as exc:  # handed to the caller
                _settle(future, exc=_unwrap(exc))
            else:
                _settle(future, result=result)
            finally:
                if not future.done():  # cancelled by stop(): the caller must not wait forever
                    _settle(future, exc=DiscoveryClosed("the DHT node stopped during this call"))


def _unwrap(exc: BaseException) -> BaseException:
    """The single error inside trio's exception groups, so callers see what went wrong."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


def _settle(future: cf.Future[Any], *, result: Any = None, exc: BaseException | None = None) -> None:
    try:
        future.set_result(result) if exc is None else future.set_exception(exc)
    except cf.InvalidStateError:
        pass  # the caller cancelled first
