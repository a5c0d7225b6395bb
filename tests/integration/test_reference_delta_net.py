"""qwen3next / qwen35moe against llama.cpp beyond the shared gates (test_reference): the legacy ssm_in layout and a
per-layer schedule array compute what llama.cpp computes, and each feature of the random models matters: done wrong
(V heads the other arch's way, no conv history, no state carried, no L2 norm, no output gate, ...) the F32 gate fails."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from experts import delta_net, forward
from experts.forward import KVCache
from experts.gguf_model import GGUFModel
from experts.model_writer import write_model
from experts.random_model import byte_level_tokenizer, random_config, random_tensors
from experts.verify import compare

from ..conftest import make_model
from .test_reference import SHAPE, TOKENS, engine

pytestmark = pytest.mark.llama


def _gdn(**change):
    return lambda bb, mp: setattr(bb, "layers", [dataclasses.replace(L, gdn=dataclasses.replace(L.gdn, **{k: f(L.gdn) for k, f in change.items()})) if L.gdn else L for L in bb.layers])


def _other_heads(bb, mp):
    cfg = bb.cfg
    j = np.arange(cfg.ssm_v_heads)
    other = j // (cfg.ssm_v_heads // cfg.ssm_k_heads) if cfg.spec.attention.tiled_v else j % cfg.ssm_k_heads
    mp.setattr(delta_net, "key_heads", lambda cfg: other)


def _no_history(g):
    c = g.conv.copy()
    c[:, :-1] = 0.0
    return c


ABLATIONS = {
    "V heads tiled vs grouped": _other_heads,
    "conv history": _gdn(conv=_no_history),
    "state carried across tokens": _gdn(a=lambda g: np.full_like(g.a, -1e4)),  # exp(g) = 0: each token starts afresh
    "q/k L2 norm": lambda bb, mp: mp.setattr(delta_net, "l2_norm", lambda x, eps: x),
    "dt bias": _gdn(dt_bias=lambda g: np.zeros_like(g.dt_bias)),
    "attention output gate": lambda bb, mp: mp.setattr(forward, "sigmoid", lambda x: np.float32(1.0)),
    "partial rope": lambda bb, mp: setattr(bb, "cfg", dataclasses.replace(bb.cfg, n_rot=0)),
    "shared expert": lambda bb, mp: setattr(bb, "layers", [dataclasses.replace(L, shexp=None) for L in bb.layers]),
}


@pytest.mark.parametrize("feature", list(ABLATIONS))
@pytest.mark.parametrize("arch", ["qwen3next", "qwen35moe"])
def test_every_feature_of_the_hybrid_random_models_matters(model_dir, monkeypatch, arch, feature):
    """Each feature done wrong drops the min cosine to llama.cpp below 0.9999 (done right it is >= 0.99999)."""
    pytest.importorskip("llama_cpp")
    from experts.reference import llamacpp_logits

    path = make_model(model_dir, arch, **SHAPE)
    bb, hook = engine(GGUFModel(path), "reference")
    ABLATIONS[feature](bb, monkeypatch)
    c = compare(bb.forward(TOKENS, KVCache(), hook), llamacpp_logits(path, TOKENS))
    assert c.min_cosine < 0.9999, c


def legacy_copy(src: GGUFModel, out) -> GGUFModel:
    """The same qwen3next weights with each recurrent layer's attn_qkv + attn_gate regrouped into the legacy ssm_in:
    per k head [q, k, its v heads, their z rows] (the layout llama.cpp's build_qkvz splits)."""
    cfg = src.cfg
    S, n_k, r = cfg.ssm_state, cfg.ssm_k_heads, cfg.ssm_v_heads // cfg.ssm_k_heads
    tensors = {}
    for name in src.tensors:
        if name.endswith("attn_gate.weight"):
            continue
        w = src.dense(name)
        if name.endswith("attn_qkv.weight"):
            b = name.removesuffix("attn_qkv.weight")
            kd = cfg.gdn_key_dim
            q, k, v = w[:kd].reshape(n_k, S, -1), w[kd : 2 * kd].reshape(n_k, S, -1), w[2 * kd :].reshape(n_k, r * S, -1)
            z = src.dense(b + "attn_gate.weight").reshape(n_k, r * S, -1)
            tensors[b + "ssm_in.weight"] = np.concatenate([q, k, v, z], axis=1).reshape(-1, cfg.n_embd)
        else:
            tensors[name] = w
    write_model(out, cfg, tensors, src.tokenizer_spec)
    return GGUFModel(out)


def test_a_legacy_ssm_in_file_matches_llamacpp(model_dir, tmp_path):
    """qwen3next's legacy ssm_in (which llama.cpp 0.3.36 still loads) passes the F32 gate and computes what the
    attn_qkv + attn_gate file of the same weights computes."""
    pytest.importorskip("llama_cpp")
    from experts.reference import llamacpp_logits

    modern = GGUFModel(make_model(model_dir, "qwen3next", **SHAPE))
    legacy = legacy_copy(modern, tmp_path / "legacy.gguf")
    assert legacy.has("blk.0.ssm_in.weight") and not legacy.has("blk.0.attn_qkv.weight")
    bb, hook = engine(legacy, "reference")
    ours, ref = bb.forward(TOKENS, KVCache(), hook), llamacpp_logits(legacy.path, TOKENS)
    c = compare(ours, ref)
    assert c.min_cosine >= 0.99999 and (ours.argmax(-1) == ref.argmax(-1)).all(), c
    mb, mhook = engine(modern, "reference")
    assert compare(ours, mb.forward(TOKENS, KVCache(), mhook)).min_cosine >= 0.999999


def test_a_per_layer_schedule_array_matches_llamacpp(tmp_path):
    """A schedule no interval describes (attention.recurrent_layers r, a, a, r) is read as llama.cpp reads it."""
    pytest.importorskip("llama_cpp")
    from experts.reference import llamacpp_logits

    cfg = dataclasses.replace(random_config("qwen35moe", **{**SHAPE, "n_layer": 4}), layer_kinds="raar")
    p = tmp_path / "array.gguf"
    write_model(p, cfg, random_tensors(cfg), byte_level_tokenizer())
    bb, hook = engine(GGUFModel(p), "reference")
    ours, ref = bb.forward(TOKENS, KVCache(), hook), llamacpp_logits(p, TOKENS)
    c = compare(ours, ref)
    assert c.min_cosine >= 0.99999 and (ours.argmax(-1) == ref.argmax(-1)).all(), c
