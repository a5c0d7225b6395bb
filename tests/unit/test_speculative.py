"""Speculative decoding: greedy output identical to plain decoding, fewer passes, sampled distribution preserved."""

from __future__ import annotations

import itertools
import math
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from experts.embedded import EMBEDDED_MODEL
from experts.forward import Backbone, KVCache
from experts.generate import Sampling, generate, probabilities
from experts.gguf_model import GGUFModel
from experts.moe import Partition, grouped_moe, ungrouped_moe
from experts.slices import ExpertStore
from experts.speculative import PromptLookupDrafter, SpecStats, acceptance_stats, next_k, speculative_generate, verify
from experts.tokenizer import Tokenizer

from ..conftest import make_model

PROMPTS = (
    "And God said",
    "The LORD is my shepherd; I shall not want.",
    "And it came to pass, when",
)
# The model goes on repeating this refrain, so prompt lookup has something to copy.
REPETITIVE = "for his mercy endureth for ever. O give thanks unto the LORD; for his mercy endureth for ever. O give thanks unto the LORD;"


class Counting:
    """A backbone stand-in that records each forward pass's length and checks it stays inside the context."""

    def __init__(self, backbone: Backbone) -> None:
        self.backbone, self.cfg, self.passes = backbone, backbone.cfg, []

    def forward(self, tokens, cache: KVCache, moe_ffn):
        assert cache.n_past + len(tokens) <= self.cfg.context_length
        self.passes.append(len(tokens))
        return self.backbone.forward(tokens, cache, moe_ffn)


class NoDraft:
    def propose(self, context, k):
        return []


class Fixed:
    """Proposes the same tokens whatever the context (so the model rejects many of them)."""

    def __init__(self, tokens) -> None:
        self.tokens = list(tokens)

    def propose(self, context, k):
        return self.tokens[:k]


class Oracle:
    """Knows the plain greedy continuation of *prompt* and proposes it: every draft token is accepted."""

    def __init__(self, prompt, continuation) -> None:
        self.n_prompt, self.continuation = len(prompt), list(continuation)

    def propose(self, context, k):
        done = len(context) - self.n_prompt
        return self.continuation[done : done + k]


@pytest.fixture(scope="module")
def kjv():
    """The embedded model, F32, experts combined locally over a 3-group partition."""
    model = GGUFModel(EMBEDDED_MODEL)
    store, part = ExpertStore(model), Partition.even(model.cfg.n_expert, 3)
    tok = Tokenizer.from_spec(model.tokenizer_spec)
    return Backbone(model), (lambda i, x, e, w: grouped_moe(store, part, i, x, e, w)), tok


@pytest.fixture(scope="module")
def tiny(model_dir):
    """A one-layer random qwen2moe with the 265-token byte-level vocabulary."""
    model = GGUFModel(make_model(model_dir, "qwen2moe", n_layer=1, n_embd=32, n_head=2, n_head_kv=1, n_expert=4, n_ff_exp=16))
    store = ExpertStore(model)
    return Backbone(model), (lambda i, x, e, w: ungrouped_moe(store, i, x, e, w))


def assert_same(plain, spec):
    assert [t for t, _ in spec] == [t for t, _ in plain]
    for (_, a), (_, b) in zip(plain, spec):
        assert a.tobytes() == b.tobytes()


@pytest.mark.parametrize("k_max", [1, 4, 8])
@pytest.mark.parametrize("text", PROMPTS + (REPETITIVE,))
def test_greedy_tokens_and_logits_equal_plain_decoding(kjv, text, k_max):
    """Greedy speculation yields the very tokens and logit bits of generate, whatever k_max."""
    bb, hook, tok = kjv
    prompt = tok.encode(text)
    plain = list(generate(bb, prompt, 40, hook, stop={tok.eos_id}))
    assert_same(plain, list(speculative_generate(bb, prompt, 40, hook, stop={tok.eos_id}, k_max=k_max)))


