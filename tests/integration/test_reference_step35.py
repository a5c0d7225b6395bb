"""step35 against llama.cpp with every feature of the arch on: a dense lead layer, odd layers SWA (window 4 of 42
positions, own RoPE base, 6 query / 3 KV heads) and even ones full attention (4 / 2 heads, half the dims rotated,
rope_freqs), per-head q/k norm and sigmoid output gate, a grouped sigmoid router with bias, norm and scale, a shared
expert, SwiGLU clamps on routed experts and on shared/dense FFNs, and a trailing MTP block that is read, not run.
The F32 and quantized gates, incremental decoding and the swarm runs are test_reference's and test_swarm_archs'
(step35 is in ISSUE15_ARCHS); here each feature is shown to matter.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from experts.archs import Arch
from experts.archs.step import Step35
from experts.config import ModelConfig
from experts.forward import KVCache
from experts.gguf_model import GGUFModel
from experts.moe import SWIGLU, Glu, silu
from experts.verify import compare

from ..conftest import make_model
from .test_reference import SHAPE, TOKENS, engine

pytestmark = pytest.mark.llama


def test_the_random_model_has_every_step35_feature(model_dir):
    """Per-layer heads and SWA flags, both clamp kinds set per layer, the optional tensors written, an MTP block."""
    m = GGUFModel(make_model(model_dir, "step35", **SHAPE))
    c = m.cfg
    assert m.moe_layers == (1, 2) and m.has("blk.0.ffn_gate.weight") and m.has("blk.3.nextn.eh_proj.weight")
    assert [c.is_swa(i) for i in range(3)] == [False, True, False] and c.n_swa == 4 < len(TOKENS)
    assert [c.heads(i) for i in range(3)] == [4, 6, 4] and [c.kv_heads(i) for i in range(3)] == [2, 3, 2]
    assert [c.rope_dim_at(i) for i in range(3)] == [16, 32, 16] and m.shape("rope_freqs.weight") == (16,)
    assert m.has("blk.1.attn_gate.weight") and m.has("blk.0.attn_q_norm.weight") and m.has("blk.1.exp_probs_b.bias")
    assert [c.glu_exp(i).limit for i in (1, 2)] == [1.0, 0.75] and [c.glu_shexp(i).limit for i in range(3)] == [0.5, 1.25, 1.0]


def test_the_clamps_clip_on_the_random_model():
    """At the random weights' scale (gate and up ~ N(0, 1)) the clamps change a good share of the activations."""
    rng = np.random.default_rng(0)
    g, u = rng.standard_normal((2, 4096)).astype(np.float32)
    for limit in (0.5, 0.75, 1.0, 1.25):
        clipped = np.mean(Glu(limit=limit)(g, u) != silu(g) * u)
        assert clipped > 0.15, (limit, clipped)


def _layers(change):
    return lambda bb, mp: mp.setattr(bb, "layers", [change(L) for L in bb.layers])


def _no_ffn_clamps(L):
    """The shared experts and dense FFNs without swiglu_clamp_shexp."""
    plain = SWIGLU
    shexp = None if L.shexp is None else (L.shexp[0], dataclasses.replace(L.shexp[1], glu=plain))
    return dataclasses.replace(L, shexp=shexp, ffn=None if L.ffn is None else dataclasses.replace(L.ffn, glu=plain))


STEP35_ABLATIONS = {
    "routed-expert clamps": lambda bb, mp: mp.setattr(ModelConfig, "glu_exp", lambda self, layer: SWIGLU),
    "shared and dense clamps": _layers(_no_ffn_clamps),
    "sliding window": lambda bb, mp: mp.setattr(bb, "cfg", dataclasses.replace(bb.cfg, n_swa=10**6)),
    "SWA RoPE base": lambda bb, mp: mp.setattr(bb, "cfg", dataclasses.replace(bb.cfg, rope_theta_swa=0.0)),
    "half rotation on full layers": lambda bb, mp: mp.setattr(ModelConfig, "rope_dim_at", lambda self, layer: self.rope_dim),
    "rope_freqs factors": lambda bb, mp: mp.setattr(bb, "rope_freqs", None),
    "rope_freqs on full layers only": lambda bb, mp: mp.setattr(Step35, "rope_factors", Arch.rope_factors),
    "head gate": _layers(lambda L: dataclasses.replace(L, head_gate=None)),
    "q/k norm": _layers(lambda L: dataclasses.replace(L, q_norm=None)),
    "selection bias": _layers(lambda L: dataclasses.replace(L, selection_bias=None)),
    "shared expert": _layers(lambda L: dataclasses.replace(L, shexp=None)),
    "routed scale": lambda bb, mp: mp.setattr(bb, "router_params", dataclasses.replace(bb.router_params, scale=0.0)),
    "expert groups": lambda bb, mp: mp.setattr(bb, "router_params", dataclasses.replace(bb.router_params, n_groups=0)),
}


@pytest.mark.parametrize("feature", list(STEP35_ABLATIONS))
def test_every_step35_feature_of_the_random_model_matters(model_dir, monkeypatch, feature):
    """The F32 gate would catch each step35 feature done wrong: leaving any one out drops below 0.9999 vs llama.cpp."""
    pytest.importorskip("llama_cpp")
    from experts.reference import llamacpp_logits

    path = make_model(model_dir, "step35", **SHAPE)
    bb, hook = engine(GGUFModel(path), "reference")
    STEP35_ABLATIONS[feature](bb, monkeypatch)
    c = compare(bb.forward(TOKENS, KVCache(), hook), llamacpp_logits(path, TOKENS))
    assert c.min_cosine < 0.9999, c


def test_without_a_swa_rope_base_the_swa_layers_use_10000_as_llamacpp(tmp_path):
    """A file without rope.freq_base_swa: llama.cpp's SWA layers rotate with its default base 10000, not the file's
    rope.freq_base (50000 here); so do ours, and using the file's base on them fails the gate."""
    pytest.importorskip("llama_cpp")
    from experts.random_model import random_config, write_random_model
    from experts.reference import llamacpp_logits

    cfg = dataclasses.replace(random_config("step35", **SHAPE), rope_theta=50000.0, rope_theta_swa=0.0)
    path = tmp_path / "no-swa-base.gguf"
    write_random_model(path, cfg)
    model = GGUFModel(path)
    assert "step35.rope.freq_base_swa" not in model.reader.fields and model.cfg.rope_base(1) == 10000.0 and model.cfg.rope_base(0) == 50000.0
    bb, hook = engine(model, "reference")
    ref = llamacpp_logits(path, TOKENS)
    ours = bb.forward(TOKENS, KVCache(), hook)
    c = compare(ours, ref)
    assert c.min_cosine >= 0.99999 and (ours.argmax(-1) == ref.argmax(-1)).all(), c
    bb.cfg = dataclasses.replace(bb.cfg, rope_theta_swa=0.0)
    assert compare(bb.forward(TOKENS, KVCache(), hook), ref).min_cosine < 0.9999
