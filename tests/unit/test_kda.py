"""kimi-linear files: the head_count_kv schedule and KDA keys are read (bad ones refused), and the KDA cache under
rollback, prefix reuse and speculative decoding gives the bits of one uninterrupted pass (the delta-net checks)."""

from __future__ import annotations

import dataclasses

import pytest

from experts import delta_net
from experts.errors import ModelFormatError
from experts.gguf_model import ExpertRange, GGUFModel
from experts.model_writer import write_model
from experts.random_model import byte_level_tokenizer, random_config, random_tensors
from experts.slices import check_slice, write_slice

from ..conftest import make_model
from . import test_delta_net as gdn

ARCH = "kimi-linear"


def test_the_schedule_and_kda_keys_are_read(model_dir):
    """head_count_kv [0, 1, 0, 1]: KDA, MLA, KDA, MLA; kda.head_dim and ssm.conv_kernel; a KDA layer has no MLA tensors."""
    m = GGUFModel(make_model(model_dir, ARCH, n_layer=4))
    c = m.cfg
    assert (c.layer_kinds, c.n_head_kv_layers, c.ssm_conv, c.ssm_state, c.ssm_k_heads, c.ssm_v_heads) == ("rara", (0, 1, 0, 1), 4, 16, 4, 4)
    assert list(m.reader.fields[f"{ARCH}.attention.head_count_kv"].contents()) == [0, 1, 0, 1]
    assert m.has("blk.0.ssm_conv1d_q.weight") and not m.has("blk.0.attn_kv_a_mqa.weight") and m.has("blk.1.attn_k_b.weight")
    assert c.gdn_row_floats == 3 * 64 + 4 + 64 and c.moe_layers == (1, 2, 3)


def test_a_head_count_kv_other_than_0_or_1_is_refused(tmp_path):
    cfg = dataclasses.replace(random_config(ARCH, n_layer=3), n_head_kv_layers=(0, 2, 0))
    p = tmp_path / "bad.gguf"
    write_model(p, cfg, random_tensors(cfg), byte_level_tokenizer())
    with pytest.raises(ModelFormatError, match="0 \\(KDA\\) or 1"):
        GGUFModel(p)


@pytest.mark.parametrize("every", [4, delta_net.CHECKPOINT_EVERY])
def test_rollback_and_prefix_reuse_give_the_bits_of_one_pass(model_dir, monkeypatch, every):
    gdn.test_rollback_and_prefix_reuse_give_the_bits_of_one_pass(model_dir, monkeypatch, ARCH, every)


def test_speculative_greedy_equals_plain_decoding(model_dir):
    gdn.test_speculative_greedy_equals_plain_decoding_after_rejections_and_from_a_cached_prefix(model_dir, ARCH)


def test_a_slice_carries_routed_experts_only(model_dir, tmp_path):
    """The KDA state and weights travel in no slice (nor dispatch): only the MoE layers' experts."""
    full = GGUFModel(make_model(model_dir, ARCH, n_layer=3))
    sl = GGUFModel(write_slice(full, range(0, 3), ExpertRange(2, 6), tmp_path / "s.gguf"))
    check_slice(sl, full.digest)
    assert sl.moe_layers == (1, 2) and not any("ssm_" in n or "attn_" in n for n in sl.tensors)
