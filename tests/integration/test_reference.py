"""Our numpy forward against llama.cpp's own logits on the same GGUF files (F32 weights, F32 KV cache)."""

from __future__ import annotations

import numpy as np
import pytest

from experts.forward import Backbone, KVCache, local_moe
from experts.gguf_model import GGUFModel
from experts.moe import ungrouped_moe
from experts.slices import ExpertStore
from experts.verify import compare

from ..conftest import ARCHS, make_model

pytestmark = pytest.mark.llama
TOKENS = [256 + 8, 72, 101, 108, 108, 111, 44, 32, 116, 104, 101, 114, 101, 33, 10, 65, 110, 100, 32, 115, 111]


@pytest.mark.parametrize("arch", ARCHS)
def test_numpy_forward_matches_llamacpp(model_dir, arch):
    """cosine >= 0.99999 and argmax agreement on every clear position, for each architecture."""
    pytest.importorskip("llama_cpp")
    from experts.reference import llamacpp_logits

    path = make_model(model_dir, arch, n_layer=3, n_expert=16, n_expert_used=4, n_embd=128, n_ff_exp=64, head_dim=32)
    model = GGUFModel(path)
    store = ExpertStore(model)
    ours = Backbone(model).forward(TOKENS, KVCache(), local_moe(lambda i, x, e, w: ungrouped_moe(store, i, x, e, w)))
    c = compare(ours, llamacpp_logits(path, TOKENS))
    assert c.min_cosine >= 0.99999, c
    assert c.argmax_agree == 1.0, c
    assert c.positions == len(TOKENS)


@pytest.mark.parametrize("arch", ARCHS)
def test_incremental_decoding_matches_one_pass(f32_models, arch):
    """Feeding tokens one by one through the KV cache gives the same bits as a single full pass (batch invariance)."""
    model = GGUFModel(f32_models[arch])
    store = ExpertStore(model)
    bb = Backbone(model)
    hook = local_moe(lambda i, x, e, w: ungrouped_moe(store, i, x, e, w))
    full = bb.forward(TOKENS, KVCache(), hook)
    cache = KVCache()
    steps = np.concatenate([bb.forward(TOKENS[:5], cache, hook)] + [bb.forward([t], cache, hook) for t in TOKENS[5:]])
    assert steps.tobytes() == full.tobytes()
