"""MTP drafting: the model's nextn block as llama.cpp runs it, agreeing drafts accepted, greedy output unchanged."""

from __future__ import annotations

import numpy as np
import pytest

from experts.errors import UsageError
from experts.forward import Backbone, KVCache, local_moe, rms_norm
from experts.generate import generate, prefill
from experts.gguf_model import GGUFModel
from experts.moe import ungrouped_moe
from experts.mtp import MtpDrafter, NoMtpError
from experts.random_model import write_restating_mtp_model
from experts.slices import ExpertStore
from experts.speculative import DRAFTERS, SpecStats, pick_drafter, speculative_generate
from node.cli.options import DRAFTER_NAMES

from ..conftest import make_model

PROMPT = [264, 72, 101, 108, 108, 111, 32, 119, 111]


def loaded(path):
    model = GGUFModel(path)
    store = ExpertStore(model)
    return Backbone(model), local_moe(lambda i, x, e, w: ungrouped_moe(store, i, x, e, w))


@pytest.fixture(scope="module", params=["glm4moe", "deepseek2", "qwen3next", "qwen35moe", "step35"])
def random_mtp(request, model_dir):
    """A random model of the arch with one MTP block (its head is random too): glm4moe, deepseek2 and step35 with a dense lead layer, the hybrids with delta-net layers before it."""
    return loaded(make_model(model_dir, request.param, n_layer=3, n_embd=32, n_ff_exp=16))


@pytest.fixture(scope="module", params=["glm4moe", "deepseek2"])
def agreeing(request, tmp_path_factory):
    """A one-layer model whose MTP block restates the trunk (:func:`write_restating_mtp_model`)."""
    path = tmp_path_factory.mktemp("mtp") / f"{request.param}-restating.gguf"
    write_restating_mtp_model(path, request.param, seed=3)
    return loaded(path)


