"""`moeswarm bench engine` runs both engines end to end (tiny model) and its JSON has the keys other tools read.

No speed is asserted (benchmarks measure, tests check behaviour).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.llama


def test_bench_engine_json_has_decode_prefill_and_rss():
    """A 1-layer, 8-expert run: decode and prefill tokens/s of both engines at 1 and 2 threads, ratios, the decode-step split, peak RSS vs the file."""
    pytest.importorskip("llama_cpp")
    args = ["bench", "engine", "--json", "--layers", "1", "--tokens", "4", "--rounds", "1", "--hidden", "256", "--experts", "8", "--prefill", "16"]
    p = subprocess.run([sys.executable, "-m", "node", *args], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout.strip().splitlines()[-1])
    for kind in ("decode", "prefill"):
        for key in ("moeswarm_tps", "moeswarm_tps_2t", "llamacpp_tps_1t", "llamacpp_tps_2t", "ratio_1t", "ratio_2t"):
            assert r[kind][key] > 0, (kind, key, r[kind])
    step = r["moeswarm_decode_step"]
    assert step["step_ms"] > 0 and step["kernel_expert_ffn_ms"] > 0 and step["kernel_matmul_ms"] > 0
    rss = r["rss"]
    assert rss["moeswarm_bytes"] >= rss["baseline_bytes"] > 0
    assert rss["ratio"] == round(rss["moeswarm_bytes"] / rss["file_bytes"], 3)
    assert (r["config"]["n_layer"], r["config"]["n_embd"], r["config"]["n_expert"], r["config"]["head_dim"]) == (1, 256, 8, 128)
