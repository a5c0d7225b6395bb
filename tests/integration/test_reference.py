"""Our forward, through each kernel, against llama.cpp's own logits on the same GGUF files (F32 KV cache).

F32 weights: cosine >= 0.99999 and the same argmax everywhere, on the reference and the ggml kernels. Quantized
weights (Q8_0, Q4_K; MXFP4 for gpt-oss) through the ggml kernel: the quantized gate, cosine >= 0.999 with near ties excluded and
counted. Only ggml is held to it: like llama.cpp it quantizes the activations inside those matmuls, while the
reference kernel multiplies the dequantized weights in float32, which flips router choices on random models
(measured: Q8_0 min cosine 0.998 for qwen3moe, 0.964 for glm4moe).
"""

from __future__ import annotations

import dataclasses

import gguf
import numpy as np
import pytest

from experts import moe
from experts.arch import Gating
from experts.codecs import Codec
from experts.forward import Backbone, KVCache, local_moe
from experts.gguf_model import GGUFModel
from experts.hosting import open_experts
from experts.kernels import make_kernel
from experts.moe import ungrouped_moe
from experts.slices import ExpertStore
from experts.tokenizer import Tokenizer
from experts.verify import DEFAULT_PROMPT, MIN_COSINE, compare, run_gate

from ..conftest import ARCHS, NEW_ARCHS, make_model

pytestmark = pytest.mark.llama
Q = gguf.GGMLQuantizationType
KERNELS = ["reference", "ggml"]
TOKENS = [256 + 8, 72, 101, 108, 108, 111, 44, 32, 116, 104, 101, 114, 101, 33, 10, 65, 110, 100, 32, 115, 111] * 2
# Big enough that every feature matters (the router picks 4 of 16, in groups for glm4moe), small enough for seconds;
# K-quants need rows of 256 (their block width).
SHAPE = {"n_layer": 3, "n_expert": 16, "n_expert_used": 4, "n_embd": 128, "n_ff_exp": 64, "head_dim": 32}
K_SHAPE = {**SHAPE, "n_embd": 256, "n_ff_exp": 256, "n_head": 8}
# llama.cpp aborts on a llama4 model without a NoPE layer (the 4th): its temperature input is then not in the graph.
MIN_LAYERS = {"llama4": 4}


def shape(arch: str, base: dict) -> dict:
    return {**base, "n_layer": max(base.get("n_layer", 2), MIN_LAYERS.get(arch, 0))}


def engine(model: GGUFModel, kernel_name: str):
    """The dense forward and a hook over every expert (llama.cpp's plain slot-order sum), both on the kernel."""
    kernel = make_kernel(kernel_name, 1)
    store, _ = open_experts(model, kernel)
    return Backbone(model, kernel), local_moe(lambda i, x, e, w: ungrouped_moe(store, i, x, e, w))


@pytest.mark.parametrize("kernel_name", KERNELS)
@pytest.mark.parametrize("arch", ARCHS + NEW_ARCHS)
def test_f32_forward_matches_llamacpp(model_dir, arch, kernel_name):
    """cosine >= 0.99999 on every position and the same argmax on all of them, for each architecture and kernel."""
    pytest.importorskip("llama_cpp")
    from experts.reference import llamacpp_logits

    path = make_model(model_dir, arch, **shape(arch, SHAPE))
    bb, hook = engine(GGUFModel(path), kernel_name)
    ours, ref = bb.forward(TOKENS, KVCache(), hook), llamacpp_logits(path, TOKENS)
    c = compare(ours, ref)
    assert c.min_cosine >= 0.99999, c
    assert (ours.argmax(-1) == ref.argmax(-1)).all(), c
    assert c.positions == len(TOKENS) >= 32


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_K], ids=["Q8_0", "Q4_K"])
@pytest.mark.parametrize("arch", ARCHS + NEW_ARCHS)
def test_quantized_model_passes_the_gate_against_llamacpp(model_dir, arch, qtype):
    """Through the ggml kernel: min cosine >= 0.999 on every position, argmax on every clear one, near ties
    excluded and counted; and `verify --wire f32` on it is bit-identical remote vs local."""
    pytest.importorskip("llama_cpp")
    from experts.reference import llamacpp_logits

    model = GGUFModel(make_model(model_dir, arch, qtype, **shape(arch, K_SHAPE if qtype is Q.Q4_K else SHAPE)))
    tokens = Tokenizer.from_spec(model.tokenizer_spec).encode(DEFAULT_PROMPT)
    bb, hook = engine(model, "ggml")
    c = compare(bb.forward(tokens, KVCache(), hook), llamacpp_logits(model.path, tokens))
    assert c.min_cosine >= MIN_COSINE and c.argmax_agree == 1.0, c
    assert c.positions >= 32
    if qtype is Q.Q8_0:  # random Q4_K models' logits are nearly flat: every position is a near tie, cosine decides
        assert c.positions - c.near_ties_excluded >= 32, c  # the argmax check covers >= 32 clear positions
    assert run_gate(model, Codec.F32, kernel=make_kernel("ggml", 1))["remote_vs_local"]["bit_identical"]


