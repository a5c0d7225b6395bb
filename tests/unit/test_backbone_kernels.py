"""The backbone's dense projections through a kernel on the packed bytes: the reference kernel keeps
today's bits exactly; ggml is batch invariant and within the quantized-weights gate of the reference."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from experts.dense_weights import PackedFFN, PackedLinear
from experts.forward import Backbone, KVCache, local_moe
from experts.gguf_model import GGUFModel
from experts.kernels import GgmlKernel, ReferenceKernel
from experts.moe import ungrouped_moe
from experts.packed_experts import PackedExperts
from experts.slices import ExpertStore
from experts.verify import compare
from tests.conftest import ARCHS, make_model

Q = gguf.GGMLQuantizationType
TOKENS = [264, 72, 101, 108, 108, 111, 44, 32, 116, 104, 101, 114, 101, 33, 10, 65, 110, 100]
# Every matrix row a multiple of 256 (K-quants), the shared expert too; random head width.
SHAPE = dict(n_embd=256, n_ff_exp=256, n_ff_shexp=256, n_expert=8, n_expert_used=2, head_dim=64)


def quantized(model_dir, arch: str, qtype) -> GGUFModel:
    return GGUFModel(make_model(model_dir, arch, qtype, **SHAPE))


def f32_hook(model: GGUFModel):
    store = ExpertStore(model)
    return local_moe(lambda i, x, e, w: ungrouped_moe(store, i, x, e, w))


@pytest.mark.parametrize("qtype", [Q.F32, Q.Q8_0, Q.Q4_K])
@pytest.mark.parametrize("arch", ARCHS)
def test_reference_kernel_keeps_todays_bits(model_dir, arch, qtype):
    """Backbone(model, ReferenceKernel()) on the packed bytes gives exactly the logits of today's float32 copies."""
    model = quantized(model_dir, arch, qtype)
    hook = f32_hook(model)
    today = Backbone(model).forward(TOKENS, KVCache(), hook)
    packed = Backbone(model, kernel=ReferenceKernel())
    assert isinstance(packed.layers[0].wq, PackedLinear)
    assert packed.forward(TOKENS, KVCache(), hook).tobytes() == today.tobytes()


@pytest.mark.parametrize("arch", ARCHS)
def test_backbone_with_a_kernel_keeps_no_float32_copies(model_dir, arch):
    """Every matrix of a kernel backbone is a view of the file's memory map (resident memory ~ the quantized size)."""
    model = quantized(model_dir, arch, Q.Q4_K)
    bb = Backbone(model, kernel=GgmlKernel())
    linears = [bb.tok_embd, bb.output] + [w for L in bb.layers for w in (L.wq, L.wk, L.wv, L.wo, L.router)]
    ffns = [L.shexp[1] for L in bb.layers if L.shexp is not None]
    assert len(ffns) == (model.cfg.n_layer if arch == "qwen2moe" else 0)
    views = [lin.w.data for lin in linears] + [w.data for f in ffns for w in (f.gate, f.up, f.down)]
    assert all(isinstance(lin, PackedLinear) for lin in linears) and all(isinstance(f, PackedFFN) for f in ffns)
    assert all(np.shares_memory(v, model.reader.data) for v in views)


@pytest.mark.parametrize("arch", ARCHS)
def test_ggml_backbone_decodes_incrementally_bit_for_bit(model_dir, arch):
    """With ggml for the dense part and the experts, token-by-token decoding equals one pass (batch invariance)."""
    model = quantized(model_dir, arch, Q.Q4_K)
    kernel = GgmlKernel()
    experts = PackedExperts(model, kernel)
    hook = local_moe(lambda i, x, e, w: experts.partial_sum(i, x, e, w, np.ones(e.shape, dtype=bool))[0])
    bb = Backbone(model, kernel=kernel)
    full = bb.forward(TOKENS, KVCache(), hook)
    cache = KVCache()
    steps = np.concatenate([bb.forward(TOKENS[:5], cache, hook)] + [bb.forward([t], cache, hook) for t in TOKENS[5:]])
    assert steps.tobytes() == full.tobytes()


def routed(model: GGUFModel, log: list[np.ndarray]):
    """The float32 expert hook, recording each layer's chosen experts (as sets: slot order may swap on a tie)."""
    hook = f32_hook(model)

    def moe(i, x, e, w):
        log.append(np.sort(e, axis=1))
        return hook(i, x, e, w)

    return moe  # the hook's Future passes through


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_K, Q.Q6_K])
@pytest.mark.parametrize("arch", ARCHS)
def test_ggml_backbone_passes_the_quantized_gate(model_dir, arch, qtype):
    """ggml's dense projections vs the float32 reference: min cosine >= 0.999 and argmax on clear positions.

    Positions where a router's top-k flips (a near tie the quantized activations tip over) are
    excluded and counted, as the gate does; they must stay a small minority.
    """
    model = quantized(model_dir, arch, qtype)
    ref_ids: list[np.ndarray] = []
    got_ids: list[np.ndarray] = []
    ref = Backbone(model).forward(TOKENS, KVCache(), routed(model, ref_ids))
    got = Backbone(model, kernel=GgmlKernel()).forward(TOKENS, KVCache(), routed(model, got_ids))
    same_route = np.all([(a == b).all(axis=1) for a, b in zip(ref_ids, got_ids, strict=True)], axis=0)
    assert same_route.sum() >= 0.75 * len(TOKENS), f"routing flipped at {np.nonzero(~same_route)[0].tolist()}"
    c = compare(got[same_route], ref[same_route])
    assert not compare(got, ref).bit_identical  # the kernel really ran (ggml's bits are its own)
    assert c.min_cosine >= 0.999, c
    assert c.argmax_agree == 1.0, c
