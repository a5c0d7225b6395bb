"""`moeswarm bench federation` at a tiny size: a real pool and two real gateways, the JSON a user reads (no timings
asserted), and Jain's index on known values."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from node.bench.federation import jain

pytestmark = pytest.mark.slow


def test_jain_index_is_one_when_fair_and_one_over_n_when_one_takes_all():
    assert jain([3.0, 3.0, 3.0, 3.0]) == pytest.approx(1.0)
    assert jain([5.0, 0.0, 0.0, 0.0]) == pytest.approx(0.25)
    assert jain([1.0, 3.0]) == pytest.approx(16 / 20)


def test_bench_federation_reports_every_count_and_identical_texts(tmp_path):
    """One worker, 1 then 2 gateways at once: every count's keys are there, every text equals the local run's, none
    failed; a gateway's texts would differ if it decoded a different model or dropped a layer."""
    model = tmp_path / "tiny.gguf"
    shape = ["--layers", "2", "--hidden", "256", "--experts", "8", "--top-k", "2", "--expert-ffn", "256", "--qtype", "Q4_K"]
    subprocess.run([sys.executable, "-m", "node", "model", "random", *shape, "-o", str(model)], check=True, capture_output=True, timeout=120)
    cmd = [sys.executable, "-m", "node", "bench", "federation", "--json", "--model", str(model), "--workers", "1", "--backbones", "1,2", "--tokens", "4", "--rounds", "1"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout)
    assert r["identical"] is True and r["failed"] == 0 and r["moe_layers"] == 2 and r["workers"] == 1
    assert set(r["backbones"]) == {"1", "2"} and len(r["backbones"]["2"]["per_backbone_tps"]) == 2
    assert all(v["aggregate_tps"] > 0 and 0 < v["jain"] <= 1 for v in r["backbones"].values())
    assert r["aggregate_ratio_1"] == 1.0 and r["aggregate_ratio_2"] > 0 and "jain_2" in r
    assert len(r["load"]["start"]) == len(r["load"]["end"]) == 3


def test_bench_federation_refuses_a_count_that_is_not_a_number(tmp_path):
    p = subprocess.run([sys.executable, "-m", "node", "bench", "federation", "--backbones", "1,two"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "expected counts like 1,2,4" in p.stderr
