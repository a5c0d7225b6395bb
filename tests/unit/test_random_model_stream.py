"""Random models are streamed to disk: one tensor in memory at a time, the same bytes as the whole-model writer."""

from __future__ import annotations

import hashlib
import subprocess
import sys

import gguf
import numpy as np
import pytest

from experts import random_model
from experts.errors import ModelFormatError
from experts.gguf_model import GGUFModel
from experts.model_writer import PlannedTensor, keeps_f32, write_model, write_streamed
from experts.random_model import byte_level_tokenizer, random_config, random_tensors, write_random_model

Q = gguf.GGMLQuantizationType


def test_chunked_normals_equal_one_draw(monkeypatch):
    """Matrices drawn a chunk at a time (chunks that do not divide the tensor) equal one whole-array draw bit for bit."""
    monkeypatch.setattr(random_model, "DRAW_CHUNK", 1000)
    rng, ref = np.random.default_rng(5), np.random.default_rng(5)
    got = random_model._scaled_normals(rng, (3, 7, 129), 0.25)
    assert got.dtype == np.float32 and np.array_equal(got, (0.25 * ref.standard_normal((3, 7, 129))).astype(np.float32))
    assert rng.standard_normal() == ref.standard_normal()  # both streams are at the same place afterwards


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0], ids=lambda q: q.name)
def test_streamed_random_model_equals_the_whole_model_writer(tmp_path, qtype):
    """write_random_model (streamed) writes the very bytes write_model writes from all tensors in memory."""
    cfg = random_config("qwen3moe", n_layer=2, n_embd=64, n_ff_exp=32)
    write_random_model(tmp_path / "streamed.gguf", cfg, qtype=qtype, seed=3)
    write_model(tmp_path / "whole.gguf", cfg, random_tensors(cfg, 3), byte_level_tokenizer(), qtype=qtype)
    assert (tmp_path / "streamed.gguf").read_bytes() == (tmp_path / "whole.gguf").read_bytes()


def test_k_quant_model_keeps_its_layout_and_loads(tmp_path):
    """A Q4_K model: F32 tensors first, then the packed ones in draw order; deepseek2's short rows fall back to Q5_0."""
    cfg = random_config("deepseek2", n_layer=2, n_embd=256, n_ff_exp=256, head_dim=64)
    path = tmp_path / "k.gguf"
    write_random_model(path, cfg, qtype=Q.Q4_K)
    types = [(t.name, Q(t.tensor_type)) for t in gguf.GGUFReader(path).tensors]
    kinds = [qt == Q.F32 for _, qt in types]
    assert kinds == sorted(kinds, reverse=True)  # every F32 tensor before every packed one
    by_name = dict(types)
    assert by_name["blk.1.ffn_up_exps.weight"] == Q.Q4_K and by_name["blk.0.attn_k_b.weight"] == Q.Q5_0
    assert all(by_name[n] == Q.F32 for n in by_name if keeps_f32(n, (1,) if n.endswith("norm.weight") else (2, 2)))
    assert len(GGUFModel(path).digest) == 64  # opening checks every tensor's shape against the config


def test_k_quant_bytes_are_pinned(tmp_path):
    """The generator's output for a seed does not drift: this digest is what the whole-model writer produced."""
    cfg = random_config("qwen3moe", n_layer=2, n_embd=256, n_ff_exp=256)
    write_random_model(tmp_path / "k.gguf", cfg, qtype=Q.Q4_K, seed=2)
    assert hashlib.sha256((tmp_path / "k.gguf").read_bytes()).hexdigest()[:16] == "0c4a9ea4d0f3ea2a"


def test_short_or_wrong_data_is_refused_and_leaves_no_file(tmp_path):
    """Data that does not match the header is a clear error, and no truncated file is left behind as a model."""
    cfg = random_config("qwen3moe", n_layer=1, n_embd=64, n_ff_exp=32)
    plan = [PlannedTensor("token_embd.weight", (cfg.n_vocab, 64), Q.F32), PlannedTensor("output_norm.weight", (64,), Q.F32)]
    path = tmp_path / "bad.gguf"
    with pytest.raises(ModelFormatError, match="output_norm.weight: the header promised 256 bytes of F32, the data was 12 bytes"):
        write_streamed(path, cfg, byte_level_tokenizer(), plan, iter([np.zeros((cfg.n_vocab, 64), np.float32), np.zeros(3, np.float32)]), quantized=False)
    assert not path.exists()
    with pytest.raises(ModelFormatError, match="more tensor data"):
        write_streamed(path, cfg, byte_level_tokenizer(), plan[:1], iter([np.zeros((cfg.n_vocab, 64), np.float32)] * 2), quantized=False)
    assert not path.exists()


def test_peak_memory_is_about_one_tensor_not_the_file(tmp_path):
    """A real process writing a ~225 MB Q4_K model grows by a couple of float tensors (32 MB each), under half the file
    (the whole-model writer grew by ~5x the file: every tensor's blocks and floats held until the end)."""
    out = tmp_path / "m.gguf"
    rss = "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)"
    code = (
        "import resource, sys, gguf; from experts.random_model import random_config, write_random_model;"
        "write_random_model(sys.argv[1], random_config('qwen3moe', n_layer=16, n_embd=1024, n_expert=16, n_expert_used=4, n_ff_exp=512), qtype=gguf.GGMLQuantizationType.Q4_K);"
    )
    base = int(subprocess.run([sys.executable, "-c", "import resource, gguf, experts.random_model;" + rss], capture_output=True, text=True, check=True).stdout)
    p = subprocess.run([sys.executable, "-c", code + rss, str(out)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    grown, size = (int(p.stdout) - base) * 1024, out.stat().st_size
    assert size > 200e6 and grown < size / 2, (grown, size)
