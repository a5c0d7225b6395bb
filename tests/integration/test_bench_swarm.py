"""`moeswarm bench swarm` at a tiny size: real bootstrap and worker processes, the JSON a user reads (no timings asserted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from experts.gguf_model import GGUFModel
from node.bench import swarm

pytestmark = pytest.mark.slow


def test_bench_swarm_reports_every_key_and_identical_output(tmp_path):
    """Two workers of a 2-layer random model: every documented key is there, the swarm's tokens equal the local run's."""
    model = tmp_path / "tiny.gguf"
    shape = ["--layers", "2", "--hidden", "256", "--experts", "8", "--top-k", "2", "--expert-ffn", "256", "--qtype", "Q4_K"]
    subprocess.run([sys.executable, "-m", "node", "model", "random", *shape, "-o", str(model)], check=True, capture_output=True, timeout=120)
    cmd = [sys.executable, "-m", "node", "bench", "swarm", "--json", "--model", str(model), "--workers", "2", "--tokens", "3", "--rounds", "2"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout)
    assert r["identical"] is True and r["moe_layers"] == 2 and r["workers"] == 2
    assert set(r["decode"]) >= {"local_tps", "swarm_tps", "ratio"} and all(v > 0 for v in r["decode"].values())
    assert r["dispatches"] > 0 and r["failed_dispatches"] == 0
    assert 0 < r["worker_ms_p50"] < r["rtt_ms_p50"] and r["overhead_ms_p50"] > 0
    assert len(r["load"]["start"]) == len(r["load"]["end"]) == 3


def test_bench_swarm_refuses_layers_with_a_model_file(tmp_path):
    """--layers shapes the cached random model only: with --model it is a usage error, not silently ignored."""
    model = tmp_path / "m.gguf"
    model.write_bytes(b"")
    p = subprocess.run([sys.executable, "-m", "node", "bench", "swarm", "--model", str(model), "--layers", "4"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "--layers shapes the default random model" in p.stderr


def test_cached_model_is_written_once_under_the_home(tmp_path):
    """The default model lives in $MOESWARM_HOME/models, is reused by the next run, and no half-written file remains."""
    small = dict(n_embd=256, n_expert=8, n_expert_used=2, n_ff_exp=256)
    path = swarm.cached_model(1, small)
    assert path.parent == tmp_path / "home" / "models" and GGUFModel(path).cfg.n_expert == 8
    stamp = path.stat().st_mtime_ns
    assert swarm.cached_model(1, small) == path and path.stat().st_mtime_ns == stamp
    assert not [p.name for p in path.parent.iterdir() if p.name.startswith(".writing-")]
