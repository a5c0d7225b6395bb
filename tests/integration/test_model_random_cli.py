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


def test_glm4moe_random_model_and_inspect_show_its_dense_layer(tmp_path):
    """--arch glm4moe writes a model with a dense lead layer and an MTP block; inspect lists only the MoE layers."""
    import json

    out = tmp_path / "glm.gguf"
    p = subprocess.run([sys.executable, "-m", "node", "model", "random", "--arch", "glm4moe", "--layers", "3", "-o", str(out)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    p = subprocess.run([sys.executable, "-m", "node", "inspect", str(out), "--json"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    info = json.loads(p.stdout)
    assert info["moe_layers"] == [1, 2] and info["config"]["n_nextn"] == 1 and info["load"]["float_bytes"] == 2 * 8 * 3 * 32 * 64 * 4 and info["load"]["mode"] == "packed"


def test_gpt_oss_mxfp4_random_model_keeps_biases_and_router_f32(tmp_path):
    """--arch gpt-oss --qtype MXFP4: the expert and attention matrices are MXFP4, the biases, sinks and router F32;
    inspect counts the expert biases in the hosted bytes."""
    import json

    import gguf

    out = tmp_path / "oss.gguf"
    p = subprocess.run([sys.executable, "-m", "node", "model", "random", "--arch", "gpt-oss", "--qtype", "MXFP4", "-o", str(out)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    m = GGUFModel(out)
    Q = gguf.GGMLQuantizationType
    assert m.qtype("blk.0.ffn_up_exps.weight") is m.qtype("blk.0.attn_q.weight") is Q.MXFP4
    assert {m.qtype(n) for n in ("blk.0.ffn_up_exps.bias", "blk.0.attn_sinks.weight", "blk.0.ffn_gate_inp.weight", "blk.0.ffn_gate_inp.bias")} == {Q.F32}
    p = subprocess.run([sys.executable, "-m", "node", "inspect", str(out), "--json"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    load = json.loads(p.stdout)["load"]
    weights = sum(m.tensors[f"blk.{i}.{k}_exps.weight"].n_bytes for i in range(2) for k in ("ffn_gate", "ffn_up", "ffn_down"))
    assert load["packed_bytes"] == weights + 2 * 8 * (32 + 32 + 64) * 4


def test_deepseek2_random_model_and_inspect_report_the_latent_kv_cache(tmp_path):
    """--arch deepseek2 [--mla-kv-b] writes either MLA layout; inspect reports the cache as the latent plus the roped
    key part (latent 32 + rope 8 floats at these dims; 576 at DeepSeek-V3's), in JSON and in its text."""
    import json

    for flag, tensor in (([], "blk.0.attn_k_b.weight"), (["--mla-kv-b"], "blk.0.attn_kv_b.weight")):
        out = tmp_path / f"ds{len(flag)}.gguf"
        p = subprocess.run([sys.executable, "-m", "node", "model", "random", "--arch", "deepseek2", "--layers", "3", *flag, "-o", str(out)], capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr
        assert GGUFModel(out).has(tensor)
        p = subprocess.run([sys.executable, "-m", "node", "inspect", str(out), "--json"], capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr
        info = json.loads(p.stdout)
        assert info["moe_layers"] == [1, 2] and info["config"]["n_nextn"] == 1 and info["kv_cache_bytes_per_token_per_layer"] == (32 + 8) * 4
        p = subprocess.run([sys.executable, "-m", "node", "inspect", str(out)], capture_output=True, text=True, timeout=120)
        assert "KV cache: 160 bytes per token per layer (40 float32, the MLA latent)" in p.stdout, p.stdout


def test_qwen3next_random_model_and_inspect_report_the_recurrent_cache(tmp_path):
    """--arch qwen3next writes recurrent and full-attention layers; inspect reports what a recurrent layer caches per
    token (conv input 2*32 + 64, beta and g of 4 V heads) and its state checkpoint (4 heads of 16 x 16), JSON and text."""
    import json

    out = tmp_path / "next.gguf"
    p = subprocess.run([sys.executable, "-m", "node", "model", "random", "--arch", "qwen3next", "--layers", "4", "-o", str(out)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    p = subprocess.run([sys.executable, "-m", "node", "inspect", str(out), "--json"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    info = json.loads(p.stdout)
    assert info["recurrent_layers"] == [0, 2] and info["moe_layers"] == [0, 1, 2, 3] and info["config"]["layer_kinds"] == "rara"
    assert info["recurrent_cache_bytes_per_token_per_layer"] == 4 * (2 * 32 + 64 + 2 * 4) and info["recurrent_state_bytes"] == 4 * 4 * 16 * 16
    p = subprocess.run([sys.executable, "-m", "node", "inspect", str(out)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "recurrent layers [0, 2]: 544 bytes per token per layer" in p.stdout, p.stdout


def test_set_picks_arch_options_and_llamacpp_loads_the_deepseek32_file(tmp_path):
    """--set FIELD=VALUE reaches any config field (here deepseek32's lightning indexer); the file is one llama.cpp
    loads and runs, and inspect reports the indexer's key in the KV cache; a setting it could not run is refused."""
    import json

    out = tmp_path / "ds32.gguf"
    args = ["model", "random", "--arch", "deepseek32", "--set", "indexer_top_k=8", "--set", "indexer_heads=4", "-o", str(out)]
    p = subprocess.run([sys.executable, "-m", "node", *args], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    p = subprocess.run([sys.executable, "-m", "node", "inspect", str(out), "--json"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    info = json.loads(p.stdout)
    c = info["config"]
    assert (c["indexer_top_k"], c["indexer_heads"], c["indexer_head_dim"]) == (8, 4, 64)
    assert info["kv_cache_bytes_per_token_per_layer"] == 4 * (c["kv_lora_rank"] + c["n_rot"] + 64)
    bad = subprocess.run([sys.executable, "-m", "node", *args[:-2], "--set", "indexer_head_dim=48", "-o", str(tmp_path / "bad.gguf")], capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "power of two" in bad.stderr and not (tmp_path / "bad.gguf").exists()
    import importlib.util

    if importlib.util.find_spec("llama_cpp") is not None:  # the optional reference engine
        from experts.reference import llamacpp_logits

        logits = llamacpp_logits(out, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], isolated=True)  # see experts.reference
        assert logits.shape == (12, GGUFModel(out).cfg.n_vocab) and bool((logits == logits).all())


def test_set_picks_msa_options_and_llamacpp_runs_the_minimax_m3_file_sparse(tmp_path):
    """--set reaches minimax-m3's MSA options; llama.cpp loads the file and, with flash attention on (as
    experts.reference turns it on for this arch), runs the sparse graph: on 40 tokens, past the 2 kept blocks of 8,
    its logits differ from its dense fallback (flash attention off)."""
    import importlib.util

    out = tmp_path / "m3.gguf"
    args = ["model", "random", "--arch", "minimax-m3", "--layers", "3", "--set", "indexer_top_k=2", "--set", "indexer_block_size=8", "-o", str(out)]
    p = subprocess.run([sys.executable, "-m", "node", *args], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    c = GGUFModel(out).cfg
    assert (c.indexer_top_k, c.indexer_block_size, c.indexer_local_blocks, c.indexer_heads) == (2, 8, 1, c.n_head_kv)
    p = subprocess.run([sys.executable, "-m", "node", "inspect", str(out)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and f"{4 * c.kv_cache_floats} bytes per token per layer" in p.stdout and "MSA's index key" in p.stdout, p.stdout
    assert c.kv_cache_floats == 2 * c.head_dim * c.n_head_kv + c.indexer_head_dim
    bad = subprocess.run([sys.executable, "-m", "node", *args[:-2], "--set", "indexer_local_blocks=3", "-o", str(tmp_path / "bad.gguf")], capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "between 0 and top_k" in bad.stderr and not (tmp_path / "bad.gguf").exists()
    if importlib.util.find_spec("llama_cpp") is not None:  # the optional reference engine
        import numpy as np

        from experts.reference import llamacpp_logits

        tokens = [(3 * i + 5) % 256 for i in range(40)]
        sparse, dense = llamacpp_logits(out, tokens, isolated=True), llamacpp_logits(out, tokens, isolated=True, flash_attn=False)
        assert sparse.shape == (40, c.n_vocab) and bool(np.isfinite(sparse).all())
        assert np.allclose(sparse[:16], dense[:16], atol=1e-2) and not np.allclose(sparse[16:], dense[16:], atol=1e-2)
