"""llama4 against llama.cpp with every feature of the arch on: 4 layers, so the schedule has dense layers (0, 2), MoE
layers (1, 3), chunked-attention layers (0-2) and a NoPE layer (3); rope_freqs factors; top-4 routing so the weight
before the expert acts on several slots. Chunks (8192) and the temperature only change anything past position 8190:
one test runs 8200 positions through both engines for them. The F32 and quantized gates and incremental decoding are
test_reference's (llama4 is in NEW_ARCHS, with 4 layers there).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from experts import forward
from experts.forward import KVCache
from experts.gguf_model import GGUFModel
from experts.verify import compare

from ..conftest import make_model
from .test_reference import SHAPE, TOKENS, engine

pytestmark = pytest.mark.llama
L4 = {**SHAPE, "n_layer": 4}


def test_the_random_model_has_every_llama4_feature(model_dir):
    """Dense and MoE layers interleaved, 3 chunked layers then a NoPE one, rope factors, q/k norm on."""
    m = GGUFModel(make_model(model_dir, "llama4", **L4))
    c = m.cfg
    assert m.moe_layers == (1, 3) and m.has("blk.0.ffn_gate.weight") and m.has("blk.1.ffn_gate_shexp.weight")
    assert [c.is_swa(i) for i in range(4)] == [True, True, True, False] and [c.uses_rope(i) for i in range(4)] == [True, True, True, False]
    assert m.has("rope_freqs.weight") and c.n_swa == 8192 and c.n_expert_used == 4


def _no_weight_before(bb, mp):
    router = dataclasses.replace(bb.arch.router, weight_before_expert=False)
    mp.setattr(bb, "arch", dataclasses.replace(bb.arch, router=router))


LLAMA4_ABLATIONS = {
    "weight before the expert": _no_weight_before,
    "rope_freqs factors": lambda bb, mp: mp.setattr(bb, "rope_freqs", None),
    "q/k norm after RoPE": lambda bb, mp: mp.setattr(bb, "qk_norm_after_rope", False),
    "NoPE layers": lambda bb, mp: mp.setattr(bb, "cfg", dataclasses.replace(bb.cfg, arch="llama")),
    "shared expert": lambda bb, mp: mp.setattr(bb, "layers", [dataclasses.replace(L, shexp=None) for L in bb.layers]),
}


@pytest.mark.parametrize("feature", list(LLAMA4_ABLATIONS))
def test_every_llama4_feature_of_the_random_model_matters(model_dir, monkeypatch, feature):
    """The F32 gate would catch each llama4 feature done wrong: leaving any one out drops below 0.9999 vs llama.cpp."""
    pytest.importorskip("llama_cpp")
    from experts.reference import llamacpp_logits

    path = make_model(model_dir, "llama4", **L4)
    bb, hook = engine(GGUFModel(path), "reference")
    LLAMA4_ABLATIONS[feature](bb, monkeypatch)
    c = compare(bb.forward(TOKENS, KVCache(), hook), llamacpp_logits(path, TOKENS))
    assert c.min_cosine < 0.9999, c


@pytest.mark.slow
def test_chunks_and_temperature_past_position_8190_match_llamacpp(model_dir):
    """8200 positions: from 8191 on the NoPE layer scales q by 1 + 0.1 ln 2, and from 8192 on the chunked layers attend
    only within the new chunk. Both engines agree on the last 20 positions (cosine >= 0.99999, same argmax), and
    leaving out either the chunks or the temperature fails that gate."""
    pytest.importorskip("llama_cpp")
    from experts.reference import llamacpp_logits

    path = make_model(model_dir, "llama4", n_layer=4)
    tokens = np.random.default_rng(0).integers(0, 256, 8200).tolist()
    ref = llamacpp_logits(path, tokens)[8180:]
    bb, hook = engine(GGUFModel(path), "reference")
    prefix = KVCache()
    bb.forward(tokens[:8180], prefix, hook)  # positions < 8191: neither chunks nor temperature change them

    def tail() -> np.ndarray:
        return bb.forward(tokens[8180:], KVCache(list(prefix.k), list(prefix.v)), hook)

    ours = tail()
    c = compare(ours, ref)
    assert c.min_cosine >= 0.99999 and (ours.argmax(-1) == ref.argmax(-1)).all(), c
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(bb, "cfg", dataclasses.replace(bb.cfg, n_swa=0))
        assert compare(tail(), ref).min_cosine < 0.99999
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(forward, "attn_temperature", lambda pos, temp: np.ones(pos.shape, dtype=np.float32))
        assert compare(tail(), ref).min_cosine < 0.99999
