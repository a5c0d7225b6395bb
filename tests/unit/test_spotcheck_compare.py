"""Spot-check comparison: exact against a worker with our kernel, the quantized tolerance against any other."""

from __future__ import annotations

import numpy as np

from experts.codecs import Codec
from node.backbone.spotcheck import Answer, agree, compare, settle


def sums(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((4, 64)).astype(np.float32)


def test_same_kernel_on_f32_must_match_bit_for_bit():
    want = sums()
    assert compare(Codec.F32, want.copy(), want).ok
    nudged = want.copy()
    nudged[0, 0] = np.nextafter(nudged[0, 0], np.float32(np.inf))
    assert not compare(Codec.F32, nudged, want).ok  # one ulp is a mismatch


def test_another_kernel_is_held_to_the_quantized_tolerance():
    """Another library's rounding (cosine ~0.99999) passes; a cheat's plausible garbage does not."""
    want = sums()
    rounding = want + 1e-3 * sums(1)
    assert not compare(Codec.F32, rounding, want).ok
    assert compare(Codec.F32, rounding, want, same_kernel=False).ok
    garbage = want + 0.2 * sums(2)
    assert not compare(Codec.F32, garbage, want, same_kernel=False).ok


def test_a_third_answer_settles_which_of_two_replicas_is_wrong():
    """The replica the third answer disagrees with is wrong; if it agrees with both or neither, nothing is settled."""
    right, wrong, other = Answer(sums(), "ggml"), Answer(sums() + 0.2 * sums(2), "ggml"), Answer(sums(3), "ggml")
    assert settle(Codec.F32, wrong, right, right).wrong == 0
    assert settle(Codec.F32, right, wrong, right).wrong == 1
    assert settle(Codec.F32, right, wrong, other).wrong is None
    assert not settle(Codec.F32, right, wrong, right).evidence.ok  # the evidence is the wrong answer's mismatch


def test_replicas_with_different_kernels_are_held_to_the_tolerance():
    """Two honest replicas on different kernels agree within the tolerance, not bit for bit."""
    a, b = Answer(sums(), "ggml"), Answer(sums() + 1e-4 * sums(1), "reference")
    assert agree(Codec.F32, a, b).ok
    assert not agree(Codec.F32, a, Answer(b.sums, "ggml")).ok
