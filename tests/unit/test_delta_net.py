"""qwen3next / qwen35moe files: what the reader makes of them, and the recurrent cache under rollback and reuse
(rejected drafts, a truncated cache, a prefix from the prefix cache) giving the bits of one uninterrupted pass."""

from __future__ import annotations

import dataclasses

import gguf
import numpy as np
import pytest

from experts import delta_net
from experts.errors import ModelFormatError
from experts.forward import Backbone, KVCache, local_moe
from experts.generate import generate
from experts.gguf_model import ExpertRange, GGUFModel
from experts.model_writer import write_model
from experts.moe import ungrouped_moe
from experts.random_model import byte_level_tokenizer, random_config, random_tensors
from experts.slices import ExpertStore, check_slice, write_slice
from experts.speculative import SpecStats, speculative_generate
from node.backbone.prefix_cache import PrefixCache

from ..conftest import make_model

HYBRID = ("qwen3next", "qwen35moe")
TOKENS = [264, 72, 101, 108, 108, 111, 44, 32, 116, 104, 101, 114, 101, 33, 10, 65, 110, 100, 32, 115, 111] * 2


def engine(path):
    model = GGUFModel(path)
    store = ExpertStore(model)
    return Backbone(model), local_moe(lambda i, x, e, w: ungrouped_moe(store, i, x, e, w))


@pytest.mark.parametrize("arch", HYBRID)
def test_the_schedule_ssm_keys_and_mtp_block_are_read(model_dir, arch):
    """Layers r/a/r/a (full attention every 2nd), the five ssm.* keys, and an MTP block counted but not run."""
    m = GGUFModel(make_model(model_dir, arch, n_layer=4))
    c = m.cfg
    assert (c.layer_kinds, c.n_layer, c.n_nextn, c.ssm_conv, c.ssm_state, c.ssm_k_heads, c.ssm_v_heads) == ("rara", 4, 1, 4, 16, 2, 4)
    assert int(m.reader.fields[f"{arch}.block_count"].contents()) == 5 and int(m.reader.fields[f"{arch}.full_attention_interval"].contents()) == 2
    assert m.shape("blk.0.attn_qkv.weight") == (2 * 32 + 64, 64) and m.shape("blk.1.attn_q.weight") == (2 * 64, 64) and m.shape("blk.4.attn_q.weight") == (128, 64)
    assert m.has("blk.0.ssm_beta.weight") == (arch == "qwen35moe") and m.has("blk.0.ssm_ba.weight") == (arch == "qwen3next")
    assert not m.has("blk.0.attn_q_norm.weight") and m.has("blk.1.attn_q_norm.weight") and m.has("blk.4.nextn.eh_proj.weight")
    assert c.rope_dim == 4 and c.router.norm and c.n_ff_shexp == 64 and c.moe_layers == (0, 1, 2, 3)


def test_a_per_layer_array_overrides_the_interval_and_the_default_is_four(tmp_path, monkeypatch):
    """attention.recurrent_layers (any schedule) wins; with neither key every 4th layer is full attention."""
    cfg = dataclasses.replace(random_config("qwen35moe", n_layer=4), layer_kinds="raar")
    p = tmp_path / "array.gguf"
    write_model(p, cfg, random_tensors(cfg), byte_level_tokenizer())
    m = GGUFModel(p)
    assert m.cfg.layer_kinds == "raar" and "qwen35moe.full_attention_interval" not in m.reader.fields
    assert list(m.reader.fields["qwen35moe.attention.recurrent_layers"].contents()) == [True, False, False, True, False]
    cfg = dataclasses.replace(random_config("qwen3next", n_layer=5), layer_kinds="rrrar")
    monkeypatch.setattr(gguf.GGUFWriter, "add_full_attention_interval", lambda self, value: None)
    p = tmp_path / "default.gguf"
    write_model(p, cfg, random_tensors(cfg), byte_level_tokenizer())
    assert GGUFModel(p).cfg.layer_kinds == "rrrar"


def test_ssm_keys_that_do_not_fit_a_delta_net_are_refused(tmp_path):
    """inner_size must be state_size * time_step_rank (llama.cpp sizes the state so): one line naming the keys."""
    cfg = random_config("qwen3next", n_layer=3)
    p = tmp_path / "bad.gguf"
    write_model(p, cfg, random_tensors(cfg), byte_level_tokenizer(), extra_kv={"qwen3next.ssm.inner_size": 7})
    with pytest.raises(ModelFormatError, match=r"ssm.\* keys .* do not fit a gated delta-net") as err:
        GGUFModel(p)
    assert "\n" not in str(err.value)


def test_a_qwen35moe_file_with_a_legacy_ssm_in_is_refused(tmp_path):
    """Only qwen3next's loader reads ssm_in; in a qwen35moe file it is a tensor moeswarm (and llama.cpp) does not read."""
    cfg = random_config("qwen35moe", n_layer=3)
    p = tmp_path / "ssm_in.gguf"
    extra = {"blk.0.ssm_in.weight": np.zeros((2 * cfg.gdn_key_dim + 2 * cfg.gdn_value_dim, cfg.n_embd), dtype=np.float32)}
    write_model(p, cfg, {**random_tensors(cfg), **extra}, byte_level_tokenizer())
    with pytest.raises(ModelFormatError, match="tensor blk.0.ssm_in.weight .* not one moeswarm reads for qwen35moe"):
        GGUFModel(p)


