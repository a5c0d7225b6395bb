"""Speculative decoding: guess k tokens cheaply, verify them all in one forward pass.

Over a WAN each MoE layer of each forward pass costs a backbone <-> worker round trip,
and a pass over k+1 tokens costs about as many round trips as a pass over one. So a
step feeds the pending token plus a k-token draft through the model once, keeps the
draft tokens the model agrees with and adds one token of its own: every accepted
draft token saves a pass.

Exactness rests on the forward being batch invariant (:mod:`experts.forward`): row i
of a verify pass is the same bits as decoding that token alone, so

* greedy: accepting the longest draft prefix that matches the argmax gives the very
  tokens and logits :func:`experts.generate.generate` gives;
* sampling: the drafter proposes one token x per position (q is a point mass), and
  the speculative-sampling rule (Leviathan et al. 2023, Chen et al. 2023) becomes:
  accept x with probability p(x), else draw from p with x removed and renormalised;
  after k acceptances draw a bonus token from the last row. Then
  P(emit y) = p(y) for every y, with p the same top-p filtered distribution
  :func:`experts.generate.sample` draws from, whatever the drafter proposed, as long
  as it never sees the sampler's random numbers.

Rejected draft tokens leave keys/values in the cache; :meth:`KVCache.truncate` drops them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from .forward import Backbone, KVCache, MoeFfn
from .generate import Sampling, check_request, probabilities, sample
from .gguf_model import GGUFModel
from .moe import ungrouped_moe
from .slices import ExpertStore
from .tokenizer import Tokenizer


class Drafter(Protocol):
    """Proposes tokens likely to follow a context; cheap, and free to propose nothing."""

    def propose(self, context: np.ndarray, k: int) -> Sequence[int]:
        """Up to *k* tokens guessed to follow *context* (prompt + generated so far, int64, read-only)."""
        ...


@dataclass(frozen=True)
class PromptLookupDrafter:
    """Prompt lookup: the text repeats itself, so continue it as it went on last time.

    Finds the most recent earlier occurrence of the context's last n tokens, for the
    largest n from max_ngram down to min_ngram that has one, and proposes the (up to
    k) tokens that followed it. Needs no vocabulary and no model; costs one vectorised
    scan of the context per n.
    """

    max_ngram: int = 3
    min_ngram: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"need 1 <= min_ngram ({self.min_ngram}) <= max_ngram ({self.max_ngram})")

    def propose(self, context: np.ndarray, k: int) -> list[int]:
        context = np.asarray(context)
        n_ctx = len(context)
        for n in range(min(self.max_ngram, n_ctx - 1), self.min_ngram - 1, -1):
            # Windows that start early enough to have a following token, i.e. every occurrence but the suffix itself.
            hits = np.flatnonzero((sliding_window_view(context[:-1], n) == context[-n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return context[start : start + k].tolist()
        return []


@dataclass
class SpecStats:
    """What speculative runs did; pass one object to several runs to add them up.

    Each decode step is one forward pass (one round trip per MoE layer over a WAN);
    the prefill is one more per run and yields the first token.
    """

    tokens: int = 0  # tokens yielded
    prefills: int = 0
    drafted: list[int] = field(default_factory=list)  # draft length of each decode step (0: a plain step)
    accepted: list[int] = field(default_factory=list)  # draft tokens the model agreed with, per decode step

    @property
    def steps(self) -> int:
        return len(self.drafted)

    @property
    def forward_passes(self) -> int:
        return self.prefills + self.steps

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted tokens (0 when nothing was drafted)."""
        total = sum(self.drafted)
        return sum(self.accepted) / total if total else 0.0

    @property
    def mean_accepted(self) -> float:
        """Accepted draft tokens per decode step."""
        return sum(self.accepted) / self.steps if self.steps else 0.0

    @property
    def tokens_per_pass(self) -> float:
        """Tokens yielded per forward pass, prefills included (1.0 without speculation)."""
        return self.tokens / self.forward_passes if self.forward_passes else 0.0

    def summary(self) -> dict:
        return {
            "tokens": self.tokens,
            "forward_passes": self.forward_passes,
            "steps": self.steps,
            "drafted": sum(self.drafted),
            "accepted": sum(self.accepted),
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_accepted_per_step": round(self.mean_accepted, 4),
            "tokens_per_pass": round(self.tokens_per_pass, 4),
        }


def next_k(k: int, drafted: int, accepted: int, k_max: int) -> int:
    """Adaptive draft length: two longer after a full draft was wholly accepted, one shorter after a rejection.

    A pass costs a round trip whatever its length, so k leans long: it climbs fast on
    copied text and gives way slowly at the end of a copied phrase, while a drafter
    that keeps missing walks it down to 1 (one wasted row per pass). A short draft
    that was all accepted says nothing about longer ones and leaves k alone.
    Measured on the embedded model (k_max 8, 100 tokens per prompt), repetitive
    prompts: 1.54 tokens per pass from 1.07 drafted rows per token; "double, else
    accepted + 1" gave 1.40 from 0.71, a fixed k of 8 gave 1.64 from 1.68.
    """
    if accepted < drafted:
        return max(1, k - 1)
    if drafted == k:
        return min(k_max, k + 2)
    return k


