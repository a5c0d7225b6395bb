"""Stages (issue 26): a chain of layer ranges run from dense slices equals the full forward bit for bit, rolls back
exactly for speculative decoding, and rebuilds a lost stage's KV by replay with the same output."""

from __future__ import annotations

import numpy as np
import pytest

from experts.errors import LocalProtocolError
from experts.forward import Backbone, KVCache, MoeFfn, local_moe
from experts.generate import generate
from experts.gguf_model import ExpertRange, GGUFModel
from experts.model_parts import SlicedModel
from experts.moe import ungrouped_moe
from experts.parts import Part, block_of
from experts.slices import ExpertStore, write_part_slice, write_slice
from experts.speculative import SpecStats, speculative_generate
from experts.stage_forward import BadPass, LocalStage, StageChain, StagedBackbone, StageGap, StageLink, StageLost, StageRunner

from ..conftest import make_model

PROMPT = [1, 5, 9, 2, 7, 5, 9, 2]


def experts_hook(model: GGUFModel) -> MoeFfn:
    store = ExpertStore(model)
    return local_moe(lambda i, x, e, w: ungrouped_moe(store, i, x, e, w))


@pytest.fixture(scope="module", params=["qwen3moe", "deepseek2", "qwen3next"])
def cut(request, model_dir, tmp_path_factory):
    """A full model and what a client (head), two stages (dense 0-1, 2-3) and their workers (experts) hold."""
    arch = request.param
    full = GGUFModel(make_model(model_dir, arch, n_layer=4))
    tmp = tmp_path_factory.mktemp(f"stages-{arch}")
    head = SlicedModel([GGUFModel(write_part_slice(full, Part.HEAD, out=tmp / "head.gguf"))], full.digest)
    dense = [SlicedModel([GGUFModel(write_part_slice(full, Part.DENSE, r, tmp / f"dense{r.start}.gguf"))], full.digest) for r in (range(0, 2), range(2, 4))]
    experts = GGUFModel(write_slice(full, range(4), ExpertRange(0, full.cfg.n_expert), tmp / "experts.gguf"))
    return full, head, dense, experts


def chain_of(cut, replace=None) -> StagedBackbone:
    full, head, dense, experts = cut
    hook = experts_hook(experts)
    links: list[StageLink] = [LocalStage(StageRunner(d, d.layers), hook) for d in dense]
    return StagedBackbone(head, StageChain(links, replace or (lambda hop, lost: pytest.fail("no stage was lost"))))


def local_tokens(full: GGUFModel, n: int) -> list[int]:
    return [t for t, _ in generate(Backbone(full), PROMPT, n, experts_hook(full))]


def test_a_two_stage_chain_from_slices_equals_the_full_forward_bit_for_bit(cut):
    """Logits of a prompt and of each decoded token are the full file's bits; no stage holds a head tensor."""
    full, head, dense, _ = cut
    staged = chain_of(cut)
    for link in staged.chain.links:
        runner = link.runner  # type: ignore[attr-defined]
        assert not runner.model.has_head and all(block_of(n) in runner.layers or block_of(n) is None for n in runner.model.tensors)
    want_cache, got_cache = KVCache(), staged.new_cache("s")
    want = Backbone(full).forward(PROMPT, want_cache, experts_hook(full))
    got = staged.forward(PROMPT, got_cache, local_moe(lambda *a: pytest.fail("a client computes no experts")))
    assert got.tobytes() == want.tobytes()
    for tok in (3, 8):
        assert staged.forward([tok], got_cache, experts_hook(full)).tobytes() == Backbone(full).forward([tok], want_cache, experts_hook(full)).tobytes()
    assert got_cache.n_past == want_cache.n_past == len(PROMPT) + 2


