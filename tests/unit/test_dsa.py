"""deepseek32 (DeepSeek Sparse Attention) files: what the reader makes of them, what it refuses, and the generic
``model random --set`` settings that pick the indexer's options."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from experts.dense_weights import DenseLinear
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


def test_the_hadamard_matrix_is_ggmls_orthonormal_sylvester_matrix():
    from experts.dsa import hadamard

    h4 = np.array([[1, 1, 1, 1], [1, -1, 1, -1], [1, 1, -1, -1], [1, -1, -1, 1]], dtype=np.float32) / 2
    assert hadamard(4).tobytes() == h4.tobytes()
    h = hadamard(64)
    assert (h == h.T).all() and np.allclose(h @ h, np.eye(64), atol=1e-6) and set(np.unique(np.abs(h))) == {np.float32(0.125)}


def test_the_layer_norm_centres_and_scales_before_its_weight_and_bias():
    from experts.dsa import layer_norm

    x = np.random.default_rng(0).standard_normal((3, 64)).astype(np.float32) * 5 + 2
    y = layer_norm(x, np.full(64, 2.0, dtype=np.float32), np.full(64, 0.5, dtype=np.float32))
    assert np.allclose(y.mean(-1), 0.5, atol=1e-5) and np.allclose(y.std(-1), 2.0, atol=1e-4)


def test_selection_keeps_every_position_up_to_top_k_then_the_best_scores():
    """Scores are sum_h relu(q_h . k) w_h: a key only a negatively weighted head likes scores below one no head likes."""
    from experts.dsa import Indexer

    idx = Indexer(wq_b=None, wk=None, k_norm=None, k_norm_b=None, proj=None, rot=DenseLinear(np.eye(2, dtype=np.float32)), heads=2, top_k=2)  # type: ignore[arg-type]
    q, w = np.array([[1.0, 0.0], [0.0, 1.0]], dtype=np.float32), np.array([1.0, -1.0], dtype=np.float32)
    keys = np.array([[3.0, 0.0], [0.0, 5.0], [-1.0, -1.0], [1.0, 0.0]], dtype=np.float32)  # scores 3, -5, 0, 1
    assert idx.select(q, w, keys[:2]).tolist() == [0, 1]
    assert idx.select(q, w, keys).tolist() == [0, 3]
    assert idx.select(q, w, keys[:3]).tolist() == [0, 2]


def test_decoding_token_by_token_and_after_a_rollback_gives_one_pass_bits(tmp_path):
    """Past the indexer's top-k the selection differs per query; incremental decoding, and decoding again after the
    cache is cut back across the point where selection starts (speculative rollback), give the bits of one pass.
    The cache keeps each position's indexer key beside its latent."""
    from experts.forward import Backbone, KVCache, local_moe
    from experts.hosting import open_experts
    from experts.kernels import make_kernel
    from experts.moe import ungrouped_moe

    cfg = with_settings(random_config(ARCH, n_layer=3), ["indexer_top_k=6"])
    path = tmp_path / "ds32.gguf"
    write_random_model(path, cfg)
    model, kernel = GGUFModel(path), make_kernel("reference", 1)
    store, _ = open_experts(model, kernel)
    bb, hook = Backbone(model, kernel), local_moe(lambda i, x, e, w: ungrouped_moe(store, i, x, e, w))
    tokens = [(7 * i + 3) % 256 for i in range(20)]
    full = bb.forward(tokens, KVCache(), hook)
    cache = KVCache()
    steps = np.concatenate([bb.forward(tokens[:4], cache, hook)] + [bb.forward([t], cache, hook) for t in tokens[4:]])
    assert steps.tobytes() == full.tobytes()
    assert [v.shape for v in cache.v] == [(20, 64)] * 3 and [k.shape[1] for k in cache.k] == [cfg.kv_lora_rank + cfg.rope_dim] * 3
    cache.truncate(5)
    again = bb.forward(tokens[5:], cache, hook)
    assert again.tobytes() == full[5:].tobytes()
    dense = Backbone(model, kernel)
    dense.layers = [dataclasses.replace(L, mla=dataclasses.replace(L.mla, indexer=None)) for L in dense.layers]
    plain = dense.forward(tokens, KVCache(), hook)
    assert plain[:6].tobytes() == full[:6].tobytes() and not np.allclose(plain[6:], full[6:], atol=1e-3)  # the same until top-k drops a position


def test_head_dense_and_expert_slices_verify_and_compute_the_full_models_logits(tmp_path):
    """The indexer's tensors go with the dense weights of their layer; slices of every part verify against the digest
    and a backbone from them gives the full file's logits bit for bit on a prompt past the top-k."""
    from experts.forward import Backbone, KVCache, local_moe
    from experts.model_parts import SlicedModel
    from experts.moe import ungrouped_moe
    from experts.slices import ExpertStore, check_slice

    from .test_part_slices import cut_all

    path = tmp_path / "ds32.gguf"
    write_random_model(path, with_settings(random_config(ARCH, n_layer=3), ["indexer_top_k=4"]))
    full = GGUFModel(path)
    head, dense, experts = cut_all(full, tmp_path)
    for sl in (head, *dense, experts):
        check_slice(sl, full.digest)
    assert all(d.has(f"blk.{i}.indexer.attn_q_b.weight") for d in dense for i in d.layers) and not experts.has("blk.0.indexer.proj.weight")
    tokens = [(5 * i + 1) % 256 for i in range(12)]

    def hook(model: GGUFModel):
        store = ExpertStore(model)
        return local_moe(lambda i, x, e, w: ungrouped_moe(store, i, x, e, w))

    want = Backbone(full).forward(tokens, KVCache(), hook(full))
    assert Backbone(SlicedModel([head, *dense], full.digest)).forward(tokens, KVCache(), hook(experts)).tobytes() == want.tobytes()


def test_speculative_decoding_with_rollback_across_the_top_k_boundary_is_plain_decoding(tmp_path):
    """Drafts rejected before and after position top_k cut the indexer keys back with the latents: greedy speculative
    decoding yields plain decoding's tokens and logit bits."""
    from experts.forward import Backbone, local_moe
    from experts.generate import generate
    from experts.moe import ungrouped_moe
    from experts.slices import ExpertStore
    from experts.speculative import PromptLookupDrafter, speculative_generate

    from .test_speculative import Fixed, assert_same

    path = tmp_path / "ds32.gguf"
    write_random_model(path, with_settings(random_config(ARCH, n_layer=3), ["indexer_top_k=8"]))
    model = GGUFModel(path)
    store = ExpertStore(model)
    bb, hook, prompt = Backbone(model), local_moe(lambda i, x, e, w: ungrouped_moe(store, i, x, e, w)), [264, 72, 101, 108, 108, 111]
    plain = list(generate(bb, prompt, 20, hook))
    for drafter in (Fixed([0, 1, 2, 3, 4, 5, 6, 7]), PromptLookupDrafter(max_ngram=1)):
        assert_same(plain, list(speculative_generate(bb, prompt, 20, hook, drafter=drafter, adaptive=False)))


def test_at_deepseek_v32_dims_the_cache_holds_704_floats_per_token_per_layer():
    """Latent 512 + rope 64 + one 128-wide indexer key (64 indexer heads of 128 share it)."""
    cfg = dataclasses.replace(random_config(ARCH), n_head=128, head_dim=192, n_rot=64, kv_lora_rank=512, v_head_dim=128, indexer_heads=64, indexer_head_dim=128, indexer_top_k=2048)
    cfg.spec.check(cfg)
    assert cfg.kv_cache_floats == 704 and cfg.gguf_kv_lengths == (576, 512)
