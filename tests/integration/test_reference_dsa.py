"""deepseek32 (MLA + DeepSeek Sparse Attention) against llama.cpp: the F32 gate at two shapes on prompts longer than
the indexer's top-k (so the selection drops positions), each indexer piece done wrong fails it, the quantized gates.

llama.cpp runs in a child process here (``llamacpp_logits(isolated=True)``): in a process that has loaded the ggml
kernel's older libggml, llama.cpp's deepseek32 graph runs on that one and aborts.
"""

from __future__ import annotations

import dataclasses

import gguf
import numpy as np
import pytest

from experts.codecs import Codec
from experts.dsa import Indexer
from experts.forward import KVCache
from experts.gguf_model import GGUFModel
from experts.kernels import make_kernel
from experts.random_model import random_config, with_settings, write_random_model
from experts.tokenizer import Tokenizer
from experts.verify import DEFAULT_PROMPT, compare, run_gate

from . import test_reference as ref

pytestmark = pytest.mark.llama
Q = gguf.GGMLQuantizationType
ARCH = "deepseek32"
# top-k 16 of 42 positions (V3.2: 2048 of 128K); the second shape keeps 8 with 8 indexer heads, 4 layers, 8 heads
SHAPES = {
    "base": (ref.SHAPE, ()),
    "more-heads": ({**ref.SHAPE, "n_layer": 4, "n_head": 8, "head_dim": 16}, ("indexer_top_k=8", "indexer_heads=8")),
}


def model(directory, shape: dict, settings: tuple[str, ...] = (), qtype=Q.F32) -> GGUFModel:
    name = "-".join(f"{k}{v}" for k, v in sorted(shape.items())) + "".join(settings)
    path = directory / f"{ARCH}-{qtype.name}-{name}.gguf"
    if not path.exists():
        write_random_model(path, with_settings(random_config(ARCH, **shape), settings), qtype=qtype)
    return GGUFModel(path)


def theirs(m: GGUFModel, tokens: list[int]) -> np.ndarray:
    from experts.reference import llamacpp_logits

    return llamacpp_logits(m.path, tokens, isolated=True)


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("kernel_name", ref.KERNELS)
def test_f32_forward_matches_llamacpp_past_the_indexers_top_k(model_dir, kernel_name, shape):
    """min cosine >= 0.99999 and the same argmax on all 42 positions, 26 (or 34) of which attend to top-k only."""
    pytest.importorskip("llama_cpp")
    m = model(model_dir, *SHAPES[shape])
    assert len(ref.TOKENS) > m.cfg.indexer_top_k + 16
    bb, hook = ref.engine(m, kernel_name)
    ours, want = bb.forward(ref.TOKENS, KVCache(), hook), theirs(m, ref.TOKENS)
    c = compare(ours, want)
    assert c.min_cosine >= 0.99999, c
    assert (ours.argmax(-1) == want.argmax(-1)).all() and c.positions == len(ref.TOKENS) >= 32


def _indexer(**change):
    """Every trunk layer's indexer with fields replaced (None: no indexer, dense MLA)."""

    def ablate(bb, mp):
        def one(idx):
            return None if not change else dataclasses.replace(idx, **{k: f(idx) for k, f in change.items()})

        bb.layers = [dataclasses.replace(L, mla=dataclasses.replace(L.mla, indexer=one(L.mla.indexer))) for L in bb.layers]

    return ablate


def _rotation(transform):
    rotated = Indexer._rotated
    return lambda bb, mp: mp.setattr(Indexer, "_rotated", lambda self, x, rotate: rotated(self, x, transform(rotate)))


def _no_relu(bb, mp):
    def select(self, q, w, keys):
        if keys.shape[0] <= self.top_k:
            return np.arange(keys.shape[0])
        scores = (np.matmul(q, keys.T) * w[:, None]).sum(axis=0)
        return np.sort(np.argsort(-scores, kind="stable")[: self.top_k])

    mp.setattr(Indexer, "select", select)


def _unweighted_heads(bb, mp):
    queries = Indexer.queries
    mp.setattr(Indexer, "queries", lambda self, qr, h, rotate: (queries(self, qr, h, rotate)[0], np.ones((h.shape[0], self.heads), dtype=np.float32)))


ABLATIONS = {
    "indexer (dense MLA)": _indexer(),
    "indexer RoPE": _rotation(lambda rotate: lambda x: x),
    "[rope | nope] head layout": _rotation(lambda rotate: lambda x: rotate(x[..., ::-1])[..., ::-1]),
    "key LayerNorm bias": _indexer(k_norm_b=lambda idx: np.zeros_like(idx.k_norm_b)),
    "ReLU of each head's score": _no_relu,
    "per-head weights": _unweighted_heads,
    "top-k count": _indexer(top_k=lambda idx: idx.top_k + 4),
}


@pytest.mark.parametrize("feature", list(ABLATIONS))
def test_every_indexer_piece_matters(model_dir, monkeypatch, feature):
    """Each piece done wrong drops the min cosine to llama.cpp below 0.9999 (done right it is >= 0.99999). The
    Hadamard product has no ablation: orthonormal, it leaves every q . k as it is up to rounding."""
    pytest.importorskip("llama_cpp")
    m = model(model_dir, *SHAPES["base"])
    bb, hook = ref.engine(m, "reference")
    ABLATIONS[feature](bb, monkeypatch)
    c = compare(bb.forward(ref.TOKENS, KVCache(), hook), theirs(m, ref.TOKENS))
    assert c.min_cosine < 0.9999, c


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_K], ids=["Q8_0", "Q4_K"])
def test_quantized_model_passes_the_gate_against_llamacpp(model_dir, qtype):
    """As the other archs' quantized gate (ggml kernel, near ties and routing near-ties excluded and counted), and
    `verify --wire f32` remote == local bit for bit."""
    pytest.importorskip("llama_cpp")
    m = model(model_dir, ref.K_SHAPE if qtype is Q.Q4_K else ref.SHAPE, qtype=qtype)
    tokens = Tokenizer.from_spec(m.tokenizer_spec).encode(DEFAULT_PROMPT)
    assert len(tokens) > m.cfg.indexer_top_k + 16
    bb, hook = ref.engine(m, "ggml")
    margins: list[np.ndarray] = []
    c = compare(bb.forward(tokens, KVCache(), hook, margins=margins), theirs(m, tokens), margins=margins)
    assert c.passes and c.positions >= 32, c
    if qtype is Q.Q8_0:
        assert c.positions - c.near_ties_excluded >= 32, c
    assert run_gate(m, Codec.F32, kernel=make_kernel("ggml", 1))["remote_vs_local"]["bit_identical"]
