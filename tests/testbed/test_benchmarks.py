"""The WAN benchmarks run end to end in the testbed (tiny sizes): their JSON has every field BENCHMARKS.md reports.

No speed is asserted here (benchmarks measure, tests check behaviour): only that every technique decodes the same
tokens, nothing failed, the star check saw layers fanned out to all three workers, and the plots are real PNGs.
"""

from __future__ import annotations

import json

import pytest

from tests.support import moeswarm as run_moeswarm

from .conftest import why_no_testbed

pytestmark = pytest.mark.skipif(why_no_testbed() is not None, reason=why_no_testbed() or "")


def moeswarm(*args: str, timeout: float = 900) -> dict:
    """`moeswarm ARGS` run to success; its JSON output."""
    p = run_moeswarm(*args, timeout=timeout)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout)


def test_bench_wan_reports_every_technique_and_the_star(tmp_path):
    """`bench wan` at 20 ms: all variants give the naive tokens, sessions and star are measured, PNGs written."""
    md = tmp_path / "BENCH.md"
    r = moeswarm("bench", "wan", "--json", "--rtt-ms", "20", "--tokens", "6", "--prompts", "1", "--session-tokens", "3", "--session-rounds", "1", "--star-tokens", "8", "--plots", str(tmp_path / "plots"), "--write", str(md))
    assert r["rtt_ms"] == 20 and set(r["tokens_s"]) == {"naive", "speculative", "overlap", "all"}
    assert r["identical"] and r["failed_dispatches"] == 0 and r["bound_tokens_s"] == 1000 / (r["moe_layers"] * 20)
    assert set(r["speedup"]) == {"speculative", "overlap", "all"} and r["acceptance_mean"] >= 0
    assert r["sessions8_aggregate_ratio"] == r["sessions"]["plain"]["ratio"] > 0
    assert all(1 <= r["sessions"][mode]["sessions_per_dispatch"] <= 8 for mode in ("plain", "speculative"))
    star = r["star"]
    assert star["rtts_ms"] == [20, 40, 80] and star["max_rtt_ms"] == 80 and star["layers"] > 0 and star["failed_dispatches"] == 0
    assert r["bytes_per_token_per_layer"]["int8"] < r["bytes_per_token_per_layer"]["f16"] < r["bytes_per_token_per_layer"]["f32"]
    for png in r["plots"]:
        with open(png, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert "moeswarm bench wan --json --rtt-ms 20" in md.read_text()


def test_bench_paths_reports_punches_and_both_relay_placements():
    """`bench paths` with one attempt per pair: punch counts, relay at the edge and mid-WAN, same tokens, no failures."""
    r = moeswarm("bench", "paths", "--json", "--rtt-ms", "20", "--attempts", "2", "--tokens", "4")
    assert set(r["punch"]) == {"cone_public", "cone_cone", "symmetric_any"} and r["punch"]["cone_public"]["tries"] == 2
    assert r["failed_dispatches"] == 0 and r["identical"] and r["relay_mid_wan"]["identical"]
    assert r["relay_link_ms"] == 0 and r["relay_mid_wan"]["relay_link_ms"] == 10
    for t in (r["throughput"], r["relay_mid_wan"]["throughput"]):
        assert t["direct_tokens_s"] > 0 and t["relay_tokens_s"] > 0
