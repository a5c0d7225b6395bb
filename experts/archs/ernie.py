"""ernie4_5-moe (ERNIE-4.5 MoE), src/models/ernie4-5-moe.cpp + ernie4-5.cpp: NORM RoPE, softmax with an optional
selection bias, renormalisation hard-coded, no scale (expert_weights_scale is not read), leading dense layers, a
plain shared expert only if expert_shared_feed_forward_length says so. interleave_moe_layer_step is required and must
be 1: llama.cpp loads experts on every layer past the dense lead but would run them only on every step-th."""

from __future__ import annotations

from ..arch import RopeStyle
from .attention import Attention
from .base import Arch, FixedKey, RandomFeatures
from .ffn import DenseLead, SharedByWidth
from .router import Presence, RouterSpec

ERNIE4_5_MOE = Arch(
    name="ernie4_5-moe",
    attention=Attention(rope=RopeStyle.NORM),
    router=RouterSpec(norm=True, selection_bias=Presence.OPTIONAL),
    shared=SharedByWidth(),
    schedule=DenseLead(),
    fixed_keys=(FixedKey("interleave_moe_layer_step", only=1),),
    random=RandomFeatures(n_dense_lead=1, groups=(4, 2)),  # its shared expert and selection bias are on by default
)
