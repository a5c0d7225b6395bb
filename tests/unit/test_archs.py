"""olmoe / glm4moe / minimax-m2 / gpt-oss files: what the reader makes of them, their dense layers in slices, clear errors."""

from __future__ import annotations

import dataclasses

import gguf
import numpy as np
import pytest

from experts.arch import Gating
from experts.archs import ARCHS
from experts.errors import ModelFormatError, SliceError
from experts.gguf_model import ExpertRange, GGUFModel
from experts.hosting import float_bytes, open_experts, packed_bytes
from experts.kernels import make_kernel
from experts.model_writer import write_model
from experts.moe import partial_sum
from experts.packed_experts import PackedExperts
from experts.random_model import byte_level_tokenizer, random_config, random_tensors
from experts.slices import ExpertStore, check_slice, write_slice

from ..conftest import NEW_ARCHS, make_model


def test_glm4moe_reads_its_schedule_router_and_rope_from_the_file(model_dir):
    """block_count counts the MTP block, which is not run; layer 0 is dense; half the head rotates."""
    m = GGUFModel(make_model(model_dir, "glm4moe", n_layer=3))
    assert int(m.reader.fields["glm4moe.block_count"].contents()) == 4
    c = m.cfg
    assert (c.n_layer, c.n_nextn, c.n_dense_lead, c.rope_dim, c.head_dim) == (3, 1, 1, 8, 16)
    assert m.moe_layers == (1, 2) and not c.is_moe(0)
    r = c.router
    assert (r.gating.name, r.norm, r.scale, r.n_groups, r.n_group_used) == ("SIGMOID", True, 2.5, 4, 2)
    assert m.has("blk.3.nextn.eh_proj.weight") and m.has("blk.0.ffn_gate.weight") and not m.has("blk.0.ffn_gate_inp.weight")


@pytest.mark.parametrize("arch", NEW_ARCHS)
def test_new_archs_config_lines_name_only_what_they_use(model_dir, arch):
    """Later config fields enter the config line (and so the digest) only when they are not at their default."""
    line = GGUFModel(make_model(model_dir, arch)).manifest[0]
    feat = ARCHS[arch].random
    assert ("n_dense_lead" in line) == bool(feat.n_dense_lead)
    assert ("n_rot" in line) == (feat.rot_div == 2)  # the others rotate the whole head
    assert ("yarn_factor" in line) == bool(feat.yarn_factor)
    assert ("n_swa" in line) == (arch in ("gpt-oss", "llama4"))  # llama4: chunks of 8192
    assert ("moe_step" in line) == bool(feat.moe_step)


def test_missing_required_keys_and_tensors_are_named(tmp_path, monkeypatch):
    """Keys llama.cpp refuses a file without (expert_shared_count, expert_gating_func) and the selection bias, one line each."""
    cases = [("glm4moe", "add_expert_shared_count", "glm4moe.expert_shared_count"), ("minimax-m2", "add_expert_gating_func", "minimax-m2.expert_gating_func")]
    for arch, method, key in cases:
        with monkeypatch.context() as mp:
            mp.setattr(gguf.GGUFWriter, method, lambda self, value: None)
            cfg = random_config(arch)
            p = tmp_path / f"{arch}.gguf"
            write_model(p, cfg, random_tensors(cfg), byte_level_tokenizer())
        with pytest.raises(ModelFormatError) as err:
            GGUFModel(p)
        assert key in str(err.value) and "missing" in str(err.value) and "\n" not in str(err.value)
    cfg = random_config("minimax-m2")
    p = tmp_path / "nobias.gguf"
    write_model(p, cfg, {k: v for k, v in random_tensors(cfg).items() if k != "blk.1.exp_probs_b.bias"}, byte_level_tokenizer())
    with pytest.raises(ModelFormatError, match="tensor blk.1.exp_probs_b.bias is missing"):
        GGUFModel(p)


def test_glm4moe_optional_attention_tensors_may_be_absent(tmp_path):
    """GLM-4.5 files without q/k norms or biases load (llama.cpp loads them if present)."""
    cfg = random_config("glm4moe")
    p = tmp_path / "plain.gguf"
    kept = {k: v for k, v in random_tensors(cfg).items() if not k.endswith(cfg.spec.optional_tensors)}
    write_model(p, cfg, kept, byte_level_tokenizer())
    m = GGUFModel(p)
    assert not m.has("blk.0.attn_k_norm.weight") and not m.has("blk.0.attn_q.bias") and m.has("blk.1.exp_probs_b.bias")


