"""kimi-linear (hybrid KDA / NoPE MLA) against llama.cpp: the F32 gate at two shapes with a prompt past a state
checkpoint, the quantized gates, batch invariance, and each KDA piece done wrong fails the F32 gate."""

from __future__ import annotations

import dataclasses

import gguf
import numpy as np
import pytest

from experts import delta_net
from experts.archs.kimi import KimiLinear
from experts.forward import KVCache
from experts.gguf_model import GGUFModel
from experts.kda import KimiDelta
from experts.verify import compare

from ..conftest import make_model
from . import test_reference as ref

pytestmark = pytest.mark.llama
Q = gguf.GGMLQuantizationType
ARCH = "kimi-linear"
LONG = ref.TOKENS * 2  # 84 positions: past delta_net.CHECKPOINT_EVERY (64)
SHAPES = {"base": ref.SHAPE, "more-heads": {**ref.SHAPE, "n_layer": 4, "n_head": 8, "head_dim": 16}}


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("kernel_name", ref.KERNELS)
def test_f32_forward_matches_llamacpp(model_dir, kernel_name, shape):
    """min cosine >= 0.99999 and the same argmax on all 84 positions, on both kernels and both shapes."""
    pytest.importorskip("llama_cpp")
    from experts.reference import llamacpp_logits

    path = make_model(model_dir, ARCH, **SHAPES[shape])
    bb, hook = ref.engine(GGUFModel(path), kernel_name)
    ours, theirs = bb.forward(LONG, KVCache(), hook), llamacpp_logits(path, LONG)
    c = compare(ours, theirs)
    assert c.min_cosine >= 0.99999, c
    assert (ours.argmax(-1) == theirs.argmax(-1)).all() and c.positions == len(LONG) > delta_net.CHECKPOINT_EVERY


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_K], ids=["Q8_0", "Q4_K"])
def test_quantized_model_passes_the_gate_against_llamacpp(model_dir, qtype):
    """The shared quantized gate (ggml kernel) and `verify --wire f32` remote == local bit for bit."""
    ref.test_quantized_model_passes_the_gate_against_llamacpp(model_dir, ARCH, qtype, 0)


def test_incremental_decoding_matches_one_pass(model_dir):
    """Token by token through the recurrent cache and its checkpoints: the bits of one pass."""
    bb, hook = ref.engine(GGUFModel(make_model(model_dir, ARCH, n_layer=3)), "reference")
    full = bb.forward(LONG, KVCache(), hook)
    cache = KVCache()
    steps = np.concatenate([bb.forward(LONG[:60], cache, hook)] + [bb.forward([t], cache, hook) for t in LONG[60:]])
    assert steps.tobytes() == full.tobytes()


def _kda(**change):
    return lambda bb, mp: setattr(bb, "layers", [dataclasses.replace(L, gdn=dataclasses.replace(L.gdn, **{k: f(L.gdn) for k, f in change.items()})) if L.gdn else L for L in bb.layers])


def _no_history(g):
    c = g.conv.copy()
    c[:, :-1] = 0.0
    return c


def _decay_per_head(bb, mp):
    inputs = KimiDelta.inputs

    def per_head(self, cfg, h):
        rows, gate = inputs(self, cfg, h)
        H, S = cfg.ssm_v_heads, cfg.ssm_state
        g = rows[:, -H * S :].reshape(-1, H, S)
        rows[:, -H * S :] = np.broadcast_to(g.mean(axis=-1, keepdims=True), g.shape).reshape(-1, H * S)
        return rows, gate

    mp.setattr(KimiDelta, "inputs", per_head)


def _silu_gate(bb, mp):
    mp.setattr(KimiDelta, "output", lambda self, cfg, o, gate: self.out((delta_net.head_norm(o, self.norm, cfg.rms_eps) * delta_net.silu(gate.reshape(o.shape))).reshape(o.shape[0], -1)))


ABLATIONS = {
    "conv history": _kda(conv=_no_history),
    "state carried across tokens": _kda(a=lambda g: np.full_like(g.a, -1e4)),
    "one decay per key dim": _decay_per_head,
    "q/k L2 norm": lambda bb, mp: mp.setattr(delta_net, "l2_norm", lambda x, eps: x),
    "dt bias": _kda(dt_bias=lambda g: np.zeros_like(g.dt_bias)),
    "sigmoid (not silu) output gate": _silu_gate,
    "NoPE MLA": lambda bb, mp: mp.setattr(KimiLinear, "uses_rope", lambda self, layer: True),
    "shared expert": lambda bb, mp: setattr(bb, "layers", [dataclasses.replace(L, shexp=None) for L in bb.layers]),
}


@pytest.mark.parametrize("feature", list(ABLATIONS))
def test_every_kda_feature_matters(model_dir, monkeypatch, feature):
    """Each piece done wrong drops the min cosine to llama.cpp below 0.9999 (done right it is >= 0.99999)."""
    pytest.importorskip("llama_cpp")
    from experts.reference import llamacpp_logits

    path = make_model(model_dir, ARCH, **ref.SHAPE)
    bb, hook = ref.engine(GGUFModel(path), "reference")
    ABLATIONS[feature](bb, monkeypatch)
    c = compare(bb.forward(ref.TOKENS, KVCache(), hook), llamacpp_logits(path, ref.TOKENS))
    assert c.min_cosine < 0.9999, c
