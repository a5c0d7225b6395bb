"""`backbone generate --drafter mtp` in a real local swarm: plain decoding's tokens, drafted by the model's MTP block."""

from __future__ import annotations

import json

import pytest

from experts.gguf_model import GGUFModel
from node.launcher import Cluster
from tests.support import moeswarm

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