def test_olmoe_needs_as_many_kv_heads_as_heads():
    """llama.cpp norms olmoe's whole K with an n_embd-wide weight: fewer KV heads are refused up front."""
    assert random_config("olmoe").n_head_kv == 4
    with pytest.raises(ModelFormatError, match="as many KV heads"):
        random_config("olmoe", n_head_kv=2)


def test_a_slice_over_dense_layers_holds_only_the_moe_ones(model_dir, tmp_path):
    """Layers 0-2 of a glm4moe model: the slice proves and computes layers 1-2; layer 0 (dense) alone is refused."""
    full = GGUFModel(make_model(model_dir, "glm4moe", n_layer=3))
    sl = GGUFModel(write_slice(full, range(0, 3), ExpertRange(2, 6), tmp_path / "s.gguf"))
    check_slice(sl, full.digest)
    assert sl.layers == range(0, 3) and sl.moe_layers == (1, 2) and not sl.has("blk.0.ffn_gate_exps.weight")
    store = ExpertStore(sl)
    store.warm()
    assert not store.holds(0, 3) and store.holds(1, 3)
    assert float_bytes(sl, sl.layers, sl.experts) == float_bytes(full, range(1, 3), ExpertRange(2, 6)) == 2 * 4 * 3 * full.cfg.n_ff_exp * full.cfg.n_embd * 4
    assert packed_bytes(sl, sl.layers, sl.experts) == packed_bytes(full, range(0, 3), ExpertRange(2, 6)) > 0
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, full.cfg.n_embd)).astype(np.float32)
    ids = rng.integers(2, 6, size=(3, 2)).astype(np.int32)
    w = rng.random((3, 2)).astype(np.float32)
    held = np.ones_like(ids, dtype=bool)
    a, _ = partial_sum(ExpertStore(full), 2, x, ids, w, held)
    b, _ = partial_sum(store, 2, x, ids, w, held)
    assert a.tobytes() == b.tobytes()
    with pytest.raises(SliceError, match="all dense"):
        write_slice(full, range(0, 1), ExpertRange(0, 4), tmp_path / "dense.gguf")


def test_unknown_tensors_are_refused_but_optional_mtp_ones_load(tmp_path):
    """An NVFP4 ``*.scale`` tensor is named and refused (as llama.cpp refuses tensors it does not load);
    an MTP block's optional head tensors are accepted, since they are never run."""
    cfg = random_config("glm4moe")
    tensors = random_tensors(cfg)
    p = tmp_path / "scale.gguf"
    write_model(p, cfg, {**tensors, "blk.1.ffn_down_exps.scale": np.ones(cfg.n_expert, dtype=np.float32)}, byte_level_tokenizer())
    with pytest.raises(ModelFormatError, match=r"tensor blk.1.ffn_down_exps.scale .* is not one moeswarm reads for glm4moe"):
        GGUFModel(p)
    p = tmp_path / "mtp.gguf"
    write_model(p, cfg, {**tensors, f"blk.{cfg.n_layer}.nextn.shared_head_norm.weight": np.ones(cfg.n_embd, dtype=np.float32)}, byte_level_tokenizer())
    assert GGUFModel(p).has(f"blk.{cfg.n_layer}.nextn.shared_head_norm.weight")


def test_gpt_oss_reads_its_window_yarn_router_and_biases(model_dir):
    """Even layers slide over 4 positions with their own RoPE base; YaRN factor 32 over 64; router and experts carry biases."""
    m = GGUFModel(make_model(model_dir, "gpt-oss", n_layer=3))
    c = m.cfg
    assert (c.n_swa, c.swa_period, c.yarn_factor, c.yarn_orig_ctx) == (4, 2, 32.0, 64)
    assert [c.is_swa(i) for i in range(3)] == [True, False, True]
    assert [c.rope_base(i) for i in range(3)] == [2000.0, 10000.0, 2000.0]
    assert c.router.gating is Gating.SOFTMAX_WEIGHT and not c.router.norm and c.router.scale == 0.0
    for name, shape in {"blk.1.attn_sinks.weight": (4,), "blk.1.attn_output.bias": (64,), "blk.1.ffn_gate_inp.bias": (8,),
                        "blk.1.ffn_gate_exps.bias": (8, 32), "blk.1.ffn_up_exps.bias": (8, 32), "blk.1.ffn_down_exps.bias": (8, 64)}.items():
        assert m.shape(name) == shape and m.qtype(name) is gguf.GGMLQuantizationType.F32, name
    assert len(m.leaves["blk.1.ffn_down_exps.bias"]) == 8  # biases are hashed expert by expert, like the weights
    assert m.expert_biases(1, 5)[2].tobytes() == m.dense("blk.1.ffn_down_exps.bias")[5].tobytes()


