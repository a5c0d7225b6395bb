"""Token generation over the backbone forward: prefill, then one token per step."""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass

import numpy as np

from .errors import UsageError
from .forward import Backbone, KVCache, MoeFfn


class PromptError(UsageError, ValueError):
    """A request that cannot be generated: an empty prompt, or more tokens than the model's context holds.

    Also a ValueError, as it was before the shared hierarchy: callers and tests catch it as one.
    """


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int = 0


def probabilities(logits: np.ndarray, s: Sampling) -> np.ndarray:
    """The distribution a token is drawn from: softmax at s.temperature over the top-p nucleus (float64).

    Greedy (temperature <= 0) is the point mass on the argmax. Speculative sampling
    accepts and resamples against exactly this distribution.
    """
    if s.temperature <= 0:
        p = np.zeros(logits.shape[-1])
        p[np.argmax(logits)] = 1.0
        return p
    z = logits.astype(np.float64) / s.temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p)
    keep = np.cumsum(p[order]) - p[order] < s.top_p
    p_kept = np.zeros_like(p)
    p_kept[order[keep]] = p[order[keep]]
    return p_kept / p_kept.sum()


def sample(logits: np.ndarray, s: Sampling, rng: np.random.Generator) -> int:
    if s.temperature <= 0:
        return int(np.argmax(logits))
    p = probabilities(logits, s)
    return int(rng.choice(p.size, p=p))


def check_request(backbone: Backbone, prompt: list[int], max_tokens: int, cache: KVCache | None = None) -> None:
    """Reject a request before any forward pass: empty prompt, more tokens than the context holds, or a
    starting cache that leaves no prompt token to feed (the prefill's last row gives the first token)."""
    if not prompt:
        raise PromptError("the prompt must hold at least one token; give a non-empty prompt")
    limit = backbone.cfg.context_length
    if len(prompt) + max_tokens > limit:
        raise PromptError(f"prompt ({len(prompt)}) + max_tokens ({max_tokens}) exceeds the model's context of {limit}; ask for fewer tokens")
    if cache is not None and cache.n_past >= len(prompt):
        raise PromptError(f"the cache holds {cache.n_past} positions of a {len(prompt)}-token prompt; at least its last token must be fed")


def prefill(backbone: Backbone, prompt: list[int], moe_ffn: MoeFfn, cache: KVCache | None, hidden: list[np.ndarray] | None = None) -> tuple[KVCache, np.ndarray]:
    """Feed the prompt tokens *cache* does not hold yet (all of them without one); (the cache, their logits).

    A given cache must hold the keys/values of ``prompt[:cache.n_past]`` (a reused prefix,
    see :mod:`node.backbone.prefix_cache`); it is extended in place, so the caller can keep it.
    *hidden* is as for :meth:`Backbone.forward`.
    """
    cache = cache if cache is not None else KVCache()
    return cache, backbone.forward(prompt[cache.n_past :], cache, moe_ffn, hidden=hidden)


def generate(
    backbone: Backbone,
    prompt: list[int],
    max_tokens: int,
    moe_ffn: MoeFfn,
    *,
    sampling: Sampling = Sampling(),
    stop: set[int] | None = None,
    cache: KVCache | None = None,
) -> Generator[tuple[int, np.ndarray], None, None]:
    """Yield (token, logits it was sampled from) until max_tokens or a stop token.

    One forward pass per token: the prefill yields the first, each later pass the next
    (no pass is run for the token after the last one). *cache*, if given, already holds
    a prefix of the prompt, which is not recomputed (see :func:`prefill`); it ends up
    holding every position fed.
    """
    check_request(backbone, prompt, max_tokens, cache)
    rng = np.random.default_rng(sampling.seed)
    cache, logits = prefill(backbone, prompt, moe_ffn, cache)
    logits = logits[-1]
    for n in range(1, max_tokens + 1):
        tok = sample(logits, sampling, rng)
        yield tok, logits
        if n == max_tokens or (stop and tok in stop):
            return
        logits = backbone.forward([tok], cache, moe_ffn)[-1]