def verify(rows: np.ndarray, draft: Sequence[int], s: Sampling, rng: np.random.Generator) -> list[int]:
    """The tokens a verify pass emits: the accepted prefix of *draft*, then one token of the model's.

    rows[i] are the logits for the position after draft[:i] (len(draft) + 1 rows); the
    last emitted token is a correction (drawn from its row without the rejected draft
    token) or, when the whole draft was accepted, a bonus drawn from the last row.
    """
    out: list[int] = []
    for row, x in zip(rows, draft):
        if s.temperature <= 0:
            best = int(np.argmax(row))
            out.append(best)
            if best != x:
                return out
            continue
        p = probabilities(row, s)
        if rng.random() < p[x]:
            out.append(int(x))
            continue
        p[x] = 0.0  # p(x) < 1 here, so the rest has mass
        out.append(int(rng.choice(p.size, p=p / p.sum())))
        return out
    out.append(sample(rows[len(draft)], s, rng))
    return out


def speculative_generate(
    backbone: Backbone,
    prompt: list[int],
    max_tokens: int,
    moe_ffn: MoeFfn,
    *,
    sampling: Sampling = Sampling(),
    stop: set[int] | None = None,
    drafter: Drafter | None = None,
    k_max: int = 8,
    adaptive: bool = True,
    stats: SpecStats | None = None,
) -> Iterator[tuple[int, np.ndarray]]:
    """Yield (token, logits it was drawn from) as :func:`experts.generate.generate` does, fewer passes.

    Greedy output (tokens and logits) is identical to ``generate``; sampled output has
    the same distribution (not the same draws). Drafts hold up to k tokens: k_max, or
    with *adaptive* a length set by :func:`next_k` starting at k_max; never more than
    the tokens still allowed minus one, so no pass goes past max_tokens or the
    context. A step whose drafter proposes nothing is a plain one-token pass. *stats*,
    if given, is updated as tokens are yielded.
    """
    check_request(backbone, prompt, max_tokens)
    if k_max < 1:
        raise ValueError(f"k_max must be at least 1, not {k_max}")
    drafter = drafter if drafter is not None else PromptLookupDrafter()
    stats = stats if stats is not None else SpecStats()
    stop = stop or set()
    if max_tokens <= 0:
        return
    rng = np.random.default_rng(sampling.seed)
    context = np.empty(len(prompt) + max_tokens, dtype=np.int64)  # prompt, then every yielded token
    context[: len(prompt)] = prompt
    n, end = len(prompt), len(prompt) + max_tokens  # tokens in context now, and when to stop
    cache = KVCache()
    rows = backbone.forward(prompt, cache, moe_ffn)[-1:]  # the prefill: a step with an empty draft
    stats.prefills += 1
    draft: list[int] = []
    k = k_max
    while True:
        new = verify(rows, draft, sampling, rng)
        cache.truncate(n + len(new) - 1)  # every emitted token's entry but the last, which the next pass feeds
        if n > len(prompt):  # a decode step, not the prefill
            stats.drafted.append(len(draft))
            stats.accepted.append(len(new) - 1)
            if adaptive and draft:
                k = next_k(k, len(draft), len(new) - 1, k_max)
        for i, tok in enumerate(new):
            yield tok, rows[i]
            stats.tokens += 1
            context[n] = tok
            n += 1
            if n == end or tok in stop:
                return
        want = min(k, end - n - 1)  # the pass yields up to len(draft) + 1 tokens
        draft = _draft(drafter, context[:n], want, backbone.cfg.n_vocab) if want > 0 else []
        rows = backbone.forward([int(context[n - 1]), *draft], cache, moe_ffn)


def _draft(drafter: Drafter, context: np.ndarray, k: int, n_vocab: int) -> list[int]:
    context.flags.writeable = False  # a view of the live buffer: look, don't touch
    draft = [int(t) for t in drafter.propose(context, k)][:k]
    if any(not 0 <= t < n_vocab for t in draft):
        raise ValueError(f"the drafter proposed a token outside the vocabulary 0..{n_vocab - 1}: {draft}")
    return draft


def acceptance_stats(
    model_path: str | Path,
    prompts: Sequence[str],
    n_tokens: int,
    *,
    drafter: Drafter | None = None,
    k_max: int = 8,
    adaptive: bool = True,
) -> SpecStats:
    """Greedy speculative runs of *n_tokens* after each prompt on a local model, added up.

    ``mean_accepted`` and ``tokens_per_pass`` of the result say how many round trips
    speculation saves on that model and kind of text (the tokens are those of plain
    greedy decoding, so only the pass count depends on the drafter).
    """
    model = GGUFModel(model_path)
    backbone, store = Backbone(model), ExpertStore(model)
    tok = Tokenizer.from_spec(model.tokenizer_spec)
    stats = SpecStats()
    for text in prompts:
        run = speculative_generate(
            backbone,
            tok.encode(text),
            n_tokens,
            lambda i, x, e, w: ungrouped_moe(store, i, x, e, w),
            stop={tok.eos_id},
            drafter=drafter,
            k_max=k_max,
            adaptive=adaptive,
            stats=stats,
        )
        for _ in run:
            pass
    return stats
