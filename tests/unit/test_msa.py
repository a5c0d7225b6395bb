"""minimax-m3 (MiniMax Sparse Attention) files and numerics: what the reader makes of them, what it refuses, the block
selection, and decoding / rollback / slices keeping one pass's bits."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from experts.arch import Activation
from experts.errors import ModelFormatError
from experts.gguf_model import GGUFModel
from experts.model_writer import write_model
from experts.msa import BlockIndexer
from experts.random_model import byte_level_tokenizer, random_config, random_tensors, with_settings, write_random_model

ARCH = "minimax-m3"


def test_a_random_minimax_m3_file_reads_back_its_index_branch_and_caches_its_key(tmp_path):
    """The MSA keys and tensors round-trip through the file, on the sparse layers only; SwiGLU-OAI in all three FFNs;
    the cache holds K, V and one index key per token."""
    cfg = random_config(ARCH, n_layer=3)
    path = tmp_path / "m3.gguf"
    write_random_model(path, cfg)
    m = GGUFModel(path)
    assert dataclasses.replace(m.cfg, rms_eps=cfg.rms_eps) == cfg  # the file stores the eps as float32
    c = m.cfg
    assert (c.indexer_heads, c.indexer_head_dim, c.indexer_top_k, c.indexer_block_size, c.indexer_local_blocks) == (2, 32, 3, 4, 1)
    assert (c.n_dense_lead, c.gating, c.norm_topk, c.expert_weights_scale, c.n_ff_shexp) == (1, "sigmoid", True, 2.5, 2 * c.n_ff_exp)
    assert c.kv_cache_floats == 2 * c.head_dim * c.n_head_kv + 32
    assert not m.has("blk.0.indexer.q_proj.weight")  # the leading dense layer attends densely
    for i in (1, 2):
        assert tuple(int(x) for x in m.tensors[f"blk.{i}.indexer.q_proj.weight"].shape) == (c.n_embd, 2 * 32)  # ggml ne
        assert m.has(f"blk.{i}.indexer.k_norm.weight") and m.has(f"blk.{i}.exp_probs_b.bias")
    assert int(m.reader.fields["minimax-m3.attention.indexer.block_size"].contents()) == 4
    assert {c.glu_exp(1).act, c.glu_shexp(1).act, c.glu_shexp(0).act} == {Activation.SWIGLU_OAI}


def test_a_quantized_file_keeps_the_index_branch_in_f32(tmp_path):
    """As MiniMax-M3's converter forces: the block choice hangs on the index scores' rounding."""
    import gguf

    path = tmp_path / "m3-q8.gguf"
    write_random_model(path, random_config(ARCH), qtype=gguf.GGMLQuantizationType.Q8_0)
    m = GGUFModel(path)
    assert m.tensors["blk.1.indexer.q_proj.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    assert m.tensors["blk.1.attn_q.weight"].tensor_type == gguf.GGMLQuantizationType.Q8_0


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ("indexer_heads=1", "must equal the KV head count"),
        ("indexer_block_size=0", "at least one position"),
        ("indexer_top_k=0", "at least one kept block"),
        ("indexer_local_blocks=4", "between 0 and top_k"),
        ("indexer_head_dim=4", "exceeds the index head"),
    ],
)
def test_settings_llamacpp_cannot_run_are_refused_before_writing(setting, message):
    with pytest.raises(ModelFormatError, match=message):
        with_settings(random_config(ARCH), [setting])


def test_a_file_without_a_block_key_names_it(tmp_path, monkeypatch):
    import gguf

    add = gguf.GGUFWriter.add_uint32
    monkeypatch.setattr(gguf.GGUFWriter, "add_uint32", lambda self, key, v: None if key.endswith("local_blocks") else add(self, key, v))
    cfg = random_config(ARCH)
    path = tmp_path / "no-local.gguf"
    write_model(path, cfg, random_tensors(cfg), byte_level_tokenizer())
    with pytest.raises(ModelFormatError, match="minimax-m3.attention.indexer.local_blocks' is missing"):
        GGUFModel(path)


def _indexer(top_k: int, block: int, local: int) -> BlockIndexer:
    return BlockIndexer(wq=None, wk=None, q_norm=None, k_norm=np.ones(1, dtype=np.float32), heads=2, top_k=top_k, block=block, local=local)  # type: ignore[arg-type]


def test_blocks_score_their_best_position_and_the_latest_are_forced_in():
    """Group 0 likes position 1 (block 0) and 5 (block 2), group 1 position 3 (block 1); the query's own block 4 is
    forced. Each group keeps its 2 blocks' causal positions; all positions while they span <= top_k blocks."""
    idx = _indexer(top_k=2, block=2, local=1)
    q = np.array([[1.0], [-1.0]], dtype=np.float32)
    keys = np.array([0.0, 5.0, 0.0, -6.0, 0.0, 3.0, 0.0, 0.0, -1.0], dtype=np.float32)[:, None]  # 9 positions, 5 blocks
    assert [p.tolist() for p in idx.select(q, keys)] == [[0, 1, 8], [2, 3, 8]]  # the forced block 4 has position 8 only
    assert idx.block_scores(q, keys)[0].tolist() == [5.0, 0.0, 3.0, 0.0, np.inf]
    assert [p.tolist() for p in idx.select(q, keys[:4])] == [[0, 1, 2, 3]] * 2  # two blocks: nothing dropped
    no_local = _indexer(top_k=2, block=2, local=0)
    assert [p.tolist() for p in no_local.select(q, keys)] == [[0, 1, 4, 5], [2, 3, 8]]  # block 4 only as group 1's best
    two_local = _indexer(top_k=2, block=2, local=2)
    assert [p.tolist() for p in two_local.select(q, keys)] == [[6, 7, 8]] * 2


