"""Spot checks: re-compute a sample of dispatches and catch workers that return wrong partial sums.

hivemind only checks answers for NaN/Inf; a worker can return plausible garbage and be
paid for it. The backbone re-computes a configurable fraction of dispatches from its own
copy of the experts (exact inputs) and compares: with an F32 wire and a worker whose kernel
identity (from its record) equals ours the answer must be bit-identical; a lossy wire, or
another kernel (other quantized-activation rounding, another library), must stay within the
quantized-weights tolerance (cosine >= 0.999 per token and a small absolute error). A mismatch disputes the
receipt (unpaid), is logged with the evidence, and bans the worker with exponential
backoff. Pure functions and a small policy object; the backbone does the I/O.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np

from experts.codecs import Codec
from p2p.backoff import Backoff

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


class SpotChecker:
    """Which dispatches to re-compute (a seeded sample of *fraction*) and how long to ban a cheat."""

    def __init__(self, fraction: float, seed: int | None = None) -> None:
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"spot-check fraction {fraction} must be between 0 and 1")
        self.fraction = fraction
        self._rng = random.Random(seed)
        self.checked = 0
        self.caught = 0
        self._offences: dict[str, int] = {}

    def should_check(self) -> bool:
        return self.fraction > 0 and self._rng.random() < self.fraction

    def ban_for(self, peer: str) -> float:
        """Seconds to ban *peer* after its n-th caught mismatch: 60 s, doubling, at most an hour."""
        n = self._offences.get(peer, 0) + 1
        self._offences[peer] = n
        return BAN.delay(n - 1)
