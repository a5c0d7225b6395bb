"""MoE math: routing, batch-invariant expert FFNs, weighted partial sums and their combine order.

Exactness across the swarm rests on two rules, both part of the protocol:

1. **Batch invariance.** BLAS gives a token different bits depending on how many
   other rows share its matmul (measured: OpenBLAS sgemm differs for M=1 and M=3).
   A worker batches tokens from many backbones, so every expert matmul here runs
   on fixed tiles of ``TILE`` rows (zero-padded): a row's result then depends only
   on the row itself, never on its neighbours.
2. **Fixed summation order.** Floating-point addition is not associative. A worker
   sums its experts' weighted outputs in the token's top-k *slot order* (highest
   router probability first, as llama.cpp does); the backbone adds the workers'
   partial sums in ascending *group order* (the order of expert ranges in the
   partition). The local path uses the same grouping, so with an F32 wire the
   remote result equals the local one bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .arch import Activation, Gating

Progress = Callable[[int, int], None]
"""Called with (steps done, steps in all) as long work goes on; it may raise to stop that work at once."""

if TYPE_CHECKING:  # experts.kernels imports this module
    from .gguf_model import ExpertRange, GGUFModel
    from .kernels.identity import KernelIdentity

TILE = 8


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    m = x.max(axis=axis, keepdims=True)
    e = np.exp(x - m)
    return e / e.sum(axis=axis, keepdims=True)


def silu(x: np.ndarray) -> np.ndarray:
    """x * sigmoid(x) as ggml computes it; exp overflow to inf gives the right limit (-0.0)."""
    with np.errstate(over="ignore"):
        return x / (np.float32(1.0) + np.exp(-x))


# llama.cpp clamps the renormalisation's denominator to the smallest normal f16 (build_moe_ffn).
NORM_CLAMP = np.float32(6.103515625e-5)


@dataclass(frozen=True)
class Router:
    """How llama.cpp's ``build_moe_ffn`` turns router logits into (expert ids, weights)."""

    gating: Gating = Gating.SOFTMAX
    norm: bool = False  # renormalise the k weights to sum to 1
    scale: float = 0.0  # multiply the weights by this unless 0 or 1
    n_groups: int = 0  # > 1: keep only the n_group_used groups with the largest top-2 sums
    n_group_used: int = 0
    select_logits: bool = False  # top-k on the raw logits, not the probabilities (llama4)


