"""A model cut into stages: a stage runs layers A..B on hidden states, a client keeps the embeddings and head (issue 26).

Why: a backbone that runs every dense layer crosses the WAN once per MoE layer (to the experts and back). Cut the
trunk into a few contiguous layer ranges, each run by a stage next to the workers of its experts, and a token
crosses the WAN once per stage instead. What travels between them is the residual stream ``x`` (n, n_embd) after the
stage's last layer, un-normed: the next stage (or the client's output norm and head) continues from it exactly as
:meth:`Backbone.forward`'s loop would, so a chain of stages is the full forward bit for bit (every matmul is batch
invariant, so cutting the loop changes no bit).

* :class:`StageRunner` (the stage side): a :class:`Backbone` over its layers only (``layers=A..B, head=False``, from
  dense slices: it never opens the full file) and one KV cache per session. ``pass_hidden(session, x, start, hook)``
  runs the layers on rows at positions ``start ..``. A pass *starting before* the cache's end cuts the cache there
  first: that is the KV rollback speculative decoding needs (rejected drafts are simply re-run over), with no extra
  message. A pass starting *after* the end is a :class:`StageGap` (the stage lost the session: restarted, evicted, or
  a replacement), which the client answers by replaying.
* :class:`StagedBackbone` (the client side): a :class:`Backbone` with the head and no layers, whose ``forward`` embeds,
  sends the rows along a :class:`StageChain` and applies the head, so every decoding loop (plain, speculative,
  provenance-checked) runs on it unchanged. Its :class:`ChainCache` holds no keys or values, only the positions and,
  per stage, every input row sent into it: on a gap, or when a stage is replaced after it died, the client replays
  those rows in one pass, which rebuilds the stage's KV exactly (batch invariance again).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from .errors import LocalProtocolError, MoeSwarmError, RemoteProtocolError, UsageError
from .forward import Backbone, KVCache, MoeFfn, rms_norm
from .gguf_model import GGUFModel
from .kernels import Kernel


class StageError(MoeSwarmError):
    """A stage could not run a pass; the subclass says whose fault."""


class StageGap(StageError, RemoteProtocolError):
    """The pass starts after the positions the stage holds for the session (it lost them): replay from ``held``."""

    def __init__(self, session: str, start: int, held: int) -> None:
        super().__init__(f"session {session!r}: pass starts at position {start}, the stage holds {held}; replay its inputs")
        self.start, self.held = start, held


class BadPass(StageError, UsageError):
    """Hidden states a stage cannot run: wrong width or type, non-finite, beyond the context."""


class StageLost(StageError):
    """The stage did not answer (dead, unreachable, timed out, refused): the chain replaces it and replays."""


def _empty_cache(first: int) -> KVCache:
    """A cache whose layer slots before *first* stay empty, so a stage's layers keep their model index (as MTP's)."""
    empty = np.zeros((0, 0), dtype=np.float32)
    return KVCache([empty] * first, [empty] * first)


@dataclass
class StageRunner:
    """Layers *layers* of *model* (dense slices or the full file) over hidden states, a KV cache per session."""

    model: GGUFModel
    layers: range
    kernel: Kernel | None = None
    max_sessions: int = 64
    sessions: dict[str, KVCache] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = self.model.cfg.n_layer
        if not self.layers or self.layers.step != 1 or not 0 <= self.layers.start < self.layers.stop <= n:
            raise UsageError(f"a stage runs a non-empty contiguous range of layers 0-{n - 1}, got {self.layers}")
        self.backbone = Backbone(self.model, self.kernel, layers=self.layers, head=False)

    def held(self, session: str) -> int:
        """Positions of *session* this stage holds keys and values for."""
        cache = self.sessions.get(session)
        return cache.k[self.layers.start].shape[0] if cache is not None and len(cache.k) > self.layers.start else 0

    def check(self, x: np.ndarray, start: int) -> None:
        cfg = self.model.cfg
        if x.dtype != np.float32 or x.ndim != 2 or x.shape[1] != cfg.n_embd or x.shape[0] == 0:
            raise BadPass(f"a pass carries float32 rows of width {cfg.n_embd}, got {x.dtype} {x.shape}")
        if start < 0 or start + x.shape[0] > cfg.context_length:
            raise BadPass(f"positions {start}..{start + x.shape[0] - 1} are outside the context of {cfg.context_length}")
        if not np.isfinite(x).all():
            raise BadPass("a pass carries non-finite hidden states")

    def pass_hidden(self, session: str, x: np.ndarray, start: int, moe_ffn: MoeFfn) -> np.ndarray:
        """The residual stream after this stage's last layer for rows *x* at positions ``start ..``.

        Cuts the session's cache back to *start* first (rolled-back drafts); a *start* past what is held is a
        :class:`StageGap`. A new session beyond ``max_sessions`` evicts the oldest (its client replays if it returns).
        """
        self.check(x, start)
        held = self.held(session)
        if start > held:
            raise StageGap(session, start, held)
        cache = self.sessions.pop(session, None) or _empty_cache(self.layers.start)
        if start < held:
            cache.truncate(start)
        self.sessions[session] = cache  # most recently used last
        while len(self.sessions) > self.max_sessions:
            self.sessions.pop(next(iter(self.sessions)))
        pos = np.arange(start, start + x.shape[0])
        for i in self.layers:
            x = self.backbone.block(i, x, pos, cache, moe_ffn)
        return x

    def close(self, session: str) -> None:
        self.sessions.pop(session, None)


class StageLink(Protocol):
    """One hop of a chain as the client sees it: layers, and a pass that raises StageGap or StageLost."""

    @property
    def layers(self) -> range: ...

    def run(self, session: str, x: np.ndarray, start: int) -> np.ndarray: ...


@dataclass
class LocalStage:
    """A :class:`StageRunner` in this process as a link (tests, and a client holding some layers itself)."""

    runner: StageRunner
    moe_ffn: MoeFfn

    @property
    def layers(self) -> range:
        return self.runner.layers

    def run(self, session: str, x: np.ndarray, start: int) -> np.ndarray:
        return self.runner.pass_hidden(session, x, start, self.moe_ffn)


def check_cover(links: Sequence[StageLink], n_layer: int) -> None:
    """A LocalProtocolError unless the links cover layers 0..n_layer-1 in order, each once."""
    at = 0
    for link in links:
        if link.layers.start != at:
            raise LocalProtocolError(f"stage chain has layers {[f'{x.layers.start}-{x.layers.stop - 1}' for x in links]}: a stage must start at layer {at}")
        at = link.layers.stop
    if at != n_layer:
        raise LocalProtocolError(f"stage chain ends at layer {at - 1}; the model has {n_layer} layers")


@dataclass
class StageChain:
    """The links a client sends its rows along, and how to get a new link for a hop whose stage was lost.

    *replace(hop, lost)* returns a link over the same layers (another stage, or the same one restarted), or raises
    StageLost when there is none; the chain then replays the hop's inputs into it.
    """

    links: list[StageLink]
    replace: Callable[[int, StageLink], StageLink]
    max_replacements: int = 3
    replays: int = 0  # passes replayed into a stage (gaps and replacements), for logs and tests

    def run_hop(self, hop: int, session: str, x: np.ndarray, start: int, before: np.ndarray) -> np.ndarray:
        """Hop *hop* on rows *x* at ``start ..``; *before* holds every row sent into it before (positions 0..start-1).

        A gap is answered by sending the missing rows with these (one pass); a lost stage by a replacement that gets
        every row from position 0. Either way only the rows of *x* are returned, the same bits as without the fault.
        """
        rows, at = x, start
        for _ in range(self.max_replacements + 1):
            link = self.links[hop]
            try:
                try:
                    out = link.run(session, rows, at)
                except StageGap as gap:
                    self.replays += 1
                    rows, at = np.concatenate([before[gap.held : start], x]), gap.held
                    out = link.run(session, rows, at)
                return out[start - at :]
            except StageLost:
                self.links[hop] = self.replace(hop, link)
                self.replays += 1
                rows, at = np.concatenate([before[:start], x]), 0
        raise StageLost(f"the stage for layers {self.links[hop].layers.start}-{self.links[hop].layers.stop - 1} was lost {self.max_replacements + 1} times in one pass")


class ChainCache(KVCache):
    """A client's "cache" over a chain: no keys or values (the stages hold them), the positions fed, and per hop
    every input row sent, for replays. Truncating it is all a rollback needs: the next pass starts at the cut, and
    each stage cuts its own cache there (:meth:`StageRunner.pass_hidden`)."""

    def __init__(self, session: str, hops: int) -> None:
        super().__init__()
        self.session = session
        self.inputs: list[np.ndarray] = [np.zeros((0, 0), dtype=np.float32)] * hops
        self.fed = 0

    @property
    def n_past(self) -> int:
        return self.fed

    def truncate(self, n: int) -> None:
        self.fed = min(self.fed, n)
        self.inputs = [rows[:n] for rows in self.inputs]

    def prefix(self, n: int, copy: bool = False) -> ChainCache:
        """The first *n* positions as a new session's cache: its stages have nothing yet, so its first pass
        replays these inputs (a prefix cache hit costs the stages a replay, the client no recompute)."""
        out = ChainCache(f"{self.session}/{n}", len(self.inputs))
        out.inputs = [np.array(rows[:n]) if copy else rows[:n] for rows in self.inputs]
        out.fed = min(n, self.fed)
        return out

    @property
    def nbytes(self) -> int:
        return sum(rows.nbytes for rows in self.inputs)


class StagedBackbone(Backbone):
    """The client of a chain: the head's embeddings and output head here, every layer in the stages."""

    def __init__(self, head: GGUFModel, chain: StageChain, kernel: Kernel | None = None) -> None:
        super().__init__(head, kernel, layers=range(0))
        check_cover(chain.links, self.cfg.n_layer)
        self.chain = chain

    def new_cache(self, session: str) -> ChainCache:
        return ChainCache(session, len(self.chain.links))

    def forward(
        self, tokens: np.ndarray | list[int], cache: KVCache, moe_ffn: MoeFfn, *, hidden: list[np.ndarray] | None = None, margins: list[np.ndarray] | None = None
    ) -> np.ndarray:
        """As :meth:`Backbone.forward`, the layers run by the chain (*moe_ffn* is unused: each stage has its own
        experts and workers; *margins* are not collected, the stages route)."""
        if not isinstance(cache, ChainCache):
            raise LocalProtocolError("a staged backbone runs on its ChainCache (new_cache), not a KVCache")
        tokens = np.asarray(tokens, dtype=np.int64)
        if tokens.size == 0:
            raise ValueError("forward needs at least one token")
        if tokens.min() < 0 or tokens.max() >= self.cfg.n_vocab:
            raise ValueError(f"token id out of range 0..{self.cfg.n_vocab - 1}")
        start = cache.fed
        x = self.tok_embd.rows(tokens)
        for hop in range(len(self.chain.links)):
            before = cache.inputs[hop][:start]
            y = self.chain.run_hop(hop, cache.session, x, start, before)
            cache.inputs[hop] = np.concatenate([before, x]) if start else x
            x = y
        cache.fed = start + tokens.size
        h = rms_norm(x, self.output_norm, self.cfg.rms_eps)
        if hidden is not None:
            hidden.append(h)
        return self.output(h)