@pytest.mark.parametrize("every", [4, delta_net.CHECKPOINT_EVERY])
@pytest.mark.parametrize("arch", HYBRID)
def test_rollback_and_prefix_reuse_give_the_bits_of_one_pass(model_dir, monkeypatch, arch, every):
    """Truncating the cache (back past checkpoints too) or taking a prefix of it, then feeding the rest, gives the
    logits of a single pass bit for bit; so does a cache that went down a wrong branch first."""
    monkeypatch.setattr(delta_net, "CHECKPOINT_EVERY", every)
    bb, hook = engine(make_model(model_dir, arch, n_layer=3))
    full = bb.forward(TOKENS, KVCache(), hook)
    for cut in (3, 9, 17):
        cache = KVCache()
        bb.forward(TOKENS[:5], cache, hook)
        bb.forward(TOKENS[5:22], cache, hook)
        bb.forward([7, 7, 7], cache, hook)  # a wrong branch, rolled back below
        cache.truncate(cut)
        assert bb.forward(TOKENS[cut:], cache, hook).tobytes() == full[cut:].tobytes(), cut
        again = cache.prefix(cut + 4)
        assert bb.forward(TOKENS[cut + 4 :], again, hook).tobytes() == full[cut + 4 :].tobytes(), cut
    kept = {i for i, st in cache.states.items() if st}
    assert kept == {0, 2} and all(p % every == 0 or p in (17, len(TOKENS)) for p in cache.states[0])


def test_without_recomputing_the_state_a_rollback_would_be_wrong(model_dir):
    """The check above can fail: reusing the state of the longer run after a truncation changes the logits."""
    bb, hook = engine(make_model(model_dir, "qwen3next", n_layer=3))
    full = bb.forward(TOKENS, KVCache(), hook)
    cache = KVCache()
    bb.forward(TOKENS[:20], cache, hook)
    cache.truncate(12)
    cache.states = {i: {12: st[max(st)]} for i, st in cache.states.items()}  # the state after 20 positions, kept
    assert not np.allclose(bb.forward(TOKENS[12:], cache, hook), full[12:], atol=1e-3)


class WrongEvery:
    """Proposes the plain greedy continuation with every 3rd draft token replaced: drafts are cut at rejections."""

    def __init__(self, prompt, continuation) -> None:
        self.n_prompt, self.continuation = len(prompt), list(continuation)

    def propose(self, context, k):
        done = len(context) - self.n_prompt
        draft = self.continuation[done : done + k]
        return [(t + 1) % 256 if (done + j) % 3 == 2 else t for j, t in enumerate(draft)]


@pytest.mark.parametrize("arch", HYBRID)
def test_speculative_greedy_equals_plain_decoding_after_rejections_and_from_a_cached_prefix(model_dir, arch):
    """Greedy speculative decoding with drafts that are partly rejected yields the tokens and logits of plain
    decoding, from scratch and from a prefix cache entry of an earlier sequence."""
    bb, hook = engine(make_model(model_dir, arch, n_layer=3))
    prompt = TOKENS[:12]
    plain = list(generate(bb, prompt, 16, hook))
    drafter = WrongEvery(prompt, [t for t, _ in plain])
    stats = SpecStats()
    spec = list(speculative_generate(bb, prompt, 16, hook, drafter=drafter, k_max=4, adaptive=False, stats=stats))
    assert any(a < d for a, d in zip(stats.accepted, stats.drafted)) and any(stats.accepted)  # drafts cut, some kept
    assert [t for t, _ in spec] == [t for t, _ in plain]
    assert all(a.tobytes() == b.tobytes() for (_, a), (_, b) in zip(plain, spec))
    prefixes = PrefixCache(1 << 26)
    seen = KVCache()
    earlier = TOKENS[:9] + [50, 51, 52, 53]
    list(generate(bb, earlier, 4, hook, cache=seen))
    prefixes.store(None, earlier, seen)
    cache, _ = prefixes.lookup(None, prompt)
    assert cache.n_past == 9
    resumed = list(speculative_generate(bb, prompt, 16, hook, drafter=drafter, k_max=4, adaptive=False, cache=cache))
    assert all(a.tobytes() == b.tobytes() for (_, a), (_, b) in zip(plain, resumed)) and len(resumed) == len(plain)


@pytest.mark.parametrize("arch", HYBRID)
def test_a_slice_of_a_hybrid_model_holds_ordinary_routed_experts(model_dir, tmp_path, arch):
    """Every layer (recurrent or attention) routes to experts: a slice proves them as for any arch and carries no
    attention or recurrent weights."""
    full = GGUFModel(make_model(model_dir, arch, n_layer=3))
    sl = GGUFModel(write_slice(full, range(0, 3), ExpertRange(2, 6), tmp_path / "s.gguf"))
    check_slice(sl, full.digest)
    assert sl.moe_layers == (0, 1, 2) and not any(n.endswith(("attn_qkv.weight", "ssm_a", "attn_q.weight")) for n in sl.tensors)