@pytest.mark.parametrize("drafter", [NoDraft(), Fixed([0, 1, 2, 3, 4, 5, 6, 7]), PromptLookupDrafter(max_ngram=1)], ids=["none", "fixed", "unigram"])
def test_greedy_output_does_not_depend_on_the_drafter(kjv, drafter):
    """Wrong drafts, no drafts or a fixed k: the output is still plain decoding's."""
    bb, hook, tok = kjv
    prompt = tok.encode(PROMPTS[0])
    plain = list(generate(bb, prompt, 30, hook))
    assert_same(plain, list(speculative_generate(bb, prompt, 30, hook, drafter=drafter, adaptive=False)))


@pytest.mark.parametrize("max_tokens", [0, 1, 2, 3, 9, 10, 11, 25])
def test_max_tokens_is_exact_even_when_drafts_run_on(kjv, max_tokens):
    """Exactly max_tokens tokens, and no pass past them, with every draft accepted."""
    bb, hook, tok = kjv
    prompt = tok.encode(PROMPTS[1])
    plain = list(generate(bb, prompt, max_tokens, hook))
    counting, stats = Counting(bb), SpecStats()
    spec = list(speculative_generate(counting, prompt, max_tokens, hook, drafter=Oracle(prompt, [t for t, _ in plain]), stats=stats))
    assert_same(plain, spec)
    assert sum(counting.passes) == (len(prompt) + max_tokens - 1 if max_tokens else 0)  # the prompt, then each yielded token but the last
    assert stats.forward_passes == len(counting.passes) and stats.tokens == max_tokens


def test_stop_token_inside_an_accepted_draft_ends_the_output(kjv):
    """A stop token accepted mid-draft is the last token yielded; the accepted tokens after it are not."""
    bb, hook, tok = kjv
    prompt = tok.encode(PROMPTS[2])
    plain = [t for t, _ in generate(bb, prompt, 30, hook)]
    # The first step after the prefill drafts 8 tokens (plain[1:9]): stop on one in the middle that is new there.
    j = next(j for j in range(3, 8) if plain[j] not in plain[:j])
    stats = SpecStats()
    spec = list(speculative_generate(bb, prompt, 30, hook, stop={plain[j]}, drafter=Oracle(prompt, plain), stats=stats))
    assert_same(list(generate(bb, prompt, 30, hook, stop={plain[j]})), spec)
    assert len(spec) == j + 1 and stats.accepted[0] == 8


def test_stop_on_the_first_token(kjv):
    """A stop token drawn from the prefill ends generation before any decode pass."""
    bb, hook, tok = kjv
    prompt = tok.encode(PROMPTS[0])
    first = next(generate(bb, prompt, 1, hook))[0]
    counting = Counting(bb)
    assert [t for t, _ in speculative_generate(counting, prompt, 20, hook, stop={first})] == [first]
    assert counting.passes == [len(prompt)]


