"""minimax-m3 (MiniMax Sparse Attention, SwiGLU-OAI, shared experts) against llama.cpp: the F32 gate at two shapes on
prompts past the kept blocks (so the selection drops positions), each new piece done wrong fails it, the dense
fallback, llama.cpp's one-token decode graph, the quantized gates.

llama.cpp runs in a child process (``llamacpp_logits(isolated=True)``: in a process that has loaded the ggml kernel's
older libggml its newer graphs abort) with flash attention on, which experts.reference turns on for this arch: with it
off llama.cpp only logs a warning and runs dense attention on every layer.
"""

from __future__ import annotations

import dataclasses

import gguf
import numpy as np
import pytest

from experts.arch import Gating
from experts.codecs import Codec
from experts.config import ModelConfig
from experts.forward import KVCache
from experts.gguf_model import GGUFModel
from experts.kernels import make_kernel
from experts.moe import SWIGLU
from experts.msa import BlockIndexer
from experts.random_model import random_config, with_settings, write_random_model
from experts.tokenizer import Tokenizer
from experts.verify import DEFAULT_PROMPT, compare, run_gate

from . import test_reference as ref

pytestmark = pytest.mark.llama
Q = gguf.GGMLQuantizationType
ARCH = "minimax-m3"
# base: 3 blocks of 4 positions kept of 42 (the query's own forced), 2 KV groups of 2 heads; the second shape: 4 layers
# (2 dense ones), 8 heads in 2 groups, 3 blocks of 6 kept with the 2 latest forced, a 16-wide index head.
# Not covered: 4 KV groups (see test_four_kv_groups_differ_from_llamacpp_on_one_row).
SHAPES = {
    "base": (ref.SHAPE, ()),
    "wider-groups": (
        {**ref.SHAPE, "n_layer": 4, "n_head": 8, "head_dim": 16},
        ("n_dense_lead=2", "indexer_head_dim=16", "indexer_top_k=3", "indexer_block_size=6", "indexer_local_blocks=2"),
    ),
}


def model(directory, shape: dict, settings: tuple[str, ...] = (), qtype=Q.F32) -> GGUFModel:
    name = "-".join(f"{k}{v}" for k, v in sorted(shape.items())) + "".join(settings)
    path = directory / f"{ARCH}-{qtype.name}-{name}.gguf"
    if not path.exists():
        write_random_model(path, with_settings(random_config(ARCH, **shape), settings), qtype=qtype)
    return GGUFModel(path)


def theirs(m: GGUFModel, tokens: list[int], **options) -> np.ndarray:
    from experts.reference import llamacpp_logits

    return llamacpp_logits(m.path, tokens, isolated=True, **options)


def kept(m: GGUFModel) -> int:
    return m.cfg.indexer_top_k * m.cfg.indexer_block_size


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("kernel_name", ref.KERNELS)
def test_f32_forward_matches_llamacpp_past_the_kept_blocks(model_dir, kernel_name, shape):
    """min cosine >= 0.99999 and the same argmax on all 42 positions, 30 (or 24) of which attend to kept blocks only."""
    pytest.importorskip("llama_cpp")
    m = model(model_dir, *SHAPES[shape])
    assert len(ref.TOKENS) >= kept(m) + 24
    bb, hook = ref.engine(m, kernel_name)
    ours, want = bb.forward(ref.TOKENS, KVCache(), hook), theirs(m, ref.TOKENS)
    c = compare(ours, want)
    assert c.min_cosine >= 0.99999, c
    assert (ours.argmax(-1) == want.argmax(-1)).all() and c.positions == len(ref.TOKENS) >= 32


def _msa(**change):
    """Every sparse layer's index branch with fields replaced (no change: no branch, dense attention)."""

    def ablate(bb, mp):
        bb.layers = [L if L.msa is None else dataclasses.replace(L, msa=dataclasses.replace(L.msa, **change) if change else None) for L in bb.layers]

    return ablate


def _mean_pooled_blocks(bb, mp):
    scores = BlockIndexer.block_scores

    def mean(self, q, keys):
        t = keys.shape[0]
        out = scores(self, q, keys)
        padded = np.zeros((q.shape[0], out.shape[1] * self.block), dtype=np.float32)
        padded[:, :t] = q @ keys.T
        return np.where(np.isinf(out), out, padded.reshape(q.shape[0], -1, self.block).mean(axis=-1))

    mp.setattr(BlockIndexer, "block_scores", mean)


def _swiglu(*methods):
    """SwiGLU instead of SwiGLU-OAI where *methods* of the config decide (set before the engine is built)."""
    return lambda mp: [mp.setattr(ModelConfig, name, lambda self, layer: SWIGLU) for name in methods]


def _shared(change):
    def ablate(bb, mp):
        bb.layers = [L if L.shexp is None else dataclasses.replace(L, shexp=change(L.shexp)) for L in bb.layers]

    return ablate


def _router(**change):
    def ablate(bb, mp):
        bb.router_params = dataclasses.replace(bb.router_params, **change)

    return ablate