GPT_OSS_ABLATIONS = {
    "yarn": lambda bb, mp: setattr(bb, "yarn", None),
    "sinks": lambda bb, mp: setattr(bb, "layers", [dataclasses.replace(L, sinks=None) for L in bb.layers]),
    "sliding window": lambda bb, mp: setattr(bb, "cfg", dataclasses.replace(bb.cfg, n_swa=0)),
    "SWA RoPE base": lambda bb, mp: setattr(bb, "cfg", dataclasses.replace(bb.cfg, rope_theta_swa=0.0)),
    "output bias": lambda bb, mp: setattr(bb, "layers", [dataclasses.replace(L, bo=None) for L in bb.layers]),
    "router bias": lambda bb, mp: setattr(bb, "layers", [dataclasses.replace(L, router_bias=None) for L in bb.layers]),
    "softmax over the selected": lambda bb, mp: setattr(bb, "router_params", dataclasses.replace(bb.router_params, gating=Gating.SOFTMAX)),
    "SwiGLU-OAI clamps": lambda bb, mp: mp.setattr(moe, "swiglu_oai", lambda g, u: g / (1 + np.exp(-1.702 * g)) * (u + 1)),
    "expert biases": lambda bb, mp: mp.setattr(ExpertStore, "biases", lambda self, layer, expert: None),
}


@pytest.mark.parametrize("feature", list(GPT_OSS_ABLATIONS))
def test_every_gpt_oss_feature_of_the_random_model_matters(model_dir, monkeypatch, feature):
    """The F32 gate would catch each gpt-oss feature done wrong: leaving any one out drops below 0.9999 vs llama.cpp."""
    pytest.importorskip("llama_cpp")
    from experts.reference import llamacpp_logits

    path = make_model(model_dir, "gpt-oss", **SHAPE)
    bb, hook = engine(GGUFModel(path), "reference")
    GPT_OSS_ABLATIONS[feature](bb, monkeypatch)
    c = compare(bb.forward(TOKENS, KVCache(), hook), llamacpp_logits(path, TOKENS))
    assert c.min_cosine < 0.9999, c


def test_mxfp4_gpt_oss_passes_the_quantized_gate_against_llamacpp(model_dir):
    """gpt-oss ships MXFP4 experts: through the ggml kernel (which, like llama.cpp, quantizes the activations to Q8_0
    inside MXFP4 matmuls) a random MXFP4 model passes the quantized gate, and `verify --wire f32` is bit-identical."""
    pytest.importorskip("llama_cpp")
    from experts.reference import llamacpp_logits

    model = GGUFModel(make_model(model_dir, "gpt-oss", Q.MXFP4, **SHAPE))
    assert model.qtype("blk.0.ffn_down_exps.weight") is Q.MXFP4 and model.qtype("blk.0.ffn_down_exps.bias") is Q.F32
    tokens = Tokenizer.from_spec(model.tokenizer_spec).encode(DEFAULT_PROMPT)
    bb, hook = engine(model, "ggml")
    c = compare(bb.forward(tokens, KVCache(), hook), llamacpp_logits(model.path, tokens))
    assert c.min_cosine >= MIN_COSINE and c.argmax_agree == 1.0, c
    assert c.positions - c.near_ties_excluded >= 32, c
    assert run_gate(model, Codec.F32, kernel=make_kernel("ggml", 1))["remote_vs_local"]["bit_identical"]


@pytest.mark.parametrize("kernel_name", KERNELS)
@pytest.mark.parametrize("arch", ARCHS + NEW_ARCHS)
def test_incremental_decoding_matches_one_pass(model_dir, arch, kernel_name):
    """Feeding tokens one by one through the KV cache gives the same bits as a single full pass (batch invariance)."""
    bb, hook = engine(GGUFModel(make_model(model_dir, arch, **shape(arch, {}))), kernel_name)
    full = bb.forward(TOKENS, KVCache(), hook)
    cache = KVCache()
    steps = np.concatenate([bb.forward(TOKENS[:5], cache, hook)] + [bb.forward([t], cache, hook) for t in TOKENS[5:]])
    assert steps.tobytes() == full.tobytes()
