"""deepseek32 (DeepSeek Sparse Attention) files: what the reader makes of them, what it refuses, and the generic
``model random --set`` settings that pick the indexer's options."""

from __future__ import annotations

import dataclasses

import pytest

from experts.errors import ModelFormatError, UsageError
from experts.gguf_model import GGUFModel
from experts.model_writer import write_model
from experts.random_model import byte_level_tokenizer, random_config, random_tensors, with_settings, write_random_model

ARCH = "deepseek32"


def test_a_random_deepseek32_file_reads_back_its_indexer_and_caches_its_key(tmp_path):
    """The indexer keys and tensors round-trip through the file; the cache holds latent + rope + indexer key per token."""
    cfg = random_config(ARCH, n_layer=3)
    path = tmp_path / "ds32.gguf"
    write_random_model(path, cfg)
    m = GGUFModel(path)
    assert dataclasses.replace(m.cfg, rms_eps=cfg.rms_eps) == cfg  # the file stores the eps as float32
    assert (m.cfg.indexer_heads, m.cfg.indexer_head_dim, m.cfg.indexer_top_k) == (16, 64, 16)
    assert m.cfg.kv_cache_floats == cfg.kv_lora_rank + cfg.rope_dim + 64
    for i in range(cfg.n_layer + cfg.n_nextn):  # the MTP block carries the indexer too (llama.cpp requires it there)
        assert tuple(int(x) for x in m.tensors[f"blk.{i}.indexer.attn_q_b.weight"].shape) == (cfg.q_lora_rank, 16 * 64)  # ggml ne
        assert m.has(f"blk.{i}.indexer.k_norm.bias") and m.has(f"blk.{i}.indexer.proj.weight")
    assert int(m.reader.fields["deepseek32.attention.indexer.top_k"].contents()) == 16


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ("indexer_head_dim=96", "power of two"),
        ("indexer_head_dim=32", "power of two"),
        ("indexer_top_k=0", "at least one head"),
        ("q_lora_rank=0", "q-LoRA"),
    ],
)
def test_settings_llamacpp_cannot_run_are_refused_before_writing(setting, message):
    with pytest.raises(ModelFormatError, match=message):
        with_settings(random_config(ARCH), [setting])


def test_a_file_without_an_indexer_key_names_it(tmp_path, monkeypatch):
    import gguf

    monkeypatch.setattr(gguf.GGUFWriter, "add_indexer_top_k", lambda self, v: None)
    cfg = random_config(ARCH)
    path = tmp_path / "no-top-k.gguf"
    write_model(path, cfg, random_tensors(cfg), byte_level_tokenizer())
    with pytest.raises(ModelFormatError, match="deepseek32.attention.indexer.top_k' is missing"):
        GGUFModel(path)


def test_settings_are_parsed_as_their_fields_types():
    base = random_config("step35")
    cfg = with_settings(base, ["indexer_top_k=8", "rms_eps=1e-5", "norm_topk=false", "gating=none", "clamp_exp=7, 7.5, 0", "name=x"])
    assert (cfg.indexer_top_k, cfg.rms_eps, cfg.norm_topk, cfg.gating, cfg.clamp_exp, cfg.name) == (8, 1e-5, False, None, (7.0, 7.5, 0.0), "x")
    assert dataclasses.replace(cfg, indexer_top_k=0, rms_eps=base.rms_eps, norm_topk=base.norm_topk, gating=base.gating, clamp_exp=base.clamp_exp, name=base.name) == base


@pytest.mark.parametrize(("setting", "message"), [("nope=1", "FIELD one of"), ("indexer_top_k", "FIELD=VALUE"), ("arch=qwen3moe", "FIELD one of"), ("n_layer=two", "not a int"), ("mla_kv_b=maybe", "not a bool")])
def test_bad_settings_are_one_line_usage_errors(setting, message):
    with pytest.raises(UsageError, match=message) as err:
        with_settings(random_config(ARCH), [setting])
    assert "\n" not in str(err.value)