def sigmoid(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return np.float32(1.0) / (np.float32(1.0) + np.exp(-x))


def selection(logits: np.ndarray, router: Router, selection_bias: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """What llama.cpp's router ranks: (probabilities, selection scores), before any group limit.

    :func:`route` picks its top-k from these (through :func:`group_limit`) and :func:`route_margin` measures how near
    that pick is to another; one computation serves both, so the margin is always that of the choice the forward made.
    """
    logits = logits.astype(np.float32, copy=False)
    probs = {Gating.SOFTMAX: softmax, Gating.SIGMOID: sigmoid, Gating.SOFTMAX_WEIGHT: lambda z: z}[router.gating](logits)
    return probs, logits if router.select_logits else probs if selection_bias is None else probs + selection_bias


def group_limit(sel: np.ndarray, router: Router) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """(*sel* with the experts of dropped groups at -inf, each group's score (n, groups), the index of its top two
    in the group (n, groups, 2)); without groups *sel* as is and None, None."""
    if router.n_groups <= 1:
        return sel, None, None
    n, e = sel.shape
    groups = sel.reshape(n, router.n_groups, e // router.n_groups)
    top2 = np.argsort(-groups, axis=-1, kind="stable")[..., :2]
    score = np.take_along_axis(groups, top2, axis=-1).sum(axis=-1)
    keep = np.argsort(-score, axis=-1, kind="stable")[:, : router.n_group_used]
    mask = np.full(groups.shape[:2], -np.inf, dtype=np.float32)
    np.put_along_axis(mask, keep, np.float32(0.0), axis=-1)
    return (groups + mask[..., None]).reshape(n, e), score, top2


def route(logits: np.ndarray, k: int, router: Router, selection_bias: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Gating -> (biased, group-limited) top-k (slot 0 = highest) -> optional renorm and scale, as llama.cpp.

    The selection bias and the group mask only choose the experts; the weights are the unbiased
    probabilities of the chosen ones. Returns (expert ids int32 (n, k), weights float32 (n, k)).
    """
    probs, sel = selection(logits, router, selection_bias)
    sel, _, _ = group_limit(sel, router)
    ids = np.argsort(-sel, axis=-1, kind="stable")[:, :k].astype(np.int32)
    w = np.take_along_axis(probs, ids, axis=-1)
    if router.gating is Gating.SOFTMAX_WEIGHT:
        w = softmax(w)
    if router.norm:
        w = w / np.maximum(w.sum(axis=-1, keepdims=True), NORM_CLAMP)
    if router.scale not in (0.0, 1.0):
        w = w * np.float32(router.scale)
    return ids, w.astype(np.float32)


def boundary_gap(scores: np.ndarray, slope: np.ndarray, kept: int) -> np.ndarray:
    """Per row: how far the logits must move to swap the last of the top-*kept* scores with the best one left out.

    (kept-th largest - (kept+1)-th largest) / (the sum of their *slope*s, d score / d logit): the change of the
    router's logits, pushing the two apart in opposite directions, that closes the gap. inf where nothing is left
    out (fewer than kept + 1 finite scores).
    """
    finite = np.isfinite(scores)
    if scores.shape[-1] <= kept:
        return np.full(scores.shape[0], np.inf, dtype=np.float32)
    order = np.argsort(-np.where(finite, scores, -np.inf), axis=-1, kind="stable")[:, kept - 1 : kept + 1]
    s, d = np.take_along_axis(scores, order, axis=-1), np.take_along_axis(slope, order, axis=-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        gap = (s[:, 0] - s[:, 1]) / (d[:, 0] + d[:, 1])
    return np.where(np.isfinite(s[:, 1]), gap, np.inf).astype(np.float32)


def route_margin(logits: np.ndarray, k: int, router: Router, selection_bias: np.ndarray | None = None) -> np.ndarray:
    """Per token (n,): the smallest logit change that makes :func:`route` choose otherwise, over the RMS of the logits.

    The top-k boundary among the experts of the kept groups, and with expert groups the group boundary too (the last
    kept group's score vs the best dropped one's; a group's slope is that of its top two). In logit units because
    that is where another engine's error arrives (its activation quantization perturbs the router's input, so its
    logits, in proportion to their size), whatever the gating: a swap of two negligible softmax experts needs as
    large a logit change as any other, and sigmoid scores crowded near 0.5 need little. Slopes: p (1 - p) for
    softmax and sigmoid (softmax's own term), 1 where the scores are the logits. A small margin means a tiny change
    of the router's input picks other experts: the verification gate excludes such tokens.
    """
    probs, sel = selection(logits, router, selection_bias)
    kept, score, top2 = group_limit(sel, router)
    raw = router.select_logits or router.gating is Gating.SOFTMAX_WEIGHT
    slope = np.ones_like(probs) if raw else probs * (np.float32(1.0) - probs)
    rms = np.sqrt(np.mean(np.square(logits.astype(np.float64)), axis=-1)).astype(np.float32)
    gap = boundary_gap(kept, slope, k)
    if score is not None and top2 is not None:
        group_slope = np.take_along_axis(slope.reshape(top2.shape[0], top2.shape[1], -1), top2, axis=-1).sum(axis=-1)
        gap = np.minimum(gap, boundary_gap(score, group_slope, router.n_group_used))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(rms > 0, gap / rms, np.inf).astype(np.float32)


def weight_inputs(x: np.ndarray, expert_ids: np.ndarray, weights: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Weight before the expert (llama4, ``expert_j(w_j x)``) as a plain dispatch: one row ``w_j x`` per (token, slot),
    that slot's expert, weight 1.0. Workers compute it as any other dispatch (1.0 * y is y, bit for bit), so the
    wire and the workers need nothing new; :func:`slot_sum` adds the rows back in slot order, as llama.cpp does."""
    n, k = expert_ids.shape
    rows = (weights[:, :, None] * x[:, None, :]).reshape(n * k, x.shape[1])
    return rows, expert_ids.reshape(n * k, 1), np.ones((n * k, 1), dtype=np.float32)


def slot_sum(rows: np.ndarray, k: int) -> np.ndarray:
    """The routed sum of :func:`weight_inputs`' rows (n * k, d): each token's k slots added in slot order."""
    terms = rows.reshape(-1, k, rows.shape[1])
    return ordered_sum(terms, np.ones(terms.shape[:2], dtype=bool))[0]


def tiled_matmul(x: np.ndarray, w_t: np.ndarray) -> np.ndarray:
    """x (m, a) @ w_t (a, b), computed on zero-padded tiles of TILE rows (batch invariant)."""
    m = x.shape[0]
    padded = -(-m // TILE) * TILE
    if padded != m:
        x = np.concatenate([x, np.zeros((padded - m, x.shape[1]), dtype=np.float32)])
    out = np.empty((padded, w_t.shape[1]), dtype=np.float32)
    for t in range(0, padded, TILE):
        np.matmul(x[t : t + TILE], w_t, out=out[t : t + TILE])
    return out[:m]


# SwiGLU-OAI (gpt-oss), as ggml's swiglu_oai: gate capped, up clipped, sigmoid sharpened, up shifted by 1.
OAI_ALPHA = np.float32(1.702)
OAI_LIMIT = 7.0
# llama.cpp applies a SwiGLU clamp only above this limit (build_moe_ffn / build_ffn: ``limit > 1e-6f``).
CLAMP_EPS = 1e-6


@dataclass(frozen=True)
class Glu:
    """An FFN's gated activation and its clamp: what a worker must know of a layer to compute its experts.

    gpt-oss's SwiGLU-OAI always clamps at 7; step35 clamps plain SwiGLU by a per-layer limit from the file
    (``swiglu_clamp_exp`` for routed experts, ``swiglu_clamp_shexp`` for shared and dense FFNs), which reaches a
    worker in its slice's hyper-parameters. ``limit`` 0 (or <= 1e-6, as llama.cpp tests it): no clamp.
    """

    act: Activation = Activation.SILU
    limit: float = 0.0

    @property
    def clamps(self) -> bool:
        return self.limit > CLAMP_EPS

    def __call__(self, g: np.ndarray, u: np.ndarray) -> np.ndarray:
        """The activation of (gate x, up x), element by element in float32."""
        if self.act is Activation.SWIGLU_OAI:
            return swiglu_oai(g, u, self.limit)
        if not self.clamps:
            return silu(g) * u
        lim = np.float32(self.limit)  # llama.cpp: up clipped to +-L, silu(gate) capped at L, then their product
        return np.minimum(silu(g), lim) * np.clip(u, -lim, lim)


SWIGLU = Glu()  # plain SwiGLU, no clamp: every FFN's activation but gpt-oss's and step35's


def swiglu_oai(g: np.ndarray, u: np.ndarray, limit: float = OAI_LIMIT) -> np.ndarray:
    """min(g, L) * sigmoid(1.702 min(g, L)) * (clip(u, -L, L) + 1), element by element in float32 (L = 7)."""
    lim = np.float32(limit)
    x = np.minimum(g, lim)
    y = np.clip(u, -lim, lim)
    with np.errstate(over="ignore"):
        return x / (np.float32(1.0) + np.exp(OAI_ALPHA * -x)) * (y + np.float32(1.0))


# One expert's biases (gate (ff,), up (ff,), down (d,)): added after each projection, as llama.cpp's add_id.
Biases = tuple[np.ndarray, np.ndarray, np.ndarray]


def expert_ffn(
    x: np.ndarray, gate: np.ndarray, up: np.ndarray, down: np.ndarray, act: Glu = SWIGLU, bias: Biases | None = None
) -> np.ndarray:
    """Gated expert: down(act(gate x, up x)) (+ biases after each projection), batch invariant. x (m, d) -> (m, d)."""
    g = tiled_matmul(x, gate.T)
    u = tiled_matmul(x, up.T)
    if bias is not None:
        g, u = g + bias[0], u + bias[1]
    y = tiled_matmul(act(g, u), down.T)
    return y if bias is None else y + bias[2]


class ExpertSource:
    """The experts a node computes: their weights, and their weighted partial sums.

    Callers ask for ``partial_sum``; the base class computes it from float32 ``weights`` with
    :func:`partial_sum` (the reference numerics), and a source backed by a faster kernel
    (``experts.packed_experts.PackedExperts``) overrides it. ``identity`` names whose bits the sums
    are: two sources with equal identities give identical bits for identical inputs.
    """

    model: GGUFModel
    layers: range
    experts: ExpertRange

    @property
    def identity(self) -> KernelIdentity:
        """Whose bits the sums are (a kernel's identity); read-only: a source computes with one kernel."""
        raise NotImplementedError

    def weights(self, layer: int, expert: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        raise NotImplementedError

    def biases(self, layer: int, expert: int) -> Biases | None:
        """The expert's (gate, up, down) biases, or None for an arch without them (this default)."""
        return None

    def glu(self, layer: int) -> Glu:
        """The gated activation of *layer*'s experts (this default: plain SiLU); a source on a model says its own."""
        return SWIGLU

    def partial_sum(self, layer: int, x: np.ndarray, expert_ids: np.ndarray, weights: np.ndarray, held: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """See :func:`partial_sum`."""
        return partial_sum(self, layer, x, expert_ids, weights, held)

    def warm(self, progress: Progress | None = None) -> None:
        """Make the first dispatches as fast as the later ones (load caches, fault pages in); default: nothing.

        *progress* hears after each step (a raise from it stops warming: how Ctrl-C stops a load at once)."""


def partial_sum(
    source: ExpertSource,
    layer: int,
    x: np.ndarray,
    expert_ids: np.ndarray,
    weights: np.ndarray,
    held: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """The weighted sum, in slot order, of the experts *held* for each token.

    x (n, d); expert_ids, weights (n, k); held (n, k) bool marks the slots this worker
    answers for. Returns (sums (n, d), has_any (n,) bool): tokens with no held slot get 0.
    One expert's FFN runs once over all tokens that chose it.
    """
    n, k = expert_ids.shape
    contrib = np.zeros((n, k, x.shape[1]), dtype=np.float32)
    for e in np.unique(expert_ids[held]):
        rows, slots = np.nonzero(held & (expert_ids == e))
        y = expert_ffn(x[rows], *source.weights(layer, int(e)), source.glu(layer), source.biases(layer, int(e)))
        contrib[rows, slots] = weights[rows, slots][:, None] * y
    return ordered_sum(contrib, held)


def ordered_sum(terms: np.ndarray, present: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sum terms (n, m, d) over m in index order, using only the *present* (n, m) ones.

    The first present term is taken as is (not added to zero), so the result is the
    same whether absent terms exist or not: ((t0 + t1) + t2) + ...
    """
    n, m, d = terms.shape
    acc = np.zeros((n, d), dtype=np.float32)
    started = np.zeros(n, dtype=bool)
    for j in range(m):
        col = present[:, j]
        add = col & started
        first = col & ~started
        acc[add] += terms[add, j]
        acc[first] = terms[first, j]
        started |= col
    return acc, started


@dataclass(frozen=True)
class Partition:
    """Expert ranges that answer together, in combine order: ((start, stop), ...) sorted by start.

    Ranges may overlap (workers announce what they hold); an expert belongs to the
    first range in this order that contains it, so every expert has one owner.
    """

    bounds: tuple[tuple[int, int], ...]

    @classmethod
    def even(cls, n_expert: int, n_groups: int) -> Partition:
        edges = np.linspace(0, n_expert, n_groups + 1).round().astype(int)
        return cls(tuple((int(a), int(b)) for a, b in zip(edges[:-1], edges[1:]) if b > a))

    @classmethod
    def covering(cls, ranges, n_expert: int) -> Partition:
        """The announced *ranges* plus a group for each gap, so every expert 0..n_expert-1 has an owner."""
        bounds = sorted({(int(a), int(b)) for a, b in ranges if a < b <= n_expert})
        covered = np.zeros(n_expert, dtype=bool)
        for a, b in bounds:
            covered[a:b] = True
        gaps, start = [], None
        for e in range(n_expert + 1):
            if e < n_expert and not covered[e]:
                start = e if start is None else start
            elif start is not None:
                gaps.append((start, e))
                start = None
        return cls(tuple(sorted(bounds + gaps)))

    @property
    def owner(self) -> np.ndarray:
        """owner[e] = index of the group that answers for expert e (-1: none)."""
        n = max(b for _, b in self.bounds)
        own = np.full(n, -1, dtype=np.int32)
        for g in reversed(range(len(self.bounds))):
            a, b = self.bounds[g]
            own[a:b] = g
        return own

    def held_mask(self, group: int, expert_ids: np.ndarray) -> np.ndarray:
        return self.owner[expert_ids] == group


def combine(partials: Sequence[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
    """Add per-group partial sums in group order (the protocol's combine order)."""
    sums = np.stack([p for p, _ in partials], axis=1)
    present = np.stack([h for _, h in partials], axis=1)
    total, _ = ordered_sum(sums, present)
    return total


def grouped_moe(
    source: ExpertSource, partition: Partition, layer: int, x: np.ndarray, expert_ids: np.ndarray, weights: np.ndarray
) -> np.ndarray:
    """The local path: every group's partial sum computed here, combined in protocol order."""
    return combine([source.partial_sum(layer, x, expert_ids, weights, partition.held_mask(g, expert_ids)) for g in range(len(partition.bounds))])


def hot_grouped_moe(
    source: ExpertSource, partition: Partition, hot: np.ndarray, layer: int, x: np.ndarray, expert_ids: np.ndarray, weights: np.ndarray
) -> np.ndarray:
    """The local path when the backbone keeps *hot* (a mask over experts) itself: each group answers
    for its experts that are not hot, and the hot ones form one extra group, added last."""
    is_hot = hot[expert_ids]
    groups = [partition.held_mask(g, expert_ids) & ~is_hot for g in range(len(partition.bounds))] + [is_hot]
    return combine([source.partial_sum(layer, x, expert_ids, weights, held) for held in groups])


def ungrouped_moe(source: ExpertSource, layer: int, x: np.ndarray, expert_ids: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Plain slot-order sum over all k experts (what a single llama.cpp process does)."""
    return source.partial_sum(layer, x, expert_ids, weights, np.ones(expert_ids.shape, dtype=bool))[0]
