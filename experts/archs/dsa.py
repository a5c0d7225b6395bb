"""DeepSeek Sparse Attention (deepseek32, DeepSeek-V3.2): keys, tensors, writer and random fields of its lightning
indexer, on top of deepseek2's absorbed MLA (:class:`.mla.LatentAttention`).

src/models/deepseek32.cpp: every trunk layer scores its past positions with a small multi-head indexer (its own
``attention.indexer.head_count`` heads of ``key_length``, one shared key per position, kept in the KV cache) and the
MLA attention then reads only the ``top_k`` best of them. llama.cpp needs the absorbed MLA layout and q-LoRA (the
indexer's query is projected from the normed q-LoRA latent), and multiplies the indexer's q and k by a Hadamard
matrix of the largest power of two from 64 dividing the head: only a power-of-two head of at least 64 fits that
product, other widths abort its graph. The numerics are :mod:`experts.dsa`; an MTP block runs dense MLA (as
llama.cpp's deepseek32 MTP graph: "the DSA indexer is not used at runtime") but carries the tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import gguf

from ..errors import ModelFormatError
from .attention import Shapes
from .keys import Keys
from .mla import LatentAttention

if TYPE_CHECKING:
    from ..config import ModelConfig

INDEXER_KEYS = ("attention.indexer.head_count", "attention.indexer.key_length", "attention.indexer.top_k")
MIN_HADAMARD = 64  # llama.cpp's smallest rotation (llama_kv_cache::build_input_k_rot)


@dataclass(frozen=True)
class SparseLatentAttention(LatentAttention):
    """Absorbed MLA with q-LoRA, plus the lightning indexer of ``indexer_heads`` heads choosing ``indexer_top_k``
    past positions per query. Random models: 16 indexer heads of 64 (V3.2 has 64 of 128: with few heads a key
    every head scores below zero ties at 0, and a tie at the top-k boundary is broken by the engine's sort), top-k 16."""

    random_indexer: tuple[int, int, int] = (16, 64, 16)

    def read(self, k: Keys, head_dim: int, n_layer: int) -> dict:
        for key in ("attention.key_length_mla", "attention.value_length_mla", "attention.q_lora_rank"):
            k.req(key)  # llama.cpp's deepseek32 loader requires MLA ("requires MLA") and reads q_lora_rank unconditionally
        heads, width, top_k = (int(k.req(key)) for key in INDEXER_KEYS)
        return super().read(k, head_dim, n_layer) | {"indexer_heads": heads, "indexer_head_dim": width, "indexer_top_k": top_k}

    def check(self, cfg: ModelConfig) -> None:
        super().check(cfg)
        w = cfg.indexer_head_dim
        if cfg.indexer_heads < 1 or cfg.indexer_top_k < 1:
            raise ModelFormatError(f"{cfg.arch}: attention.indexer.head_count {cfg.indexer_heads} / top_k {cfg.indexer_top_k}: the lightning indexer needs at least one head and one kept position")
        if w < MIN_HADAMARD or w & (w - 1):
            raise ModelFormatError(f"{cfg.arch}: attention.indexer.key_length is {w}; llama.cpp's indexer multiplies it by a Hadamard matrix, which needs a power of two of at least {MIN_HADAMARD}")
        if cfg.rope_dim > w:
            raise ModelFormatError(f"{cfg.arch}: rope.dimension_count {cfg.rope_dim} exceeds the indexer head {w} (llama.cpp rotates the first n_rot dims of it)")
        if not cfg.q_lora_rank or cfg.mla_kv_b:
            raise ModelFormatError(f"{cfg.arch} needs q-LoRA and the absorbed MLA layout (attn_k_b / attn_v_b)")

    def extra_shapes(self, cfg: ModelConfig, i: int, b: str) -> Shapes:
        """The indexer's tensors (src/models/deepseek32.cpp ``load_arch_tensors``), MTP blocks included."""
        w, heads = cfg.indexer_head_dim, cfg.indexer_heads
        return super().extra_shapes(cfg, i, b) | {
            b + "indexer.k_norm.weight": (w,),
            b + "indexer.k_norm.bias": (w,),
            b + "indexer.proj.weight": (heads, cfg.n_embd),
            b + "indexer.attn_k.weight": (w, cfg.n_embd),
            b + "indexer.attn_q_b.weight": (heads * w, cfg.q_lora_rank),
        }

    def write(self, w: gguf.GGUFWriter, cfg: ModelConfig) -> None:
        super().write(w, cfg)
        w.add_indexer_head_count(cfg.indexer_heads)
        w.add_indexer_key_length(cfg.indexer_head_dim)
        w.add_indexer_top_k(cfg.indexer_top_k)

    def required_keys(self) -> set[str]:
        return super().required_keys() | {"attention.key_length_mla", "attention.value_length_mla", "attention.q_lora_rank", *INDEXER_KEYS}

    def random_fields(self, head_dim: int, n_head: int, n_head_kv: int, n_layer: int, mla_kv_b: bool) -> dict:
        if mla_kv_b:
            raise ModelFormatError("deepseek32 runs the absorbed MLA layout only (attn_k_b / attn_v_b)")
        heads, width, top_k = self.random_indexer
        return super().random_fields(head_dim, n_head, n_head_kv, n_layer, False) | {"indexer_heads": heads, "indexer_head_dim": width, "indexer_top_k": top_k}
