"""llama4 files: what the reader makes of them, the weight-before-expert dispatch, chunks, temperature, clear errors."""

from __future__ import annotations

import dataclasses

import gguf
import numpy as np
import pytest

from experts.errors import ModelFormatError
from experts.forward import Backbone, attn_temperature
from experts.gguf_model import ExpertRange, GGUFModel
from experts.model_writer import write_model
from experts.moe import partial_sum, route, slot_sum, weight_inputs
from experts.random_model import byte_level_tokenizer, random_config, random_tensors
from experts.slices import ExpertStore, check_slice, write_slice

from ..conftest import make_model


def test_llama4_reads_its_schedule_and_router(model_dir):
    """Experts on layers 1 and 3 (interleave step 2), a shared expert as wide as a routed one, sigmoid on raw logits."""
    m = GGUFModel(make_model(model_dir, "llama4", n_layer=4))
    c = m.cfg
    assert int(m.reader.fields["llama4.interleave_moe_layer_step"].contents()) == 2 and c.moe_step == 2
    assert m.moe_layers == (1, 3) and c.n_ff_shexp == c.n_ff_exp and c.n_ff_dense == 2 * c.n_ff_exp
    assert not m.has("blk.2.ffn_gate_inp.weight") and m.has("blk.2.ffn_gate.weight") and m.has("rope_freqs.weight")
    r = c.router
    assert (r.gating.name, r.norm, r.select_logits) == ("SIGMOID", False, True)


def test_a_llama4_slice_holds_only_its_moe_layers(model_dir, tmp_path):
    """A slice of layers 0-3 carries and proves the experts of layers 1 and 3 only."""
    full = GGUFModel(make_model(model_dir, "llama4", n_layer=4))
    sl = GGUFModel(write_slice(full, range(0, 4), ExpertRange(2, 6), tmp_path / "s.gguf"))
    check_slice(sl, full.digest)
    assert sl.moe_layers == (1, 3) and not sl.has("blk.2.ffn_gate_exps.weight") and sl.cfg.moe_step == 2


def test_weight_before_the_expert_is_a_plain_dispatch_of_weighted_rows(model_dir):
    """One w_j x row per (token, slot) with weight 1.0, summed back in slot order, is sum_j expert_j(w_j x) exactly."""
    m = GGUFModel(make_model(model_dir, "llama4", n_layer=2))
    store = ExpertStore(m)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, m.cfg.n_embd)).astype(np.float32)
    ids, w = route(rng.standard_normal((3, m.cfg.n_expert)).astype(np.float32), 2, m.cfg.router)
    rows, row_ids, ones = weight_inputs(x, ids, w)
    assert rows.shape == (6, m.cfg.n_embd) and row_ids.shape == ones.shape == (6, 1) and (ones == 1).all()
    y, _ = partial_sum(store, 1, rows, row_ids, ones, np.ones((6, 1), dtype=bool))
    want = []
    for t in range(3):
        ys = [partial_sum(store, 1, w[t, j] * x[t : t + 1], ids[t : t + 1, j : j + 1], np.ones((1, 1), np.float32), np.ones((1, 1), bool))[0][0] for j in range(2)]
        want.append(ys[0] + ys[1])
    assert slot_sum(y, 2).tobytes() == np.stack(want).tobytes()
    assert slot_sum(y[:3], 1).tobytes() == y[:3].tobytes()  # top-1 (the real models): the rows are the sums


def test_llama4_router_selects_on_the_raw_logits():
    """Saturated sigmoids tie at 1.0; llama.cpp still picks the larger logit, and so do we."""
    logits = np.array([[20.0, 30.0, -1.0]], dtype=np.float32)
    ids, w = route(logits, 1, random_config("llama4").router)
    assert ids.tolist() == [[1]] and w.tolist() == [[1.0]]


def test_chunked_attention_and_temperature_follow_llamacpp():
    """Chunked layers see only their 8192-position chunk; the NoPE layer's q scale steps at position 8191."""
    c = random_config("llama4", n_layer=4)
    assert [c.first_key(0, p) for p in (0, 8191, 8192, 9000)] == [0, 0, 8192, 8192]
    assert c.first_key(3, 9000) == 0  # the 4th layer attends to everything
    t = attn_temperature(np.array([0, 8190, 8191, 3 * 8192 - 1]), c.spec.attn_temp)
    assert t[0] == t[1] == 1.0 and t[2] == np.float32(1 + 0.1 * np.log(2.0)) and t[3] == np.float32(1 + 0.1 * np.log(4.0))


def test_128_expert_llama4_has_no_qk_norm(tmp_path):
    """llama.cpp leaves the q/k norm out for Maverick (17B_128E), which it recognises by 128 experts."""
    cfg = random_config("llama4", n_expert=128, n_expert_used=1)
    p = tmp_path / "m.gguf"
    write_model(p, cfg, random_tensors(cfg), byte_level_tokenizer())
    assert not Backbone(GGUFModel(p)).qk_norm_after_rope
    assert Backbone(GGUFModel(make_model(tmp_path, "llama4"))).qk_norm_after_rope


def test_llama4_files_llamacpp_cannot_run_are_refused_in_one_line(tmp_path, monkeypatch):
    """No interleave_moe_layer_step (llama.cpp requires it), a step leaving no MoE layer, or sliding_window 0."""
    cfg = random_config("llama4")
    with monkeypatch.context() as mp:
        mp.setattr(gguf.GGUFWriter, "add_interleave_moe_layer_step", lambda self, value: None)
        write_model(tmp_path / "nostep.gguf", cfg, random_tensors(cfg), byte_level_tokenizer())
    with pytest.raises(ModelFormatError, match="llama4.interleave_moe_layer_step' is missing"):
        GGUFModel(tmp_path / "nostep.gguf")
    big = dataclasses.replace(cfg, moe_step=3)
    write_model(tmp_path / "step3.gguf", big, random_tensors(cfg), byte_level_tokenizer())
    with pytest.raises(ModelFormatError, match="interleave_moe_layer_step is 3: with 2 layers that leaves no MoE layer"):
        GGUFModel(tmp_path / "step3.gguf")
    write_model(tmp_path / "nochunk.gguf", cfg, random_tensors(cfg), byte_level_tokenizer(), extra_kv={"llama4.attention.sliding_window": 0})
    with pytest.raises(ModelFormatError, match="sliding_window is 0") as err:
        GGUFModel(tmp_path / "nochunk.gguf")
    assert "\n" not in str(err.value)


def test_llama4_rope_freqs_may_be_absent(tmp_path):
    """rope_freqs.weight is optional (llama.cpp loads it if present): a file without it loads and rotates plainly."""
    cfg = random_config("llama4")
    p = tmp_path / "nofreqs.gguf"
    write_model(p, cfg, {k: v for k, v in random_tensors(cfg).items() if k != "rope_freqs.weight"}, byte_level_tokenizer())
    assert Backbone(GGUFModel(p)).rope_freqs is None
