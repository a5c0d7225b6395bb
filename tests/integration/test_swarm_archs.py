"""olmoe / glm4moe / minimax-m2 / gpt-oss / deepseek2 / qwen3next / qwen35moe / kimi-linear / deepseek32 / minimax-m3 through a real local swarm: one worker on the full file, one on a slice file.

One bootstrap serves the whole module and each arch's two workers start once (`arch_swarm`); the demo starts its own."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import pytest

from experts.codecs import Codec
from experts.forward import local_moe
from experts.generate import generate
from experts.gguf_model import GGUFModel
from experts.moe import Partition, grouped_moe
from experts.slices import check_slice
from node.backbone.options import BackboneOptions
from node.backbone.session import backbone_session, wait_for_hosts
from p2p.identity import Identity
from tests.support import moeswarm
from tests.support.engine import local_engine
from tests.support.swarm import Swarm

from ..conftest import ISSUE15_ARCHS, NEW_ARCHS, make_model

pytestmark = pytest.mark.slow
N_TOKENS = 16
PROMPT = [264, 72, 101, 108, 108, 111]
KIMI_ARCHS = ("kimi-linear",)  # issue 27: hybrid KDA / MLA
DSA_ARCHS = ("deepseek32",)  # issue 27: MLA + DeepSeek Sparse Attention (the 22 positions pass its top-k of 16)
MSA_ARCHS = ("minimax-m3",)  # issue 27: MiniMax Sparse Attention (the 22 positions pass its 3 kept blocks of 4)


async def remote_run(model: GGUFModel, boot: str) -> list:
    bb, _ = local_engine(model)
    async with backbone_session(Identity.generate(), model, [boot], bb.kernel, BackboneOptions(codec=Codec.F32)) as moe:
        await wait_for_hosts(moe, model.moe_layers, 1, 60)
        return await asyncio.to_thread(lambda: list(generate(bb, PROMPT, N_TOKENS, moe.hook)))


@pytest.fixture(scope="module")
def bootstrap(tmp_path_factory) -> Iterator[str]:
    """One DHT bootstrap for every arch's swarm: it serves no model, and each arch's workers announce another digest."""
    with Swarm(tmp_path_factory.mktemp("bootstrap")) as cluster:
        yield cluster.start("bootstrap", "bootstrap", "--listen", "127.0.0.1:0").wait_ready()["dht_addrs"][0]


@pytest.fixture(scope="module", params=NEW_ARCHS + ISSUE15_ARCHS + KIMI_ARCHS + DSA_ARCHS + MSA_ARCHS)
def arch_swarm(request, model_dir, tmp_path_factory, bootstrap) -> Iterator[GGUFModel]:
    """Per arch, started once: a worker with experts 0-3 of the full file, one with a `moeswarm slice` of layers 0-2
    and experts 4-7 (cut while the first one loads)."""
    model = GGUFModel(make_model(model_dir, request.param, n_layer=3))
    tmp = tmp_path_factory.mktemp(f"swarm-{request.param}")
    with Swarm(tmp) as cluster:
        full = cluster.start("w0", "worker", "--model", str(model.path), "--experts", "0-3", "--bootstrap", bootstrap)
        sl = tmp / "slice.gguf"
        p = moeswarm("slice", str(model.path), "--layers", "0-2", "--experts", "4-7", "-o", str(sl))
        assert p.returncode == 0, p.stderr
        check_slice(GGUFModel(sl), model.digest)
        sliced = cluster.start("w1", "worker", "--model", str(sl), "--bootstrap", bootstrap)
        for proc in (full, sliced):
            proc.wait_ready()
        yield model


def test_swarm_with_a_slice_file_generates_the_local_tokens(arch_swarm, bootstrap):
    """Experts 0-3 from the full file, 4-7 from a `moeswarm slice` of layers 0-2 (glm4moe's layer 0 is dense): same bits as local."""
    model = arch_swarm
    remote = asyncio.run(remote_run(model, bootstrap))
    bb, store = local_engine(model)
    part = Partition(((0, 4), (4, 8)))
    local = list(generate(bb, PROMPT, N_TOKENS, local_moe(lambda i, x, e, w: grouped_moe(store, part, i, x, e, w))))
    assert [t for t, _ in remote] == [t for t, _ in local]
    assert all(a.tobytes() == b.tobytes() for (_, a), (_, b) in zip(remote, local, strict=True))


@pytest.mark.parametrize("arch", NEW_ARCHS + ISSUE15_ARCHS + KIMI_ARCHS + DSA_ARCHS + MSA_ARCHS)
def test_demo_runs_a_random_model_of_each_new_arch(model_dir, tmp_path, arch):
    """`moeswarm demo --model FILE` (bootstrap, two workers, backbone): the tokens equal the single-process run."""
    model = GGUFModel(make_model(model_dir, arch, n_layer=3))
    p = moeswarm("demo", "--model", str(model.path), "--tokens", "8", "--workers", "2", "--workdir", str(tmp_path / "demo"), "--json", timeout=300)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["tokens"] == 8 and out["identical_to_local"] and out["failed_dispatches"] == 0
    assert all(w["dispatches"] > 0 for w in out["workers"])
