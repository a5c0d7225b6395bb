"""MoE math: routing as llama.cpp does it, batch invariance, and the protocol's summation order."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from experts.arch import Gating
from experts.moe import TILE, ExpertSource, Partition, Router, combine, expert_ffn, grouped_moe, ordered_sum, partial_sum, route, route_margin


class RandomExperts(ExpertSource):
    def __init__(self, n_expert=8, d=48, ff=40, seed=0):
        rng = np.random.default_rng(seed)
        self.w = [tuple((rng.standard_normal(s) / 6).astype(np.float32) for s in ((ff, d), (ff, d), (d, ff))) for _ in range(n_expert)]

    def weights(self, layer, expert):
        return self.w[expert]


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 3 * TILE + 1), pos=st.integers(0, 100), seed=st.integers(0, 2**16))
def test_expert_rows_do_not_depend_on_their_batch(n, pos, seed):
    """A token's expert output is the same bits whatever other tokens share the batch."""
    src = RandomExperts()
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 48)).astype(np.float32)
    i = pos % n
    alone = expert_ffn(x[i : i + 1], *src.weights(0, 3))
    batched = expert_ffn(x, *src.weights(0, 3))
    assert alone[0].tobytes() == batched[i].tobytes()


def test_route_matches_softmax_topk_and_renormalises_when_asked():
    """Slot 0 holds the highest probability; weights are probabilities, renormalised only if the arch does."""
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((6, 10)).astype(np.float32) * 3
    ids, w = route(logits, 3, Router(norm=False))
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    for t in range(6):
        assert list(ids[t]) == list(np.argsort(-p[t])[:3])
        np.testing.assert_allclose(w[t], p[t, ids[t]], rtol=1e-6)
    _, wn = route(logits, 3, Router(norm=True))
    np.testing.assert_allclose(wn.sum(-1), 1.0, rtol=1e-6)


def test_sigmoid_router_selects_with_the_bias_but_weighs_without_it():
    """exp_probs_b moves the choice only; weights are the unbiased sigmoids, renormalised (clamped) and scaled."""
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((5, 8)).astype(np.float32) * 2
    bias = np.zeros(8, dtype=np.float32)
    bias[7] = 10.0  # expert 7 always wins the selection
    ids, w = route(logits, 2, Router(Gating.SIGMOID, norm=True, scale=2.5), bias)
    p = 1 / (1 + np.exp(-logits.astype(np.float64)))
    for t in range(5):
        assert ids[t, 0] == 7 and ids[t, 1] == int(np.argsort(-p[t, :7])[0])
        np.testing.assert_allclose(w[t], 2.5 * p[t, ids[t]] / p[t, ids[t]].sum(), rtol=1e-6)
    _, tiny = route(np.full((1, 8), -30.0, dtype=np.float32), 2, Router(Gating.SIGMOID, norm=True))
    assert np.all(tiny < 1e-6)  # the clamp keeps tiny sums from being blown up to 0.5 each


def test_group_limited_routing_only_picks_from_the_best_groups():
    """With 4 groups of 2 and 2 groups kept, experts come from the two groups with the largest top-2 sums."""
    logits = np.array([[5.0, 4.0, 9.0, -9.0, 1.0, 1.0, -5.0, -5.0]], dtype=np.float32)
    # group sums (softmax is monotone, compare logits): g0 = {5,4}, g1 = {9,-9}, g2 = {1,1}, g3 = {-5,-5}
    ids, _ = route(logits, 3, Router(n_groups=4, n_group_used=2))
    p = np.exp(logits[0] - logits.max())
    p /= p.sum()
    best = np.argsort(-(np.sort(p.reshape(4, 2), axis=-1)[:, ::-1][:, :2].sum(-1)))[:2]
    allowed = {int(g) * 2 + j for g in best for j in range(2)}
    assert set(ids[0].tolist()) <= allowed and ids[0, 0] == 2


def test_ordered_sum_adds_present_terms_left_to_right():
    """Absent terms are skipped, not added as zeros; order is index order."""
    terms = np.array([[[1e8], [1.0], [-1e8]]], dtype=np.float32)
    s, has = ordered_sum(terms, np.array([[True, True, True]]))
    assert s[0, 0] == np.float32((np.float32(1e8) + np.float32(1.0)) + np.float32(-1e8))
    s, has = ordered_sum(terms, np.array([[False, True, False]]))
    assert s[0, 0] == 1.0 and has[0]
    s, has = ordered_sum(terms, np.array([[False, False, False]]))
    assert not has[0]


