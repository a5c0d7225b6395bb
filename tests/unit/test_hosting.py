"""The load plan: which source computes a node's experts, the memory it takes, and budgets it refuses."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from experts.errors import SliceError
from experts.gguf_model import ExpertRange, GGUFModel
from experts.hosting import float_bytes, open_experts, packed_bytes, plan_load
from experts.kernels import GgmlKernel, ReferenceKernel
from experts.packed_experts import PackedExperts
from experts.random_model import random_config, write_random_model
from experts.slices import ExpertStore

Q = gguf.GGMLQuantizationType


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> GGUFModel:
    path = tmp_path_factory.mktemp("hosting") / "m.gguf"
    write_random_model(path, random_config(arch="qwen3moe", n_layer=2, n_embd=256, n_ff_exp=256, n_expert=8, n_expert_used=2), qtype=Q.Q4_K)
    return GGUFModel(path)


def test_sizes_are_the_files_bytes_and_float32(model):
    """packed_bytes is what the expert tensors take in the file; float_bytes 4 bytes per weight."""
    everything = sum(model.tensors[f"blk.{i}.{k}.weight"].n_bytes for i in model.layers for k in model.expert_kinds(i))
    assert packed_bytes(model, model.layers, model.experts) == everything
    assert packed_bytes(model, range(0, 1), ExpertRange(0, 4)) == everything // 4
    assert float_bytes(model, model.layers, model.experts) == 3 * 256 * 256 * 4 * 2 * 8


def test_plan_by_kernel_and_budget(model):
    """ggml holds the packed bytes; the reference caches float32 when it fits, else dequantizes on the fly."""
    packed, floats = packed_bytes(model, model.layers, model.experts), float_bytes(model, model.layers, model.experts)
    assert floats > 6 * packed  # Q4_K: ~4.5 bits a weight
    p = plan_load(model, GgmlKernel())
    assert (p.mode, p.resident_bytes) == ("packed", packed)
    assert plan_load(model, ReferenceKernel()).mode == "cached"
    p = plan_load(model, ReferenceKernel(), floats - 1)
    assert (p.mode, p.resident_bytes) == ("on-the-fly", packed)
    source, plan = open_experts(model, GgmlKernel(), memory_budget=packed)
    assert isinstance(source, PackedExperts) and plan.mode == "packed"
    source, plan = open_experts(model, ReferenceKernel(), memory_budget=packed)
    assert isinstance(source, ExpertStore) and source.mode == "on-the-fly"


@pytest.mark.parametrize("kernel", [GgmlKernel(), ReferenceKernel()], ids=["ggml", "reference"])
def test_a_budget_below_the_packed_size_is_refused_with_the_numbers(model, kernel):
    """A worker whose experts cannot fit learns it at start-up, with what they need and what it has."""
    packed = packed_bytes(model, range(0, 1), ExpertRange(0, 4))
    with pytest.raises(SliceError) as err:
        plan_load(model, kernel, packed - 1, range(0, 1), ExpertRange(0, 4))
    text = str(err.value)
    assert f"{packed / 2**20:.1f} MB" in text and f"{(packed - 1) / 2**20:.1f} MB" in text and "--experts" in text
    assert plan_load(model, kernel, packed, range(0, 1), ExpertRange(0, 4)).resident_bytes == packed


def test_both_sources_answer_partial_sums_with_their_kernel_identity(model):
    """The worker calls source.partial_sum whatever the source; identity says whose bits they are."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 256)).astype(np.float32)
    ids = np.array([[0, 5], [7, 1], [2, 2]], dtype=np.int32)
    w = np.full((3, 2), 0.5, dtype=np.float32)
    held = np.ones((3, 2), dtype=bool)
    fast, _ = open_experts(model, GgmlKernel())
    ref, _ = open_experts(model, ReferenceKernel())
    assert fast.identity == GgmlKernel().identity and ref.identity == ReferenceKernel.identity
    a, _ = fast.partial_sum(0, x, ids, w, held)
    b, _ = ref.partial_sum(0, x, ids, w, held)
    cos = (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))
    assert cos.min() > 0.999 and not np.array_equal(a, b)  # ggml quantizes activations: close, other bits
