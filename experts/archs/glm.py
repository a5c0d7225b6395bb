"""glm4moe (GLM-4.5 / 4.5-Air / 4.6, Solar Open), src/models/glm4-moe.cpp.

Sigmoid router with a required selection bias, renormalisation and scale from the file (DeepSeek-V3's router),
leading dense layers, a plain shared expert of expert_shared_count widths, partial NEOX RoPE, optional q/k/v biases
and per-head q/k norms, the FFN pre-norm named post_attention_norm, a trailing MTP block counted in block_count.
"""

from __future__ import annotations

from ..arch import Gating, QKNorm
from .attention import Attention
from .base import Arch, RandomFeatures
from .ffn import DenseLead, SharedByCount
from .router import FROM_FILE, Presence, RouterSpec

GLM4MOE = Arch(
    name="glm4moe",
    attention=Attention(
        qk_norm=QKNorm.PER_HEAD,
        qkv_bias=True,
        optional=("attn_q.bias", "attn_k.bias", "attn_v.bias", "attn_q_norm.weight", "attn_k_norm.weight"),
    ),
    router=RouterSpec(gating=Gating.SIGMOID, reads=FROM_FILE, selection_bias=Presence.REQUIRED),
    shared=SharedByCount(),
    schedule=DenseLead(),
    ffn_norm="post_attention_norm",
    # a dense lead layer, an MTP block, half-width RoPE, a scaled renormalised router with expert groups
    random=RandomFeatures(n_dense_lead=1, n_nextn=1, rot_div=2, gating="sigmoid", norm_topk=True, scale=2.5, groups=(4, 2)),
)
