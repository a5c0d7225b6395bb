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

import io
import zipfile
import zlib
from collections.abc import Generator, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np
import structlog
from numpy.lib.stride_tricks import sliding_window_view

from .errors import ModelFormatError, UsageError
from .forward import Backbone, KVCache, MoeFfn, local_moe
from .generate import Sampling, check_request, prefill, probabilities, sample
from .gguf_model import GGUFModel
from .moe import ungrouped_moe
from .mtp import MtpDrafter
from .slices import ExpertStore
from .tokenizer import Tokenizer

log = structlog.get_logger(__name__)


class Drafter(Protocol):
    """Proposes tokens likely to follow a context; cheap, and free to propose nothing."""

    def propose(self, context: np.ndarray, k: int) -> Sequence[int]:
        """Up to *k* tokens guessed to follow *context* (prompt + generated so far, int64, read-only)."""
        ...


class DraftRun(Drafter, Protocol):
    """A drafter of one generation that also reads the trunk's hidden states (:class:`experts.mtp.MtpRun`)."""

    def observe(self, hidden: np.ndarray) -> None:
        """The output-normed final states of the positions a pass kept (before the next propose)."""
        ...


@runtime_checkable
class FollowingDrafter(Protocol):
    """Drafts from the model's own states (:class:`experts.mtp.MtpDrafter`): a :class:`DraftRun` per generation."""

    def run(self, start: int) -> DraftRun:
        """State for a generation whose first fed position is *start*."""
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


# An n-gram table (``<model>.ngram.npz``, written by training/build_ngram.py) is a zip of .npy arrays,
# no pickle: format (int, NGRAM_FORMAT), max_order (int), model_digest (str: the model it was built for),
# keys (uint64, strictly increasing: the context keys of every order together), next (uint16/uint32: the
# token predicted after each key's context), count (uint16, saturating: how often that token followed).
NGRAM_FORMAT = 1
_M64 = (1 << 64) - 1