def _engine(path):
    from experts.forward import Backbone, local_moe
    from experts.moe import ungrouped_moe
    from experts.slices import ExpertStore

    model = GGUFModel(path)
    store = ExpertStore(model)
    return model, Backbone(model), local_moe(lambda i, x, e, w: ungrouped_moe(store, i, x, e, w))


def test_decoding_token_by_token_and_after_a_rollback_gives_one_pass_bits(tmp_path):
    """What "exact" means for MSA decode here: past the kept blocks each query reads its own selection, and decoding
    one token at a time, or again after the cache is cut back across the point where selection starts (speculative
    rollback), gives one pass's bits. Without MSA the logits agree until a block is dropped, then differ."""
    from experts.forward import KVCache

    path = tmp_path / "m3.gguf"
    write_random_model(path, random_config(ARCH, n_layer=3))
    model, bb, hook = _engine(path)
    tokens = [(7 * i + 3) % 256 for i in range(30)]
    full = bb.forward(tokens, KVCache(), hook)
    cache = KVCache()
    steps = np.concatenate([bb.forward(tokens[:5], cache, hook)] + [bb.forward([t], cache, hook) for t in tokens[5:]])
    assert steps.tobytes() == full.tobytes()
    assert sorted(cache.index) == [1, 2] and [cache.index[i].shape for i in (1, 2)] == [(30, 32)] * 2
    cache.truncate(10)
    assert [cache.index[i].shape[0] for i in (1, 2)] == [10, 10]
    assert bb.forward(tokens[10:], cache, hook).tobytes() == full[10:].tobytes()
    dense = type(bb)(model)
    dense.layers = [dataclasses.replace(L, msa=None) for L in dense.layers]
    plain = dense.forward(tokens, KVCache(), hook)
    kept = model.cfg.indexer_top_k * model.cfg.indexer_block_size  # 12 positions: 3 blocks of 4
    assert plain[:kept].tobytes() == full[:kept].tobytes() and not np.allclose(plain[kept:], full[kept:], atol=1e-3)


def test_speculative_decoding_with_rollback_across_the_block_selection_is_plain_decoding(tmp_path):
    """Drafts rejected before and after the kept blocks fill (12 positions) cut the index keys back with K and V:
    greedy speculative decoding yields plain decoding's tokens and logit bits."""
    from experts.generate import generate
    from experts.speculative import PromptLookupDrafter, speculative_generate

    from .test_speculative import Fixed, assert_same

    path = tmp_path / "m3.gguf"
    write_random_model(path, random_config(ARCH, n_layer=3))
    _, bb, hook = _engine(path)
    prompt = [264, 72, 101, 108, 108, 111]
    plain = list(generate(bb, prompt, 20, hook))
    for drafter in (Fixed([0, 1, 2, 3, 4, 5, 6, 7]), PromptLookupDrafter(max_ngram=1)):
        assert_same(plain, list(speculative_generate(bb, prompt, 20, hook, drafter=drafter, adaptive=False)))


def test_head_dense_and_expert_slices_verify_and_compute_the_full_models_logits(tmp_path):
    """The index branch goes with the dense weights of its layer; slices of every part verify against the digest and
    a backbone from them gives the full file's logits bit for bit on a prompt past the kept blocks."""
    from experts.forward import Backbone, KVCache, local_moe
    from experts.model_parts import SlicedModel
    from experts.moe import ungrouped_moe
    from experts.slices import ExpertStore, check_slice

    from .test_part_slices import cut_all

    path = tmp_path / "m3.gguf"
    write_random_model(path, random_config(ARCH, n_layer=3))
    full = GGUFModel(path)
    head, dense, experts = cut_all(full, tmp_path)
    for sl in (head, *dense, experts):
        check_slice(sl, full.digest)
    assert all(d.has(f"blk.{i}.indexer.q_proj.weight") for d in dense for i in d.layers if i >= 1) and not experts.has("blk.1.indexer.q_proj.weight")
    tokens = [(5 * i + 1) % 256 for i in range(20)]

    def hook(model: GGUFModel):
        store = ExpertStore(model)
        return local_moe(lambda i, x, e, w: ungrouped_moe(store, i, x, e, w))

    want = Backbone(full).forward(tokens, KVCache(), hook(full))
    assert Backbone(SlicedModel([head, *dense], full.digest)).forward(tokens, KVCache(), hook(experts)).tobytes() == want.tobytes()
