"""Token generation over the backbone forward: prefill, then one token per step."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from .forward import Backbone, KVCache, MoeFfn


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int = 0


def sample(logits: np.ndarray, s: Sampling, rng: np.random.Generator) -> int:
    if s.temperature <= 0:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / s.temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p)
    keep = np.cumsum(p[order]) - p[order] < s.top_p
    p_kept = np.zeros_like(p)
    p_kept[order[keep]] = p[order[keep]]
    return int(rng.choice(p.size, p=p_kept / p_kept.sum()))


def generate(
    backbone: Backbone,
    prompt: list[int],
    max_tokens: int,
    moe_ffn: MoeFfn,
    *,
    sampling: Sampling = Sampling(),
    stop: set[int] | None = None,
) -> Iterator[tuple[int, np.ndarray]]:
    """Yield (token, logits it was sampled from) until max_tokens or a stop token."""
    if not prompt:
        raise ValueError("the prompt must hold at least one token")
    limit = backbone.cfg.context_length
    if len(prompt) + max_tokens > limit:
        raise ValueError(f"prompt ({len(prompt)}) + max_tokens ({max_tokens}) exceeds the model's context of {limit}")
    rng = np.random.default_rng(sampling.seed)
    cache = KVCache()
    logits = backbone.forward(prompt, cache, moe_ffn)[-1]
    for _ in range(max_tokens):
        tok = sample(logits, sampling, rng)
        yield tok, logits
        if stop and tok in stop:
            return
        logits = backbone.forward([tok], cache, moe_ffn)[-1]
