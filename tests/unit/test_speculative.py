"""Speculative decoding: greedy output identical to plain decoding, fewer passes, sampled distribution preserved."""

from __future__ import annotations

import itertools
import math
import shutil
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

from experts import speculative
from experts.embedded import EMBEDDED_MODEL
from experts.errors import ModelFormatError
from experts.forward import Backbone, KVCache, local_moe
from experts.generate import Sampling, generate, probabilities
from experts.gguf_model import GGUFModel
from experts.moe import Partition, grouped_moe, ungrouped_moe
from experts.slices import ExpertStore
from experts.speculative import (
    CombinedDrafter,
    NgramDrafter,
    PromptLookupDrafter,
    SpecStats,
    acceptance_stats,
    default_drafter,
    next_k,
    ngram_path,
    speculative_generate,
    verify,
)
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

    def forward(self, tokens, cache: KVCache, moe_ffn, hidden=None):
        assert cache.n_past + len(tokens) <= self.cfg.context_length
        self.passes.append(len(tokens))
        return self.backbone.forward(tokens, cache, moe_ffn, hidden=hidden)


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
    return Backbone(model), local_moe(lambda i, x, e, w: grouped_moe(store, part, i, x, e, w)), tok


@pytest.fixture(scope="module")
def tiny(model_dir):
    """A one-layer random qwen2moe with the 265-token byte-level vocabulary."""
    model = GGUFModel(make_model(model_dir, "qwen2moe", n_layer=1, n_embd=32, n_head=2, n_head_kv=1, n_expert=4, n_ff_exp=16))
    store = ExpertStore(model)
    return Backbone(model), local_moe(lambda i, x, e, w: ungrouped_moe(store, i, x, e, w))


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


def random_arch(model_dir, arch: str):
    """A random model of *arch* on the reference experts and a byte-token prompt."""
    model = GGUFModel(make_model(model_dir, arch, n_layer=3))
    store = ExpertStore(model)
    return Backbone(model), local_moe(lambda i, x, e, w: ungrouped_moe(store, i, x, e, w)), [264, 72, 101, 108, 108, 111]


@pytest.fixture(scope="module")
def deepseek2(model_dir):
    """A random deepseek2: its KV cache is the MLA latent, rolled back like any other."""
    return random_arch(model_dir, "deepseek2")


@pytest.fixture(scope="module")
def step35(model_dir):
    """A random step35: per-layer head counts (so per-layer KV widths) and SWA layers whose window the rollback keeps."""
    return random_arch(model_dir, "step35")


@pytest.fixture(params=["kjv", "deepseek2", "step35"])
def drafted(request):
    """(backbone, hook, prompt) of the embedded model or of a random deepseek2 / step35."""
    if request.param == "kjv":
        bb, hook, tok = request.getfixturevalue("kjv")
        return bb, hook, tok.encode(PROMPTS[1])
    return request.getfixturevalue(request.param)


@pytest.mark.parametrize("drafter", [NoDraft(), Fixed([0, 1, 2, 3, 4, 5, 6, 7]), PromptLookupDrafter(max_ngram=1)], ids=["none", "fixed", "unigram"])
def test_greedy_output_does_not_depend_on_the_drafter(drafted, drafter):
    """Wrong drafts, no drafts or a fixed k: the output is still plain decoding's."""
    bb, hook, prompt = drafted
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


@pytest.mark.parametrize("speculate", [False, True], ids=["generate", "speculative"])
def test_starting_from_a_cached_prefix_feeds_only_the_rest(drafted, speculate):
    """Given a cache holding the prompt's first tokens, the prefill feeds only the others and the output keeps every bit."""
    bb, hook, prompt = drafted
    run = speculative_generate if speculate else generate
    cache = KVCache()
    bb.forward(prompt[:5], cache, hook)
    counting = Counting(bb)
    assert_same(list(run(bb, prompt, 12, hook)), list(run(counting, prompt, 12, hook, cache=cache)))
    assert counting.passes[0] == len(prompt) - 5 and cache.n_past >= len(prompt)
    whole = KVCache()
    bb.forward(prompt, whole, hook)
    with pytest.raises(ValueError, match="at least its last token"):
        next(run(bb, prompt, 12, hook, cache=whole))


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


# --- the n-gram drafter ----------------------------------------------------------------------------

# "2" is followed by 3 twice and by 4 three times, but "1 2" only ever by 3.
CORPUS = [1, 2, 3, 1, 2, 3, 9, 2, 4, 9, 2, 4, 7, 2, 4]


def ngram(corpus=CORPUS, **kw) -> NgramDrafter:
    return NgramDrafter.build([(np.array(corpus), None)], **{"max_order": 4, "min_count": 1, **kw})


def draft(drafter, context, k):
    return drafter.propose(np.array(context, dtype=np.int64), k)


def test_ngram_longest_known_context_wins():
    """After "1 2" the bigram's follower (3) is proposed, not the unigram's commoner 4; an unseen "5 2" backs off to "2"."""
    d = ngram()
    assert draft(d, [1, 2], 1) == [3]
    assert draft(d, [5, 2], 1) == [4]
    assert draft(d, [9, 2], 1) == [4]


