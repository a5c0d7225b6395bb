"""Stages as real processes (issue 26): a client chaining two `moeswarm stage` processes over QUIC gets a local run's
greedy tokens bit for bit, also when the second stage is SIGKILLed mid-run and a replacement process takes over (the
chain replays every input the dead stage had, rebuilding its KV)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest

from experts.forward import Backbone, MoeFfn, local_moe
from experts.generate import generate
from experts.gguf_model import GGUFModel
from experts.kernels import make_kernel
from experts.moe import Partition, grouped_moe, ungrouped_moe
from experts.slices import ExpertStore
from experts.stage_forward import StageChain, StagedBackbone, StageLink
from node.launcher import NodeProcess
from node.stage.link import RemoteStage
from p2p.identity import Identity, PeerId
from p2p.quic.endpoint import Endpoint
from tests.support.swarm import Swarm

from ..conftest import make_model

pytestmark = pytest.mark.slow
PROMPT = [1, 5, 9, 2, 7, 5, 9, 2]
N_TOKENS = 8
KILL_AT = 3  # the token after which stage 2 is SIGKILLed
LOOPBACK_DATAGRAM = "16384"
HOP_TIMEOUT_S = 5.0  # a dead stage is given up on after this long (then replaced)
BOUND_S = 240.0


@pytest.fixture(scope="module")
def full(model_dir) -> GGUFModel:
    return GGUFModel(make_model(model_dir, "qwen3moe", n_layer=4))


def local_tokens(full: GGUFModel) -> list[int]:
    """Greedy tokens of one process running the whole model, experts in slot order (the stages' --experts all)."""
    kernel = make_kernel("reference", 1)
    store = ExpertStore(full)
    hook: MoeFfn = local_moe(lambda i, x, e, w: ungrouped_moe(store, i, x, e, w))
    return [t for t, _ in generate(Backbone(full, kernel), PROMPT, N_TOKENS, hook)]


def stage(swarm: Swarm, name: str, full: GGUFModel, layers: str, *extra: str) -> NodeProcess:
    return swarm.start(name, "stage", "--model", str(full.path), "--layers", layers, "--kernel", "reference", "--threads", "1", "--max-datagram", LOOPBACK_DATAGRAM, *extra)


def run_client(full: GGUFModel, ready: list[dict], replace: Callable[[int, StageLink], dict] | None = None, after_token: Callable[[int], None] | None = None) -> tuple[list[int], StageChain]:
    """The client in this process: its own endpoint, a RemoteStage per ready stage, greedy tokens off the loop."""

    async def main() -> tuple[list[int], StageChain]:
        loop = asyncio.get_running_loop()
        endpoint = await Endpoint.bind(Identity.generate(), "127.0.0.1", 0, handler=None, max_datagram_size=int(LOOPBACK_DATAGRAM))

        def link(info: dict) -> RemoteStage:
            host, port = info["quic_addr"].rsplit(":", 1)
            a, b = (int(v) for v in info["layers"].split("-"))
            assert info["model_digest"] == full.digest
            return RemoteStage(endpoint, loop, (host, int(port)), PeerId.from_string(info["peer_id"]), full.digest, range(a, b + 1), HOP_TIMEOUT_S)

        chain = StageChain([link(info) for info in ready], lambda hop, lost: link(replace(hop, lost)) if replace else pytest.fail("no stage may be lost"))
        staged = StagedBackbone(full, chain, make_kernel("reference", 1))
        no_experts = local_moe(lambda *a: pytest.fail("the client computes no experts"))

        def tokens() -> list[int]:
            out = []
            for i, (t, _) in enumerate(generate(staged, PROMPT, N_TOKENS, no_experts, cache=staged.new_cache("client"))):
                out.append(t)
                if after_token:
                    after_token(i)
            return out

        try:
            return await asyncio.to_thread(tokens), chain
        finally:
            await endpoint.close()

    return asyncio.run(asyncio.wait_for(main(), BOUND_S))


def test_two_stage_processes_give_the_local_tokens_and_survive_a_sigkill(full, tmp_path):
    want = local_tokens(full)
    assert len(set(want)) > 1
    with Swarm(tmp_path) as swarm:
        first, second = stage(swarm, "stage1", full, "0-1"), stage(swarm, "stage2", full, "2-3")
        ready = [first.wait_ready(), second.wait_ready()]
        assert [r["role"] for r in ready] == ["stage", "stage"]
        got, chain = run_client(full, ready)
        assert got == want and chain.replays == 0

        started: list[float] = []

        def kill(i: int) -> None:
            if i == KILL_AT:
                second.kill()  # SIGKILL: no goodbye, the client learns it by its hop timing out
                started.append(time.monotonic())

        def replace(hop: int, lost: StageLink) -> dict:
            assert hop == 1 and lost.layers == range(2, 4) and second.proc is not None and second.proc.poll() is not None
            return stage(swarm, "stage2b", full, "2-3").wait_ready()

        got, chain = run_client(full, ready, replace, kill)
        assert got == want
        assert started and chain.replays == 1
        assert "stage.ready" in (tmp_path / "stage2b.log").read_text()


def test_stages_whose_experts_come_from_worker_processes_give_the_grouped_local_tokens(full, tmp_path):
    """Each stage dispatches its MoE layers to two real workers (experts 0-3 and 4-7) and computes none itself
    (--remote-experts-only): the tokens equal one process summing the same two groups in protocol order."""
    part = Partition.even(full.cfg.n_expert, 2)
    store = ExpertStore(full)
    hook: MoeFfn = local_moe(lambda i, x, e, w: grouped_moe(store, part, i, x, e, w))
    want = [t for t, _ in generate(Backbone(full, make_kernel("reference", 1)), PROMPT, N_TOKENS, hook)]
    assert len(set(want)) > 1
    with Swarm(tmp_path) as swarm:
        boot = swarm.start("bootstrap", "bootstrap", "--listen", "127.0.0.1:0").wait_ready()["dht_addrs"][0]
        workers = [
            swarm.start(f"worker{g}", "worker", "--model", str(full.path), "--experts", f"{a}-{b - 1}", "--bootstrap", boot, "--kernel", "reference", "--threads", "1", "--max-datagram", LOOPBACK_DATAGRAM, "--no-ledger")
            for g, (a, b) in enumerate(part.bounds)
        ]
        for w in workers:
            w.wait_ready()
        remote = ("--experts", "remote", "--remote-experts-only", "--bootstrap", boot, "--wait-hosts", "2", "--spot-check", "0")
        stages = [stage(swarm, "stage1", full, "0-1", *remote), stage(swarm, "stage2", full, "2-3", *remote)]
        got, chain = run_client(full, [s.wait_ready(90) for s in stages])
        assert got == want and chain.replays == 0
