"""Rollback after a caught cheater: the provenance bookkeeping, and decoding that ends equal to the honest run."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from experts.embedded import EMBEDDED_MODEL
from experts.forward import Backbone, local_moe
from experts.generate import generate
from experts.gguf_model import GGUFModel
from experts.moe import ungrouped_moe
from experts.slices import ExpertStore
from experts.speculative import PromptLookupDrafter, speculative_generate
from experts.tokenizer import Tokenizer
from node.backbone.provenance import Provenance, Rollback, RollbackStats, exact_generate


def row(i: int) -> np.ndarray:
    """A dispatch's row mask in which row *i* is the first set (a later one too, which must not matter)."""
    return np.arange(i + 3) >= i


def test_rollback_point_is_the_first_position_of_the_caught_host():
    """A catch cuts back to the caught host's first unchecked position; other hosts' later entries go, earlier ones stay."""
    culprits: list[str] = []
    p = Provenance(culprits)
    p.begin(0)
    p.used("honest", row(2))  # position 2
    p.begin(5)
    p.used("cheat", row(1))  # position 6
    p.begin(9)
    p.used("cheat", row(0))
    p.used("other", row(0))  # position 9: re-decoded after the cut, so forgotten
    assert p.rollback_to() is None  # nobody caught yet
    culprits.append("cheat")
    assert p.rollback_to() == 6
    assert p.rollback_to() is None  # a catch is consumed once
    culprits.append("other")
    assert p.rollback_to() is None  # its only entry was past the cut
    culprits.append("honest")
    assert p.rollback_to() == 2


def test_catches_before_the_sequence_started_do_not_roll_it_back():
    """A host caught in an earlier sequence of the session (and used again after its ban) does not cut this one."""
    culprits = ["cheat"]
    p = Provenance(culprits)
    p.begin(3)
    p.used("cheat", row(0))
    assert p.rollback_to() is None
    culprits.append("cheat")  # caught again, now in this sequence
    assert p.rollback_to() == 3


def test_inherited_taint_rolls_back_into_the_reused_prefix_and_says_what_is_final():
    """Positions reused from a prefix cache keep their taint: a catch cuts back into them; until then, no token after
    the first unchecked position is final."""
    culprits: list[str] = []
    p = Provenance(culprits)
    p.inherit({"cheat": 4, "honest": 7})
    p.begin(10)
    p.used("honest", row(0))
    assert p.final(n_prompt=12, n_out=5) == 0  # position 4 of the prompt was unchecked: everything may be redone
    clean = Provenance(culprits)
    clean.begin(12)
    clean.used("honest", row(2))  # position 14: the tokens at 12, 13, 14 were drawn before it and stay
    assert clean.final(n_prompt=12, n_out=5) == 3 and Provenance(culprits).final(12, 5) == 5
    culprits.append("cheat")
    assert p.rollback_to() == 4


class Cheat:
    """A local MoE in which host "cheat" answers every layer wrong (reporting it as unchecked) until its *catch_at*-th call."""

    def __init__(self, store: ExpertStore, catch_at: int) -> None:
        self.store, self.catch_at, self.calls = store, catch_at, 0
        self.culprits: list[str] = []
        self.provenance = Provenance(self.culprits)

    def compute(self, layer, x, ids, w):
        sums = ungrouped_moe(self.store, layer, x, ids, w)
        if self.culprits:  # banned: the honest path answers
            return sums
        self.calls += 1
        if self.calls == self.catch_at:  # this dispatch was checked: the right answer is used, the host named
            self.culprits.append("cheat")
            return sums
        self.provenance.used("cheat", row(0))
        return sums + np.random.default_rng(layer).standard_normal(sums.shape).astype(np.float32) * np.abs(sums).mean()


def kept(events) -> list[int]:
    """The tokens a consumer ends with: every token yielded, minus what each Rollback retracts."""
    out: list[int] = []
    for e in events:
        if isinstance(e, Rollback):
            del out[e.keep :]
        else:
            out.append(e[0])
    return out


@pytest.mark.parametrize("speculative", [False, True])
@pytest.mark.parametrize("catch_at", [3, 40])  # in the prefill, and some tokens into decoding
def test_output_equals_the_honest_run_after_a_catch(speculative, catch_at):
    """Greedy tokens after rollback equal a run without the cheater; without rollback they differ; the cost is counted."""
    model = GGUFModel(EMBEDDED_MODEL)
    store, bb = ExpertStore(model), Backbone(model)
    prompt = Tokenizer.from_spec(model.tokenizer_spec).encode("And it came to pass")
    decode = functools.partial(speculative_generate, drafter=PromptLookupDrafter()) if speculative else generate
    honest = [t for t, _ in generate(bb, prompt, 24, local_moe(lambda i, x, e, w: ungrouped_moe(store, i, x, e, w)))]
    blind = Cheat(store, catch_at=10**9)  # never caught
    assert [t for t, _ in decode(bb, prompt, 24, local_moe(blind.compute))] != honest
    cheat, stats = Cheat(store, catch_at), RollbackStats()
    events = list(exact_generate(bb, prompt, 24, local_moe(cheat.compute), cheat.provenance, decode=decode, stats=stats))
    assert kept(events) == honest
    assert stats.rollbacks == 1 and stats.redecoded == sum(1 for e in events if not isinstance(e, Rollback)) - 24
    assert stats.summary() == {"rollbacks": 1, "tokens_redecoded": stats.redecoded}
