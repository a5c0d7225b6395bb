"""MiniMax Sparse Attention (minimax-m3): keys, tensors, writer and random fields of its index branch, on top of
MiniMax-M2's grouped-query attention with a per-head QK norm and partial NEOX RoPE.

src/models/minimax-m3.cpp: on every layer past the leading dense ones, an index branch projects ``head_count``
queries (one per KV group: llama.cpp asserts the two counts equal) and one key per position, each RMS-normed and
roped like the attention's heads, and scores the query's causal positions with plain dot products. The scores are
pooled to blocks of ``block_size`` positions by their maximum, the ``local_blocks`` latest blocks are forced in (a
+1e30 bias), and each KV group attends to the positions of its ``top_k`` best blocks only: ``top_k`` counts the forced
blocks too. The numerics are :mod:`experts.msa`; the keys of the branch are what its KV cache keeps besides K and V.

llama.cpp computes MSA only with flash attention on (off, it logs a warning and runs dense attention on every layer,
:attr:`needs_flash_attn`), and only where a sequence's cache slots are its positions; moeswarm's caches always are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import gguf

from ..arch import QKNorm
from ..errors import ModelFormatError
from .attention import Attention, Shapes
from .dsa import INDEXER_KEYS
from .keys import Keys

if TYPE_CHECKING:
    from ..config import ModelConfig

BLOCK_KEYS = ("attention.indexer.block_size", "attention.indexer.local_blocks")  # no gguf-py helpers for these two


@dataclass(frozen=True)
class BlockSparseAttention(Attention):
    """GQA with a per-head QK norm, plus the index branch choosing ``indexer_top_k`` blocks per KV group and query.
    Random models: a 32-wide index head, 3 blocks of 4 positions kept, the latest one forced (the real model keeps
    more blocks of more positions: a test prompt must outgrow what is kept for the selection to drop anything)."""

    qk_norm: QKNorm = QKNorm.PER_HEAD
    random_indexer: tuple[int, int, int, int] = (32, 3, 4, 1)  # key width, top-k blocks, block size, local blocks
    needs_flash_attn: ClassVar[bool] = True

    def read(self, k: Keys, head_dim: int, n_layer: int) -> dict:
        heads, width, top_k = (int(k.req(key)) for key in INDEXER_KEYS)
        block, local = (int(k.req(key)) for key in BLOCK_KEYS)
        fields = {"indexer_heads": heads, "indexer_head_dim": width, "indexer_top_k": top_k, "indexer_block_size": block, "indexer_local_blocks": local}
        return super().read(k, head_dim, n_layer) | fields

    def check(self, cfg: ModelConfig) -> None:
        super().check(cfg)
        a = cfg.arch
        if cfg.indexer_block_size < 1:
            raise ModelFormatError(f"{a}: attention.indexer.block_size is {cfg.indexer_block_size}; llama.cpp asserts a block of at least one position")
        if cfg.indexer_heads != cfg.n_head_kv:
            raise ModelFormatError(f"{a}: attention.indexer.head_count {cfg.indexer_heads} must equal the KV head count {cfg.n_head_kv} (one index head per GQA group, as llama.cpp asserts)")
        if cfg.indexer_top_k < 1 or cfg.indexer_head_dim < 1:
            raise ModelFormatError(f"{a}: attention.indexer.top_k {cfg.indexer_top_k} / key_length {cfg.indexer_head_dim}: MSA needs at least one kept block and a key")
        if not 0 <= cfg.indexer_local_blocks <= cfg.indexer_top_k:
            raise ModelFormatError(f"{a}: attention.indexer.local_blocks {cfg.indexer_local_blocks} must be between 0 and top_k {cfg.indexer_top_k} (more forced blocks than kept ones: llama.cpp would drop some by its sort's tie order)")
        if cfg.rope_dim > cfg.indexer_head_dim:
            raise ModelFormatError(f"{a}: rope.dimension_count {cfg.rope_dim} exceeds the index head {cfg.indexer_head_dim} (llama.cpp rotates its first n_rot dims)")

    def extra_shapes(self, cfg: ModelConfig, i: int, b: str) -> Shapes:
        """The index branch's tensors on the sparse layers (src/models/minimax-m3.cpp ``load_arch_tensors``)."""
        out = super().extra_shapes(cfg, i, b)
        if i < cfg.n_dense_lead:  # leading dense layers attend densely and carry no index branch
            return out
        w, d = cfg.indexer_head_dim, cfg.n_embd
        return out | {
            b + "indexer.q_proj.weight": (cfg.indexer_heads * w, d),
            b + "indexer.k_proj.weight": (w, d),
            b + "indexer.q_norm.weight": (w,),
            b + "indexer.k_norm.weight": (w,),
        }

    def write(self, w: gguf.GGUFWriter, cfg: ModelConfig) -> None:
        super().write(w, cfg)
        w.add_indexer_head_count(cfg.indexer_heads)
        w.add_indexer_key_length(cfg.indexer_head_dim)
        w.add_indexer_top_k(cfg.indexer_top_k)
        for key, value in zip(BLOCK_KEYS, (cfg.indexer_block_size, cfg.indexer_local_blocks), strict=True):
            w.add_uint32(f"{cfg.arch}.{key}", value)

    def required_keys(self) -> set[str]:
        return super().required_keys() | {*INDEXER_KEYS, *BLOCK_KEYS}

    def random_fields(self, head_dim: int, n_head: int, n_head_kv: int, n_layer: int, mla_kv_b: bool) -> dict:
        width, top_k, block, local = self.random_indexer
        return {"indexer_heads": n_head_kv, "indexer_head_dim": width, "indexer_top_k": top_k, "indexer_block_size": block, "indexer_local_blocks": local}