def _mix(key, token):
    """A context key extended by one older token (splitmix64's finaliser over key + token + 1).

    Folded from the newest token, so one pass yields the keys of all suffixes. Works on
    Python ints and uint64 arrays alike (numpy wraps), so builder and drafter share it.
    """
    x = ((key + token + 1) * 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def _top_followers(keys: np.ndarray, follows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per distinct key (ascending): its most frequent follower (ties: the lowest id) and that follower's count."""
    if not keys.size:
        return keys, follows, np.zeros(0, np.int64)
    order = np.lexsort((follows, keys))
    k, f = keys[order], follows[order]
    start = np.flatnonzero(np.r_[True, (k[1:] != k[:-1]) | (f[1:] != f[:-1])])
    k, f, c = k[start], f[start], np.diff(np.r_[start, k.size])
    best = np.lexsort((f, -c, k))
    k, f, c = k[best], f[best], c[best]
    first = np.r_[True, k[1:] != k[:-1]]
    return k[first], f[first], c[first]


@dataclass(frozen=True, eq=False)
class NgramDrafter:
    """Drafts from a table of the token that followed each short context, in text a model wrote or read.

    A small model's greedy text is predictable from its last few tokens: its corpus's
    phrases and loops of its own. propose takes the token of the longest context suffix
    (up to max_order tokens) the table knows and chains it into the next lookup, up to
    k tokens or until no suffix is known. Keys are 64-bit hashes: a collision costs a
    rejected draft at worst.
    """

    keys: np.ndarray
    next: np.ndarray
    count: np.ndarray
    max_order: int
    model_digest: str = ""

    @classmethod
    def build(
        cls, streams: Iterable[tuple[np.ndarray, np.ndarray | None]], *, max_order: int = 8, min_count: int = 1, model_digest: str = ""
    ) -> NgramDrafter:
        """A table from (tokens, follow) streams; follow[i] is the token seen after tokens[: i + 1].

        follow is tokens[1:] (pass None) for plain text, or a model's greedy choice at each
        position, to mimic the model rather than its corpus. A context of 1..max_order tokens
        keeps its most frequent follower (ties: the lowest id) if seen min_count times, unless
        its one-token-shorter suffix, so pruned, predicts the same: back-off finds that anyway.
        """
        if not 1 <= max_order <= 64:
            raise ValueError(f"max_order must be in 1..64, not {max_order}")
        tokens, follows = [], []
        for t, f in streams:
            tokens.append(np.asarray(t, np.uint64))
            follows.append(np.asarray(t[1:] if f is None else f, np.int64))
            if len(follows[-1]) != max(len(t) - 1, 0):
                raise ValueError(f"a stream of {len(t)} tokens needs {max(len(t) - 1, 0)} followers, not {len(follows[-1])}")
        keys = [np.zeros(len(t), np.uint64) for t in tokens]  # [i]: key of the context ending at token i - 1 + order
        said = [np.full(len(t), -1) for t in tokens]  # what the pruned table predicts there so far (-1: nothing)
        kept = []
        for n in range(1, max_order + 1):
            keys = [_mix(k[1:], t[: max(len(t) - n, 0)]) for k, t in zip(keys, tokens)]
            said = [s[1:] for s in said]
            uk, top, cnt = _top_followers(np.concatenate(keys), np.concatenate([f[n - 1 :] for f in follows]))
            keep = np.zeros(uk.size, bool)
            for j, k in enumerate(keys):
                pos = np.searchsorted(uk, k)
                new = (cnt[pos] >= min_count) & (top[pos] != said[j])
                keep[pos[new]] = True
                said[j] = np.where(new, top[pos], said[j])
            kept.append((uk[keep], top[keep], cnt[keep]))
        k, nxt, cnt = (np.concatenate(column) for column in zip(*kept))
        order = np.argsort(k, kind="stable")
        if np.any(k[order][1:] == k[order][:-1]):
            raise ValueError("two contexts of different orders share a key; change _mix")
        dtype = np.uint16 if nxt.max(initial=0) < 1 << 16 else np.uint32
        return cls(k[order], nxt[order].astype(dtype), np.minimum(cnt[order], 0xFFFF).astype(np.uint16), max_order, model_digest)

    def save(self, path: str | Path) -> None:
        """Write the table as an .npz with fixed zip timestamps, so the same table gives the same bytes."""
        arrays = dict(format=np.int64(NGRAM_FORMAT), max_order=np.int64(self.max_order), model_digest=np.str_(self.model_digest))
        with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
            for name, a in {**arrays, "keys": self.keys, "next": self.next, "count": self.count}.items():
                buf = io.BytesIO()
                np.lib.format.write_array(buf, np.asanyarray(a), allow_pickle=False)
                z.writestr(zipfile.ZipInfo(name + ".npy", date_time=(1980, 1, 1, 0, 0, 0)), buf.getvalue(), zipfile.ZIP_DEFLATED)

    @classmethod
    def load(cls, path: str | Path) -> NgramDrafter:
        """Read a table written by save; anything else raises ModelFormatError naming the file."""
        try:
            with np.load(path, allow_pickle=False) as z:
                fmt, max_order, digest = int(z["format"]), int(z["max_order"]), str(z["model_digest"])
                keys, nxt, cnt = z["keys"], z["next"], z["count"]
        # (zipfile takes flag bits set by corruption for features it lacks: Runtime/NotImplementedError)
        except (OSError, ValueError, KeyError, TypeError, EOFError, RuntimeError, NotImplementedError, zipfile.BadZipFile, zlib.error) as e:
            raise ModelFormatError(f"{path} is not a readable n-gram table ({type(e).__name__}: {e}); rebuild it with training/build_ngram.py") from e
        if fmt != NGRAM_FORMAT:
            raise ModelFormatError(f"{path}: n-gram table format {fmt}, this version reads {NGRAM_FORMAT}; rebuild it")
        columns = keys.dtype == np.uint64 and nxt.dtype in (np.uint16, np.uint32) and cnt.dtype == np.uint16
        if not (1 <= max_order <= 64 and columns and keys.ndim == 1 and keys.shape == nxt.shape == cnt.shape):
            raise ModelFormatError(f"{path}: malformed n-gram table (max_order {max_order}; keys, next, count: {keys.dtype}{keys.shape}, {nxt.dtype}{nxt.shape}, {cnt.dtype}{cnt.shape})")
        if np.any(keys[1:] <= keys[:-1]):
            raise ModelFormatError(f"{path}: n-gram table keys are not strictly increasing")
        return cls(keys, nxt, cnt, max_order, digest)

    def propose(self, context: np.ndarray, k: int) -> list[int]:
        recent = [int(t) for t in context[-self.max_order :]]
        out: list[int] = []
        while len(out) < k and self.keys.size:
            key, keys = 0, []
            for t in reversed(recent):
                key = _mix(key, t)
                keys.append(key)
            probe = np.array(keys, dtype=np.uint64)
            pos = np.minimum(np.searchsorted(self.keys, probe), self.keys.size - 1)
            hits = np.flatnonzero(self.keys[pos] == probe)
            if not hits.size:
                break
            out.append(int(self.next[pos[hits[-1]]]))
            recent = [*recent, out[-1]][-self.max_order :]
        return out


@dataclass(frozen=True)
class CombinedDrafter:
    """Two drafters, one proposal: the first's if it is at least as long as the second's, else the second's.

    Prompt lookup then the embedded model's table (k_max 8, adaptive, 40 held-out
    prompts): 2.69 tokens per pass; 2.64 taking the first's whenever it has one; the
    table alone, which knows the model's loops too, 3.13 (what default_drafter picks).
    """

    first: Drafter
    second: Drafter

    def propose(self, context: np.ndarray, k: int) -> list[int]:
        a = list(self.first.propose(context, k))[:k]
        b = list(self.second.propose(context, k))[:k] if len(a) < k else []
        return a if len(a) >= len(b) else b


def ngram_path(model_path: str | Path) -> Path:
    """Where a model's n-gram table lives: beside it, ``<name>.ngram.npz``."""
    return Path(model_path).with_suffix(".ngram.npz")


def default_drafter(model: GGUFModel) -> Drafter:
    """The best drafter at hand for *model*: its n-gram table if one built for this very model lies beside it, else prompt lookup."""
    path = ngram_path(model.path)
    if not path.exists():
        return PromptLookupDrafter()
    table = NgramDrafter.load(path)
    if table.model_digest != model.digest:
        log.warning("speculative.ngram_mismatch", table=str(path), table_model=table.model_digest[:16], model=model.digest[:16])
        return PromptLookupDrafter()
    return table


DRAFTERS = ("ngram", "mtp")  # --drafter choices; ngram is the default (see pick_drafter)


def pick_drafter(backbone: Backbone, name: str = "ngram") -> Drafter | FollowingDrafter:
    """The drafter *name* for *backbone*'s model: ``ngram`` (:func:`default_drafter`) or ``mtp`` (its MTP block).

    ngram stays the default even for models with MTP blocks: the only MTP heads measured here are random
    ones (BENCHMARKS.md), which say nothing about a trained head's acceptance.
    """
    if name == "mtp":
        return MtpDrafter(backbone)
    if name == "ngram":
        return default_drafter(backbone.model)
    raise UsageError(f"unknown drafter {name!r}; choose one of {', '.join(DRAFTERS)}")


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
    drafter: Drafter | FollowingDrafter | None = None,
    k_max: int = 8,
    adaptive: bool = True,
    stats: SpecStats | None = None,
    cache: KVCache | None = None,
) -> Generator[tuple[int, np.ndarray], None, None]:
    """Yield (token, logits it was drawn from) as :func:`experts.generate.generate` does, fewer passes.

    Greedy output (tokens and logits) is identical to ``generate``; sampled output has
    the same distribution (not the same draws). Drafts hold up to k tokens: k_max, or
    with *adaptive* a length set by :func:`next_k` starting at k_max; never more than
    the tokens still allowed minus one, so no pass goes past max_tokens or the
    context. A step whose drafter proposes nothing is a plain one-token pass. A
    :class:`FollowingDrafter` (MTP) gets a run for this generation that sees the final
    states of every kept position before it proposes. *stats*,
    if given, is updated as tokens are yielded. *cache* is as for ``generate``: a prompt
    prefix not recomputed; it ends up holding the positions fed and kept (rejected drafts dropped).
    """
    check_request(backbone, prompt, max_tokens, cache)
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
    run: DraftRun | None = None
    proposer: Drafter
    if isinstance(drafter, FollowingDrafter):
        run = proposer = drafter.run(cache.n_past if cache is not None else 0)
    else:
        proposer = drafter
    hidden: list[np.ndarray] | None = [] if run is not None else None  # each pass's final states, for the run
    cache, rows = prefill(backbone, prompt, moe_ffn, cache, hidden)
    rows = rows[-1:]  # the prefill: a step with an empty draft
    stats.prefills += 1
    draft: list[int] = []
    k = k_max
    while True:
        new = verify(rows, draft, sampling, rng)
        cache.truncate(n + len(new) - 1)  # every emitted token's entry but the last, which the next pass feeds
        if run is not None and hidden:
            fed = hidden.pop()
            run.observe(fed if n == len(prompt) else fed[: len(new)])  # the prefill's rows are all kept
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
        draft = _draft(proposer, context[:n], want, backbone.cfg.n_vocab) if want > 0 else []
        rows = backbone.forward([int(context[n - 1]), *draft], cache, moe_ffn, hidden=hidden)


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
            local_moe(lambda i, x, e, w: ungrouped_moe(store, i, x, e, w)),
            stop={tok.eos_id},
            drafter=drafter,
            k_max=k_max,
            adaptive=adaptive,
            stats=stats,
        )
        for _ in run:
            pass
    return stats
