"""GGUF reading: expert byte ranges, dequantization, digests and clear errors for bad files."""

from __future__ import annotations

import shutil

import gguf
import numpy as np
import pytest

from experts.errors import ModelFormatError
from experts.gguf_model import GGUFModel
from experts.model_writer import write_model
from experts.random_model import SUPPORTED_QTYPES, byte_level_tokenizer, random_config, random_tensors

from ..conftest import ARCHS, make_model

Q = gguf.GGMLQuantizationType
# K-quants need rows of 256: give every matrix 256-wide rows.
WIDE = {"n_embd": 256, "n_ff_exp": 256, "n_head": 4, "head_dim": 64, "n_expert": 4, "n_layer": 1}


@pytest.mark.parametrize("qtype", sorted(SUPPORTED_QTYPES, key=lambda q: q.name), ids=lambda q: q.name)
@pytest.mark.parametrize("arch", ARCHS)
def test_expert_slices_equal_whole_tensor_dequantization(model_dir, arch, qtype):
    """Each expert's byte range dequantizes to exactly the matching slice of the whole tensor."""
    m = GGUFModel(make_model(model_dir, arch, qtype, **WIDE))
    raw_file = m.path.read_bytes()
    for kind in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):
        name = f"blk.0.{kind}.weight"
        assert m.qtype(name) == qtype
        whole = m.dense(name)
        prev_end = None
        for e in range(m.cfg.n_expert):
            off, length = m.expert_byte_range(0, kind, e)
            block_bytes = gguf.GGML_QUANT_SIZES[qtype][1]
            assert length % block_bytes == 0
            assert prev_end is None or off == prev_end  # contiguous along ne[2]
            prev_end = off + length
            assert raw_file[off : off + length] == m.expert_bytes(0, kind, e).tobytes()
        for e in range(m.cfg.n_expert):
            g, u, d = m.expert_weights(0, e)
            mine = {"ffn_gate_exps": g, "ffn_up_exps": u, "ffn_down_exps": d}[kind]
            np.testing.assert_array_equal(mine, whole[e])


def test_digest_depends_on_every_tensor_and_the_config(model_dir, tmp_path):
    """Changing one weight byte or one hyper-parameter changes the model digest."""
    src = make_model(model_dir, "qwen3moe")
    base = GGUFModel(src).digest
    m = GGUFModel(src)
    off, _ = m.expert_byte_range(1, "ffn_down_exps", 5)
    flipped = tmp_path / "flipped.gguf"
    data = bytearray(src.read_bytes())
    data[off + 3] ^= 0x40
    flipped.write_bytes(bytes(data))
    assert GGUFModel(flipped).digest != base
    cfg = random_config("qwen3moe", n_embd=64, n_ff_exp=32, n_expert=8, n_expert_used=3)
    other = tmp_path / "topk3.gguf"
    write_model(other, cfg, random_tensors(cfg), byte_level_tokenizer())
    assert GGUFModel(other).digest != base


def _expect_error(path, *needles):
    with pytest.raises(ModelFormatError) as err:
        GGUFModel(path)
    for needle in needles:
        assert needle in str(err.value)


def test_truncated_file_is_named(model_dir, tmp_path):
    """A file cut short in its tensor data or in its header gives a 'truncated' error, not a crash."""
    src = make_model(model_dir, "llama")
    data = src.read_bytes()
    for cut in (len(data) - 1000, 100, 10):
        p = tmp_path / f"cut{cut}.gguf"
        p.write_bytes(data[:cut])
        _expect_error(p, "truncated")


def test_unknown_arch_missing_key_and_shape_mismatch_are_named(tmp_path):
    """Unsupported arch, missing metadata and wrong tensor shapes each name the culprit."""
    cfg = random_config("qwen3moe", n_embd=64, n_ff_exp=32)
    tensors = random_tensors(cfg)
    tok = byte_level_tokenizer()

    p = tmp_path / "arch.gguf"
    w = gguf.GGUFWriter(str(p), "mamba")
    w.add_block_count(1)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    _expect_error(p, "'mamba'", "qwen3moe")

    bad = dict(tensors)
    bad["blk.1.ffn_up_exps.weight"] = bad["blk.1.ffn_up_exps.weight"][:, :16]
    p = tmp_path / "shape.gguf"
    write_model(p, cfg, bad, tok)
    _expect_error(p, "blk.1.ffn_up_exps.weight", "(8, 16, 64)")

    missing = {k: v for k, v in tensors.items() if k != "blk.0.ffn_down_exps.weight"}
    p = tmp_path / "missing.gguf"
    write_model(p, cfg, missing, tok)
    _expect_error(p, "blk.0.ffn_down_exps.weight", "missing")

    p = tmp_path / "nokey.gguf"
    w = gguf.GGUFWriter(str(p), "qwen3moe")
    w.add_embedding_length(64)
    w.add_head_count(4)
    w.add_expert_count(8)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    _expect_error(p, "qwen3moe.block_count")


def test_dense_model_is_refused(tmp_path):
    """A model without experts is not a MoE model and says so."""
    p = tmp_path / "dense.gguf"
    w = gguf.GGUFWriter(str(p), "llama")
    w.add_embedding_length(64)
    w.add_head_count(4)
    w.add_block_count(1)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    _expect_error(p, "dense model")


def test_digest_cache_is_keyed_by_file_identity(model_dir, tmp_path):
    """The digest sidecar is reused for an unchanged file and ignored once the file changes."""
    src = tmp_path / "m.gguf"
    shutil.copy(make_model(model_dir, "qwen2moe"), src)
    d1 = GGUFModel(src).digest
    assert (tmp_path / "m.gguf.moeswarm-digest.json").exists()
    assert GGUFModel(src).digest == d1
    data = bytearray(src.read_bytes())
    data[-5] ^= 1
    src.write_bytes(bytes(data))
    assert GGUFModel(src).digest != d1