def test_gpt_oss_window_pattern_comes_from_the_file_and_the_window_is_required(tmp_path, monkeypatch):
    """A period of 3 makes layers 0, 1 SWA and 2 full (llama.cpp's set_swa_pattern); no sliding_window: one clear line."""
    cfg = dataclasses.replace(random_config("gpt-oss", n_layer=3), swa_period=3)
    p = tmp_path / "p3.gguf"
    write_model(p, cfg, random_tensors(cfg), byte_level_tokenizer())
    assert [GGUFModel(p).cfg.is_swa(i) for i in range(3)] == [True, True, False]
    monkeypatch.setattr(gguf.GGUFWriter, "add_sliding_window", lambda self, value: None)
    p = tmp_path / "nowindow.gguf"
    write_model(p, cfg, random_tensors(cfg), byte_level_tokenizer())
    with pytest.raises(ModelFormatError, match=r"gpt-oss.attention.sliding_window' is missing") as err:
        GGUFModel(p)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("tensor", ["blk.0.attn_sinks.weight", "blk.1.ffn_up_exps.bias", "blk.0.attn_output.bias"])
def test_gpt_oss_without_its_required_tensors_is_refused(tmp_path, tensor):
    """Sinks, expert biases and the output bias are required (llama.cpp refuses such a file too): named, one line."""
    cfg = random_config("gpt-oss")
    p = tmp_path / "missing.gguf"
    write_model(p, cfg, {k: v for k, v in random_tensors(cfg).items() if k != tensor}, byte_level_tokenizer())
    with pytest.raises(ModelFormatError, match=f"tensor {tensor} is missing"):
        GGUFModel(p)


def _forge(path, tensor: str, expert: int) -> None:
    """Flip one float of *expert*'s row of *tensor* inside the slice file, as a dishonest host would."""
    m = GGUFModel(path)
    t = m.tensors[tensor]
    per = t.n_bytes // m.shape(tensor)[0]
    offset = t.data_offset + (expert - m.experts.start) * per
    del m
    with open(path, "r+b") as f:
        f.seek(offset)
        value = np.frombuffer(f.read(4), dtype=np.float32)[0]
        f.seek(offset)
        f.write(np.float32(value + 1.0).tobytes())


@pytest.mark.parametrize("kernel_name", ["reference", "ggml"])
def test_gpt_oss_expert_biases_travel_in_slices_and_reach_the_compute(model_dir, tmp_path, kernel_name):
    """A slice carries the expert biases, proves them expert by expert, and its sums equal the full file's; the
    sums differ without the biases, so they are used."""
    full = GGUFModel(make_model(model_dir, "gpt-oss", n_layer=3))
    sl = GGUFModel(write_slice(full, range(1, 3), ExpertRange(2, 6), tmp_path / "s.gguf"))
    check_slice(sl, full.digest)
    assert sl.shape("blk.2.ffn_gate_exps.bias") == (4, full.cfg.n_ff_exp) and sl.shape("blk.2.ffn_down_exps.bias") == (4, full.cfg.n_embd)
    kernel = make_kernel(kernel_name, 1)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, full.cfg.n_embd)).astype(np.float32)
    ids = rng.integers(2, 6, size=(5, 4)).astype(np.int32)
    w = rng.random((5, 4)).astype(np.float32)
    held = np.ones_like(ids, dtype=bool)
    a, _ = open_experts(full, kernel)[0].partial_sum(2, x, ids, w, held)
    b, _ = open_experts(sl, kernel)[0].partial_sum(2, x, ids, w, held)
    assert a.tobytes() == b.tobytes()
    store = open_experts(sl, kernel)[0]
    store.biases = lambda layer, expert: None  # type: ignore[method-assign]
    if isinstance(store, PackedExperts):
        store.stack_biases = lambda layer: None  # type: ignore[method-assign]
    c, _ = store.partial_sum(2, x, ids, w, held)
    assert not np.allclose(a, c, atol=1e-3)


