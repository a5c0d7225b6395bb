"""`moeswarm model random` writes the shape it is asked for (real process)."""

from __future__ import annotations

import subprocess
import sys

from experts.gguf_model import GGUFModel


def test_head_dim_option_sets_the_attention_width(tmp_path):
    """--head-dim decouples the head width from hidden / heads, as in Qwen3-30B-A3B (2048 hidden, 32 heads of 128)."""
    out = tmp_path / "wide-heads.gguf"
    args = ["model", "random", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--head-dim", "32", "-o", str(out)]
    p = subprocess.run([sys.executable, "-m", "node", *args], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    cfg = GGUFModel(out).cfg
    assert (cfg.head_dim, cfg.q_dim, cfg.kv_dim) == (32, 128, 64)
