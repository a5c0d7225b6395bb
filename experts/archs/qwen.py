"""Qwen MoE: qwen2moe (Qwen1.5/2-MoE), qwen3moe (Qwen3-30B-A3B / 235B-A22B) and qwen3vlmoe (Qwen3-VL MoE, text part).

src/models/qwen2moe.cpp, qwen3moe.cpp, qwen3vlmoe.cpp: NEOX RoPE, softmax router. qwen2moe has q/k/v biases, no
renormalisation and a sigmoid-gated shared expert; qwen3moe per-head q/k norms and renormalised top-k; qwen3vlmoe is
qwen3moe's graph with IMROPE, which rotates as NEOX when every section holds the token's position (a text batch):
``rope.dimension_sections`` is required, deepstack only adds the zero padding of text embeddings.
"""

from __future__ import annotations

from ..arch import QKNorm
from .attention import Attention, imrope_sections
from .base import Arch, FixedKey
from .ffn import SharedByWidth
from .router import RouterSpec

QWEN2MOE = Arch(
    name="qwen2moe",
    attention=Attention(qkv_bias=True),
    shared=SharedByWidth(gated=True, fallback=True),
    tied_output=False,
)
QWEN3MOE = Arch(
    name="qwen3moe",
    attention=Attention(qk_norm=QKNorm.PER_HEAD),
    router=RouterSpec(norm=True),
)
QWEN3VLMOE = Arch(
    name="qwen3vlmoe",
    attention=Attention(qk_norm=QKNorm.PER_HEAD),
    router=RouterSpec(norm=True),
    fixed_keys=(FixedKey("rope.dimension_sections", value=imrope_sections),),
)