def test_context_limit_is_checked_and_never_passed(tiny):
    """A request beyond the context fails up front, as generate's does; one that fills it exactly stays inside."""
    bb, hook = tiny
    limit = bb.cfg.context_length
    with pytest.raises(ValueError, match="exceeds the model's context"):
        next(speculative_generate(bb, [1] * (limit - 4), 5, hook))
    prompt = [1, 2, 3, 4] * ((limit - 12) // 4)
    plain = list(generate(bb, prompt, limit - len(prompt), hook))
    spec = list(speculative_generate(Counting(bb), prompt, limit - len(prompt), hook, drafter=Oracle(prompt, [t for t, _ in plain])))
    assert_same(plain, spec)


def test_prompt_lookup_saves_passes_on_repetitive_text(kjv):
    """On text that repeats itself, fewer forward passes than tokens; every pass counted in the stats."""
    bb, hook, tok = kjv
    counting, stats = Counting(bb), SpecStats()
    out = list(speculative_generate(counting, tok.encode(REPETITIVE), 40, hook, stats=stats))
    assert len(out) == stats.tokens == 40
    assert stats.forward_passes == len(counting.passes) < 40
    assert sum(stats.accepted) == 40 - len(counting.passes)  # each pass yields its accepted tokens plus one
    assert stats.mean_accepted > 0 and stats.tokens_per_pass > 1


def test_no_draft_costs_one_single_token_pass_per_token(kjv):
    """A drafter that never proposes: one pass per token, each (after the prefill) one token long."""
    bb, hook, tok = kjv
    counting, stats = Counting(bb), SpecStats()
    out = list(speculative_generate(counting, tok.encode(REPETITIVE), 30, hook, drafter=NoDraft(), stats=stats))
    assert len(out) == stats.forward_passes == len(counting.passes) == 30
    assert counting.passes[1:] == [1] * 29 and sum(stats.drafted) == 0 and stats.tokens_per_pass == 1.0


def test_drafts_are_cut_to_k_and_must_be_tokens(tiny):
    """A drafter's extra tokens are dropped (no pass longer than k_max + 1); out-of-vocabulary ones are refused."""
    bb, hook = tiny
    counting = Counting(bb)
    list(speculative_generate(counting, [1, 2, 3], 12, hook, drafter=Fixed([5] * 50), k_max=3, adaptive=False))
    assert max(counting.passes[1:]) == 4
    with pytest.raises(ValueError, match="outside the vocabulary"):
        list(speculative_generate(bb, [1, 2, 3], 5, hook, drafter=Fixed([bb.cfg.n_vocab])))


def test_adaptive_k_rule():
    """k grows by 2 after a full draft is accepted, shrinks by 1 after a rejection, stays in [1, k_max]."""
    assert next_k(2, 2, 2, 8) == 4 and next_k(7, 7, 7, 8) == 8 and next_k(8, 8, 8, 8) == 8
    assert next_k(8, 8, 2, 8) == 7 and next_k(5, 5, 0, 8) == 4 and next_k(1, 1, 0, 8) == 1
    assert next_k(8, 3, 3, 8) == 8  # a short draft wholly accepted says nothing about longer ones


def test_adaptive_k_shrinks_after_rejections(kjv):
    """With a drafter that is always wrong, adaptive drafts shrink step by step to one token; fixed ones stay at k_max."""
    bb, hook, tok = kjv
    prompt = tok.encode(PROMPTS[0])
    adaptive, fixed = SpecStats(), SpecStats()
    list(speculative_generate(bb, prompt, 16, hook, drafter=Fixed([tok.eos_id] * 8), stats=adaptive))
    list(speculative_generate(bb, prompt, 16, hook, drafter=Fixed([tok.eos_id] * 8), stats=fixed, adaptive=False))
    # 15 decode steps; drafts never reach past the 16th token, so the last step drafts nothing.
    assert adaptive.drafted == [8, 7, 6, 5, 4, 3, 2, 1, 1, 1, 1, 1, 1, 1, 0] and sum(adaptive.accepted) == 0
    assert fixed.drafted == [min(8, 14 - i) for i in range(15)] and sum(fixed.accepted) == 0


# --- the drafter ---------------------------------------------------------------------------------


def propose(context, k, **kw):
    return PromptLookupDrafter(**kw).propose(np.array(context, dtype=np.int64), k)


def test_longest_ngram_wins():
    """The trigram match is used even though the unigram's occurrence is more recent."""
    context = [1, 2, 3, 9, 8, 7, 3, 5, 1, 2, 3]
    assert propose(context, 3) == [9, 8, 7]
    assert propose(context, 3, max_ngram=1) == [5, 1, 2]


def test_most_recent_occurrence_wins():
    """Of several occurrences of the suffix, the latest one's continuation is proposed."""
    assert propose([5, 6, 1, 5, 6, 2, 4, 5, 6], 2) == [2, 4]


def test_no_proposal_without_a_match():
    """Nothing is proposed when no suffix of at least min_ngram tokens occurred before."""
    assert propose([1, 2, 3, 4], 4) == []
    assert propose([7], 4) == []
    assert propose([1, 2, 3, 1], 4, min_ngram=2) == []
    assert propose([1, 2, 3, 1], 4) == [2, 3, 1]


def test_proposal_is_limited_to_k_and_to_what_followed():
    """Up to k tokens, and only tokens that really followed the occurrence."""
    assert propose([1, 2, 3, 4, 5, 1], 2) == [2, 3]
    assert propose([1, 2, 3, 4, 5, 1], 0) == []
    assert propose([4, 1, 4], 5) == [1, 4]


@settings(max_examples=200, deadline=None)
@given(context=st.lists(st.integers(0, 3), min_size=1, max_size=40), k=st.integers(1, 6))
def test_proposals_continue_the_latest_longest_match(context, k):
    """A proposal is what followed the latest occurrence of the longest matching suffix (n <= 3)."""
    got = propose(context, k)
    for n in range(min(3, len(context) - 1), 0, -1):
        starts = [i for i in range(len(context) - n) if context[i : i + n] == context[-n:]]
        if starts:
            assert got == context[starts[-1] + n : starts[-1] + n + k]
            return
    assert got == []


# --- sampling keeps the model's distribution -------------------------------------------------------


def chi_square_p(observed: Counter, expected: dict, n: int) -> float:
    """p-value of observed counts against expected probabilities; cells expecting < 5 are pooled."""
    big = {c for c, p in expected.items() if p * n >= 5}
    obs = [observed[c] for c in big] + [n - sum(observed[c] for c in big)]
    exp = [expected[c] * n for c in big] + [n - sum(expected[c] * n for c in big)]
    x2 = sum((o - e) ** 2 / e for o, e in zip(obs, exp) if e > 0)
    df = len(obs) - 1
    z = ((x2 / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))  # Wilson-Hilferty
    return 0.5 * math.erfc(z / math.sqrt(2))


def test_verify_rule_draws_from_p_whatever_the_draft():
    """Accept x with p(x), else draw from p without x: each emitted token has probability p, for any x."""
    s = Sampling(temperature=1.0, top_p=0.95)
    row = np.log(np.array([0.5, 0.3, 0.15, 0.05]))[None, :].repeat(2, axis=0)
    p = probabilities(row[0], s)
    assert p[3] == 0  # outside the nucleus
    rng = np.random.default_rng(1)
    for x in (0, 1, 3):
        counts = Counter(verify(row, [x], s, rng)[0] for _ in range(6000))
        assert chi_square_p(counts, dict(enumerate(p)), 6000) > 1e-3
        assert counts[3] == 0


def test_sampled_tokens_keep_the_model_distribution(tiny):
    """The first three tokens sampled with speculation follow the exact joint distribution plain sampling draws from."""
    bb, hook = tiny
    s = Sampling(temperature=0.3, top_p=0.8)
    prompt = [72, 101, 108, 108, 111]

    def dist(seq):
        return probabilities(bb.forward(seq, KVCache(), hook)[-1], s)

    exact, p1 = {}, dist(prompt)
    for a in np.flatnonzero(p1):
        p2 = dist(prompt + [a])
        for b in np.flatnonzero(p2):
            p3 = dist(prompt + [a, b])
            for c in np.flatnonzero(p3):
                exact[(a, b, c)] = p1[a] * p2[b] * p3[c]
    # Draft the greedy continuation: accepted often after the likeliest first token, rejected otherwise.
    g1 = int(np.argmax(p1))
    g2 = int(np.argmax(dist(prompt + [g1])))
    drafter = Fixed([g2, int(np.argmax(dist(prompt + [g1, g2])))])
    n, stats, seen = 3000, SpecStats(), Counter()
    for seed in range(n):
        run = speculative_generate(bb, prompt, 4, hook, sampling=Sampling(s.temperature, s.top_p, seed), drafter=drafter, k_max=2, stats=stats)
        seen[tuple(t for t, _ in itertools.islice(run, 3))] += 1
    assert 0.05 < stats.acceptance_rate < 0.95 and 2 in stats.accepted  # both branches of the rule ran, full drafts too
    assert chi_square_p(seen, exact, n) > 1e-3


def test_acceptance_stats_on_the_embedded_model():
    """The measurement helper adds up runs over prompts: tokens, passes and acceptance agree."""
    stats = acceptance_stats(EMBEDDED_MODEL, [PROMPTS[0], REPETITIVE], 20)
    assert stats.tokens == 40 and stats.prefills == 2
    assert stats.forward_passes == stats.tokens - sum(stats.accepted)
    assert stats.tokens_per_pass > 1
