"""The Qwen delta-net hybrids: qwen3next (Qwen3-Next-80B-A3B) and qwen35moe (Qwen3.5 / 3.6 MoE).

src/models/qwen3next.cpp, qwen35moe.cpp (:mod:`.gdn`): gated delta-net on 3 of 4 layers, gated full attention with
per-head q/k norms and partial NEOX RoPE on the others; softmax router with renormalisation hard-coded, a
sigmoid-gated shared expert; the FFN pre-norm is post_attention_norm; an MTP block counted in block_count is never
run. qwen35moe has separate ssm_beta / ssm_alpha, tiled V heads, no legacy ssm_in, and IMROPE (NEOX for text
positions: the sections key is required but changes nothing in a text forward).
"""

from __future__ import annotations

from .attention import imrope_sections
from .base import Arch, FixedKey, RandomFeatures
from .ffn import SharedByWidth
from .gdn import GatedDeltaNet
from .router import RouterSpec

# a quarter of the head rotated (as the real models), a trailing MTP block
_RANDOM = RandomFeatures(n_nextn=1, rot_div=4)

QWEN3NEXT = Arch(
    name="qwen3next",
    attention=GatedDeltaNet(ssm_in=True),
    router=RouterSpec(norm=True),
    shared=SharedByWidth(gated=True, fallback=True),
    ffn_norm="post_attention_norm",
    random=_RANDOM,
)
QWEN35MOE = Arch(
    name="qwen35moe",
    attention=GatedDeltaNet(tiled_v=True, split_ba=True),
    router=RouterSpec(norm=True),
    shared=SharedByWidth(gated=True, fallback=True),
    ffn_norm="post_attention_norm",
    fixed_keys=(FixedKey("rope.dimension_sections", value=imrope_sections),),
    random=_RANDOM,
)
