"""DeepSeek Sparse Attention's lightning indexer in numpy (deepseek32), as src/models/deepseek32.cpp computes it.

Each trunk layer projects one indexer key per position (``indexer.attn_k`` of the normed hidden state, a LayerNorm
with bias, eps 1e-6) and ``heads`` queries per position (``indexer.attn_q_b`` of the normed q-LoRA latent); both are
rotated (NEOX RoPE over the first n_rot dims: the head is laid out [rope | nope]) and multiplied by an orthonormal
Hadamard matrix. A past position's score for a query is ``sum_h relu(q_h . k) * w_h`` with the per-head weights
``w = indexer.proj(x) / sqrt(width * heads)``; the MLA attention then reads only the ``top_k`` best-scoring causal
positions (all of them while there are no more than top_k).

The keys are what the cache keeps for the indexer (the MLA layer's ``KVCache.v``, otherwise empty there), so
rolling the cache back rolls them back. Why a Hadamard: it spreads outliers before llama.cpp may quantize the cache;
in float32 it changes no score by more than rounding (q.k is invariant under an orthonormal map), so an ablation of it
cannot fail the reference gate and none is claimed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .dense_weights import DenseLinear, Linear

LAYER_NORM_EPS = 1e-6  # llama.cpp's deepseek32 hparams.f_norm_eps, not read from the file
Rotate = Callable[[np.ndarray], np.ndarray]  # RoPE of (n, heads, width) rows at the pass's positions


def hadamard(n: int) -> np.ndarray:
    """The orthonormal Sylvester-Walsh-Hadamard matrix of order *n* (a power of two) in float32, as llama.cpp's
    ``ggml_gen_hadamard`` fills it: entries +-1/sqrtf(n), symmetric, its own inverse."""
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return (h * (1.0 / np.float64(np.sqrt(np.float32(n))))).astype(np.float32)


def layer_norm(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float = LAYER_NORM_EPS) -> np.ndarray:
    """ggml_norm (mean and variance in double), times the weight plus the bias."""
    x64 = x.astype(np.float64)
    centred = x64 - x64.mean(axis=-1, keepdims=True)
    scale = 1.0 / np.sqrt((centred**2).mean(axis=-1, keepdims=True) + eps)
    return (centred.astype(np.float32) * scale.astype(np.float32)) * w + b


@dataclass(frozen=True)
class Indexer:
    """One layer's lightning indexer weights and options."""

    wq_b: Linear  # indexer.attn_q_b: q-LoRA latent -> heads x width
    wk: Linear  # indexer.attn_k: normed hidden state -> the position's one key
    k_norm: np.ndarray
    k_norm_b: np.ndarray
    proj: Linear  # indexer.proj: normed hidden state -> one weight per head
    rot: DenseLinear  # the Hadamard matrix of the head width
    heads: int
    top_k: int

    @classmethod
    def load(cls, model, lin, b: str) -> Indexer:
        cfg, d = model.cfg, model.dense
        return cls(
            wq_b=lin.linear(b + "indexer.attn_q_b.weight"),
            wk=lin.linear(b + "indexer.attn_k.weight"),
            k_norm=d(b + "indexer.k_norm.weight"),
            k_norm_b=d(b + "indexer.k_norm.bias"),
            proj=lin.linear(b + "indexer.proj.weight"),
            rot=DenseLinear(hadamard(cfg.indexer_head_dim)),
            heads=cfg.indexer_heads,
            top_k=cfg.indexer_top_k,
        )

    @property
    def width(self) -> int:
        return self.rot.w.shape[0]

    def _rotated(self, x: np.ndarray, rotate: Rotate) -> np.ndarray:
        """RoPE then the Hadamard product of (n, heads, width) rows."""
        n, heads, _ = x.shape
        return self.rot(np.ascontiguousarray(rotate(x)).reshape(n * heads, self.width)).reshape(n, heads, self.width)

    def keys(self, h: np.ndarray, rotate: Rotate) -> np.ndarray:
        """The indexer keys (n, width) of the positions whose attention-normed hidden states are *h*."""
        k = layer_norm(self.wk(h), self.k_norm, self.k_norm_b)
        return self._rotated(k[:, None, :], rotate)[:, 0]

    def queries(self, qr: np.ndarray, h: np.ndarray, rotate: Rotate) -> tuple[np.ndarray, np.ndarray]:
        """Per position: the (heads, width) queries from the normed q-LoRA latent *qr*, and the (heads,) weights."""
        q = self._rotated(self.wq_b(qr).reshape(qr.shape[0], self.heads, self.width), rotate)
        return q, self.proj(h) * np.float32(1.0 / np.sqrt(np.float32(self.width * self.heads)))

    def select(self, q: np.ndarray, w: np.ndarray, keys: np.ndarray) -> np.ndarray:
        """The positions (ascending) one query row attends to among its causal *keys* (t, width): all of them while
        t <= top_k, else the top_k scores (a tie broken towards the earlier position)."""
        t = keys.shape[0]
        if t <= self.top_k:
            return np.arange(t)
        scores = (np.maximum(np.matmul(q, np.ascontiguousarray(keys.T)), np.float32(0.0)) * w[:, None]).sum(axis=0)
        return keep_top(scores, self.top_k)


def keep_top(scores: np.ndarray, k: int) -> np.ndarray:
    """The indices (ascending) of the *k* best *scores*, a tie broken towards the earlier index: what both sparse
    attentions keep (deepseek32's positions, minimax-m3's blocks)."""
    return np.sort(np.argsort(-scores, kind="stable")[:k])
