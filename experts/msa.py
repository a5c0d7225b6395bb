"""MiniMax Sparse Attention's index branch in numpy (minimax-m3), as src/models/minimax-m3.cpp computes it.

Each sparse layer projects one index key per position (``indexer.k_proj`` of the attention-normed hidden state) and
one index query per KV group (``indexer.q_proj``); both are RMS-normed per head (``indexer.{q,k}_norm``) and roped
over their first n_rot dims exactly as the attention's heads are. For a query at position p, group g scores each
causal position by ``q_g . k`` (unscaled: only the order matters), pools the scores to blocks of ``block`` positions
by their maximum, forces the ``local`` latest blocks in (llama.cpp adds 1e30 to them: they outrank every score) and
keeps the ``top_k`` best blocks, forced ones included; the group's heads then attend to the kept blocks' causal
positions only. While a query's past spans no more than top_k blocks nothing is dropped.

Decode is exact by construction: a query's choice and its attention read only its own index query and the cached
keys, so a token decoded alone, verified inside a speculative draft or batched in a prompt gets the same bits.
llama.cpp's one-token graph gathers the kept keys instead of masking them, which re-orders its flash-attention sums
(its decode and prompt logits differ by ~1e-3 on random models); the batch graph is the reference here.

The keys are what the cache keeps for the branch (:attr:`experts.forward.KVCache.index`), so rolling the cache
back rolls them back.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .dense_weights import Linear
from .dsa import keep_top
from .moe import softmax

Prepare = Callable[[np.ndarray, np.ndarray], np.ndarray]  # (n, heads, width) rows RMS-normed by a weight, then roped


@dataclass(frozen=True)
class BlockIndexer:
    """One sparse layer's index branch weights and options."""

    wq: Linear  # indexer.q_proj: normed hidden state -> one query per KV group
    wk: Linear  # indexer.k_proj: normed hidden state -> the position's one key
    q_norm: np.ndarray
    k_norm: np.ndarray
    heads: int
    top_k: int  # blocks kept per query and group, the forced ones included
    block: int  # positions per block
    local: int  # the latest blocks always kept (the query's own first)

    @classmethod
    def load(cls, model, lin, b: str) -> BlockIndexer:
        cfg, d = model.cfg, model.dense
        return cls(
            wq=lin.linear(b + "indexer.q_proj.weight"),
            wk=lin.linear(b + "indexer.k_proj.weight"),
            q_norm=d(b + "indexer.q_norm.weight"),
            k_norm=d(b + "indexer.k_norm.weight"),
            heads=cfg.indexer_heads,
            top_k=cfg.indexer_top_k,
            block=cfg.indexer_block_size,
            local=cfg.indexer_local_blocks,
        )

    @property
    def width(self) -> int:
        return self.k_norm.shape[0]

    def keys(self, h: np.ndarray, prepare: Prepare) -> np.ndarray:
        """The index keys (n, width) of the positions whose attention-normed hidden states are *h*."""
        return prepare(self.wk(h).reshape(h.shape[0], 1, self.width), self.k_norm)[:, 0]

    def queries(self, h: np.ndarray, prepare: Prepare) -> np.ndarray:
        """Per position, the (heads, width) index queries, one per KV group."""
        return prepare(self.wq(h).reshape(h.shape[0], self.heads, self.width), self.q_norm)

    def block_scores(self, q: np.ndarray, keys: np.ndarray) -> np.ndarray:
        """Each group's score of each block of the causal *keys* (t, width): the maximum over its positions, the
        forced blocks at +inf (llama.cpp's +1e30: they rank first whatever the scores)."""
        t = keys.shape[0]
        n_blocks = -(-t // self.block)
        scores = np.full((q.shape[0], n_blocks * self.block), -np.inf, dtype=np.float32)
        scores[:, :t] = np.matmul(q, np.ascontiguousarray(keys.T))
        blocks = scores.reshape(q.shape[0], n_blocks, self.block).max(axis=-1)
        blocks[:, max(0, n_blocks - self.local) :] = np.inf
        return blocks

    def select(self, q: np.ndarray, keys: np.ndarray) -> list[np.ndarray]:
        """Per group, the positions (ascending) its heads attend to among the causal *keys*: those of its top_k
        blocks (every position while they span no more than top_k blocks)."""
        t = keys.shape[0]
        if -(-t // self.block) <= self.top_k:
            return [np.arange(t)] * q.shape[0]
        chosen = [keep_top(row, self.top_k) for row in self.block_scores(q, keys)]
        spans = [(b[:, None] * self.block + np.arange(self.block)).ravel() for b in chosen]
        return [s[s < t] for s in spans]


def sparse_rows(q: np.ndarray, k: np.ndarray, v: np.ndarray, picks: list[np.ndarray], scale: np.float32) -> np.ndarray:
    """One query row's attention (heads, head_dim) over its causal keys/values (t, n_kv, head_dim), each KV group's
    heads (consecutive, as llama.cpp's GQA) reading only the positions *picks* gives that group.

    Each head's products have the shapes of the dense row's (:meth:`experts.forward.Backbone.attention`), so a group
    that keeps every position gets the dense attention's bits: MSA before any block is dropped is dense attention."""
    rep = q.shape[0] // len(picks)
    out = np.empty_like(q)
    for g, at in enumerate(picks):
        K = np.ascontiguousarray(np.repeat(k[None, at, g], rep, axis=0).transpose(0, 2, 1))  # (rep, head_dim, m)
        V = np.ascontiguousarray(np.repeat(v[None, at, g], rep, axis=0))  # (rep, m, head_dim)
        heads = slice(g * rep, (g + 1) * rep)
        out[heads] = np.matmul(softmax(np.matmul(q[heads][:, None, :], K) * scale), V)[:, 0, :]
    return out
