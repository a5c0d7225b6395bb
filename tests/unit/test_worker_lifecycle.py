"""The worker node's lifecycle table and the worker's drain (refuse new requests, finish those in flight), in memory."""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest

from experts.codecs import Codec
from experts.errors import LocalProtocolError
from experts.gguf_model import GGUFModel
from experts.slices import ExpertStore
from node.worker.lifecycle import TRANSITIONS, Lifecycle, State
from node.worker.service import Worker
from p2p.identity import Identity
from p2p.wire import messages as wire

from ..conftest import make_model


@pytest.mark.parametrize("start", list(State))
@pytest.mark.parametrize("to", list(State))
def test_every_move_outside_the_table_is_a_local_error(start, to):
    """A move in TRANSITIONS changes the state; any other raises LocalProtocolError and leaves the state."""
    life = Lifecycle()
    life.state = start
    if to in TRANSITIONS[start]:
        life.move(to)
        assert life.state is to
    else:
        with pytest.raises(LocalProtocolError):
            life.move(to)
        assert life.state is start


def test_the_table_runs_loading_serving_draining_closed():
    """The one graceful path visits every state once, and CLOSED is final."""
    life = Lifecycle()
    for state in (State.SERVING, State.DRAINING, State.CLOSED):
        life.move(state)
    assert life.state is State.CLOSED and TRANSITIONS[State.CLOSED] == frozenset()


def test_a_draining_worker_refuses_new_requests_and_answers_those_in_flight(model_dir):
    """After refuse_new a request gets ErrorCode.DRAINING; the one already in flight still gets its reply."""
    model = GGUFModel(make_model(model_dir, "qwen3moe"))
    model_id = wire.model_id_of(bytes.fromhex(model.digest))
    x = np.ones((1, model.cfg.n_embd), dtype=np.float32).tobytes()

    def request() -> bytes:
        return wire.DispatchRequest(os.urandom(16), model_id, 0, Codec.F32, 1, 2, (1, 3), (0.5, 0.5), x).encode()

    async def main():
        worker = Worker(Identity.generate(), ExpertStore(model))
        peer = Identity.generate().peer_id
        try:
            first = asyncio.ensure_future(worker.handle(peer, request()))
            await asyncio.sleep(0)  # one loop step: the first request is now waiting for its batch
            in_flight = worker.in_flight
            worker.refuse_new()
            refused = wire.decode(await worker.handle(peer, request()))
            await worker.idle()
            return in_flight, refused, wire.decode(await first), worker.in_flight
        finally:
            worker.close()

    in_flight, refused, answered, after = asyncio.run(main())
    assert in_flight == 1 and after == 0
    assert isinstance(refused, wire.ErrorReply) and refused.code is wire.ErrorCode.DRAINING
    assert isinstance(answered, wire.DispatchReply) and answered.n_tokens == 1


@pytest.mark.parametrize("why", ["kernel", "budget"])
def test_a_worker_that_cannot_serve_exactly_refuses_to_start(model_dir, tmp_path, monkeypatch, why):
    """A kernel whose rows vary with the batch (a test double), or experts over the memory budget: WorkerNode
    raises the one-line error before binding a socket or announcing anything, and ends CLOSED."""
    from experts.errors import KernelError, SliceError
    from experts.kernels import choose
    from node.worker.node import WorkerNode, WorkerOptions
    from tests.doubles.kernels import VaryingKernel

    monkeypatch.setitem(choose.KERNELS, "varying", lambda threads: VaryingKernel(batch=8))
    model = GGUFModel(make_model(model_dir, "qwen3moe"))
    opts = WorkerOptions(model=model.path, layers=None, experts=None, listen=("127.0.0.1", 0), dht_listen="127.0.0.1:0", bootstrap=(),
                         kernel="varying" if why == "kernel" else "ggml", memory_budget=1024 if why == "budget" else None)
    node = WorkerNode(Identity.generate(), opts)

    async def main():
        async with node:
            pass

    with pytest.raises(KernelError if why == "kernel" else SliceError, match="varying-double|memory budget of 0.0 MB"):
        asyncio.run(main())
    assert node.lifecycle.state is State.CLOSED and not hasattr(node, "endpoint")
