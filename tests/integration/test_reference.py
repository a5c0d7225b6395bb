"""Our numpy forward against llama.cpp's own logits on the same GGUF files (F32 weights and F32 KV; Q8_0 through the ggml kernel)."""

from __future__ import annotations

import numpy as np
import pytest

from experts.codecs import Codec
from experts.forward import Backbone, KVCache, local_moe
from experts.gguf_model import GGUFModel
from experts.kernels import GgmlKernel
from experts.moe import ungrouped_moe
from experts.packed_experts import PackedExperts, packed_partial_sum
from experts.slices import ExpertStore
from experts.tokenizer import Tokenizer
from experts.verify import DEFAULT_PROMPT, MIN_COSINE, compare, run_gate

from ..conftest import ARCHS, NEW_ARCHS, Q, make_model

pytestmark = pytest.mark.llama
TOKENS = [256 + 8, 72, 101, 108, 108, 111, 44, 32, 116, 104, 101, 114, 101, 33, 10, 65, 110, 100, 32, 115, 111] * 2
# Big enough that every feature matters (the router picks 4 of 16, in groups for glm4moe), small enough for seconds.
SHAPE = {"n_layer": 3, "n_expert": 16, "n_expert_used": 4, "n_embd": 128, "n_ff_exp": 64, "head_dim": 32}


def _ours(model: GGUFModel, tokens: list[int]) -> np.ndarray:
    store = ExpertStore(model)
    return Backbone(model).forward(tokens, KVCache(), local_moe(lambda i, x, e, w: ungrouped_moe(store, i, x, e, w)))


@pytest.mark.parametrize("arch", ARCHS + NEW_ARCHS)
def test_numpy_forward_matches_llamacpp(model_dir, arch):
    """cosine >= 0.99999 on every position and the same argmax on all of them, for each architecture."""
    pytest.importorskip("llama_cpp")
    from experts.reference import llamacpp_logits

    path = make_model(model_dir, arch, **SHAPE)
    model = GGUFModel(path)
    ours, ref = _ours(model, TOKENS), llamacpp_logits(path, TOKENS)
    c = compare(ours, ref)
    assert c.min_cosine >= 0.99999, c
    assert (ours.argmax(-1) == ref.argmax(-1)).all(), c
    assert c.positions == len(TOKENS) >= 32


@pytest.mark.parametrize("arch", NEW_ARCHS)
def test_quantized_model_passes_the_gate_against_llamacpp(model_dir, arch):
    """Q8_0 weights through the ggml kernel (which, like llama.cpp, quantizes the activations to Q8_0):
    min cosine >= 0.999 on every position, argmax on every clear one, near ties excluded and counted."""
    pytest.importorskip("llama_cpp")
    from experts.reference import llamacpp_logits

    model = GGUFModel(make_model(model_dir, arch, Q.Q8_0, **SHAPE))
    tokens = Tokenizer.from_spec(model.tokenizer_spec).encode(DEFAULT_PROMPT)
    kernel = GgmlKernel()
    experts = PackedExperts(model, kernel)
    hook = local_moe(lambda i, x, e, w: packed_partial_sum(experts, i, x, e, w, np.ones(e.shape, dtype=bool))[0])
    c = compare(Backbone(model, kernel=kernel).forward(tokens, KVCache(), hook), llamacpp_logits(model.path, tokens))
    assert c.min_cosine >= MIN_COSINE and c.argmax_agree == 1.0, c
    assert c.positions >= 32 and c.near_ties_excluded < c.positions // 2, c
    assert run_gate(model, Codec.F32)["remote_vs_local"]["bit_identical"]  # verify --wire f32: remote == local


@pytest.mark.parametrize("arch", ARCHS + NEW_ARCHS)
def test_incremental_decoding_matches_one_pass(model_dir, arch):
    """Feeding tokens one by one through the KV cache gives the same bits as a single full pass (batch invariance)."""
    model = GGUFModel(make_model(model_dir, arch))
    store = ExpertStore(model)
    bb = Backbone(model)
    hook = local_moe(lambda i, x, e, w: ungrouped_moe(store, i, x, e, w))
    full = bb.forward(TOKENS, KVCache(), hook)
    cache = KVCache()
    steps = np.concatenate([bb.forward(TOKENS[:5], cache, hook)] + [bb.forward([t], cache, hook) for t in TOKENS[5:]])
    assert steps.tobytes() == full.tobytes()
