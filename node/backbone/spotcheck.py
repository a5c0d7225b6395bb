"""Spot checks: re-compute a sample of dispatches and catch workers that return wrong partial sums.

hivemind only checks answers for NaN/Inf; a worker can return plausible garbage and be
paid for it. The backbone re-computes a fraction of dispatches (``DEFAULT_SPOT_CHECK``
unless told otherwise) with the exact inputs: from its own copy of the experts when it
holds them, else by asking another replica of the same experts (a backbone of a model too
large for one machine holds none); when the two replicas disagree a third answer settles
which one is wrong (:func:`settle`), and with no third the check is unsettled. It compares: with an F32 wire and a worker whose kernel
identity (from its record) equals ours the answer must be bit-identical; a lossy wire, or
another kernel (other quantized-activation rounding, another library), must stay within the
quantized-weights tolerance (cosine >= 0.999 per token and a small absolute error). A mismatch disputes the
receipt (unpaid), is logged with the evidence, and bans the worker with exponential
backoff; so does a batch signature missing past its deadline or not verifying (``unsigned``,
:mod:`node.backbone.signatures`). Pure functions and a small policy object; the backbone does the I/O.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np

from experts.codecs import Codec
from p2p.backoff import Backoff

DEFAULT_SPOT_CHECK = 0.1  # a tenth of the dispatches re-computed: BENCHMARKS.md "Verification" measures the cost
MIN_COSINE = 0.999
BAN = Backoff(first=60.0, cap=3600.0)  # seconds a caught worker is banned, doubling per offence


@dataclass(frozen=True)
class CheckResult:
    ok: bool
    max_abs_diff: float
    min_cosine: float


def compare(codec: Codec, got: np.ndarray, want: np.ndarray, *, same_kernel: bool = True) -> CheckResult:
    """Does a worker's answer match the backbone's own computation under *codec*, computed by the same
    kernel as the worker's (*same_kernel*: bits must match on an F32 wire) or another one?"""
    diff = float(np.abs(got - want).max()) if got.size else 0.0
    norms = np.linalg.norm(got, axis=-1) * np.linalg.norm(want, axis=-1)
    cos = np.where(norms > 0, (got * want).sum(-1) / np.where(norms > 0, norms, 1), 1.0)
    min_cos = float(cos.min()) if cos.size else 1.0
    if codec is Codec.F32 and same_kernel:
        return CheckResult(got.tobytes() == want.tobytes(), diff, min_cos)
    scale = float(np.abs(want).max()) if want.size else 0.0
    return CheckResult(min_cos >= MIN_COSINE and diff <= 0.05 * scale + 1e-6, diff, min_cos)


@dataclass(frozen=True)
class Answer:
    """One host's partial sums for a dispatch, and the kernel identity (from its record) that computed them."""

    sums: np.ndarray
    kernel: str


@dataclass(frozen=True)
class Settlement:
    """Which of two disagreeing answers a third one refutes."""

    wrong: int | None  # 0: the checked answer, 1: the first referee's, None: the third agrees with neither (unsettled)
    evidence: CheckResult  # how the wrong answer differs from the third (of the checked one, if unsettled)


def agree(codec: Codec, a: Answer, b: Answer) -> CheckResult:
    """Do two hosts' answers (both as decoded from the wire) match: bit for bit on an F32 wire with one kernel, else within the tolerance?"""
    return compare(codec, a.sums, b.sums, same_kernel=a.kernel == b.kernel)


def settle(codec: Codec, checked: Answer, referee: Answer, third: Answer) -> Settlement:
    """*checked* and *referee* disagree; the one *third* does not agree with is wrong (both or neither: unsettled)."""
    vs_checked, vs_referee = agree(codec, checked, third), agree(codec, referee, third)
    if vs_referee.ok and not vs_checked.ok:
        return Settlement(0, vs_checked)
    if vs_checked.ok and not vs_referee.ok:
        return Settlement(1, vs_referee)
    return Settlement(None, vs_checked)


class SpotChecker:
    """Which dispatches to re-compute (a seeded sample of *fraction*) and how long to ban a cheat."""

    def __init__(self, fraction: float, seed: int | None = None) -> None:
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"spot-check fraction {fraction} must be between 0 and 1")
        self.fraction = fraction
        self._rng = random.Random(seed)
        self.checked = 0
        self.caught = 0
        self.unverifiable = 0  # sampled dispatches nobody else could re-compute (a sole replica, no local experts)
        self.unsettled = 0  # two replicas disagreed and no third answer settled which was wrong
        self.unsigned = 0  # workers convicted for receipts left unsigned past the deadline or signed wrong
        self.culprits: list[str] = []  # peers caught, in order (append-only: sequences roll back on new entries)
        self._offences: dict[str, int] = {}

    def should_check(self) -> bool:
        return self.fraction > 0 and self._rng.random() < self.fraction

    def summary(self) -> dict:
        return {"spot_check": self.fraction, "checked": self.checked, "caught": self.caught, "unverifiable": self.unverifiable, "unsettled": self.unsettled, "unsigned": self.unsigned}

    def ban_for(self, peer: str) -> float:
        """Seconds to ban *peer* after its n-th caught mismatch: 60 s, doubling, at most an hour."""
        n = self._offences.get(peer, 0) + 1
        self._offences[peer] = n
        return BAN.delay(n - 1)