@pytest.mark.parametrize("tensor", ["blk.2.ffn_gate_exps.bias", "blk.1.ffn_down_exps.bias", "blk.2.ffn_up_exps.weight"])
def test_a_forged_expert_bias_in_a_slice_is_refused(model_dir, tmp_path, tensor):
    """One changed float in one expert's bias row (or weight) fails the slice's proof, naming the expert and tensor."""
    full = GGUFModel(make_model(model_dir, "gpt-oss", n_layer=3))
    path = write_slice(full, range(1, 3), ExpertRange(2, 6), tmp_path / "s.gguf")
    _forge(path, tensor, 4)
    with pytest.raises(SliceError, match=f"expert 4 of {tensor} does not match"):
        check_slice(GGUFModel(path), full.digest)


def test_a_node_without_gpt_oss_refuses_its_slice_with_one_line(model_dir, tmp_path, monkeypatch):
    """A worker whose arch table has no gpt-oss row (an older release) refuses the file naming the arch, computing nothing."""
    full = GGUFModel(make_model(model_dir, "gpt-oss", n_layer=3))
    path = write_slice(full, range(1, 3), ExpertRange(0, 4), tmp_path / "s.gguf")
    monkeypatch.delitem(ARCHS, "gpt-oss")
    with pytest.raises(ModelFormatError, match=r"unsupported architecture 'gpt-oss' \(general.architecture\); supported: ") as err:
        GGUFModel(path)
    assert "\n" not in str(err.value)


def test_rope_scaling_other_than_yarn_is_refused(tmp_path):
    """llama.cpp would scale RoPE linearly; we do not compute that, so the file is refused naming the key and the type."""
    cfg = random_config("qwen3moe")
    p = tmp_path / "linear.gguf"
    write_model(p, cfg, random_tensors(cfg), byte_level_tokenizer(), extra_kv={"qwen3moe.rope.scaling.type": "linear"})
    with pytest.raises(ModelFormatError, match=r"qwen3moe.rope.scaling.type is 'linear'; supported: none, yarn"):
        GGUFModel(p)


@pytest.mark.parametrize("kv_b", [False, True], ids=["attn_k_b/attn_v_b", "attn_kv_b"])
def test_deepseek2_reads_its_latent_attention_router_and_yarn(model_dir, kv_b):
    """Both MLA layouts read to one config: q-LoRA, latent, head widths, YaRN's log multiplier, V3's router; the
    KV cache holds the latent and the roped key part per token per layer, in both layouts."""
    from experts.forward import Backbone, KVCache, local_moe
    from experts.moe import ungrouped_moe

    m = GGUFModel(make_model(model_dir, "deepseek2", n_layer=3, mla_kv_b=kv_b))
    c = m.cfg
    assert (c.q_lora_rank, c.kv_lora_rank, c.head_dim, c.rope_dim, c.v_head_dim, c.mla_kv_b) == (48, 32, 24, 8, 16, kv_b)
    assert c.n_head_kv == (4 if kv_b else 1) and c.gguf_kv_lengths == ((24, 16) if kv_b else (40, 32))
    assert (c.yarn_factor, c.yarn_orig_ctx, c.yarn_log_mul, c.n_dense_lead, c.n_ff_shexp) == (4.0, 64, 1.0, 1, 64)
    r = c.router
    assert (r.gating, r.norm, r.scale, r.n_groups, r.n_group_used) == (Gating.SIGMOID, True, 2.5, 4, 2)
    assert m.has("blk.0.attn_kv_b.weight") == kv_b and m.has("blk.0.attn_k_b.weight") != kv_b and m.shape("blk.1.attn_q_b.weight") == (96, 48)
    store, bb, cache = ExpertStore(m), Backbone(m), KVCache()
    bb.forward([1, 2, 3, 4, 5], cache, local_moe(lambda i, x, e, w: ungrouped_moe(store, i, x, e, w)))
    assert c.kv_cache_floats == 40 and sum(a.nbytes for a in cache.k + cache.v) == 5 * 3 * 40 * 4


def test_deepseek_v3_shapes_cache_576_floats_per_token_per_layer():
    """At DeepSeek-V3's dims (latent 512, rope 64) the cache is the 576-float latent, not 128 heads' K and V."""
    cfg = dataclasses.replace(random_config("deepseek2"), n_head=128, head_dim=192, n_rot=64, kv_lora_rank=512, v_head_dim=128)
    assert cfg.kv_cache_floats == 576 and cfg.gguf_kv_lengths == (576, 512)
    assert dataclasses.replace(cfg, mla_kv_b=True).kv_cache_floats == 576  # a legacy file is cached as the latent too


def test_deepseek2_temperature_tuning_is_refused(tmp_path):
    """Q temperature scaling (attention.temperature_scale, Mistral-Large) is not implemented: one clear line."""
    cfg = random_config("deepseek2")
    p = tmp_path / "temp.gguf"
    write_model(p, cfg, random_tensors(cfg), byte_level_tokenizer(), extra_kv={"deepseek2.attention.temperature_scale": 0.5})
    with pytest.raises(ModelFormatError, match="temperature_scale"):
        GGUFModel(p)