def test_rollback_through_the_stages_is_exact_and_speculative_decoding_matches(cut):
    """A pass that starts before a stage's cache end cuts that stage's KV: speculative output equals plain decoding."""
    full = cut[0]

    class Guess:  # drafts the prompt's tokens in turn: mostly wrong, sometimes right
        def propose(self, context: np.ndarray, k: int) -> list[int]:
            return [PROMPT[(len(context) + j) % len(PROMPT)] for j in range(k)]

    staged = chain_of(cut)
    cache = staged.new_cache("spec")
    stats = SpecStats()
    got = [t for t, _ in speculative_generate(staged, PROMPT, 12, experts_hook(full), drafter=Guess(), cache=cache, stats=stats)]
    assert got == local_tokens(full, 12)
    assert sum(stats.drafted) > sum(stats.accepted)  # some drafts were rejected: their positions were rolled back
    runners = [link.runner for link in staged.chain.links]  # type: ignore[attr-defined]
    assert all(r.held("spec") == cache.n_past for r in runners)


def test_a_lost_stage_is_replaced_and_rebuilt_by_replay_with_identical_output(cut):
    """The second stage dies after 3 passes; its replacement (holding nothing) gets every input replayed."""
    full, head, dense, experts = cut
    hook = experts_hook(experts)

    class Dying:
        def __init__(self, runner: StageRunner, lives: int) -> None:
            self.runner, self.lives = runner, lives

        @property
        def layers(self) -> range:
            return self.runner.layers

        def run(self, session: str, x: np.ndarray, start: int) -> np.ndarray:
            self.lives -= 1
            if self.lives < 0:
                raise StageLost("killed")
            return self.runner.pass_hidden(session, x, start, hook)

    fresh: list[StageRunner] = []

    def replace(hop: int, lost: StageLink) -> StageLink:
        fresh.append(StageRunner(dense[hop], dense[hop].layers))
        return LocalStage(fresh[-1], hook)

    links: list[StageLink] = [LocalStage(StageRunner(dense[0], dense[0].layers), hook), Dying(StageRunner(dense[1], dense[1].layers), 3)]
    staged = StagedBackbone(head, StageChain(links, replace))
    got = [t for t, _ in generate(staged, PROMPT, 8, hook, cache=staged.new_cache("k"))]
    assert got == local_tokens(full, 8)
    assert len(fresh) == 1 and staged.chain.replays == 1 and fresh[0].held("k") == len(PROMPT) + 7


def test_a_stage_that_lost_a_session_reports_a_gap_and_the_client_replays(cut):
    """A stage restarted under the client (its caches gone) answers StageGap; the chain replays and the bits hold."""
    full = cut[0]
    staged = chain_of(cut)
    cache = staged.new_cache("g")
    staged.forward(PROMPT, cache, experts_hook(full))
    runner = staged.chain.links[1].runner  # type: ignore[attr-defined]
    runner.sessions.clear()
    with pytest.raises(StageGap, match="holds 0"):
        runner.pass_hidden("g", np.zeros((1, full.cfg.n_embd), np.float32), len(PROMPT), experts_hook(full))
    got = staged.forward([3], cache, experts_hook(full))
    want_cache = KVCache()
    Backbone(full).forward(PROMPT, want_cache, experts_hook(full))
    assert got.tobytes() == Backbone(full).forward([3], want_cache, experts_hook(full)).tobytes()
    assert staged.chain.replays == 1 and runner.held("g") == len(PROMPT) + 1


def test_bad_passes_and_chains_are_refused_with_a_clear_error(cut):
    """Wrong width, non-finite rows, positions past the context, a chain with a hole, a layer a stage lacks."""
    full, head, dense, experts = cut
    runner = StageRunner(dense[0], dense[0].layers)
    hook = experts_hook(experts)
    d = full.cfg.n_embd
    for x, start, match in ((np.zeros((1, d + 1), np.float32), 0, "width"), (np.full((1, d), np.nan, np.float32), 0, "non-finite"), (np.zeros((1, d), np.float64), 0, "float32"), (np.zeros((1, d), np.float32), full.cfg.context_length, "context")):
        with pytest.raises(BadPass, match=match):
            runner.pass_hidden("b", x, start, hook)
    with pytest.raises(LocalProtocolError, match="must start at layer 2"):
        StagedBackbone(head, StageChain([LocalStage(runner, hook), LocalStage(runner, hook)], lambda h, lost: lost))
    with pytest.raises(IndexError, match="layer 3 is not loaded here"):
        _ = runner.backbone.layers[3]
    with pytest.raises(LocalProtocolError, match="ChainCache"):
        chain_of(cut).forward([1], KVCache(), hook)