def test_block_is_eh_proj_of_embedding_then_state_through_the_layer_and_head(random_mtp):
    """One row: eh_proj(concat(enorm(embed t), hnorm(h))), the file's layer n_layer, then the head (output_norm, output)."""
    bb, _ = random_mtp
    drafter, m, eps = MtpDrafter(bb), bb.model, bb.cfg.rms_eps
    n = bb.cfg.n_layer
    rng = np.random.default_rng(0)
    h = rng.standard_normal((3, bb.cfg.n_embd)).astype(np.float32)
    tokens, pos = np.array([5, 77, 120]), np.arange(3)
    logits, g = drafter.step(tokens, h, pos, KVCache([np.zeros((0, 0), np.float32)] * n, [np.zeros((0, 0), np.float32)] * n))
    e = m.dense("token_embd.weight")[tokens]
    x = np.concatenate([rms_norm(e, m.dense(f"blk.{n}.nextn.enorm.weight"), eps), rms_norm(h, m.dense(f"blk.{n}.nextn.hnorm.weight"), eps)], axis=1)
    x = x @ m.dense(f"blk.{n}.nextn.eh_proj.weight").T
    fresh = KVCache([np.zeros((0, 0), np.float32)] * n, [np.zeros((0, 0), np.float32)] * n)
    y = bb.block(n, x, pos, fresh, drafter.moe)
    want_g = rms_norm(y, m.dense("output_norm.weight"), eps)
    np.testing.assert_allclose(g, want_g, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(logits, bb.output(want_g), rtol=1e-4, atol=1e-4)
    assert bb.layers[n] is drafter.backbone.layers[n] and len(bb.layers) == n + 1  # loaded once, after the trunk


def test_a_block_that_restates_the_trunk_gets_its_drafts_accepted(agreeing):
    """Copied weights: nearly every MTP draft token is the trunk's own next token, and the output is plain decoding's."""
    bb, hook = agreeing
    plain = list(generate(bb, PROMPT, 24, hook))
    stats = SpecStats()
    spec = list(speculative_generate(bb, PROMPT, 24, hook, drafter=MtpDrafter(bb), stats=stats))
    assert [t for t, _ in spec] == [t for t, _ in plain]
    assert stats.acceptance_rate > 0.8 and stats.forward_passes < 12, stats.summary()


def test_random_mtp_drafts_leave_greedy_tokens_and_logits_unchanged(random_mtp):
    """A random head's drafts are mostly rejected; the tokens and logit bits are plain decoding's all the same."""
    bb, hook = random_mtp
    plain = list(generate(bb, PROMPT, 16, hook))
    stats = SpecStats()
    spec = list(speculative_generate(bb, PROMPT, 16, hook, drafter=MtpDrafter(bb), stats=stats))
    assert [t for t, _ in spec] == [t for t, _ in plain]
    assert all(a.tobytes() == b.tobytes() for (_, a), (_, b) in zip(plain, spec))
    assert sum(stats.accepted) < sum(stats.drafted), stats.summary()  # rejections happened


def test_a_resumed_prefix_drafts_from_the_positions_fed(agreeing):
    """Starting from a cached prompt prefix (no trunk states for it, so the block attends to less than the trunk):
    drafts still come and change nothing."""
    bb, hook = agreeing
    plain = list(generate(bb, PROMPT, 12, hook))
    cache, _ = prefill(bb, PROMPT[:5], hook, None)
    stats = SpecStats()
    spec = list(speculative_generate(bb, PROMPT, 12, hook, drafter=MtpDrafter(bb), stats=stats, cache=cache))
    assert [t for t, _ in spec] == [t for t, _ in plain]
    assert sum(stats.drafted) > 0, stats.summary()


def test_mtp_is_refused_for_a_model_without_nextn_blocks_and_names_are_checked(model_dir):
    """No nextn block: a usage error naming --drafter ngram; an unknown drafter name is refused; the CLI offers the same names."""
    assert DRAFTER_NAMES == DRAFTERS
    bb, _ = loaded(make_model(model_dir, "qwen2moe", n_layer=1, n_embd=32, n_ff_exp=16))
    with pytest.raises(NoMtpError, match="--drafter ngram"):
        pick_drafter(bb, "mtp")
    with pytest.raises(UsageError, match="unknown drafter 'medusa'"):
        pick_drafter(bb, "medusa")


class Recording(MtpDrafter):
    """An MtpDrafter that records the rows each proposal's catch-up feeds the block (its first step)."""

    def __init__(self, backbone: Backbone) -> None:
        super().__init__(backbone)
        self.catch_ups: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self._first = False

    def run(self, start):
        run = super().run(start)
        propose = run.propose

        def marked(context, k):
            self._first = True
            return propose(context, k)

        run.propose = marked  # type: ignore[method-assign]
        return run

    def step(self, tokens, h, pos, cache):
        if self._first:
            self.catch_ups.append((np.array(tokens), h.copy(), pos.copy()))
            self._first = False
        return super().step(tokens, h, pos, cache)


def test_each_token_is_paired_with_the_trunk_state_of_the_position_before_it(random_mtp):
    """Catch-up row q holds token q and the trunk's final state at q - 1 (zeros at 0), bit for bit, rejected drafts never."""
    bb, hook = random_mtp
    drafter = Recording(bb)
    out = [t for t, _ in speculative_generate(bb, PROMPT, 12, hook, drafter=drafter)]
    tokens = np.array(PROMPT + out)
    states: list[np.ndarray] = []
    bb.forward(tokens, KVCache(), hook, hidden=states)
    before = np.concatenate([np.zeros((1, bb.cfg.n_embd), np.float32), states[0]])  # before[q]: the state at q - 1
    covered = np.concatenate([pos for _, _, pos in drafter.catch_ups])
    assert covered.tolist() == list(range(len(covered))) and len(covered) > len(PROMPT) + 1
    for fed, h, pos in drafter.catch_ups:
        assert fed.tolist() == tokens[pos].tolist()
        assert h.tobytes() == before[pos].tobytes()
