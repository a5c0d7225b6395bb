"""Run a synchronous forward on the event loop's own thread, so a layer's dispatch needs no thread hop.

Why. The numpy forward is synchronous: it calls its MoE hook, computes the shared expert, then blocks on
``routed.result()``. Run on a thread of its own (``asyncio.to_thread``), every MoE layer costs two thread wake-ups
on the reply's path -- ``run_coroutine_threadsafe`` writes the loop's self-pipe to wake it, the reply's
``concurrent.futures.Future`` wakes the forward through a condition variable -- and GIL hand-offs whenever both
threads want to run (the loop building QUIC packets while the forward computes). With one sequence decoding, the loop
has nothing else to do while the forward computes, so the forward may as well run on it.

How. ``run_on_loop(fn, ...)`` runs ``fn`` in a greenlet on the loop's thread (the device SQLAlchemy's asyncio support
uses to run synchronous code over async drivers). Inside it, a hook that has a coroutine to wait on calls
``start(coro)``: the coroutine becomes a task, the forward gives the loop one turn so that the task puts its request
on the wire, and gets back a Future at once (the forward computes its shared expert during the round trip, as on a
thread). Its ``result()`` switches back to ``run_on_loop``'s coroutine, which awaits the task on the loop and
switches back into the forward with the task done. The loop runs nothing else while the forward computes: a caller
that serves many sequences at once (``node.backbone.batching``) keeps them on threads.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from typing import Any, TypeVar

import greenlet

T = TypeVar("T")


class _Forward(greenlet.greenlet):
    """The greenlet ``run_on_loop`` runs its function in (the marker ``inside`` looks for)."""


class _Turn:
    """Asks ``run_on_loop`` for one turn of the loop (a task just created puts its request on the wire)."""


class _Await:
    """Asks ``run_on_loop`` to await ``future`` on the loop, then to switch back."""

    def __init__(self, future: asyncio.Future[Any]) -> None:
        self.future = future


_TURN = _Turn()


def inside() -> bool:
    """Whether the caller runs inside ``run_on_loop`` (so ``start`` may be used)."""
    return isinstance(greenlet.getcurrent(), _Forward)


class LoopFuture(Future[T]):
    """The Future ``start`` returns: ``result()`` waits by handing the greenlet back to the loop, never by blocking it.

    Only ``result`` (and ``done``/``exception``/callbacks, which Future has) may be used; ``concurrent.futures.wait``
    would block the loop's thread, on which this Future is resolved."""

    def __init__(self, task: asyncio.Task[T]) -> None:
        super().__init__()
        self._task = task
        task.add_done_callback(self._copy)

    def _copy(self, task: asyncio.Task[T]) -> None:
        if task.cancelled():
            self.cancel()
            self.set_running_or_notify_cancel()
        elif (exc := task.exception()) is not None:
            self.set_exception(exc)
        else:
            self.set_result(task.result())

    def result(self, timeout: float | None = None) -> T:
        if not self.done():
            _switch(_Await(self._task))
        return super().result(timeout=0)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        if not self.done():
            _switch(_Await(self._task))
        return super().exception(timeout=0)


def _switch(request: _Turn | _Await) -> None:
    current = greenlet.getcurrent()
    if not isinstance(current, _Forward):
        raise RuntimeError("a LoopFuture is awaited only inside run_on_loop")
    assert current.parent is not None
    current.parent.switch(request)


def start(coro: Coroutine[Any, Any, T]) -> LoopFuture[T]:
    """Run *coro* as a task of the running loop; give the loop one turn so it starts; its Future (inside ``run_on_loop``)."""
    if not inside():
        coro.close()
        raise RuntimeError("start() is for hooks called inside run_on_loop")
    future = LoopFuture(asyncio.get_running_loop().create_task(coro))
    _switch(_TURN)
    return future


async def run_on_loop(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` on this loop's thread; the hooks it calls may ``start`` coroutines and wait for them there.

    An exception of ``fn`` is raised here; a cancellation of this coroutine is raised inside ``fn`` at its wait."""
    forward = _Forward(fn)
    forward.gr_context = contextvars.copy_context()  # the caller's context (structlog's bound values), as a thread gets
    request = forward.switch(*args)
    while not forward.dead:
        try:
            if isinstance(request, _Await):
                await asyncio.wait({request.future})
            else:
                await asyncio.sleep(0)
        except BaseException as exc:  # cancelled: the forward sees it where it waits (and cleans up on its way out)
            request = forward.throw(exc)
        else:
            request = forward.switch()
    return request