@settings(max_examples=30, deadline=None)
@given(groups=st.integers(1, 8), n=st.integers(1, 12), seed=st.integers(0, 2**16))
def test_grouped_equals_combining_partial_sums_computed_separately(groups, n, seed):
    """Partial sums computed per group on only the tokens that need them combine to the local grouped result."""
    src = RandomExperts()
    part = Partition.even(8, groups)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 48)).astype(np.float32)
    ids = np.stack([rng.choice(8, 4, replace=False) for _ in range(n)]).astype(np.int32)
    w = rng.random((n, 4)).astype(np.float32)
    local = grouped_moe(src, part, 0, x, ids, w)
    partials = []
    for g in range(len(part.bounds)):
        held = part.held_mask(g, ids)
        rows = held.any(1)
        full = np.zeros_like(x)
        if rows.any():
            full[rows], _ = partial_sum(src, 0, x[rows], ids[rows], w[rows], held[rows])
        partials.append((full, rows))
    assert combine(partials).tobytes() == local.tobytes()


def test_even_partition_covers_every_expert_once():
    """Groups are contiguous, ordered and cover 0..n-1."""
    for n, g in ((128, 3), (8, 8), (32, 5), (4, 10)):
        b = Partition.even(n, g).bounds
        assert b[0][0] == 0 and b[-1][1] == n
        assert all(x[1] == y[0] for x, y in zip(b, b[1:]))


def test_softmax_weight_router_selects_on_logits_and_softmaxes_the_selected():
    """gpt-oss: top-k on the raw logits, weights the softmax over just the k chosen logits (they sum to 1)."""
    rng = np.random.default_rng(2)
    logits = rng.standard_normal((6, 16)).astype(np.float32) * 3
    ids, w = route(logits, 4, Router(Gating.SOFTMAX_WEIGHT))
    for t in range(6):
        assert list(ids[t]) == list(np.argsort(-logits[t])[:4])
        chosen = np.exp(logits[t, ids[t]] - logits[t, ids[t]].max())
        np.testing.assert_allclose(w[t], chosen / chosen.sum(), rtol=1e-6)
    assert (np.diff(w, axis=-1) <= 0).all()  # slot 0 is the largest


def test_route_margin_is_the_logit_change_that_flips_a_top_k_or_group_boundary():
    """The margin is the logit move (each of the two boundary scores pushed half the way) that swaps the k-th and
    (k+1)-th choice, over the logits' RMS; with groups the group boundary counts too, so a tie between groups is a
    small margin even when the chosen experts lead clearly."""

    def rms(z):
        return float(np.sqrt(np.mean(z.astype(np.float64) ** 2)))

    raw = Router(Gating.SOFTMAX_WEIGHT)  # the scores are the logits (slope 1)
    z = np.array([[4.0, 3.0, 2.9, 0.0]], dtype=np.float32)
    assert np.isclose(route_margin(z, 2, raw)[0] * rms(z), 0.1 / 2)
    assert np.isclose(route_margin(z, 1, raw)[0] * rms(z), 1.0 / 2)
    assert route_margin(z, 4, raw)[0] == np.inf  # nothing left out
    sig = np.array([[2.0, 0.01, 0.0, -3.0]], dtype=np.float32)  # sigmoid: the same half logit gap, near enough
    assert np.isclose(route_margin(sig, 2, Router(Gating.SIGMOID))[0] * rms(sig), 0.01 / 2, rtol=1e-3)
    grouped = Router(Gating.SOFTMAX_WEIGHT, n_groups=4, n_group_used=2)
    clear = np.array([[4.0, 3.0, 2.9, 0.0, 1.0, 0.0, 0.5, 0.0]], dtype=np.float32)  # group scores 7, 2.9, 1, 0.5
    tied = np.array([[4.0, 3.0, 2.9, 0.0, 2.85, 0.0, 0.5, 0.0]], dtype=np.float32)  # 7, 2.9, 2.85, 0.5
    assert np.isclose(route_margin(clear, 1, grouped)[0] * rms(clear), (2.9 - 1.0) / 4)  # group boundary, 4 slopes
    assert np.isclose(route_margin(tied, 1, grouped)[0] * rms(tied), (2.9 - 2.85) / 4)
    assert route(tied, 1, grouped)[0][0, 0] == 0 and route_margin(tied, 1, Router(Gating.SOFTMAX_WEIGHT))[0] * rms(tied) == 0.5
