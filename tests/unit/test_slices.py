"""Slice files: self-contained, exact, provably cut from their model, loadable within a memory budget."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from experts.errors import SliceError
from experts.gguf_model import ExpertRange, GGUFModel
from experts.moe import partial_sum
from experts.slices import ExpertStore, check_slice, parse_range, write_slice

from ..conftest import ARCHS, make_model

Q = gguf.GGMLQuantizationType


@pytest.mark.parametrize("qtype", [Q.F32, Q.Q8_0, Q.Q4_K], ids=lambda q: q.name)
@pytest.mark.parametrize("arch", ARCHS)
def test_slice_computes_exactly_what_the_full_file_computes(model_dir, tmp_path, arch, qtype):
    """Partial sums from a slice file equal those from the full model bit for bit."""
    full = GGUFModel(make_model(model_dir, arch, qtype, n_embd=256, n_ff_exp=256, n_head=4, head_dim=64, n_layer=3))
    sl_path = write_slice(full, range(1, 3), ExpertRange(2, 6), tmp_path / "s.gguf")
    sl = GGUFModel(sl_path)
    check_slice(sl, full.digest)
    assert sl.digest == full.digest and sl.is_slice
    assert sl_path.stat().st_size < full.path.stat().st_size / 1.5
    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, full.cfg.n_embd)).astype(np.float32)
    ids = rng.integers(2, 6, size=(5, 2)).astype(np.int32)
    w = rng.random((5, 2)).astype(np.float32)
    held = np.ones_like(ids, dtype=bool)
    for layer in (1, 2):
        a, _ = partial_sum(ExpertStore(full), layer, x, ids, w, held)
        b, _ = partial_sum(ExpertStore(sl), layer, x, ids, w, held)
        assert a.tobytes() == b.tobytes()
    for e in range(2, 6):
        for kind in ("ffn_gate_exps", "ffn_down_exps"):
            assert sl.expert_bytes(2, kind, e).tobytes() == full.expert_bytes(2, kind, e).tobytes()
            assert sl.qtype(f"blk.2.{kind}.weight") == qtype


def test_tampered_slice_and_wrong_model_are_refused(model_dir, tmp_path):
    """One flipped expert byte, or a slice of another model, is caught and named."""
    full = GGUFModel(make_model(model_dir, "qwen2moe"))
    other = GGUFModel(make_model(model_dir, "qwen2moe", seed=7))
    sl_path = write_slice(full, range(0, 1), ExpertRange(0, 4), tmp_path / "s.gguf")
    with pytest.raises(SliceError, match="not from"):
        check_slice(GGUFModel(sl_path), other.digest)
    sl = GGUFModel(sl_path)
    off, _ = sl.expert_byte_range(0, "ffn_up_exps", 3)
    data = bytearray(sl_path.read_bytes())
    data[off + 10] ^= 1
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(SliceError, match="expert 3 of blk.0.ffn_up_exps.weight"):
        check_slice(GGUFModel(bad), full.digest)


def test_out_of_range_requests_are_refused(model_dir, tmp_path):
    """Layer/expert ranges outside the model, and experts outside a slice, give SliceError."""
    full = GGUFModel(make_model(model_dir, "llama"))
    with pytest.raises(SliceError, match="out of bounds"):
        parse_range("0-8", full.cfg.n_expert, "expert")
    with pytest.raises(SliceError, match="not of the form"):
        parse_range("a-b", 8, "expert")
    with pytest.raises(SliceError, match="out of bounds"):
        write_slice(full, range(0, 5), ExpertRange(0, 2), tmp_path / "x.gguf")
    sl = GGUFModel(write_slice(full, range(0, 1), ExpertRange(0, 2), tmp_path / "s.gguf"))
    with pytest.raises(SliceError, match="not in"):
        ExpertStore(sl, experts=ExpertRange(0, 4))
    with pytest.raises(SliceError, match="not hosted"):
        ExpertStore(sl).weights(0, 3)
    with pytest.raises(SliceError, match="already a slice"):
        write_slice(sl, range(0, 1), ExpertRange(0, 1), tmp_path / "y.gguf")


def test_uncached_store_gives_the_cached_stores_bits(model_dir):
    """Dequantizing on the fly (no float32 cache) changes no number."""
    full = GGUFModel(make_model(model_dir, "qwen3moe", Q.Q8_0))
    cached, lean = ExpertStore(full), ExpertStore(full, cache=False)
    assert cached.mode == "cached" and lean.mode == "on-the-fly"
    for e in range(full.cfg.n_expert):
        for a, b in zip(cached.weights(1, e), lean.weights(1, e)):
            np.testing.assert_array_equal(a, b)



def test_fused_gate_up_tensor_reads_and_slices_like_separate_ones(tmp_path):
    """A model storing ffn_gate_up_exps (gate rows, then up rows) computes and slices exactly like the split layout."""
    from experts.model_writer import write_model
    from experts.random_model import byte_level_tokenizer, random_config, random_tensors

    cfg = random_config("qwen3moe", n_embd=64, n_ff_exp=32, n_expert=8, n_expert_used=2)
    tensors = random_tensors(cfg, seed=3)
    fused = dict(tensors)
    for i in range(cfg.n_layer):
        gate, up = fused.pop(f"blk.{i}.ffn_gate_exps.weight"), fused.pop(f"blk.{i}.ffn_up_exps.weight")
        fused[f"blk.{i}.ffn_gate_up_exps.weight"] = np.concatenate([gate, up], axis=1)
    write_model(tmp_path / "split.gguf", cfg, tensors, byte_level_tokenizer())
    write_model(tmp_path / "fused.gguf", cfg, fused, byte_level_tokenizer())
    split_m, fused_m = GGUFModel(tmp_path / "split.gguf"), GGUFModel(tmp_path / "fused.gguf")
    assert fused_m.expert_kinds(0) == ("ffn_gate_up_exps", "ffn_down_exps")
    for e in range(cfg.n_expert):
        for a, b in zip(split_m.expert_weights(1, e), fused_m.expert_weights(1, e)):
            np.testing.assert_array_equal(a, b)
    sl = GGUFModel(write_slice(fused_m, range(0, 2), ExpertRange(4, 8), tmp_path / "s.gguf"))
    check_slice(sl, fused_m.digest)
    for e in range(4, 8):
        for a, b in zip(sl.expert_weights(0, e), split_m.expert_weights(0, e)):
            np.testing.assert_array_equal(a, b)
