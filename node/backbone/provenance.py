"""Exact output despite a cheater: remember which hosts' unchecked sums each position used, and re-decode.

Theory of operation. Spot checks sample dispatches, so a cheating worker is caught only
after some of its wrong sums were already used. Those sums went into the keys/values of
the positions they were computed for, and every later position attends to them; the
token *at* the first such position is still right (it was drawn from the position before).
So when a worker is caught, the sequence is cut back to the first position whose forward
used any of its unchecked sums: the KV cache is truncated there, the tokens after it are
retracted, and decoding resumes from that position without the worker (it is banned).
With greedy decoding the result equals the honest run token for token.

:class:`Provenance` is the bookkeeping (one per sequence, sans-IO, no clock): the decode
loop says where each forward pass starts, the dispatcher reports each unchecked remote
answer with its first row, and the loop asks after every token whether someone was
caught since. :func:`exact_generate` is the loop: any decode function of the
``generate`` shape (plain or speculative) restarted from a truncated cache.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import structlog

from experts.forward import Backbone, KVCache, MoeFfn

log = structlog.get_logger("node.backbone.provenance")


class Provenance:
    """For one sequence: the first position that used each host's unchecked sums.

    *culprits* is the dispatcher's append-only list of hosts caught cheating (in the order
    caught); only catches after this object was made count, so a catch from an earlier
    sequence of the same session does not roll this one back. *settle* (``RemoteMoE.settle_blocking``)
    returns once every receipt so far has its batch signature's verdict: a worker that leaves
    one unsigned is a culprit too, and the sequence's last check waits for those verdicts.
    """

    def __init__(self, culprits: Sequence[str], settle: Callable[[], None] | None = None) -> None:
        self._culprits = culprits
        self._settle = settle
        self._seen = len(culprits)
        self._first: dict[str, int] = {}
        self._start = 0

    def inherit(self, taint: Mapping[str, int]) -> None:
        """The sequence starts from positions it did not compute (a prefix cache's entry), with their *taint*.

        Make this object before looking the entry up: a host caught in between is then either cut off by the lookup
        or rolled back here."""
        for peer, pos in taint.items():
            if pos < self._first.get(peer, pos + 1):
                self._first[peer] = pos

    def begin(self, start: int) -> None:
        """The next forward pass feeds positions *start*, *start* + 1, ... (row i is position start + i)."""
        self._start = start

    def used(self, peer: str, rows: np.ndarray) -> None:
        """The rows of the current pass where *rows* (a mask, one per row) is set used *peer*'s unchecked sums."""
        if not rows.any():
            return
        pos = self._start + int(np.argmax(rows))
        if pos < self._first.get(peer, pos + 1):
            self._first[peer] = pos

    def clean(self) -> int | None:
        """The first position that used anyone's unchecked sums (None: none did): a catch can cut back no further."""
        return min(self._first.values(), default=None)

    def taint(self, below: int) -> dict[str, int]:
        """Each host's first unchecked position among the first *below* (what a prefix cache keeps with them)."""
        return {p: pos for p, pos in self._first.items() if pos < below}

    def final(self, n_prompt: int, n_out: int) -> int:
        """How many of *n_out* generated tokens no catch can retract: those drawn before the first unchecked position."""
        first = self.clean()
        return n_out if first is None else min(max(first + 1 - n_prompt, 0), n_out)

    def settle(self) -> None:
        """Wait for the verdicts that could still name a culprit whose sums this sequence used unchecked."""
        if self._settle is not None and self._first:
            self._settle()

    def rollback_to(self) -> int | None:
        """The position to cut back to because of hosts caught since the last call, or None.

        The caught hosts' entries are consumed (re-decoding uses none of their sums); so
        are other hosts' entries at or after the cut, whose positions are decoded again.
        """
        caught = self._culprits[self._seen :]
        self._seen = len(self._culprits)
        hits = [self._first.pop(p) for p in set(caught) if p in self._first]
        if not hits:
            return None
        cut = min(hits)
        self._first = {p: pos for p, pos in self._first.items() if pos < cut}
        return cut


@dataclass(frozen=True)
class Rollback:
    """Emitted by :func:`exact_generate`: the generated tokens after the first *keep* are retracted."""

    keep: int
    position: int  # the first tainted position (prompt included), where decoding resumes


@dataclass
class RollbackStats:
    """What verification cost a sequence: rollbacks, and the tokens retracted and decoded again."""

    rollbacks: int = 0
    redecoded: int = 0

    def summary(self) -> dict:
        return {"rollbacks": self.rollbacks, "tokens_redecoded": self.redecoded}


class _Traced:
    """A backbone whose passes tell *provenance* the position they start at (everything else delegated)."""

    def __init__(self, backbone: Backbone, provenance: Provenance) -> None:
        self._backbone = backbone
        self._provenance = provenance

    def forward(self, tokens: np.ndarray | list[int], cache: KVCache, moe_ffn: MoeFfn, *, hidden: list[np.ndarray] | None = None) -> np.ndarray:
        self._provenance.begin(cache.n_past)
        return self._backbone.forward(tokens, cache, moe_ffn, hidden=hidden)

    def __getattr__(self, name: str):
        return getattr(self._backbone, name)


Decode = Callable[..., Generator[tuple[int, np.ndarray], None, None]]  # generate / speculative_generate (with their options bound)


def exact_generate(
    backbone: Backbone,
    prompt: list[int],
    max_tokens: int,
    moe_ffn: MoeFfn,
    provenance: Provenance,
    *,
    decode: Decode,
    stop: set[int] | None = None,
    stats: RollbackStats | None = None,
    cache: KVCache | None = None,
    until: Callable[[list[int]], bool] | None = None,
) -> Generator[tuple[int, np.ndarray] | Rollback, None, None]:
    """*decode* (``generate``'s signature) with rollback: yields (token, logits) and, after a catch, a :class:`Rollback`.

    *moe_ffn* must report unchecked remote answers to *provenance* (``RemoteMoE.hook`` with
    ``provenance=``). After every token, and once more when *decode* ends, a catch cuts
    the cache back and *decode* restarts on the kept context; the tokens a consumer keeps
    (all yielded, minus each Rollback's retraction) are those of a run without the cheater.
    Sampling restarts its random stream at a rollback (greedy output is exact).
    *cache*: the keys/values to start from (a prefix cache's; its taint given to *provenance*).
    *until*: ends decoding early as *stop* does (a stop string in the text so far), the last
    check included, so a stop that a rollback retracts does not end the sequence.
    """
    stats = stats if stats is not None else RollbackStats()
    traced = _Traced(backbone, provenance)
    cache = cache if cache is not None else KVCache()
    out: list[int] = []
    while True:
        context = [*prompt, *out]
        run = decode(traced, context, max_tokens - len(out), moe_ffn, stop=stop, cache=cache)
        cut = None
        for tok, logits in run:
            out.append(tok)
            yield tok, logits
            if (cut := provenance.rollback_to()) is not None or (until is not None and until(out)):
                break
        run.close()
        if cut is None:
            provenance.settle()  # the last check: every receipt's signature judged (catches come from there too)
            if (cut := provenance.rollback_to()) is None:
                return
        keep = max(cut + 1 - len(prompt), 0)  # the token at the cut was drawn from the clean position before it
        stats.rollbacks += 1
        stats.redecoded += len(out) - keep
        log.warning("verify.rollback", position=cut, retracted=len(out) - keep, kept=keep)
        del out[keep:]
        cache.truncate(cut)
        yield Rollback(keep, cut)