def test_ngram_chains_its_own_proposals():
    """Each proposed token joins the context of the next lookup: 1 -> 2 -> 3 -> (1 or 9: a tie, the lower id) 1."""
    d = ngram()
    assert draft(d, [1], 4) == [2, 3, 1, 2]
    assert draft(d, [1], 2) == [2, 3]
    assert draft(d, [7, 2, 4], 3) == [7, 2, 4]  # "2 4" was followed by 9 once and by 7 once: the lower id


def test_ngram_proposes_nothing_for_an_unknown_context():
    """No suffix of the context was ever followed by anything: no proposal, and none for k = 0 or an empty table."""
    d = ngram()
    assert draft(d, [8], 5) == []
    assert draft(d, [1, 2, 8], 5) == []
    assert draft(d, [], 5) == []
    assert draft(d, [1, 2], 0) == []
    assert draft(ngram([5]), [5], 3) == []


def test_ngram_min_count_drops_rare_contexts():
    """With min_count 3 only "2 -> 4" (seen 3 times) survives: "1 2" backs off to it and "1" is unknown."""
    d = ngram(min_count=3)
    assert d.keys.size == 1
    assert draft(d, [1, 2], 2) == [4]
    assert draft(d, [1], 2) == []


def test_ngram_follow_stream_replaces_the_text():
    """A (tokens, follow) stream counts follow[i] after tokens[: i + 1]: a model's choices instead of the text."""
    tokens = np.array([1, 2, 3, 1, 2, 3])
    d = NgramDrafter.build([(tokens, np.array([2, 5, 1, 2, 5]))], max_order=2, min_count=1)
    assert draft(d, [1, 2], 1) == [5]
    with pytest.raises(ValueError, match="needs 5 followers"):
        NgramDrafter.build([(tokens, np.array([2, 5]))])


def reference_proposal(corpus, context, k, max_order, min_count):
    """Brute force: the top follower (ties: lowest id) of the longest suffix seen min_count times with it, chained."""
    context, out = list(context), []
    while len(out) < k:
        for n in range(min(max_order, len(context)), 0, -1):
            after = Counter(corpus[i + n] for i in range(len(corpus) - n) if corpus[i : i + n] == context[-n:])
            if after:
                tok, count = min(after.items(), key=lambda tc: (-tc[1], tc[0]))
                if count >= min_count:
                    break
        else:
            return out
        out.append(tok)
        context.append(tok)
    return out


@settings(max_examples=150, deadline=None)
@given(
    corpus=st.lists(st.integers(0, 3), min_size=1, max_size=60),
    context=st.lists(st.integers(0, 4), max_size=6),
    k=st.integers(0, 5),
    max_order=st.integers(1, 4),
    min_count=st.integers(1, 3),
)
def test_ngram_pruning_loses_nothing(corpus, context, k, max_order, min_count):
    """The pruned table proposes exactly what brute-force longest-context back-off over the corpus does."""
    d = ngram(corpus, max_order=max_order, min_count=min_count)
    assert draft(d, context, k) == reference_proposal(corpus, context, k, max_order, min_count)


def test_ngram_build_refuses_a_key_shared_across_orders(monkeypatch):
    """If two contexts of different lengths hashed alike, lookups could not tell them apart: the build stops."""
    monkeypatch.setattr(speculative, "_mix", lambda key, token: key * 0 + token * 0 + 1)  # every context: key 1
    with pytest.raises(ValueError, match="share a key"):
        ngram([1, 1, 2])  # "1" is followed by 1 or 2 (a tie: 1), "1 1" by 2: both kept


def test_ngram_table_round_trip_is_byte_stable(tmp_path):
    """save then load gives the same table, and saving the same table twice the same bytes."""
    d = ngram(model_digest="ab" * 32)
    d.save(tmp_path / "a.npz")
    d.save(tmp_path / "b.npz")
    assert (tmp_path / "a.npz").read_bytes() == (tmp_path / "b.npz").read_bytes()
    e = NgramDrafter.load(tmp_path / "a.npz")
    assert e.model_digest == "ab" * 32 and e.max_order == 4
    for name in ("keys", "next", "count"):
        assert np.array_equal(getattr(d, name), getattr(e, name)) and getattr(d, name).dtype == getattr(e, name).dtype
    assert draft(e, [1], 4) == [2, 3, 1, 2]