@pytest.mark.parametrize("kernel_name", ["reference", "ggml"])
def test_step35_clamps_travel_in_slices_and_reach_the_compute(model_dir, tmp_path, kernel_name):
    """A slice's hyper-parameters carry every layer's routed-expert clamp (they are in the config line, so in the
    digest it proves); its sums equal the full file's bit for bit, and differ without the clamp, so it is applied."""
    full = GGUFModel(make_model(model_dir, "step35", n_layer=3))
    sl = GGUFModel(write_slice(full, range(1, 3), ExpertRange(2, 6), tmp_path / "s.gguf"))
    check_slice(sl, full.digest)
    assert sl.cfg.clamp_exp == full.cfg.clamp_exp and [sl.cfg.glu_exp(i).limit for i in (1, 2)] == [1.0, 0.75]
    kernel = make_kernel(kernel_name, 1)
    rng = np.random.default_rng(0)
    x = 3.0 * rng.standard_normal((5, full.cfg.n_embd)).astype(np.float32)
    ids = rng.integers(2, 6, size=(5, 2)).astype(np.int32)
    w = rng.random((5, 2)).astype(np.float32)
    held = np.ones_like(ids, dtype=bool)
    for layer in (1, 2):
        a, _ = open_experts(full, kernel)[0].partial_sum(layer, x, ids, w, held)
        store = open_experts(sl, kernel)[0]
        b, _ = store.partial_sum(layer, x, ids, w, held)
        assert a.tobytes() == b.tobytes()
        store.glu = lambda layer: dataclasses.replace(sl.cfg.glu_exp(layer), limit=0.0)  # type: ignore[method-assign]
        c, _ = store.partial_sum(layer, x, ids, w, held)
        assert not np.allclose(a, c, atol=1e-3)


def _file_with(tmp_path, monkeypatch, arch: str, key: str, value) -> GGUFModel:
    """A random model of *arch* whose writer stores *value* under *key* (full name) instead of the config's."""
    cfg = random_config(arch, n_layer=3)
    add = gguf.GGUFWriter.add_key_value
    with monkeypatch.context() as mp:
        vtype = gguf.GGUFValueType.ARRAY if isinstance(value, list) else gguf.GGUFValueType.UINT32
        mp.setattr(gguf.GGUFWriter, "add_key_value", lambda self, k, v, *a, **kw: add(self, k, value, vtype) if k == key else add(self, k, v, *a, **kw))
        p = tmp_path / f"{arch}.gguf"
        write_model(p, cfg, random_tensors(cfg), byte_level_tokenizer())
    return GGUFModel(p)


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("step35.attention.sliding_window_pattern", 2, "must be an array of 4 per-layer flags"),
        ("step35.attention.sliding_window_pattern", [True, False], "must be an array of 4 per-layer flags"),
        ("step35.attention.head_count", [4, 6], "has 2 entries; llama.cpp needs one per block"),
        ("step35.swiglu_clamp_exp", [1.0, 1.0], "has 2 entries; llama.cpp needs one per block"),
        ("step35.expert_feed_forward_length", [32, 64, 32, 32], "differs between layers"),
        ("step35.attention.value_length", 8, "value_length differs from the key length"),
    ],
)
def test_step35_files_moeswarm_cannot_run_are_refused_in_one_line(tmp_path, monkeypatch, key, value, message):
    """Per-layer arrays of the wrong length or kind, per-layer expert widths, unequal K/V heads: one line each."""
    with pytest.raises(ModelFormatError) as err:
        _file_with(tmp_path, monkeypatch, "step35", key, value)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_per_layer_head_counts_are_refused_for_archs_that_run_one(tmp_path, monkeypatch):
    """Only step35 runs per-layer head counts; an array of one count reads as that count (the same config line)."""
    plain = GGUFModel(make_model(tmp_path, "qwen3moe", n_layer=3))
    same = _file_with(tmp_path, monkeypatch, "qwen3moe", "qwen3moe.attention.head_count", [4, 4, 4])
    assert same.manifest[0] == plain.manifest[0]
    with pytest.raises(ModelFormatError, match="attention.head_count differs between layers; qwen3moe runs one head count"):
        _file_with(tmp_path, monkeypatch, "qwen3moe", "qwen3moe.attention.head_count", [4, 8, 4])