# (before the engine is built, after): each a new piece of this arch done wrong
ABLATIONS = {
    "MSA (dense attention)": (None, _msa()),
    "local-force bias": (None, _msa(local=0)),
    "per-block max (mean instead)": (None, _mean_pooled_blocks),
    "kept block count": (None, _msa(top_k=4)),
    "SwiGLU-OAI (SwiGLU in every FFN)": (_swiglu("glu_exp", "glu_shexp"), None),
    "SwiGLU-OAI of the shared expert and dense FFN": (_swiglu("glu_shexp"), None),
    "shared expert's gated activation (SwiGLU)": (None, _shared(lambda sh: (sh[0], dataclasses.replace(sh[1], glu=SWIGLU)))),
    "shared expert": (None, lambda bb, mp: [setattr(bb, "shared_expert", lambda i, x: None)]),
    "sigmoid gating (softmax)": (None, _router(gating=Gating.SOFTMAX)),
    "routed scaling": (None, _router(scale=0.0)),
}


@pytest.mark.parametrize("feature", list(ABLATIONS))
def test_every_new_piece_matters(model_dir, monkeypatch, feature):
    """Each piece done wrong drops the min cosine to llama.cpp below 0.9999 (done right it is >= 0.99999)."""
    pytest.importorskip("llama_cpp")
    m = model(model_dir, *SHAPES["base"])
    before, after = ABLATIONS[feature]
    if before:
        before(monkeypatch)
    bb, hook = ref.engine(m, "reference")
    if after:
        after(bb, monkeypatch)
    c = compare(bb.forward(ref.TOKENS, KVCache(), hook), theirs(m, ref.TOKENS))
    assert c.min_cosine < 0.9999, c


def test_without_msa_we_match_llamacpps_dense_fallback(model_dir):
    """llama.cpp without flash attention runs every layer densely: our forward without the index branch matches it
    at the F32 gate, and it is not the sparse model (the MSA ablation above fails against the sparse graph)."""
    pytest.importorskip("llama_cpp")
    m = model(model_dir, *SHAPES["base"])
    bb, hook = ref.engine(m, "reference")
    _msa()(bb, None)
    ours, want = bb.forward(ref.TOKENS, KVCache(), hook), theirs(m, ref.TOKENS, flash_attn=False)
    c = compare(ours, want)
    assert c.min_cosine >= 0.99999 and (ours.argmax(-1) == want.argmax(-1)).all(), c


def test_llamacpps_one_token_decode_graph_agrees_with_our_decode(model_dir):
    """llama.cpp's one-token graph gathers the kept blocks' keys rather than masking the others; it is the same sparse
    model, within the F32 gate of our forward, which decodes with the bits of its prompt pass (tests/unit/test_msa.py)."""
    pytest.importorskip("llama_cpp")
    m = model(model_dir, *SHAPES["base"])
    bb, hook = ref.engine(m, "reference")
    cache = KVCache()
    ours = np.concatenate([bb.forward([t], cache, hook) for t in ref.TOKENS])
    want = theirs(m, ref.TOKENS, batch=1)
    c = compare(ours, want)
    assert c.min_cosine >= 0.99999 and (ours.argmax(-1) == want.argmax(-1)).all(), c


# Q8_0 does not pass yet (seeds 0-2: min cosine 0.969-0.999): llama.cpp quantizes the activations of the attention
# projections, the index branch's input moves, and a block choice flips; the gate excludes routing near-ties but has
# no notion of a selection near-tie. Open, kept visible as a strict xfail.
Q8_XFAIL = pytest.mark.xfail(strict=True, reason="MSA block choices flip under llama.cpp's quantized activations; no selection near-tie exclusion yet")


@pytest.mark.parametrize("qtype", [pytest.param(Q.Q8_0, marks=Q8_XFAIL), Q.Q4_K], ids=["Q8_0", "Q4_K"])
def test_quantized_model_passes_the_gate_against_llamacpp(model_dir, qtype):
    """As the other archs' quantized gate (ggml kernel, near ties and routing near-ties excluded and counted; the index
    branch stays F32, as the converter writes it), and `verify --wire f32` remote == local bit for bit."""
    pytest.importorskip("llama_cpp")
    m = model(model_dir, ref.K_SHAPE if qtype is Q.Q4_K else ref.SHAPE, qtype=qtype)
    tokens = Tokenizer.from_spec(m.tokenizer_spec).encode(DEFAULT_PROMPT)
    assert len(tokens) > kept(m) + 24
    bb, hook = ref.engine(m, "ggml")
    margins: list[np.ndarray] = []
    c = compare(bb.forward(tokens, KVCache(), hook, margins=margins), theirs(m, tokens), margins=margins)
    assert c.passes and c.positions >= 32, c
    if qtype is Q.Q8_0:
        assert c.positions - c.near_ties_excluded >= 32, c
    assert run_gate(m, Codec.F32, kernel=make_kernel("ggml", 1))["remote_vs_local"]["bit_identical"]


@pytest.mark.xfail(strict=True, reason="open: with 4 KV groups one row of 42 differs from llama.cpp (cosine 0.974), in its batch and decode graphs alike")
def test_four_kv_groups_differ_from_llamacpp_on_one_row(model_dir):
    """Known gap, kept visible: 8 heads in 4 KV groups (index heads 4) match llama.cpp on 41 of 42 positions, row 21
    at cosine 0.974; no single block choice of one group, and no permutation of the groups, makes it match (checked
    by brute force). 2 groups of 2 or 4 heads match at every shape tried."""
    pytest.importorskip("llama_cpp")
    m = model(model_dir, {**ref.SHAPE, "n_layer": 4, "n_head": 8, "n_head_kv": 4, "head_dim": 16}, ("indexer_heads=4",))
    bb, hook = ref.engine(m, "reference")
    c = compare(bb.forward(ref.TOKENS, KVCache(), hook), theirs(m, ref.TOKENS))
    assert c.min_cosine >= 0.99999, c
