"""The stage service and RemoteStage over real QUIC on loopback (issue 26): a chain of two remote stages gives a
local run's tokens bit for bit, a restarted stage is a gap the chain replays, a dead one is lost and replaced, and
bad passes get error replies (the service never crashes)."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable

import numpy as np
import pytest

from experts.errors import LocalProtocolError
from experts.forward import Backbone, MoeFfn, local_moe
from experts.generate import generate
from experts.gguf_model import GGUFModel
from experts.moe import ungrouped_moe
from experts.slices import ExpertStore
from experts.stage_forward import StageChain, StagedBackbone, StageGap, StageLink, StageLost, StageRunner
from node.stage.link import RemoteStage
from node.stage.rows import rows_bytes, session_id
from node.stage.service import StageService
from p2p.identity import Identity
from p2p.quic.endpoint import Endpoint
from p2p.wire import messages as wire

from ..conftest import make_model

PROMPT = [1, 5, 9, 2, 7, 5, 9, 2]
N_TOKENS = 6
BOUND_S = 120.0  # every test's loop is bounded in time


def bounded(test: Callable[..., Awaitable[None]]) -> Callable[..., None]:
    @functools.wraps(test)  # pytest reads the fixtures from the wrapped signature
    def run(*args: object, **kwargs: object) -> None:
        asyncio.run(asyncio.wait_for(test(*args, **kwargs), BOUND_S))

    return run


def experts_hook(model: GGUFModel) -> MoeFfn:
    store = ExpertStore(model)
    return local_moe(lambda i, x, e, w: ungrouped_moe(store, i, x, e, w))


@pytest.fixture(scope="module")
def full(model_dir) -> GGUFModel:
    return GGUFModel(make_model(model_dir, "qwen3moe", n_layer=4))


class Stages:
    """Stage services on loopback endpoints and the client's endpoint, all on one loop (the test's)."""

    def __init__(self, full: GGUFModel) -> None:
        self.full, self.hook = full, experts_hook(full)
        self.servers: list[tuple[Endpoint, StageService]] = []

    async def serve(self, layers: range) -> tuple[Endpoint, StageService]:
        service = StageService(StageRunner(self.full, layers), self.hook)
        endpoint = await Endpoint.bind(Identity.generate(), "127.0.0.1", 0, handler=service.handle, max_datagram_size=16384)
        self.servers.append((endpoint, service))
        return endpoint, service

    def link(self, endpoint: Endpoint, layers: range, timeout: float = 10.0) -> RemoteStage:
        return RemoteStage(self.client, asyncio.get_running_loop(), endpoint.local_addr, endpoint.peer_id, self.full.digest, layers, timeout)

    async def __aenter__(self) -> Stages:
        self.client = await Endpoint.bind(Identity.generate(), "127.0.0.1", 0, handler=None, max_datagram_size=16384)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.client.close()
        for endpoint, service in self.servers:
            await endpoint.close()
            service.close()


def local_tokens(full: GGUFModel) -> list[int]:
    want = [t for t, _ in generate(Backbone(full), PROMPT, N_TOKENS, experts_hook(full))]
    assert len(set(want)) > 1  # a run that could hide a wrong hop
    return want


def staged_tokens(staged: StagedBackbone, before_token=None) -> list[int]:
    out = []
    no_experts = local_moe(lambda *a: pytest.fail("a client computes no experts"))
    for i, (t, _) in enumerate(generate(staged, PROMPT, N_TOKENS, no_experts, cache=staged.new_cache(f"run{id(staged)}"))):
        out.append(t)
        if before_token:
            before_token(i)
    return out


@bounded
async def test_two_remote_stages_give_the_local_tokens_and_a_lost_stage_is_replaced(full):
    want = local_tokens(full)
    async with Stages(full) as stages:
        (a, _), (b, b_service) = await stages.serve(range(0, 2)), await stages.serve(range(2, 4))
        links: list[StageLink] = [stages.link(a, range(0, 2)), stages.link(b, range(2, 4), timeout=3.0)]
        staged = StagedBackbone(full, StageChain(links, lambda hop, lost: pytest.fail("no stage was lost")))
        assert await asyncio.to_thread(staged_tokens, staged) == want
        assert b_service.passes == N_TOKENS  # the prompt in one pass, then one per decoded token but the last

        # Stage 2 dies mid-run; its replacement (a fresh process's state: nothing held) gets every input replayed.
        loop = asyncio.get_running_loop()
        replacements = []

        async def replacement() -> RemoteStage:
            endpoint, _ = await stages.serve(range(2, 4))
            return stages.link(endpoint, range(2, 4))

        def replace(hop: int, lost: StageLink) -> StageLink:
            assert hop == 1
            link = asyncio.run_coroutine_threadsafe(replacement(), loop).result()
            replacements.append(link)
            return link

        chain = StageChain([stages.link(a, range(0, 2)), stages.link(b, range(2, 4), timeout=3.0)], replace)
        staged = StagedBackbone(full, chain)

        def kill_after_two(i: int) -> None:
            if i == 2:
                asyncio.run_coroutine_threadsafe(b.close(), loop).result()

        assert await asyncio.to_thread(staged_tokens, staged, kill_after_two) == want
        assert len(replacements) == 1 and chain.replays >= 1


@bounded
async def test_a_restarted_stage_is_a_gap_the_chain_replays(full):
    """A stage that lost the session (here: it forgot it) answers STAGE_GAP with held 0; the chain replays."""
    want = local_tokens(full)
    async with Stages(full) as stages:
        (a, _), (b, b_service) = await stages.serve(range(0, 2)), await stages.serve(range(2, 4))
        chain = StageChain([stages.link(a, range(0, 2)), stages.link(b, range(2, 4))], lambda hop, lost: pytest.fail("a gap is no loss"))
        staged = StagedBackbone(full, chain)
        assert await asyncio.to_thread(staged_tokens, staged, lambda i: b_service.runner.sessions.clear() if i == 3 else None) == want
        assert chain.replays == 1


@bounded
async def test_a_gap_reply_carries_held_and_bad_passes_get_error_replies(full):
    async with Stages(full) as stages:
        endpoint, service = await stages.serve(range(0, 2))
        link = stages.link(endpoint, range(0, 2))
        x = np.random.default_rng(0).standard_normal((3, full.cfg.n_embd)).astype(np.float32)
        await asyncio.to_thread(link.run, "s", x, 0)
        with pytest.raises(StageGap) as gap:
            await asyncio.to_thread(link.run, "s", x, 5)
        assert gap.value.held == 3

        async def ask(payload: bytes) -> wire.ErrorReply:
            reply = wire.decode(await stages.client.request(endpoint.local_addr, endpoint.peer_id, payload, timeout=10))
            assert isinstance(reply, wire.ErrorReply)
            return reply

        model_id, width = wire.model_id_of(bytes.fromhex(full.digest)), full.cfg.n_embd
        nan = x.copy()
        nan[1, 2] = np.nan
        cases = [
            (b"not a message", wire.ErrorCode.MALFORMED),
            (wire.StagePass(session_id("s"), bytes(16), (0, 2), 0, 3, width, rows_bytes(x)).encode(), wire.ErrorCode.UNKNOWN_MODEL),
            (wire.StagePass(session_id("s"), model_id, (0, 3), 0, 3, width, rows_bytes(x)).encode(), wire.ErrorCode.NOT_HOSTED),
            (wire.StagePass(session_id("s"), model_id, (0, 2), 0, 3, width, rows_bytes(nan)).encode(), wire.ErrorCode.MALFORMED),
            (wire.StagePass(session_id("s"), model_id, (0, 2), 0, 1, width - 1, bytes(4 * (width - 1))).encode(), wire.ErrorCode.MALFORMED),
            (wire.StagePass(session_id("s"), model_id, (0, 2), full.cfg.context_length, 1, width, rows_bytes(x[:1])).encode(), wire.ErrorCode.MALFORMED),
            (wire.Hello(wire.Role.BACKBONE, (1,), (0,)).encode(), wire.ErrorCode.MALFORMED),
        ]
        for payload, code in cases:
            assert (await ask(payload)).code is code
        assert service.errors == len(cases) + 1  # and the gap
        pong = wire.decode(await stages.client.request(endpoint.local_addr, endpoint.peer_id, wire.Ping(7, 1).encode(), timeout=10))
        assert pong == wire.Pong(7, 1)
        # still serving: the session's held rows are intact after all that
        assert (await asyncio.to_thread(link.run, "s", x[:1], 3)).shape == (1, width)


@bounded
async def test_an_unreachable_stage_is_lost(full):
    async with Stages(full) as stages:
        endpoint, _ = await stages.serve(range(0, 2))
        link = stages.link(endpoint, range(0, 2), timeout=1.0)
        await endpoint.close()
        with pytest.raises(StageLost, match="did not answer"):
            await asyncio.to_thread(link.run, "s", np.zeros((1, full.cfg.n_embd), np.float32), 0)
        with pytest.raises(LocalProtocolError, match="thread"):
            link.run("s", np.zeros((1, full.cfg.n_embd), np.float32), 0)  # on the loop: refused, never a deadlock