def test_ngram_load_rejects_malformed_tables(tmp_path, monkeypatch):
    """Not a zip, another format version, unsorted keys, mismatched columns or no order: ModelFormatError naming the file."""
    good = ngram()
    (tmp_path / "junk.npz").write_bytes(b"not a table")
    bad = {
        "unsorted.npz": NgramDrafter(good.keys[::-1].copy(), good.next, good.count, 4),
        "columns.npz": NgramDrafter(good.keys, good.next[:-1], good.count, 4),
        "order.npz": NgramDrafter(good.keys, good.next, good.count, 0),
    }
    for name, table in bad.items():
        table.save(tmp_path / name)
    monkeypatch.setattr(speculative, "NGRAM_FORMAT", 99)
    good.save(tmp_path / "version.npz")
    monkeypatch.undo()
    for name in ["junk.npz", "version.npz", *bad]:
        with pytest.raises(ModelFormatError, match=name):
            NgramDrafter.load(tmp_path / name)


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_ngram_load_survives_corrupt_bytes(tmp_path_factory, data):
    """A truncated or bit-flipped table loads or raises ModelFormatError, never anything else."""
    path = tmp_path_factory.mktemp("ngram") / "t.npz"
    ngram(model_digest="d").save(path)
    raw = bytearray(path.read_bytes())
    if data.draw(st.booleans()):
        raw = raw[: data.draw(st.integers(0, len(raw) - 1))]
    else:
        for i in data.draw(st.lists(st.integers(0, len(raw) - 1), min_size=1, max_size=4)):
            raw[i] ^= 1 << data.draw(st.integers(0, 7))
    path.write_bytes(bytes(raw))
    try:
        table = NgramDrafter.load(path)
    except ModelFormatError:
        return
    assert len(draft(table, [1, 2], 3)) <= 3  # what loads is a usable table


def test_combined_drafter_prefers_the_first_unless_shorter():
    """The first drafter's proposal (cut to k) when at least as long as the second's, else the second's."""
    assert draft(CombinedDrafter(Fixed([1, 2]), Fixed([3, 4])), [0], 5) == [1, 2]
    assert draft(CombinedDrafter(Fixed([1]), Fixed([3, 4])), [0], 5) == [3, 4]
    assert draft(CombinedDrafter(Fixed([1, 2, 3]), Fixed([4, 5, 6, 7])), [0], 2) == [1, 2]
    assert draft(CombinedDrafter(NoDraft(), Fixed([4, 5, 6, 7])), [0], 3) == [4, 5, 6]
    assert draft(CombinedDrafter(NoDraft(), NoDraft()), [0], 3) == []
    both = CombinedDrafter(PromptLookupDrafter(), ngram())
    assert draft(both, [5, 6, 1, 2, 5, 6], 2) == [1, 2]  # the context repeats itself: copied
    assert draft(both, [5, 6, 1, 2], 2) == [3, 1]  # no repeat: the table
    assert draft(both, [1, 2, 5, 2], 3) == [4, 7, 2]  # the context offers only 2 tokens to copy, the table 3
    assert draft(both, [1, 2, 5, 2], 2) == [5, 2]


@pytest.fixture
def tiny_copy(tiny, tmp_path):
    """A copy of the tiny model in a directory of its own, so tables written beside it touch nothing else."""
    path = tmp_path / "tiny.gguf"
    shutil.copyfile(tiny[0].model.path, path)
    return GGUFModel(path)


def test_default_drafter_uses_a_table_only_for_its_own_model(tiny_copy):
    """No table: prompt lookup; a table built for this model: the n-gram drafter; one for another model: prompt lookup, with a warning."""
    model = tiny_copy
    assert isinstance(default_drafter(model), PromptLookupDrafter)
    ngram(model_digest=model.digest).save(ngram_path(model.path))
    assert isinstance(default_drafter(model), NgramDrafter)
    ngram(model_digest="0" * 64).save(ngram_path(model.path))
    with capture_logs() as logs:
        assert isinstance(default_drafter(model), PromptLookupDrafter)
    assert [e["event"] for e in logs] == ["speculative.ngram_mismatch"]


def test_the_embedded_model_ships_its_table():
    """The table in experts/data was built for the embedded model as it is now (rebuild it after retraining)."""
    assert isinstance(default_drafter(GGUFModel(EMBEDDED_MODEL)), NgramDrafter)


@pytest.mark.parametrize("text", PROMPTS + (REPETITIVE,))
def test_greedy_output_is_plain_decoding_with_the_ngram_drafter(kjv, text):
    """Drafting from the shipped n-gram table (alone or with prompt lookup) changes no token and no logit bit."""
    bb, hook, tok = kjv
    prompt = tok.encode(text)
    plain = list(generate(bb, prompt, 40, hook, stop={tok.eos_id}))
    table = default_drafter(bb.model)
    for drafter in (table, CombinedDrafter(PromptLookupDrafter(), table)):
        stats = SpecStats()
        assert_same(plain, list(speculative_generate(bb, prompt, 40, hook, stop={tok.eos_id}, drafter=drafter, stats=stats)))
        assert sum(stats.accepted) > 0  # drafts were made and taken, so the check has teeth


def test_ngram_drafter_beats_prompt_lookup_on_ordinary_prompts():
    """On prompts that do not repeat themselves, the n-gram table saves more passes than prompt lookup (a behaviour check, not a speed target)."""
    table = default_drafter(GGUFModel(EMBEDDED_MODEL))
    lookup = acceptance_stats(EMBEDDED_MODEL, PROMPTS, 40, drafter=PromptLookupDrafter())
    ngrams = acceptance_stats(EMBEDDED_MODEL, PROMPTS, 40, drafter=table)
    assert ngrams.tokens == lookup.tokens  # the same greedy text, so only the pass count differs
    assert ngrams.tokens_per_pass > lookup.tokens_per_pass
