"""MTP drafts through the CLI in a real local swarm and through the gateway's engine: plain decoding's tokens."""

from __future__ import annotations

import asyncio
import json

import pytest

from experts.forward import Backbone, local_moe
from experts.generate import Sampling, generate
from experts.gguf_model import GGUFModel
from experts.moe import Partition, grouped_moe
from experts.slices import ExpertStore
from experts.tokenizer import Tokenizer
from node.backbone.batching import BatchingMoE
from node.backbone.prefix_cache import PrefixCache
from node.gateway.engine import Engine
from node.gateway.openai import Job
from node.launcher import Cluster
from tests.support import moeswarm, run_bounded

from ..conftest import make_model

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("arch", ["glm4moe", "deepseek2"])
def test_generate_with_the_mtp_drafter_gives_the_plain_tokens(model_dir, tmp_path, arch):
    """Workers hold the trunk's experts; the backbone runs the MTP block itself: same tokens, drafts made and verified."""
    model = GGUFModel(make_model(model_dir, arch, n_layer=3))
    with Cluster(tmp_path) as cluster:
        boot = cluster.start("bootstrap", "bootstrap", "--listen", "127.0.0.1:0").wait_ready()["dht_addrs"][0]
        cluster.start("w0", "worker", "--model", str(model.path), "--bootstrap", boot).wait_ready()
        base = ["backbone", "generate", "--model", str(model.path), "--bootstrap", boot, "--tokens", "12", "--wire", "f32", "--json", "--data-dir", str(tmp_path / "bb"), "hello hello"]
        runs = [moeswarm(*base, *extra, timeout=300) for extra in (("--no-speculative",), ("--drafter", "mtp"))]
    assert all(p.returncode == 0 for p in runs), [p.stderr[-3000:] for p in runs]
    plain, mtp = (json.loads(p.stdout.strip().splitlines()[-1]) for p in runs)
    assert mtp["token_ids"] == plain["token_ids"] and len(plain["token_ids"]) == 12
    assert mtp["speculative"]["drafter"] == "mtp" and mtp["speculative"]["drafted"] > 0 and mtp["failed_dispatches"] == 0, mtp


def test_mtp_drafter_is_refused_for_a_model_without_nextn_blocks(model_dir, tmp_path):
    """A qwen2moe has no MTP block: one line naming the fix, before any worker is asked."""
    model = make_model(model_dir, "qwen2moe", n_layer=1, n_embd=32, n_ff_exp=16)
    with Cluster(tmp_path) as cluster:
        boot = cluster.start("bootstrap", "bootstrap", "--listen", "127.0.0.1:0").wait_ready()["dht_addrs"][0]
        p = moeswarm("backbone", "generate", "--model", str(model), "--bootstrap", boot, "--drafter", "mtp", "--data-dir", str(tmp_path / "bb"), "hi", timeout=120)
    assert p.returncode != 0 and "has no MTP (nextn) blocks; draft with --drafter ngram" in p.stderr, p.stderr[-2000:]


def test_the_gateway_engine_decodes_concurrent_greedy_jobs_with_mtp_drafts(model_dir):
    """Two jobs at once, then again from the prefix cache (the MTP block then starts mid-prompt): plain decoding's text."""
    model = GGUFModel(make_model(model_dir, "glm4moe", n_layer=3))
    store, whole = ExpertStore(model), Partition(((0, model.cfg.n_expert),))
    tok, bb = Tokenizer.from_spec(model.tokenizer_spec), Backbone(model)
    prompts = [tok.encode(p) for p in ("hello hello hello", "the cat sat on the")]
    hook = local_moe(lambda i, x, e, w: grouped_moe(store, whole, i, x, e, w))
    want = [tok.decode([t for t, _ in generate(bb, p, 12, hook, stop={tok.eos_id}) if t != tok.eos_id]) for p in prompts]

    async def scenario() -> list[list[str]]:
        moe = BatchingMoE(lambda i, x, e, w: grouped_moe(store, whole, i, x, e, w), model.cfg.moe_layers, asyncio.get_running_loop())
        engine = Engine(bb, tok, moe, max_batch=2, prefix_cache=PrefixCache(1 << 22), drafter="mtp")
        try:
            rounds = []
            for _ in range(2):
                streams = await asyncio.gather(*(engine.start(Job(tuple(p), 12, Sampling(), session="s")) for p in prompts))
                rounds.append(["".join([item async for item in s if isinstance(item, str)]) for s in streams])
            assert engine.stats.cached_tokens > 0  # the second round resumed from cached prefixes
            return rounds
        finally:
            await asyncio.to_thread(engine.close)

    assert run_bounded(scenario(), timeout=120) == [want, want]
