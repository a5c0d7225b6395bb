"""``node.backbone.onloop``: a synchronous function run on the loop's thread waits for coroutines without blocking it."""

from __future__ import annotations

import asyncio
import threading

import pytest

from node.backbone import onloop


def test_a_started_coroutine_runs_on_the_loop_thread_and_its_result_comes_back() -> None:
    """The coroutine's first step runs inside ``start`` (its request is on the wire before the caller computes on),
    everything runs on one thread, and ``result()`` hands back the coroutine's value."""
    seen: list[str] = []

    async def dispatch(n: int) -> int:
        seen.append(f"sent {n} on {threading.get_ident()}")
        await asyncio.sleep(0.01)
        return n * 2

    def forward() -> list[int]:
        out = []
        for n in range(3):
            future = onloop.start(dispatch(n))
            seen.append(f"computing {n}")  # the shared expert, while the round trip is in flight
            out.append(future.result())
        return out

    async def main() -> list[int]:
        assert not onloop.inside()
        return await onloop.run_on_loop(forward)

    assert asyncio.run(main()) == [0, 2, 4]
    me = threading.get_ident()
    assert seen == [s for n in range(3) for s in (f"sent {n} on {me}", f"computing {n}")]


def test_the_loop_keeps_running_while_the_function_waits() -> None:
    """Other tasks (keepalives, the endpoint's receive path) run while the function waits on a coroutine."""
    ticks: list[int] = []

    async def ticker() -> None:
        for i in range(5):
            ticks.append(i)
            await asyncio.sleep(0)

    async def slow() -> str:
        await asyncio.sleep(0.05)
        return "done"

    async def main() -> str:
        task = asyncio.ensure_future(ticker())
        result = await onloop.run_on_loop(lambda: onloop.start(slow()).result())
        await task
        return result

    assert asyncio.run(main()) == "done"
    assert ticks == list(range(5))


def test_failures_surface_where_they_belong() -> None:
    """A coroutine's exception is raised at ``result()``; the function's own exception out of ``run_on_loop``."""

    async def broken() -> None:
        await asyncio.sleep(0)
        raise ValueError("worker said no")

    def forward() -> str:
        with pytest.raises(ValueError, match="worker said no"):
            onloop.start(broken()).result()
        raise KeyError("forward bug")

    with pytest.raises(KeyError, match="forward bug"):
        asyncio.run(onloop.run_on_loop(forward))


def test_cancelling_the_runner_raises_inside_the_waiting_function() -> None:
    """Cancelled while the function waits (a session closing): the function sees CancelledError at its wait."""
    seen: list[str] = []

    def forward() -> None:
        try:
            onloop.start(asyncio.sleep(10)).result()
        except asyncio.CancelledError:
            seen.append("cancelled at result()")
            raise

    async def main() -> None:
        task = asyncio.ensure_future(onloop.run_on_loop(forward))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert seen == ["cancelled at result()"]


def test_start_outside_run_on_loop_is_refused() -> None:
    """``start`` is only for hooks inside ``run_on_loop``: elsewhere it would block the loop at ``result()``."""

    async def main() -> None:
        coro = asyncio.sleep(0)
        with pytest.raises(RuntimeError, match="inside run_on_loop"):
            onloop.start(coro)

    asyncio.run(main())
